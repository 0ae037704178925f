"""A restore into a parameter-server job whose tasks each run on a host of
their own (tests/hosts.py, tests/host_cluster.py), from an S3 root in which
one PS's part of the newest commit is damaged (a byte changed, cut short,
gone): the PS finds it on its host, the restore is refused naming the file,
and no PS's tables changed (none adopted its staging table while another PS
failed). The same tables then restore the undamaged chain exactly."""
import os
import sys

import hosts
from checkpoint.index import data_file, parse_index
from checkpoint.manifest import BUNDLE_PREFIX
from host_cluster import HostCluster

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "cluster"))
from cluster_harness import run_chief  # noqa: E402
from test_cluster_training import BATCH, assert_same_state, load  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DAMAGE = ("corrupt", "truncated", "missing")


def ps1_values_file(store, commit):
    """The key of the data file of PS 1's user rows in commit directory `commit` (a key prefix)."""
    num, entries = parse_index(store.get(f"{commit}/{BUNDLE_PREFIX}.index"), commit)
    shard = entries["user/part_1-values"].shard_id
    assert entries["user/part_1-values"].size > 1000
    assert [n for n, e in entries.items() if e.shard_id == shard and e.size] == ["user/part_1-values"]
    return f"{commit}/{data_file(BUNDLE_PREFIX, shard, num)}"


def damaged_copy(store, src, dst, key, how):
    """Copies every object under prefix `src` to `dst`, then damages `key`'s copy `how` ("intact": not at
    all); returns its name in the copy."""
    for k in store.keys(src + "/"):
        store.put(dst + k[len(src):], store.get(k))
    name = dst + key[len(src):]
    data = store.get(name)
    if how == "missing":
        store.delete(name)
    elif how == "truncated":
        store.put(name, data[:len(data) // 2])
    elif how == "corrupt":   # one byte changed in the middle, the size kept
        mid = len(data) // 2
        store.put(name, data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:])
    return name


class Damaging:
    """`hc` (a HostCluster) for run_chief, answering the chief's `ACTION damage ps 1` with `damage()`."""

    def __init__(self, hc, damage):
        self._hc, self._damage = hc, damage

    def __getattr__(self, name):
        return getattr(self._hc, name)

    def damage(self, job, task):
        assert (job, task) == ("ps", 1)
        self._damage()


def test_a_damaged_part_of_a_ps_on_its_own_host_is_refused_naming_it_and_no_ps_tables_change(tmp_path):
    with hosts.network_or_skip(tmp_path / "net") as net:
        store = net.object_store()
        names = {}

        def damage():
            # PS 1's part of the newest commit (a delta): each PS loads the full before it.
            delta = max(k.rsplit("/", 1)[0] for k in store.keys("job/") if "/delta-" in k)
            key = ps1_values_file(store, delta)
            for how in DAMAGE + ("intact",):
                names[how] = damaged_copy(store, "job", how, key, how)

        with HostCluster(net, num_ps=2, num_workers=1) as hc:
            r = run_chief(Damaging(hc, damage), [os.path.join(HERE, "try_restores.py")],
                          ["--cluster", hc.cluster_file, "--checkpoints", store.root("job"), "--steps", 4,
                           "--delta-every", 2, "--batch-size", BATCH, "--out", "/tmp",
                           *[store.root(how) for how in DAMAGE + ("intact",)]],
                          timeout=2 * hosts.STARTUP_S)   # commits and four restores: a bound for a hung run only
            out = hc.chief.tmp
        before = load(os.path.join(out, "before.npz"))
        assert all(len(before[f"{f}/keys"]) for f in ("user", "item"))   # rows on both PS to lose
        for i, how in enumerate(DAMAGE):
            assert r["errors"][i].startswith("CorruptCheckpointError: "), (how, r["errors"][i])
            assert names[how].split("/", 1)[1] in r["errors"][i], (how, r["errors"][i])
            assert_same_state(load(os.path.join(out, f"after-{i}.npz")), before, atol=0)
        # The same tables take the undamaged copy whole: the state the job had at its last commit.
        assert r["errors"][-1] is None
        assert_same_state(load(os.path.join(out, f"after-{len(DAMAGE)}.npz")),
                          load(os.path.join(out, "committed.npz")), atol=0)
        net.assert_no_checkpoint_files()
