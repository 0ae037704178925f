"""The REST layer alone: serving_loader.httpserver (framing by llhttp through
httptools) against the hand-written HTTP/1.1 layer it replaced (the file at
commit --base, loaded from git), measured side by side in one run.

    .venv/bin/python -m bench.serving.bench_http_layer --seconds 5 --rounds 3

Each layer runs in its own process on uvloop with the same router: POST
/v1/models/m:predict answers a fixed 20-byte JSON body at once (no model),
so what is measured is framing, routing and writing. wrk (C, 1 thread,
--connections keep-alive connections) POSTs a fixed 200-byte JSON body for
--seconds, alternating between the two servers for --rounds rounds.
Reported per layer: requests/s and the server's CPU (user + system) per
request from /proc/<pid>/stat; medians over rounds, and the ratios
new / old. Prints one JSON line (the last line of stdout).
"""
import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench.harness.paths import ROOT
from bench.harness.peers import module_cmd


BASE = "f3c542d"     # the last commit with the hand-written layer
PATH = "/v1/models/m:predict"


def _serve(which, base, port_file):
    import asyncio
    import socket

    import uvloop

    if which == "new":
        from serving_loader import httpserver as http
    else:
        src = subprocess.run(["git", "-C", ROOT, "show", f"{base}:serving_loader/httpserver.py"], check=True,
                             capture_output=True).stdout
        path = os.path.join(tempfile.mkdtemp(), "old_httpserver.py")
        with open(path, "wb") as f:
            f.write(src)
        spec = importlib.util.spec_from_file_location("old_httpserver", path)
        http = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(http)
    answer = b'{"outputs": [[0.5]]}'
    router = http.Router()
    router.add(["POST"], re.escape(PATH), lambda request: http.Response(200, answer))

    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        sock.setblocking(False)
        server = http.HttpServer(router, 1 << 20)
        await server.start(sock)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(sock.getsockname()[1]))
        os.replace(port_file + ".tmp", port_file)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()

    uvloop.run(main())


def _cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wrk(port, connections, seconds, script):
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", script,
                          f"http://127.0.0.1:{port}{PATH}"], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rps, int(errors.group(1)) if errors else 0


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=5, help="seconds per wrk run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--base", default=BASE, help="git commit holding the hand-written layer")
    ap.add_argument("--serve", choices=["new", "old"], help=argparse.SUPPRESS)
    ap.add_argument("--port-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return _serve(args.serve, args.base, args.port_file)
    if shutil.which("wrk") is None:
        sys.exit("bench_http_layer: needs wrk (apt-get install wrk)")
    work = tempfile.mkdtemp(prefix="bench-http-")
    script = os.path.join(work, "post.lua")
    body = json.dumps({"instances": [{"ids": list(range(30)), "dense": [0.25, 0.5]}]})[:200].ljust(200)
    with open(script, "w") as f:
        f.write(f'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = {json.dumps(body)}\n')
    procs, ports = {}, {}
    try:
        for which in ("new", "old"):
            port_file = os.path.join(work, which + ".port")
            procs[which] = subprocess.Popen(module_cmd(__spec__.name) + ["--serve", which, "--base", args.base,
                                             "--port-file", port_file])
            deadline = time.time() + 60
            while not os.path.exists(port_file):
                if procs[which].poll() is not None or time.time() > deadline:
                    sys.exit(f"bench_http_layer: the {which} server did not start")
                time.sleep(0.05)
            ports[which] = int(open(port_file).read())
        rounds = []
        for r in range(args.rounds):
            row = {}
            for which in (("new", "old") if r % 2 == 0 else ("old", "new")):
                pid = procs[which].pid
                c0 = _cpu_s(pid)
                rps, errors = _wrk(ports[which], args.connections, args.seconds, script)
                cpu = _cpu_s(pid) - c0
                row[which] = {"rps": rps, "errors": errors,
                              "cpu_us_per_req": 1e6 * cpu / max(rps * args.seconds, 1)}
            row["rps_new_over_old"] = row["new"]["rps"] / row["old"]["rps"]
            row["cpu_new_over_old"] = row["new"]["cpu_us_per_req"] / row["old"]["cpu_us_per_req"]
            print(f"round {r}: {row}", file=sys.stderr, flush=True)
            rounds.append(row)
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
            p.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    result = {"seconds": args.seconds, "connections": args.connections, "base": args.base, "rounds": rounds}
    for which in ("new", "old"):
        result[which] = {k: _median([r[which][k] for r in rounds]) for k in ("rps", "cpu_us_per_req")}
    result["rps_new_over_old"] = _median([r["rps_new_over_old"] for r in rounds])
    result["cpu_new_over_old"] = _median([r["cpu_new_over_old"] for r in rounds])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
