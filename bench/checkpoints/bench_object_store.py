"""Checkpoints on an object store (S3: moto's server, a separate process on
127.0.0.1) against a local root, same run: a 2-PS sharded table, and a
synchronous 2-worker job.

    .venv/bin/python -m bench.checkpoints.bench_object_store                  # 1M keys x 64, Adam slots
    .venv/bin/python -m bench.checkpoints.bench_object_store --keys 100000    # a smoke run

Parameter-server part (this process is the chief of a LocalCluster of 2 PS
and 1 worker, every task with its own TMPDIR): one EmbeddingVariable of
--keys keys x --dim in 2 shards (one per PS), with Adam slots m and v, filled
by `load`. For each root (a local directory on this disk; s3://bucket/ps):
  full save       CheckpointManager.save_full(): each PS streams its part on
                  its host (and, on S3, uploads it), the chief merges and commits;
  delta save      after --dirty of the keys were rewritten (load, untimed);
  restore         CheckpointManager.restore() of the chain (full + delta) into
                  the same table (cleared first); on S3 each PS reads its own
                  files through an object source (checkpoint/object_source.py:
                  verified once, kept in memory within its budget, loaded);
                  Reported with the bytes every process read from the root.
  download-then-load  the S3 chain restored as before the object source: every
                  file downloaded to local disk (2 threads, one per PS's part),
                  then restored from that copy as from a local root.
  chief bytes     bytes the chief sent to the root per save
                  (manager.last_save_stats["bytes_sent_here"]), against the
                  commit's total bytes.
  through chief   the alternative for S3: the same parts written on the PS
                  hosts, then every byte pulled to the chief (tf.io.read_file
                  placed on the PS) and uploaded from there (no manifest: a lower
                  bound of that design's full save).
Synchronous part: 2 worker processes (MultiWorkerMirroredStrategy), a
CollectiveEmbeddingVariable of --sync-keys keys x --dim with Adam slots
(each worker fills its own shard), SyncCheckpointManager full and delta
commits (--dirty rewritten between) to each root, timed on worker 0.

Also reported: peak memory and disk of the whole run (bench/harness/rss.py
TreeUsage: the sum over its processes, and each role's own peak: moto, each
PS, the chief, each sync worker), and moto_5xx, the requests moto failed
(retries racing a request the client gave up on: --s3-read-timeout). The run
stops itself once the machine's available memory falls under
--min-available-mib.

Prints one JSON line (the last line of stdout); progress goes to stderr.
"""
import argparse
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.harness.paths import ROOT
from bench.harness.peers import module_cmd
from bench.harness.rss import TreeUsage, guard_available_memory
from bench.harness.workload import fill_chunks, make_keys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def s3_server():
    """tests/checkpoint/s3_server.py (moto's server as a process, a fresh bucket), loaded from its file."""
    spec = importlib.util.spec_from_file_location(
        "s3_server", os.path.join(ROOT, "tests", "checkpoint", "s3_server.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def task_label(cmdline):
    """The role of a process of this benchmark, from its command line (TreeUsage's labels)."""
    if "moto.server" in cmdline:
        return "moto"
    if "evstore_app server" in cmdline:
        args = cmdline.split()
        return f"{args[args.index('--job') + 1]}{args[args.index('--task') + 1]}"
    if "object_store_sync_worker" in cmdline:
        return f"sync worker{cmdline.split('object_store_sync_worker', 1)[1].split()[0]}"
    return ""


def log(msg):
    print(f"[object-store] {msg}", file=sys.stderr, flush=True)


def rows(rng, n, dim):
    return {"values": rng.standard_normal((n, dim), dtype=np.float32) * 0.01,
            "m": rng.standard_normal((n, dim), dtype=np.float32) * 0.001,
            "v": np.abs(rng.standard_normal((n, dim), dtype=np.float32)) * 1e-4}


def load_rows(ev, keys, rng, dim, tf):
    r = rows(rng, len(keys), dim)
    ev.load(tf.constant(keys), r["values"], versions=np.zeros(len(keys), np.int64),
            freqs=np.ones(len(keys), np.int64), slots={"m": r["m"], "v": r["v"]})


def through_chief(storage, ev, tf, work):
    """Seconds to write the table's parts on the PS hosts (into each PS's own TMPDIR under `work`: the
    staging this design needs) and upload every byte from the chief."""
    from checkpoint.bundle import write_bundle
    from checkpoint.shards import device_groups
    evs = {s.name: s for s in ev.shards}
    t0 = time.perf_counter()
    sids = {n: int(e.begin_export(return_keys=False)[0]) for n, e in evs.items()}
    dirs, sent = [], 0
    try:
        dirname = "through-chief"
        storage.makedirs(storage.join(dirname))
        for k, (task, names) in enumerate(sorted(device_groups(evs).items())):
            d = os.path.join(work, f"tmp-ps-{task.rsplit(':', 1)[1]}", "through-chief")
            os.makedirs(d, exist_ok=True)
            dirs.append(d)
            files, _ = write_bundle(d, {n: evs[n] for n in names}, sids, {}, full=True, prefix=f"ckpt_part{k}",
                                    device=task + "/device:CPU:0")
            for name in files:
                with tf.device(task + "/device:CPU:0"):
                    data = tf.io.read_file(os.path.join(d, name)).numpy()
                storage.fs.pipe_file(storage.join(dirname, name), data)
                sent += len(data)
        dt = time.perf_counter() - t0
    finally:
        for n, e in evs.items():
            e.abort_export(sids[n])
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        storage.remove_dir("through-chief")
    return dt, sent


def download_then_load(mgr, ev, step, local):
    """Restores `mgr`'s chain (an S3 root) the way restores did before the object source:
    every file downloaded to local disk first (2 threads, as the 2 PS each downloaded their own part
    file by file), then restored from that copy as from a local root (hard links, every file's crc32c,
    the load)."""
    import concurrent.futures

    import checkpoint
    storage = mgr.storage
    jobs = []
    for m in mgr.chain():
        os.makedirs(os.path.join(local, m.dir))
        jobs += [(m.dir, n, m.files[n]["size"]) for n in m.files] + [(m.dir, "MANIFEST.json", 0)]
    halves = [jobs[0::2], jobs[1::2]]

    def get(files):
        for d, n, _ in files:
            storage.fs.get_file(storage.join(d, n), os.path.join(local, d, n))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(get, h) for h in halves]:
            f.result()
    copy = checkpoint.CheckpointManager(local, [ev], global_step=step, keep_chains=None)
    try:
        copy.restore()
    finally:
        copy.close()


def ps_part(args, bucket, work):
    import tensorflow as tf

    import checkpoint
    import evstore
    from evstore_app.cluster import LocalCluster

    env = {}
    for job, n in (("ps", 2), ("worker", 1)):
        for t in range(n):
            d = os.path.join(work, f"tmp-{job}-{t}")
            os.makedirs(d, exist_ok=True)
            env[(job, t)] = {"TMPDIR": d}
    out = {}
    with LocalCluster(num_ps=2, num_workers=1, directory=os.path.join(work, "cluster"), task_env=env) as lc:
        strategy = tf.distribute.experimental.ParameterServerStrategy(lc.resolver())
        with strategy.scope():
            ev = evstore.EmbeddingVariable("big", dim=args.dim, shards=2)
        step = tf.Variable(0, dtype=tf.int64)
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        for s, e, k in fill_chunks(args.keys, args.fill_chunk):
            load_rows(ev, k, rng, args.dim, tf)
        log(f"filled {args.keys} keys in {time.perf_counter() - t0:.1f}s: shards {[int(s.size()) for s in ev.shards]}")
        roots = {"local": os.path.join(work, "ckpt-local"), "s3": f"s3://{bucket}/ps"}
        mgrs = {k: checkpoint.CheckpointManager(r, [ev], global_step=step, keep_chains=None)
                for k, r in roots.items()}
        dirty = make_keys(rng.choice(args.keys, max(1, int(args.dirty * args.keys)), replace=False))
        for kind in ("full", "delta"):
            for name, mgr in mgrs.items():
                if kind == "delta":
                    load_rows(ev, dirty, rng, args.dim, tf)   # the same keys dirty for each root's delta
                step.assign_add(1)
                t0 = time.perf_counter()
                seq = mgr.save_full() if kind == "full" else mgr.save_delta()
                dt = time.perf_counter() - t0
                m = mgr.last_committed
                out[f"{name}_{kind}_save_s"] = round(dt, 2)
                out[f"{name}_{kind}_bytes"] = m.total_bytes
                out[f"{name}_{kind}_chief_sent_bytes"] = mgr.last_save_stats.get("bytes_sent_here")
                log(f"{name} {kind} seq {seq}: {dt:.2f}s, {m.total_bytes / 2**20:.1f} MiB, chief sent "
                    f"{mgr.last_save_stats.get('bytes_sent_here')} bytes")
        # Restores: each way --restore-rounds times, interleaved (local, S3 through the object source,
        # S3 downloaded first), so the machine's load moves every way alike.
        ways = [(n, mgr.restore) for n, mgr in mgrs.items()] + [
            ("s3_download_then_load", lambda: download_then_load(mgrs["s3"], ev, step,
                                                                 os.path.join(work, "downloaded")))]
        for r in range(args.restore_rounds):
            for name, run in ways:
                shutil.rmtree(os.path.join(work, "downloaded"), ignore_errors=True)   # the last round's copy
                t0 = time.perf_counter()
                run()
                dt = time.perf_counter() - t0
                rounds = out.setdefault(f"{name}_restore_rounds_s", [])
                rounds.append(round(dt, 2))
                out[f"{name}_restore_s"] = sorted(rounds)[len(rounds) // 2]   # the median so far
                read = mgrs[name].last_restore_stats["bytes_read"] if name in mgrs else None
                if read is not None:
                    out[f"{name}_restore_bytes_read"] = read
                log(f"round {r}: {name} restore (full + delta): {dt:.2f}s, {int(ev.size())} keys"
                    + (f", {read} bytes read from the root" if read is not None else ""))
        out["restore_files_bytes"] = sum(m.total_bytes for m in mgrs["s3"].chain())
        if args.skip_through_chief:
            for mgr in mgrs.values():
                mgr.close()
            return out
        dt, sent = through_chief(mgrs["s3"].storage, ev, tf, work)
        out["s3_full_through_chief_s"] = round(dt, 2)
        out["s3_full_through_chief_sent_bytes"] = sent
        log(f"s3 full, every part through the chief (no commit): {dt:.2f}s, {sent / 2**20:.1f} MiB via the chief")
        for mgr in mgrs.values():
            mgr.close()
    return out




def sync_part(args, bucket, work):
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(str(s.getsockname()[1]))
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    procs = []
    for r in range(2):
        tmp = os.path.join(work, f"tmp-sync-{r}")
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(work, f"sync-{r}.log"), "w") as err:
            procs.append(subprocess.Popen(
                module_cmd("bench.checkpoints.object_store_sync_worker", r, ",".join(ports), args.sync_keys,
                           args.dim, args.dirty, bucket, os.path.join(work, "sync-local")),
                cwd=ROOT, env=dict(env, TMPDIR=tmp), stdout=subprocess.PIPE, stderr=err, text=True))
    outs = [p.communicate(timeout=3600)[0] for p in procs]
    res = [json.loads(ln[len("RESULT "):]) for o in outs for ln in o.splitlines() if ln.startswith("RESULT ")]
    if len(res) != 2:
        raise RuntimeError(f"a sync worker failed: see {work}/sync-*.log")
    log(f"sync (worker 0): {res[0]}")
    return {f"sync_{k}": v for k, v in res[0].items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--sync-keys", type=int, default=None, help="default: --keys")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dirty", type=float, default=0.1, help="fraction of the keys rewritten before each delta")
    ap.add_argument("--fill-chunk", type=int, default=200_000)
    ap.add_argument("--skip-sync", action="store_true")
    ap.add_argument("--skip-ps", action="store_true", help="no parameter-server part")
    ap.add_argument("--skip-through-chief", action="store_true", help="no full save through the chief")
    ap.add_argument("--restore-rounds", type=int, default=1, help="times each restore is measured (interleaved)")
    ap.add_argument("--s3-read-timeout", type=float, default=None,
                    help="seconds an S3 client waits for an answer before it retries (every process of the run, "
                         "through fsspec's FSSPEC_S3 configuration; default s3fs's 15). moto answers a "
                         "CompleteMultipartUpload or CopyObject only when done, with no keep-alive bytes as S3 "
                         "sends, so at size a request outlives 15 s and its retry races the first (moto_5xx)")
    ap.add_argument("--min-available-mib", type=int, default=3072,
                    help="stop (SIGKILL every process of the run, exit 3) once the machine's MemAvailable falls "
                         "under this: a shared machine is never pushed into the OOM killer")
    args = ap.parse_args()
    args.sync_keys = args.sync_keys or args.keys
    if args.s3_read_timeout is not None:   # before any S3 filesystem exists; the tasks inherit it
        conf = json.loads(os.environ.get("FSSPEC_S3", "{}"))
        conf.setdefault("config_kwargs", {})["read_timeout"] = args.s3_read_timeout
        os.environ["FSSPEC_S3"] = json.dumps(conf)
        import fsspec.config
        fsspec.config.set_conf_env(fsspec.config.conf)
    import checkpoint
    moto_bucket = s3_server().moto_bucket
    results = os.path.join(ROOT, "bench", "results")
    os.makedirs(results, exist_ok=True)
    work = tempfile.mkdtemp(prefix="object-store-", dir=results)
    guard_available_memory(args.min_available_mib, on_low=lambda _: shutil.rmtree(work, ignore_errors=True))
    result = {"keys": args.keys, "sync_keys": args.sync_keys, "dim": args.dim, "slots": ["m", "v"],
              "dirty": args.dirty, "load_avg": os.getloadavg()[0], "cpus": os.cpu_count()}
    moto_tmp = os.path.join(work, "moto-tmp")   # where moto spools objects over 5 MiB (unlinked files)
    os.makedirs(moto_tmp)
    os.environ["TMPDIR"], saved_tmp = moto_tmp, os.environ.get("TMPDIR")
    with moto_bucket(os.path.join(work, "moto.log"), before_stop=checkpoint.lease._release_all) as bucket:
        if saved_tmp is None:
            os.environ.pop("TMPDIR")
        else:
            os.environ["TMPDIR"] = saved_tmp
        for name, part, skip in (("ps", ps_part, args.skip_ps), ("sync", sync_part, args.skip_sync)):
            if skip:
                continue
            with TreeUsage(label=task_label, disk_dirs=[work], open_files_of=lambda c: "moto.server" in c) as u:
                result.update(part(args, bucket, work))
            result[f"{name}_part_usage"] = u.as_dict()
            log(f"{name} part usage: {u.as_dict()}")
    with open(os.path.join(work, "moto.log")) as f:
        result["moto_5xx"] = sum(1 for line in f if re.search(r'" 5\d\d ', line))
    result["s3_read_timeout"] = args.s3_read_timeout
    result["load_avg_end"] = os.getloadavg()[0]
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
