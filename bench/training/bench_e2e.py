"""End-to-end training examples/s of a Criteo-like wide & deep model: evstore vs TF hashing vs TFRA.

    .venv/bin/python -m bench.training.bench_e2e            # batch 1024, 5 warm-up + 30 timed steps per run
    .venv/bin/python -m bench.training.bench_e2e --quick    # batch 1024, 3 warm-up + 12 timed steps, vocabs <= 100k
    .venv/bin/python -m bench.training.bench_e2e --rounds 2   # every run twice, alternating; the median run reported
    .venv/bin/python -m bench.training.bench_e2e --batch-size 512 --steps 20 --warmup 3 --modes keras

The data (identical in every process, generated from --seed with numpy only):
  26 sparse fields, field f has a vocabulary of V_f ids, V_f log-spaced from
  10 to --max-vocab (default 1e6); each example draws one id per field
  Zipf-like (P(rank r) ~ (r+1)^-1.1) and the id fed to the model is the int64
  hash make_keys((f << 40) | r) (bench/harness/workload.py), so fields never share ids.
  13 dense features ~ N(0, 1). Labels: Bernoulli(sigmoid(hidden function)),
  the hidden function = a fixed pseudo-random weight per (field, id) plus a
  fixed linear function of the dense features. Batch b is a function of
  (seed, b) only, so every system sees the same batches in the same order.

The model (one builder for all three systems, Keras functional API):
  deep: one embedding of dim 16 per field (26 tables, input `f<i>` [B, 1]),
        concatenated with the 13 dense features -> Dense 256 relu -> Dense 128 relu;
  wide: one dim-1 embedding over all 26 ids of a row (input `wide` [B, 26],
        ids are distinct across fields) -> its 26 weights, plus the dense features;
  out:  Dense(1, sigmoid) on [deep 128 | wide 26 | dense 13]; binary
        cross-entropy; Adam(1e-3) for every variable.
Systems (one fresh process per system x mode; peak RSS = the process's VmHWM):
  evstore   evstore.keras.Embedding per field, evstore.optimizers.Adam (fused
            native sparse apply on EVs, Keras Adam on the dense layers).
  tf_hash   keras.layers.Hashing(num_bins) + keras.layers.Embedding(num_bins)
            per field, num_bins = min(2 V_f, --hash-cap), wide: Hashing +
            Embedding(sum of the bins, 1); keras.optimizers.Adam (Keras 3 Adam
            updates the whole embedding and its slots each step: there is no
            lazy / sparse Adam in Keras 3).
  tfra      TFRA 0.8.1 de.keras.layers.Embedding per field (tf_keras model,
            de.DynamicEmbeddingOptimizer(tf_keras.optimizers.legacy.Adam), the
            optimizer TFRA documents for TF >= 2.11), bench/peers/peer_tfra_e2e.py
            in the .peer-tfra venv (TF 2.16).
Modes:
  keras     model.train_on_batch(x, y) (Keras' own compiled train function).
  step      a hand-written tf.function step: GradientTape over model(x,
            training=True), optimizer.apply_gradients.
Every run: --warmup untimed steps (the first traces/compiles), then --steps
timed steps; examples/s = batch / median step seconds (also reported: batch *
steps / total seconds). Ratios evstore/tf_hash and evstore/tfra are per mode,
all in one invocation; with --rounds N every run repeats N times (systems
alternating) and the table shows each system's fastest run plus the ratio
within every round. Results: bench/results/e2e-<UTC time>.json and .md.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


from bench.harness.driver import (add_driver_args, apply_quick, chosen, git_describe, log_dir, run_meta,
                                  utc_stamp)
from bench.harness.paths import write_result
from bench.harness.peers import module_cmd, run_json, venv_python
from bench.harness.rss import hwm_mib, rss_mib
from bench.harness.workload import make_keys

N_FIELDS = 26
N_DENSE = 13
ZIPF_S = 1.1
SYSTEMS = ("evstore", "tf_hash", "tfra")
MODES = ("keras", "step")
HASH_MIX = np.uint64(0xD6E8FEB86659FD93)


# ---------------------------------------------------------------- data (numpy only: both venvs)

def vocab_sizes(max_vocab, n_fields=N_FIELDS, min_vocab=10):
    """Per-field vocabulary sizes, log-spaced from min_vocab to max_vocab."""
    return [int(round(v)) for v in np.logspace(np.log10(min_vocab), np.log10(max_vocab), n_fields)]


def _zipf_ranks(rng, vocab, n):
    """n ranks in [0, vocab), P(r) ~ (r + 1)^-s (inverse CDF of the continuous power law)."""
    u = rng.random(n)
    a = 1.0 - ZIPF_S
    x = (1.0 + u * ((vocab + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, vocab - 1)


def _hidden_weight(ids):
    """The label function's fixed weight of an id, uniform in [-0.5, 0.5)."""
    with np.errstate(over="ignore"):
        h = (ids.astype(np.uint64) * HASH_MIX) >> np.uint64(40)
    return (h & np.uint64(0xFFFF)).astype(np.float64) / 65536.0 - 0.5


def make_batch(seed, b, batch, vocabs):
    """Batch b: (ids int64 [batch, 26], dense float32 [batch, 13], labels float32 [batch, 1])."""
    rng = np.random.default_rng([seed, b])
    cols = []
    for f, v in enumerate(vocabs):
        r = _zipf_ranks(rng, v, batch)
        cols.append(make_keys((np.int64(f) << np.int64(40)) | r))
    ids = np.stack(cols, axis=1)
    dense = rng.standard_normal((batch, N_DENSE)).astype(np.float32)
    w_dense = np.random.default_rng(12345).normal(0.0, 0.5, N_DENSE)
    logit = 0.8 * _hidden_weight(ids).sum(axis=1) + dense @ w_dense - 0.5
    labels = (rng.random(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return ids, dense, labels.reshape(-1, 1)


def model_inputs(ids, dense):
    """The dict every model takes: f0..f25 [B, 1], wide [B, 26], dense [B, 13]."""
    x = {f"f{i}": ids[:, i:i + 1] for i in range(ids.shape[1])}
    x["wide"] = ids
    x["dense"] = dense
    return x


def build_wide_deep(K, field_embedding, wide_embedding, n_fields, dim, hidden=(256, 128), seed=0):
    """The wide & deep model in Keras module K (keras 3 or tf_keras), uncompiled.

    field_embedding(i, name) and wide_embedding(name) return callables mapping
    an int64 KerasTensor of ids to ids.shape + [dim] (resp. + [1]).
    """
    inputs = {f"f{i}": K.Input(shape=(1,), dtype="int64", name=f"f{i}") for i in range(n_fields)}
    inputs["wide"] = K.Input(shape=(n_fields,), dtype="int64", name="wide")
    inputs["dense"] = K.Input(shape=(N_DENSE,), dtype="float32", name="dense")
    parts = [K.layers.Flatten()(field_embedding(i, f"emb_{i}")(inputs[f"f{i}"])) for i in range(n_fields)]
    x = K.layers.Concatenate()(parts + [inputs["dense"]])
    for j, width in enumerate(hidden):
        x = K.layers.Dense(width, activation="relu", name=f"deep_{j}",
                           kernel_initializer=K.initializers.GlorotUniform(seed=seed + j))(x)
    wide = K.layers.Flatten()(wide_embedding("wide_emb")(inputs["wide"]))
    z = K.layers.Concatenate()([x, wide, inputs["dense"]])
    out = K.layers.Dense(1, activation="sigmoid", name="out",
                         kernel_initializer=K.initializers.GlorotUniform(seed=seed + 100))(z)
    return K.Model(inputs, out)


# ---------------------------------------------------------------- timing loop (shared with the peer)

def run_steps(step_fn, batches, warmup, steps, batch):
    """Runs warmup + steps calls of step_fn(x, y) -> loss; returns the timing result dict."""
    times, losses = [], []
    for i in range(warmup + steps):
        x, y = batches[i]
        t0 = time.perf_counter()
        loss = float(step_fn(x, y))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    timed = times[warmup:]
    return {"examples_per_s": batch / statistics.median(timed),
            "examples_per_s_total": batch * len(timed) / sum(timed),
            "step_ms_median": 1000 * statistics.median(timed),
            "step_ms_min": 1000 * min(timed), "step_ms_max": 1000 * max(timed),
            "first_step_s": times[0],
            "loss_first": losses[0], "loss_last5": float(np.mean(losses[-5:]))}


def worker_args(ap):
    """The flags both workers (this file's --worker and peer_tfra_e2e.py) take."""
    ap.add_argument("--mode", choices=MODES, default="keras")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--max-vocab", type=int, default=1_000_000)
    ap.add_argument("--hash-cap", type=int, default=1 << 21)
    ap.add_argument("--threads", type=int, default=0, help="TF intra/inter-op threads (0: TF default)")


def make_batches(args):
    vocabs = vocab_sizes(args.max_vocab)
    return vocabs, [make_batch(args.seed, b, args.batch_size, vocabs) for b in range(args.warmup + args.steps)]


# ---------------------------------------------------------------- workers in the project venv

def _keras_step_fn(tf, model, mode):
    """(x, y) -> loss for the mode: Keras train_on_batch or a hand-written tf.function step."""
    if mode == "keras":
        return lambda x, y: model.train_on_batch(x, y)
    opt = model.optimizer
    import keras
    bce = keras.losses.BinaryCrossentropy()
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = bce(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def start_worker(args, keras_module):
    """How every side's worker starts (ours and the TFRA peer's): it makes its
    batches (timed: data_s), imports TensorFlow and `keras_module` ("keras" or
    "tf_keras"), sets TF's thread counts (--threads) and the seed. Returns
    (t0, vocabs, raw batches, data_s, the keras module, RSS MiB before the model
    is built, the embeddings' initializer); build time is perf_counter() - t0 - data_s."""
    import importlib
    t0 = time.perf_counter()
    vocabs, raw = make_batches(args)
    data_s = time.perf_counter() - t0
    import tensorflow as tf
    keras = importlib.import_module(keras_module)
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    keras.utils.set_random_seed(args.seed)
    return t0, vocabs, raw, data_s, keras, rss_mib(), keras.initializers.RandomNormal(0.0, 0.01, seed=args.seed)


def run_worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    t0, vocabs, raw, data_s, keras, rss0, init = start_worker(args, "keras")
    import tensorflow as tf
    meta = {"system": args.worker, "mode": args.mode, "tf_version": tf.__version__,
            "keras_version": keras.__version__}
    if args.worker == "evstore":
        import evstore
        meta["evstore_commit"] = git_describe()
        model = build_wide_deep(
            keras,
            lambda i, name: evstore.keras.Embedding(args.dim, name=name, embeddings_initializer=init),
            lambda name: evstore.keras.Embedding(1, name=name, embeddings_initializer=init),
            N_FIELDS, args.dim, seed=args.seed)
        model.compile(optimizer=evstore.optimizers.Adam(1e-3), loss="binary_crossentropy")
    elif args.worker == "tf_hash":
        bins = [min(2 * v, args.hash_cap) for v in vocabs]
        meta["hash_bins"] = bins
        meta["hash_bins_total"] = sum(bins)

        def field(i, name):
            h = keras.layers.Hashing(bins[i], name=name + "_hash")
            e = keras.layers.Embedding(bins[i], args.dim, embeddings_initializer=init, name=name)
            return lambda t: e(h(t))

        def wide(name):
            h = keras.layers.Hashing(sum(bins), name=name + "_hash")
            e = keras.layers.Embedding(sum(bins), 1, embeddings_initializer=init, name=name)
            return lambda t: e(h(t))

        model = build_wide_deep(keras, field, wide, N_FIELDS, args.dim, seed=args.seed)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    else:
        raise SystemExit(f"unknown worker system {args.worker!r}")
    meta["build_s"] = time.perf_counter() - t0 - data_s
    batches = [({k: tf.constant(v) for k, v in model_inputs(ids, dense).items()}, tf.constant(y))
               for ids, dense, y in raw]
    step_fn = _keras_step_fn(tf, model, args.mode)
    res = run_steps(step_fn, batches, args.warmup, args.steps, args.batch_size)
    res.update(meta)
    res["data_s"] = data_s
    res["rss_after_build_mib"] = rss0
    res["peak_rss_mib"] = hwm_mib()
    res["rss_end_mib"] = rss_mib()
    if args.worker == "evstore":
        res["table_rows"] = int(sum(int(model.get_layer(f"emb_{i}").ev.size()) for i in range(N_FIELDS)))
        res["wide_rows"] = int(model.get_layer("wide_emb").ev.size())
    print(json.dumps(res), flush=True)


# ---------------------------------------------------------------- orchestration

def run_one(system, mode, args, peer_py, logdir):
    """One worker process; returns its JSON result (or {"error": ...}) plus its wall time."""
    common = ["--mode", mode, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--seed", str(args.seed), "--dim", str(args.dim),
              "--max-vocab", str(args.max_vocab), "--hash-cap", str(args.hash_cap), "--threads", str(args.threads)]
    if system == "tfra":
        if not peer_py:
            return {"error": "TFRA peer venv unavailable"}
        cmd = module_cmd("bench.peers.peer_tfra_e2e", python=peer_py) + common
    else:
        cmd = module_cmd(__spec__.name) + ["--worker", system] + common
    return run_json(cmd, os.path.join(logdir, f"e2e_{system}_{mode}.log"), args.timeout)


def combine_rounds(rs):
    """One result per system/mode: the fastest of the rounds that worked (on a
    shared machine other load only ever slows a run down), with every round's
    examples/s and the max peak RSS."""
    ok = [r for r in rs if "error" not in r]
    if not ok:
        return rs[-1]
    out = dict(max(ok, key=lambda r: r["examples_per_s"]))
    out["rounds_examples_per_s"] = [r.get("examples_per_s") for r in rs]
    out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ok)
    out["failed_rounds"] = [r["error"] for r in rs if "error" in r]
    return out


def round_ratios(runs, meta):
    """evstore / peer examples/s within each round (runs of a round are back to back)."""
    out = {}
    for m in meta["modes"]:
        ev = runs.get(f"evstore/{m}", [])
        for s in meta["systems"]:
            if s == "evstore":
                continue
            peer = runs.get(f"{s}/{m}", [])
            out[f"{s}/{m}"] = [a["examples_per_s"] / b["examples_per_s"]
                               if "error" not in a and "error" not in b else None for a, b in zip(ev, peer)]
    return out


def render(results, meta):
    def g(s, m, k):
        r = results.get(f"{s}/{m}") or {}
        return r.get(k)

    def num(x, fmt="{:,.0f}"):
        return "n/a" if x is None else fmt.format(x)

    def ratio(a, b):
        return "n/a" if not a or not b else f"{a / b:.2f}x"

    out = [f"`{meta['command']}` — {meta['date_utc']}, evstore {meta['evstore_commit']}, {meta['cpus']} CPUs "
           f"(shared with other agents' builds/tests: absolute numbers are noisy), batch {meta['batch_size']}, "
           f"{meta['warmup']} warm-up + {meta['steps']} timed steps per run, {meta['rounds']} round(s) (fastest run "
           "shown; every round's examples/s, and the ratio within each round, in the last column), vocabularies 10 .. "
           f"{meta['max_vocab']:,} (sum {meta['vocab_total']:,}), TF-hashing bins min(2V, {meta['hash_cap']:,}) "
           f"(total {meta['hash_bins_total']:,}), {meta['total_s']:.0f} s total.\n",
           "| mode | system | examples/s (median step) | examples/s (total) | step ms median | first step s "
           "| loss first → last 5 | peak RSS MiB | evstore / this | rounds: examples/s (evstore / this) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for m in meta["modes"]:
        for s in meta["systems"]:
            r = results.get(f"{s}/{m}") or {}
            if "error" in r:
                out.append(f"| {m} | {s} | {r['error']} | | | | | | | |")
                continue
            out.append(f"| {m} | {s} | {num(r.get('examples_per_s'))} | {num(r.get('examples_per_s_total'))} | "
                       f"{num(r.get('step_ms_median'), '{:.1f}')} | {num(r.get('first_step_s'), '{:.1f}')} | "
                       f"{num(r.get('loss_first'), '{:.3f}')} → {num(r.get('loss_last5'), '{:.3f}')} | "
                       f"{num(r.get('peak_rss_mib'))} | "
                       f"{'' if s == 'evstore' else ratio(g('evstore', m, 'examples_per_s'), r.get('examples_per_s'))} | "
                       + ", ".join(num(x) + ("" if q is None else f" ({q:.2f}x)")
                                   for x, q in zip(r.get("rounds_examples_per_s", []),
                                                   meta.get("round_ratios", {}).get(f"{s}/{m}")
                                                   or [None] * 99)) + " |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--worker", choices=("evstore", "tf_hash"), help=argparse.SUPPRESS)
    worker_args(ap)
    add_driver_args(ap, "e2e", SYSTEMS, timeout_help="seconds per worker process",
                    quick_help="smoke run: 3 warm-up + 12 timed steps, --max-vocab 100000 (unless given)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: keras,step (default both)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every system/mode run this many times (alternating); report the median run")
    argv = sys.argv[1:]
    args = ap.parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        meta, runs = data["meta"], data["runs"]
        meta.setdefault("rounds", max(len(v) for v in runs.values()))
        meta["round_ratios"] = round_ratios(runs, meta)
        print(render({k: combine_rounds(v) for k, v in runs.items()}, meta))
        return None
    apply_quick(args, argv, (("--steps", 12), ("--warmup", 3), ("--max-vocab", 100_000)))
    systems = chosen(args.systems, SYSTEMS, "--systems")
    modes = chosen(args.modes, MODES, "--modes")
    peer_py = venv_python(args.peer_venv, needed="tfra" in systems)
    logdir = log_dir(args.out_dir)
    stamp = utc_stamp()
    vocabs = vocab_sizes(args.max_vocab)
    t_start = time.time()
    runs = {f"{s}/{m}": [] for m in modes for s in systems}
    for rnd in range(args.rounds):
        for m in modes:            # per mode, the systems back to back (closest in time)
            for s in systems:
                print(f"[{time.time() - t_start:5.0f}s] round {rnd + 1}/{args.rounds}: {s} / {m} ...", flush=True)
                r = run_one(s, m, args, peer_py, logdir)
                runs[f"{s}/{m}"].append(r)
                print("    " + (r["error"] if "error" in r else
                                f"{r['examples_per_s']:,.0f} examples/s, peak RSS {r['peak_rss_mib']:,.0f} MiB, "
                                f"{r['wall_s']:.0f} s"), flush=True)
    results = {k: combine_rounds(v) for k, v in runs.items()}
    meta = {**run_meta(stamp, argv), "batch_size": args.batch_size, "steps": args.steps,
            "warmup": args.warmup, "seed": args.seed, "dim": args.dim, "max_vocab": args.max_vocab,
            "vocabs": vocabs, "vocab_total": sum(vocabs), "hash_cap": args.hash_cap,
            "hash_bins_total": sum(min(2 * v, args.hash_cap) for v in vocabs),
            "systems": systems, "modes": modes, "rounds": args.rounds, "total_s": time.time() - t_start}
    meta["round_ratios"] = round_ratios(runs, meta)
    md = "## End-to-end training (Criteo-like wide & deep) " + stamp + "\n\n" + render(results, meta)
    write_result(f"e2e-{stamp}", {"meta": meta, "results": results, "runs": runs}, md=md, out_dir=args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
