"""How the S3 test server (moto's, a separate process on 127.0.0.1) moves one
large object, by transfer setting, same run: what bench_object_store's
figures at size are made of, and which settings keep moto's memory bounded.

    .venv/bin/python -m bench.checkpoints.bench_s3_transfer --mib 400

For one object of --mib MiB (random bytes, made in this process):
  upload serial <b>     fs.open(key, "wb", block_size=b) written 1 MiB at a
                        time: one multipart part uploaded per b bytes, each
                        upload waited for (how checkpoint/object_sink.py
                        streams a data file: s3fs's S3File);
  upload concurrent     the same bytes as parts of 50 MiB, up to 4 in flight
                        (fs.pipe_file: what a writer that overlaps its parts
                        could reach at best);
  copy fs.copy          fs.copy of the object to another key, as
                        object_sink's publish does it: one CopyObject up to
                        150 MiB, above that s3fs's serial multipart copy
                        (UploadPartCopy) in parts of 50 MiB;
  copy managed <block>  that multipart copy in parts of `block`;
  download conc <c>     fs.get_file into a local temp file with
                        max_concurrency c (s3fs's default is 10 ranged GETs of
                        50 MiB in flight; 1 is one streamed GET).
Each line gives seconds, MiB/s and moto's RSS at the start of the step and its peak during it (sampled
every 50 ms from /proc), since moto serves every ranged GET and every
UploadPartCopy by reading the whole source object into memory.

Prints one JSON line (the last line of stdout); progress goes to stderr.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

from bench.checkpoints.bench_object_store import s3_server
from bench.harness.rss import rss_mib

MiB = 2**20
BUCKET = "bench-transfer"


class Peak:
    """Peak RSS (MiB) of process `pid` while the `with` block runs."""

    def __init__(self, pid):
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            self._stop.wait(0.05)

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=400, help="the object's size")
    ap.add_argument("--blocks", default="5,50,200", help="serial upload part sizes, MiB")
    ap.add_argument("--copy-blocks", default="50,5120", help="copy part sizes, MiB")
    ap.add_argument("--download-concurrency", default="10,1")
    args = ap.parse_args()
    import fsspec
    from fsspec.asyn import sync
    import numpy as np

    data = np.random.default_rng(0).bytes(args.mib * MiB)
    work = tempfile.mkdtemp(prefix="s3-transfer-")
    out = {"mib": args.mib, "load_avg": os.getloadavg()[0], "cpus": os.cpu_count()}
    srv = s3_server()
    with open(os.path.join(work, "moto.log"), "w") as log:
        proc, endpoint = srv.start_server(log)
        try:
            os.environ.update(dict(srv.ENV, AWS_ENDPOINT_URL=endpoint))
            fs = fsspec.filesystem("s3", skip_instance_cache=True)
            fs.mkdir(BUCKET)

            def step(name, fn):
                start = rss_mib(proc.pid)
                with Peak(proc.pid) as p:
                    t0 = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t0
                out[name] = {"s": round(dt, 2), "mib_s": round(args.mib / dt, 1), "moto_rss_start_mib": round(start),
                             "moto_peak_rss_mib": round(p.peak)}
                print(f"[s3-transfer] {name}: {out[name]}", file=sys.stderr, flush=True)

            for b in [int(x) for x in args.blocks.split(",")]:
                def serial(b=b):
                    with fs.open(f"{BUCKET}/serial-{b}", "wb", block_size=b * MiB) as f:
                        for s in range(0, len(data), MiB):
                            f.write(data[s:s + MiB])
                step(f"upload_serial_{b}mib", serial)
                fs.rm(f"{BUCKET}/serial-{b}")
            step("upload_concurrent_50mib_x4", lambda: fs.pipe_file(f"{BUCKET}/src", data, chunksize=50 * MiB,
                                                                    max_concurrency=4))
            step("copy_fs_copy", lambda: fs.copy(f"{BUCKET}/src", f"{BUCKET}/copy"))   # what publish does
            fs.rm(f"{BUCKET}/copy")
            for b in [int(x) for x in args.copy_blocks.split(",")]:
                step(f"copy_managed_{b}mib", lambda b=b: sync(fs.loop, fs._copy_managed, f"{BUCKET}/src",
                                                              f"{BUCKET}/copy-{b}", len(data), block=b * MiB))
                fs.rm(f"{BUCKET}/copy-{b}")
            for c in [int(x) for x in args.download_concurrency.split(",")]:
                step(f"download_concurrency_{c}",
                     lambda c=c: fs.get_file(f"{BUCKET}/src", os.path.join(work, "got"), max_concurrency=c))
                os.remove(os.path.join(work, "got"))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    shutil.rmtree(work, ignore_errors=True)
    out["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
