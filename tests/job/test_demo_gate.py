"""`evstore demo --poison START:SECONDS --gate`: the demo's training labels shuffled for a
stretch, served by a gated `evstore serve`; every commit carries its quality. The demo commits at the
stretch's edges, so which commits are poisoned does not depend on where the delta schedule falls."""
import json
import os
import subprocess
import sys

from evstore.gate import DEFAULT_GATE


def _evstore(*args):
    return subprocess.run([sys.executable, "-m", "evstore_app.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_a_poisoned_gated_demo_reports_the_stretch_and_the_gate_and_commits_carry_quality(tmp_path):
    out = tmp_path / "demo"
    p = _evstore("demo", "--minutes", "0.5", "--out", str(out), "--delta-every", "2", "--warmup-batches", "30",
                 "--poison", "9:10", "--gate", "--no-progress")   # both edges between scheduled deltas
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    p0 = s["poison"]   # in seconds since the trainer started; the stretch starts 9 s after serving does
    assert p0["start_s"] >= 9.0 and abs(p0["end_s"] - p0["start_s"] - 10.0) < 0.02
    g = s["serving"]["gate"]
    assert g["gate"] == DEFAULT_GATE and g["held_back_total"] >= 1
    assert p0["commits"] and not set(p0["commits"]) & set(g["served_versions"])   # no poisoned commit served
    assert s["restore_matches_trainer"] is True
    roots = out / "checkpoints"
    ms = {m["seq"]: m for m in (json.loads((roots / d / "MANIFEST.json").read_text()) for d in os.listdir(roots)
                                if d.startswith(("full-", "delta-")))}
    deltas = [m for m in ms.values() if m["kind"] == "delta"]
    assert set(p0["examples"]) <= {m["metadata"]["examples"] for m in ms.values()}   # it starts and ends at commits
    assert deltas and all(m["quality"]["examples"] == m["metadata"]["examples"] - ms[m["parent"]]["metadata"]
                          ["examples"] for m in deltas if m["parent"] in ms)   # the examples since its parent
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_malformed_poison_or_gate_is_refused_in_one_line(tmp_path):
    p = _evstore("demo", "--minutes", "0.1", "--out", str(tmp_path / "a"), "--poison", "ten", "--no-progress")
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == \
        "evstore demo: --poison takes START:SECONDS (two numbers), got 'ten'"
    p = _evstore("demo", "--minutes", "0.1", "--out", str(tmp_path / "b"), "--gate", "auc >>", "--no-progress")
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("evstore demo: gate clause 1")
