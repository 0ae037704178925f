"""Markdown sections of bench/run.py for the benchmarks that report one JSON result each
(checkpoint, serving, PS cluster); numbers only, no imports beyond the standard library."""


def cluster_tables(c):
    """The PS-cluster section of a bench_cluster.py result."""
    if not c:
        return ""
    return f"\n### PS cluster\n\n- {c['error']}\n" if "error" in c else "\n" + c["markdown"]


def serving_tables(s):
    """The "Serving" section of a bench_serving.py result."""
    if not s:
        return ""
    net = s.get("net")
    net = "" if not net else (f"\n### Serving over the network\n\n- {net['error']}\n" if "error" in net
                              else net["markdown"])
    if "error" in s:
        return f"\n### Serving\n\n- {s['error']}\n" + net
    return "\n" + s["markdown"] + net


def checkpoint_tables(c):
    """The "Checkpoints" table of a bench_checkpoint.py result."""
    if not c:
        return ""
    if "error" in c:
        return f"\n### Checkpoints\n\n- {c['error']}\n"
    T = c["targets"]
    full, seq = c["full"], c["seq_write"]
    fs = full["save_s_median"]

    def mib(x):
        return f"{x['extra_mib']:.0f}"

    def mark(ok):
        return "✓" if ok else "✗"

    mem_max = max([full["extra_mib_max"]] + [d["mem"]["extra_mib"] for d in c["deltas"]])
    out = [f"\n### Checkpoints: {c['keys'] / 1e6:g}M keys x dim {c['dim']}, Adam slots m, v "
           f"({full['bytes'] / 1e9:.2f} GB per full)\n",
           "Local disk, every file fsynced; medians of the full saves / sequential writes (each run listed in the "
           "JSON). Extra memory: RSS high-water during the operation minus RSS before it. Deltas: that fraction of "
           "keys updated by sparse Adam since the previous save. Restores: into a new empty EV, crc32c check of "
           "every file + load (files in the page cache).\n",
           "| operation | seconds | MB/s | ratio | extra memory (MiB) | DESIGN target |", "|---|---|---|---|---|---|",
           f"| sequential write + fsync of the same bytes | {seq['s_median']:.2f} | {seq['mbps']:.0f} | 1 | | |",
           f"| full save (CheckpointManager.save_full) | {fs:.2f} | {full['mbps']:.0f} | "
           f"{c['full_vs_seq']:.2f}x the sequential write | {full['extra_mib_max']:.0f} | "
           f"≥ {T['full_vs_seq']}x {mark(c['full_vs_seq'] >= T['full_vs_seq'])}, "
           f"< {T['extra_mib']} MiB {mark(mem_max < T['extra_mib'])} |"]
    for d in c["deltas"]:
        tgt = (f"≤ {T['delta1_vs_full']:.0%} {mark(d['vs_full'] <= T['delta1_vs_full'])}"
               if abs(d["frac"] - 0.01) < 1e-9 else "")
        out.append(f"| delta save, {d['frac']:.1%} dirty ({d['keys']} keys, {d['bytes'] / 1e6:.1f} MB) | "
                   f"{d['save_s']:.3f} | {d['bytes'] / d['save_s'] / 1e6:.0f} | {d['vs_full']:.1%} of the full save | "
                   f"{mib(d['mem'])} | {tgt} |")
    for r in c["restore"]:
        out.append(f"| restore {r['what']} ({r['bytes'] / 1e9:.2f} GB) into a new EV | {r['s']:.2f} (verify "
                   f"{r['verify_s']:.2f} + load {r['load_s']:.2f}) | {r['bytes'] / r['s'] / 1e6:.0f} | | "
                   f"{r['mem'].get('transient_mib', r['mem']['extra_mib']):.0f} above the restored table | |")
    if c.get("restore_live"):
        r = c["restore_live"]
        out.append(f"| restore the full into the live table (load only) | {r['load_s']:.2f} | | | {mib(r['mem'])} | |")
    t = c.get("tfra")
    if t and "error" not in t:
        out.append(f"| TFRA 0.8.1 save (tf.train.Checkpoint.write + fsync; {t['bytes'] / 1e9:.2f} GB) | "
                   f"{t['save_s_median']:.2f} | {t['bytes'] / t['save_s_median'] / 1e6:.0f} | "
                   f"evstore's full save: {t['save_s_median'] / fs:.2f}x TFRA's speed | {t['extra_mib_max']:.0f} | |")
        out.append(f"| TFRA 0.8.1 restore (Checkpoint.read into cleared tables) | {t['restore_s']:.2f} | "
                   f"{t['bytes'] / t['restore_s'] / 1e6:.0f} | | {mib(t['restore_mem'])} | |")
    elif t:
        out.append(f"\n- TFRA: {t['error']}")
    return "\n".join(out) + "\n"
