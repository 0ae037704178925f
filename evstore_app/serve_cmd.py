"""`evstore serve`: the command's arguments turned into a call of
serving_loader.server.serve (the library), with the command's logging and exit status."""
import logging
import shlex
import sys

from serving_loader import admin_listener
from serving_loader.batching import BatchingOptions
from serving_loader.server import serve

__all__ = ["run"]


def _tier(args):
    """--tiered-dram-bytes / --tier-path as an evstore.TieredStorage, or None."""
    if args.tiered_dram_bytes is None:
        if args.tier_path is not None:
            raise ValueError("--tier-path needs --tiered-dram-bytes")
        return None
    from evstore.storage import TieredStorage

    return TieredStorage(args.tiered_dram_bytes, path=args.tier_path)


def _read_pem(path, flag):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e}") from None


def _shard_tls(args):
    """((key PEM, certificate PEM) of a shard's TLS or None, the front's CA PEM or None) from the flags."""
    tls = tls_ca = None
    if (args.shard_tls_cert is None) != (args.shard_tls_key is None):
        raise ValueError("--shard-tls-cert and --shard-tls-key go together")
    if args.shard_tls_cert is not None:
        if args.shard is None:
            raise ValueError("--shard-tls-cert/--shard-tls-key need --shard (the front takes --shard-tls-ca)")
        tls = (_read_pem(args.shard_tls_key, "--shard-tls-key"), _read_pem(args.shard_tls_cert, "--shard-tls-cert"))
    if args.shard_tls_ca is not None:
        if args.shards is None:
            raise ValueError("--shard-tls-ca needs --shards (a front)")
        tls_ca = _read_pem(args.shard_tls_ca, "--shard-tls-ca")
    return tls, tls_ca


def run(args):
    """Runs `evstore serve` (`args` parsed by evstore_app.cli): its flags become serve()'s
    keyword arguments (a negative port: that API off; --rest_idle_timeout_s 0: never),
    the admin token is read from --admin_token_file. Returns the exit status: serve()'s
    (0 after SIGTERM, 130 after SIGINT), or 1 with one line `evstore serve: <reason>` on
    stderr when the arguments, the export or the checkpoint root cannot be served."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("apscheduler").setLevel(logging.WARNING)  # one line per poll otherwise
    try:
        shard_token = None
        if args.shard_token_file is not None:
            if args.shard is None and args.shards is None:
                raise ValueError("--shard-token-file needs --shard or --shards")
            shard_token = admin_listener.read_token(args.shard_token_file, what="shard")
        tls, tls_ca = _shard_tls(args)
        if args.shard is not None:
            if args.shards is not None:
                raise ValueError("--shard (a shard) and --shards (a front) exclude each other")
            from serving_loader.shard_service import serve_shard

            return serve_shard(args.export, args.checkpoints, args.shard, host=args.host, port=args.port,
                               evs=args.shard_evs.split(",") if args.shard_evs else None, tier=_tier(args),
                               max_request_bytes=args.max_request_bytes, disk_bytes=args.tier_disk_bytes,
                               token=shard_token, tls=tls)
        for flag, value in (("--shard-evs", args.shard_evs), ("--tier-disk-bytes", args.tier_disk_bytes)):
            if value is not None:
                raise ValueError(f"{flag} needs --shard")
        batching = None
        if args.enable_batching:
            batching = BatchingOptions(max_batch_size=args.max_batch_size,
                                       batch_timeout_micros=args.batch_timeout_micros,
                                       max_enqueued_batches=args.max_enqueued_batches,
                                       num_batch_threads=args.num_batch_threads)
        return serve(args.export, args.checkpoints, host=args.host,
                     port=None if args.port < 0 else args.port,
                     rest_api_port=None if args.rest_api_port < 0 else args.rest_api_port,
                     model_name=args.model_name, poll_every=args.poll_every,
                     max_request_bytes=args.max_request_bytes, batching=batching, allow_empty=args.allow_empty,
                     intra_op_parallelism=args.tensorflow_intra_op_parallelism,
                     inter_op_parallelism=args.tensorflow_inter_op_parallelism,
                     grpc_idle_timeout_s=args.grpc_idle_timeout_s, gate=args.gate,
                     gate_min_examples=args.gate_min_examples, gate_max_hold_commits=args.gate_max_hold_commits,
                     gate_max_hold_s=args.gate_max_hold_seconds, gate_past_max_hold=args.gate_past_max_hold,
                     admin_port=args.admin_port, admin_host=args.admin_host,
                     admin_token=admin_listener.read_token(args.admin_token_file) if args.admin_token_file else None,
                     idle_timeout_s=args.rest_idle_timeout_s or None, tier=_tier(args),
                     use_serving_view=args.serving_view, shards=args.shards, shard_token=shard_token,
                     shard_tls_ca=tls_ca)
    except (ValueError, TypeError, OSError) as e:
        from serving_loader.model import NotAnExportError, NothingToServeError

        hint = ""
        if isinstance(e, NothingToServeError):
            hint = " (--allow-empty serves the export as it is)"
        elif isinstance(e, NotAnExportError):
            hint = (f"; from the command line: evstore train --data DATA --spec SPEC --checkpoints ROOT "
                    f"--export {shlex.quote(args.export)} --max-rows 0 writes the export alone")
        print(f"evstore serve: {e}{hint}", file=sys.stderr)
        return 1
