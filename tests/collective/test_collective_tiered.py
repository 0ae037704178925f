"""Collective EVs on tiered storage: 2 worker processes whose
CollectiveEmbeddingVariables keep their rows in a DRAM cache of 3 rows over a
disk tier (evstore.TieredStorage) end bit for bit equal to 2 workers on
all-DRAM tables after the same synchronous training (sync_model.py), which
test_collective_sync.py shows equal to one process."""
import os

import numpy as np
import pytest

import sync_harness as h
from sync_model import TIERED_ROWS

SCRIPT = os.path.join(h.HERE, "sync_model.py")
FIELDS = ("keys", "values", "versions", "freqs", "filtered_keys", "filtered_freqs", "slot_m", "slot_v")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sync_tiered")
    tier = d / "tier"
    tier.mkdir()
    procs, logs = [], []
    for kind in ("tiered", "dram"):
        ports = h.ports(2)
        for r in range(2):
            logs.append(str(d / f"{kind}{r}.log"))
            extra = ["--tiered", tier] if kind == "tiered" else []
            procs.append(h.start([SCRIPT, d / f"{kind}{r}.npz", "worker", "--rank", r, "--ports", ports, *extra],
                                 logs[-1]))
    assert h.wait_all(procs, logs) == [0] * 4, "\n".join(f"--- {lg}\n{h.tail(lg)}" for lg in logs)
    assert os.listdir(tier) == [], "each worker removes its tier directories when it exits"
    return ([np.load(d / f"tiered{r}.npz") for r in range(2)], [np.load(d / f"dram{r}.npz") for r in range(2)])


@pytest.mark.parametrize("tag", ["a", "b"])
def test_each_workers_shard_holds_more_rows_than_its_cache_and_reads_rows_back_from_disk(runs, tag):
    tiered, _ = runs
    for w in tiered:
        assert len(w[f"{tag}_keys"]) > TIERED_ROWS
        assert int(w[f"{tag}_cache_misses"]) > 0 and int(w[f"{tag}_disk_bytes"]) > 0


@pytest.mark.parametrize("tag", ["a", "b"])
def test_tiered_workers_shards_equal_all_dram_workers_shards_bit_for_bit(runs, tag):
    tiered, dram = runs
    for r in range(2):
        for f in FIELDS:
            want, got = dram[r][f"{tag}_{f}"], tiered[r][f"{tag}_{f}"]
            assert want.dtype == got.dtype and want.shape == got.shape, (r, f)
            assert want.tobytes() == got.tobytes(), (r, tag, f)


@pytest.mark.parametrize("tag", ["a", "b"])
def test_the_whole_table_gathered_from_tiered_shards_equals_the_all_dram_one(runs, tag):
    tiered, dram = runs
    for r in range(2):
        for f in FIELDS:
            assert dram[r][f"whole_{tag}_{f}"].tobytes() == tiered[r][f"whole_{tag}_{f}"].tobytes(), (r, tag, f)


def test_dense_weights_equal_all_dram_workers(runs):
    tiered, dram = runs
    for r in range(2):
        for name in ("w", "v", "bias", "iterations"):
            np.testing.assert_array_equal(tiered[r][name], dram[r][name], err_msg=name)
