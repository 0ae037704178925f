"""Tables of bench/cluster/bench_cluster.py results (markdown), and the model for larger clusters.

Per-step numbers are per worker step: a window's totals divided by the steps
all workers ran in it. Byte pairs read from the first role's sockets:
"worker->ps" [sent by workers, received by workers]; "ps->ps" [sent] counts
each PS-to-PS byte once.

The model (`model_rows`) takes the costs measured with 1 worker and 1, 2, 4 PS
to N = 8 and 32 PS. Bytes and RPCs per step are fitted by least-squares lines
in N through the runs with 2 or more PS (RPCs grow by a fixed count per PS:
one set of per-shard tensors per table). CPU is charged per row and per RPC:
  row work   (unique field ids + unique wide ids) x (1 / lookup rate + 1 /
             apply rate) at the single-process rates of BENCHMARKS.md
             (ROW_RATES: 1M keys x dim 16, Adam);
  a, c_rpc   PS CPU per step - row work = a x #PS + c_rpc x RPCs, fitted
             by least squares over every 1-worker run of the system's family
             (all evstore variants together: their RPC counts differ at the
             same PS count, which separates the two; TFRA alone, whose RPC
             count is a line in the PS count: a = 0, all per RPC): a fixed
             cost per PS and step, and one per RPC, charged to both ends of
             each RPC (upper bounds: on 2 shared cores idle TF threads spin
             and count);
With W = 4N workers, per step:
  PS tier    bytes over N links, and CPU over N PS of PS_CORES cores: the
             busiest PS pays a plus hot / N of (row work + RPCs x c_rpc),
             hot = the hot-spot factor of placing tables on fewer PS than
             all (busiest PS's share x N; 1 when sharded over all); "rows
             only" keeps the row work alone;
  chief      its bytes / link and its CPU (1-PS CPU + extra chief RPCs x c_rpc)
             / CHIEF_CORES: the one ClusterCoordinator dispatches every step
             of every worker from Python threads (mostly under the GIL, hence
             2 cores), and a system that keeps state on the chief adds to it;
  a worker   1 / ((1-PS worker CPU + extra RPCs x c_rpc) / WORKER_CORES +
             worker bytes / link + RTTS_PER_STEP x RTT).
examples/s = batch x min(PS tier, chief, W x a worker), a range from "rows
only" to "+ RPC cost". The dense variables are assumed spread over the PS
(a variable_partitioner); in the runs each is one variable on one PS.
"""

from bench.cluster.cluster_common import min_embedding_bytes

ASSUME = {"links": [(10, 100), (25, 50)], "ps_cores": 8, "worker_cores": 4, "chief_cores": 2,
          "rtts_per_step": 4, "workers_per_ps": 4}
# Single-process M keys/s at 1M keys x dim 16 (BENCHMARKS.md, "Latest run", run B): training lookup
# of existing keys and Adam apply. evstore: EvFindOrInsert 12.59, fused EvApplyAdam 5.23; TFRA:
# de.Variable.lookup 2.45, apply_gradients (tf_keras Adam) 0.56.
ROW_RATES = {"evstore": (12.59e6, 5.23e6), "evstore_group": (12.59e6, 5.23e6), "evstore_table": (12.59e6, 5.23e6),
             "evstore_2shards": (12.59e6, 5.23e6), "tfra": (2.45e6, 0.56e6)}


def _b(p, key, i):
    return p["bytes"].get(key, [0.0, 0.0])[i]


def flows(r):
    """Per-step byte and RPC figures of one result."""
    p = r["per_step"]
    wp_out, wp_in = _b(p, "worker->ps", 0), _b(p, "worker->ps", 1)
    pp = _b(p, "ps->ps", 0)
    c_out = _b(p, "chief->worker", 0) + _b(p, "chief->ps", 0)
    c_in = _b(p, "chief->worker", 1) + _b(p, "chief->ps", 1)
    rpc = p["rpcs"]
    by = lambda pre, meth=None: sum(c for k, c in rpc.items()  # noqa: E731
                                    if k.startswith(pre) and (meth is None or k.endswith(":" + meth)))
    cpu = p.get("cpu_s", {})
    return {"wp_out": wp_out, "wp_in": wp_in, "pp": pp, "chief": c_out + c_in, "chief_max": max(c_out, c_in),
            "ps_max": max(wp_out + _b(p, "chief->ps", 0) + pp, wp_in + _b(p, "chief->ps", 1) + pp),
            "worker_max": max(wp_out + _b(p, "worker->chief", 0), wp_in + _b(p, "worker->chief", 1)),
            "total": wp_out + wp_in + pp + c_out + c_in,
            "rpc_cluster": by("ps:") + by("worker:"), "rpc_rcf": by("ps:", "RunComponentFunction")
            + by("worker:", "RunComponentFunction"), "rpc_recv": by("ps:", "RecvTensor") + by("worker:", "RecvTensor"),
            "rpc_chief": by("chief:"), "cpu_ps": cpu.get("ps", 0.0), "cpu_worker": cpu.get("worker", 0.0),
            "cpu_chief": cpu.get("chief", 0.0)}


def analytic(r):
    """(total, embedding, dense) least bytes per step (cluster_common.analytic_bytes),
    recomputed from the recorded unique-id counts (results of older versions
    counted the keys twice)."""
    a = r["analytic_min"]
    emb = min_embedding_bytes(a["unique_ids_per_field_sum"], a["unique_ids_all"], r["dim"])
    return emb + a["dense_bytes"], emb, a["dense_bytes"]


def _mb(x):
    return f"{x / 1e6:.2f}"


def measured_table(meta, results):
    out = ["| system | PS | workers | examples/s (rounds) | worker→PS / PS→worker MB | PS↔PS MB | chief↔others MB "
           "| total MB | analytic min MB (emb + dense) | RPCs worker↔PS (RunComponentFunction + RecvTensor + other) "
           "| RPCs by chief | CPU ms: PS / worker / chief |", "|---" * 12 + "|"]
    for key, r in results.items():
        s, ps, w = key.split("/")
        if "error" in r:
            out.append(f"| {s} | {ps[2:]} | {w[1:]} | {r['error']} |" + " |" * 8)
            continue
        f = flows(r)
        tot, emb, dense = analytic(r)
        other = f["rpc_cluster"] - f["rpc_rcf"] - f["rpc_recv"]
        out.append(
            f"| {s} | {r['ps']} | {r['workers']} | {r['examples_per_s']:,.0f} ("
            + ", ".join(f"{x:,.0f}" for x in r["examples_per_s_rounds"]) + ") | "
            f"{_mb(f['wp_out'])} / {_mb(f['wp_in'])} | {_mb(f['pp'])} | {_mb(f['chief'])} | {_mb(f['total'])} | "
            f"{_mb(tot)} ({_mb(emb)} + {_mb(dense)}) | "
            f"{f['rpc_cluster']:.0f} ({f['rpc_rcf']:.0f} + {f['rpc_recv']:.0f} + {other:.0f}) | {f['rpc_chief']:.0f} | "
            f"{1e3 * f['cpu_ps']:.0f} / {1e3 * f['cpu_worker']:.0f} / {1e3 * f['cpu_chief']:.0f} |")
    return "\n".join(out) + "\n"


def _fit(points):
    """Least-squares line y = a + b N through [(N, y)]; one point: (y, 0)."""
    if len({n for n, _ in points}) < 2:
        return (sum(y for _, y in points) / len(points), 0.0)
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return (my - b * mx, b)


def _hotspot(r, n_ps):
    """Tables placed on k of the PS (per-table: k = 1, table i on PS i; 2 shards:
    k = 2, on PS i and i + 1): the busiest PS's share of the embedding bytes x N
    (>= 1). Sharded over every PS: 1."""
    k = {"table": 1, "shards2": 2}.get(r.get("placement"))
    if k is None:
        return 1.0
    a = r["analytic_min"]
    dim = r["dim"]
    load = [u * (8 + 4 * dim) for u in a["unique_per_field"]] + [a["unique_ids_all"] * 12]
    per_ps = [0.0] * n_ps
    for i, x in enumerate(load):
        for j in range(min(k, n_ps)):
            per_ps[(i + j) % n_ps] += x / min(k, n_ps)
    return max(1.0, max(per_ps) / sum(load) * n_ps)


def _slope(xy):
    return _fit(xy)[1]


def _family(system):
    return "tfra" if system == "tfra" else "evstore"


def _ps_cpu_fit(points):
    """(a, c) of PS CPU per step - row work = a x #PS + c x RPCs, least squares
    (clipped at 0) over [(n_ps, rpcs, y)]: a fixed cost per PS and step, c per RPC."""
    sxx = sum(n * n for n, _, _ in points)
    sxr = sum(n * r for n, r, _ in points)
    srr = sum(r * r for _, r, _ in points)
    sxy = sum(n * y for n, _, y in points)
    sry = sum(r * y for _, r, y in points)
    det = sxx * srr - sxr * sxr
    if abs(det) < 1e-12:
        return 0.0, max(0.0, sry / srr) if srr else 0.0
    a, c = (srr * sxy - sxr * sry) / det, (sxx * sry - sxr * sxy) / det
    if a < 0:
        return 0.0, max(0.0, sry / srr)
    if c < 0:
        return max(0.0, sxy / sxx), 0.0
    return a, c


def _row_seconds(system, r):
    a = r["analytic_min"]
    lookup, apply_ = ROW_RATES[system]
    return (a["unique_ids_per_field_sum"] + a["unique_ids_all"]) * (1 / lookup + 1 / apply_)


def model_rows(meta, results, targets=(8, 32)):
    """[(system, N, link, dict)] from the 1-worker runs (see the module docstring)."""
    rows, A, inf = [], ASSUME, float("inf")
    one = [(k.split("/")[0], r) for k, r in results.items()
           if "error" not in r and r["workers"] == 1 and k.split("/")[0] in ROW_RATES]
    cpu_fit = {}
    for fam in {_family(s) for s, _ in one}:
        pts = [(r["ps"], flows(r)["rpc_cluster"], flows(r)["cpu_ps"] - _row_seconds(s, r))
               for s, r in one if _family(s) == fam]
        if len({s for s, _ in one if _family(s) == fam}) > 1:
            cpu_fit[fam] = _ps_cpu_fit(pts)
        else:   # one system: its RPC count is a line in #PS, a and c cannot be told apart; all per RPC
            srr = sum(r * r for _, r, _ in pts)
            cpu_fit[fam] = (0.0, max(0.0, sum(r * y for _, r, y in pts) / srr) if srr else 0.0)
    for s in meta["systems"]:
        pts = sorted([(r["ps"], flows(r), r) for s_, r in one if s_ == s], key=lambda p: p[0])
        if not pts:
            continue
        multi = [p for p in pts if p[0] >= 2]  # lines through the runs with cross-PS traffic when possible
        fit_pts = multi if len({p[0] for p in multi}) >= 2 else pts
        fit = {q: _fit([(n, f[q]) for n, f, _ in fit_pts]) for q in pts[0][1]}
        n0, f0, r0 = pts[0]
        batch = r0["batch_size"]
        row_s = _row_seconds(s, r0)
        a_ps, c_rpc = cpu_fit[_family(s)]
        for n in targets:
            q = {k: max(0.0, a_ + b * n) for k, (a_, b) in fit.items()}
            hot = _hotspot(r0, n)
            extra = max(0.0, q["rpc_cluster"] - f0["rpc_cluster"]) * c_rpc
            for gbit, rtt_us in A["links"]:
                bw = gbit * 1e9 / 8
                net = bw * n / (q["ps_max"] * hot) if q["ps_max"] else inf
                ps_rows = A["ps_cores"] * n / (row_s * hot)
                # the busiest PS: its fixed cost a, and its share (hot / N) of the rows and the RPCs
                ps_rpc = A["ps_cores"] / (a_ps + (row_s + q["rpc_cluster"] * c_rpc) * hot / n)
                chief_cpu = f0["cpu_chief"] + max(0.0, q["rpc_chief"] - f0["rpc_chief"]) * c_rpc
                chief = min(bw / q["chief_max"] if q["chief_max"] else inf,
                            A["chief_cores"] / chief_cpu if chief_cpu else inf)
                lat = q["worker_max"] / bw + A["rtts_per_step"] * rtt_us * 1e-6
                w_lo = 1.0 / ((f0["cpu_worker"] + extra) / A["worker_cores"] + lat)
                w_hi = 1.0 / (f0["cpu_worker"] / A["worker_cores"] + lat)
                w = A["workers_per_ps"] * n
                rows.append((s, n, f"{gbit} Gbit/s, RTT {rtt_us} µs", {
                    "bytes": q["total"], "rpcs": q["rpc_cluster"], "c_rpc": c_rpc, "a_ps": a_ps, "row_s": row_s,
                    "hot": hot, "net": batch * net, "ps_rows": batch * min(net, ps_rows),
                    "ps_rpc": batch * min(net, ps_rpc), "chief": batch * chief, "worker_lo": batch * w_lo,
                    "worker_hi": batch * w_hi, "workers": w,
                    "cluster_lo": batch * min(net, ps_rpc, chief, w * w_lo),
                    "cluster_hi": batch * min(net, ps_rows, chief, w * w_hi)}))
    return rows


def model_table(meta, results):
    rows = model_rows(meta, results)
    if not rows:
        return ""
    A = ASSUME

    def num(x):
        return "∞" if x == float("inf") else f"{x:,.0f}"

    counts = sorted({r["ps"] for r in results.values() if "error" not in r and r["workers"] == 1})
    out = [f"Model (bench/cluster/cluster_report.py): 1-worker costs at {counts} PS "
           + ("fitted linearly in the PS count through the runs with 2+ PS" if len(counts) > 1 else "held constant (one PS count measured)")
           + f"; PS {A['ps_cores']} cores, chief {A['chief_cores']}, worker "
           f"{A['worker_cores']} effective; {A['rtts_per_step']} sequential round trips per step; "
           f"{A['workers_per_ps']} workers per PS; row costs from the single-process rates "
           + ", ".join(f"{k} {a / 1e6:g} / {b / 1e6:g} M keys/s" for k, (a, b) in ROW_RATES.items()) + ".\n",
           "| system | PS | link | bytes/step (MB) | RPCs/step | row work ms/step | a ms / c_rpc µs (fit) | hot-spot "
           "| PS links ceiling ex/s | PS ceiling ex/s: rows only / + RPC cost | chief ceiling ex/s "
           "| one worker ex/s: - / + RPC cost | workers | cluster ex/s |", "|---" * 14 + "|"]
    for s, n, link, d in rows:
        out.append(f"| {s} | {n} | {link} | {_mb(d['bytes'])} | {d['rpcs']:.0f} | {1e3 * d['row_s']:.1f} | "
                   f"{1e3 * d['a_ps']:.1f} / {1e6 * d['c_rpc']:.0f} | {d['hot']:.1f} | {num(d['net'])} | {num(d['ps_rows'])} / "
                   f"{num(d['ps_rpc'])} | {num(d['chief'])} | {num(d['worker_hi'])} / {num(d['worker_lo'])} | "
                   f"{d['workers']} | "
                   f"{num(d['cluster_lo'])} - {num(d['cluster_hi'])} |")
    return "\n".join(out) + "\n"


def render(meta, results):
    head = (f"`{meta['command']}` — {meta['date_utc']}, evstore {meta['evstore_commit']}, {meta['cpus']} CPUs "
            f"shared by every process of the cluster (and other agents: examples/s is noisy and cannot show "
            f"scaling), batch {meta['batch_size']}, dim {meta['dim']}, vocabularies up to {meta['max_vocab']:,}, "
            f"{meta['warmup']} warm-up + {meta['rounds']} x {meta['steps']} timed steps per worker, "
            f"{meta['total_s']:.0f} s total. Per worker step: TCP payload bytes per role pair (kernel socket "
            "counters), gRPC calls issued (TF_CPP_VMODULE=grpc_state=2), CPU seconds per role (/proc).\n")
    return head + "\n" + measured_table(meta, results) + "\n" + model_table(meta, results)
