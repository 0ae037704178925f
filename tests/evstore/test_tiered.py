"""An EmbeddingVariable on tiered storage (evstore.TieredStorage: a DRAM cache
far smaller than the table over a private directory on disk) ends bit for bit
equal to an all-DRAM EV after the same work: every optimizer kind, both
filters, both eviction policies, string keys, every lookup path, checkpoint
round trips, a SIGKILLed trainer, a full disk. docs/guides/tiered-storage.md."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import checkpoint
import checkpoint.tools
import evstore
from checkpoint.manifest import BUNDLE_PREFIX
from evstore import schema

DIM = 8
NKEYS = 3000
# ~40 rows of dim 8 with two slots: the table is ~75x its DRAM budget.
BUDGET = 40 * (DIM * 3 * 4 + 8)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FUSED = {
    "sgd": lambda: evstore.optimizers.SGD(0.1),
    "momentum": lambda: evstore.optimizers.SGD(0.05, momentum=0.9),
    "adagrad": lambda: evstore.optimizers.Adagrad(0.1),
    "adam": lambda: evstore.optimizers.Adam(0.01),
    "adamw": lambda: evstore.optimizers.AdamW(0.01, weight_decay=0.1),
    "ftrl": lambda: evstore.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
    "group_adam": lambda: evstore.optimizers.GroupAdam(0.01, l1_regularization_strength=0.01,
                                                       l21_regularization_strength=0.01),
    "group_adagrad": lambda: evstore.optimizers.GroupAdagrad(0.1, l1_regularization_strength=0.01,
                                                             l21_regularization_strength=0.01),
    "generic_rmsprop": lambda: keras.optimizers.RMSprop(0.01),
}
FILTERS = {
    "none": lambda: None,
    "counter": lambda: evstore.CounterFilter(2),
    "bloom": lambda: evstore.BloomFilter(2, capacity=20000),
}


def batch_keys(step, n=256, nkeys=NKEYS):
    """Zipf(1.1) ids, as CTR ids are; a pure function of the step."""
    r = np.random.default_rng(100 + step)
    return (np.minimum(r.zipf(1.1, size=n), nkeys) * 7919 - 3).astype(np.int64)


def make(tmp_path, tiered, name="t", **kw):
    storage = evstore.TieredStorage(dram_bytes=BUDGET, path=str(tmp_path / "tier")) if tiered else None
    return evstore.EmbeddingVariable(name, DIM, initializer=tf.random_normal_initializer(0, 0.1, seed=3),
                                     initializer_bank_size=97, storage=storage, **kw)


def train_step(ev, opt, step, keys=None):
    keys = batch_keys(step) if keys is None else keys
    target = np.random.default_rng(step).normal(size=(len(keys), DIM)).astype(np.float32)
    with tf.GradientTape() as tape:
        emb = evstore.embedding_lookup(ev, keys)
        loss = tf.reduce_sum(tf.square(emb - target))
    grads = tape.gradient(loss, ev.trainable_variables)
    opt.apply_gradients(zip(grads, ev.trainable_variables))


def state(ev):
    """Everything a checkpoint holds of the EV, keys sorted, as numpy."""
    out = {}
    for shard_i, e in enumerate(ev.shards):
        x = e.export()
        k, f = np.argsort(x["keys"].numpy()), np.argsort(x["filtered_keys"].numpy())
        for n in ("keys", "values", "versions", "freqs"):
            out[f"{shard_i}:{n}"] = x[n].numpy()[k]
        for n in ("filtered_keys", "filtered_freqs"):
            out[f"{shard_i}:{n}"] = x[n].numpy()[f]
        for s, v in x["slots"].items():
            out[f"{shard_i}:slot:{s}"] = v.numpy()[k]
    return out


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def assert_went_to_disk(ev):
    st = ev.stats()
    assert st["cache_misses"] > 0 and st["disk_bytes"] > 0, st
    assert st["cache_rows"] < st["admitted"] / 2, st


def stats_without_tier(ev):
    st = ev.stats()
    return {k: st[k] for k in ("size", "admitted", "filtered", "dirty", "deleted", "evicted", "zero_rows")}


@pytest.mark.parametrize("opt_name", sorted(FUSED))
def test_every_optimizer_trains_a_tiered_ev_exactly_like_an_all_dram_ev(tmp_path, opt_name):
    dram, tier = make(tmp_path, False), make(tmp_path, True)
    o1, o2 = FUSED[opt_name](), FUSED[opt_name]()
    for step in range(12):
        train_step(dram, o1, step)
        train_step(tier, o2, step)
    assert_went_to_disk(tier)
    assert_same(state(tier), state(dram))
    assert stats_without_tier(tier) == stats_without_tier(dram)


@pytest.mark.parametrize("filter_name", sorted(FILTERS))
@pytest.mark.parametrize("evict", ["global_step", "l2_weight"])
def test_filters_and_eviction_policies_agree_with_all_dram(tmp_path, filter_name, evict):
    policy = (lambda: evstore.GlobalStepEvict(4)) if evict == "global_step" else (lambda: evstore.L2WeightEvict(0.3))
    dram = make(tmp_path, False, filter=FILTERS[filter_name](), evict=policy())
    tier = make(tmp_path, True, filter=FILTERS[filter_name](), evict=policy())
    o1, o2 = evstore.optimizers.Adam(0.05), evstore.optimizers.Adam(0.05)
    evicted = 0
    for step in range(16):
        train_step(dram, o1, step)
        train_step(tier, o2, step)
        if step % 4 == 3:
            n = int(dram.evict(step))
            assert int(tier.evict(step)) == n
            evicted += n
    assert evicted > 0
    assert_went_to_disk(tier)
    assert_same(state(tier), state(dram))
    assert stats_without_tier(tier) == stats_without_tier(dram)


def test_eviction_by_step_reads_no_cold_row_back(tmp_path):
    tier = make(tmp_path, True, evict=evstore.GlobalStepEvict(2))
    opt = evstore.optimizers.SGD(0.1)
    for step in range(6):
        train_step(tier, opt, step)
    misses = tier.stats()["cache_misses"]
    assert int(tier.evict(100)) > 0
    assert tier.stats()["cache_misses"] == misses


def test_string_keys_on_tiered_storage(tmp_path):
    dram = make(tmp_path, False, key_dtype=tf.string)
    tier = make(tmp_path, True, key_dtype=tf.string)
    o1, o2 = evstore.optimizers.Adagrad(0.1), evstore.optimizers.Adagrad(0.1)
    for step in range(8):
        keys = np.array([b"user-%d" % k for k in batch_keys(step)], dtype=object)
        train_step(dram, o1, step, keys)
        train_step(tier, o2, step, keys)
    assert_went_to_disk(tier)
    assert_same(state(tier), state(dram))


def test_every_lookup_path_reads_the_same_rows(tmp_path):
    dram, tier = make(tmp_path, False), make(tmp_path, True)
    o1, o2 = evstore.optimizers.Adam(0.05), evstore.optimizers.Adam(0.05)
    for step in range(6):
        train_step(dram, o1, step)
        train_step(tier, o2, step)
    dram2, tier2 = make(tmp_path, False, name="t2"), make(tmp_path, True, name="t2")
    ids = batch_keys(99, n=512)
    sp = tf.sparse.from_dense(tf.constant(ids.reshape(64, 8)))
    sp_w = tf.SparseTensor(sp.indices, tf.linspace(0.5, 1.5, tf.size(sp.values)), sp.dense_shape)
    for training in (False, True):
        np.testing.assert_array_equal(evstore.embedding_lookup(tier, ids, training=training).numpy(),
                                      evstore.embedding_lookup(dram, ids, training=training).numpy())
        for combiner in ("sum", "mean", "sqrtn"):
            np.testing.assert_array_equal(
                evstore.embedding_lookup_sparse(tier, sp, sp_w, combiner=combiner, training=training).numpy(),
                evstore.embedding_lookup_sparse(dram, sp, sp_w, combiner=combiner, training=training).numpy())
            np.testing.assert_array_equal(
                evstore.safe_embedding_lookup_sparse(tier, sp, sp_w, combiner=combiner, training=training).numpy(),
                evstore.safe_embedding_lookup_sparse(dram, sp, sp_w, combiner=combiner, training=training).numpy())
        a = evstore.embedding_lookup_group([tier, tier2], [ids[:100], ids[100:]], training=training)
        b = evstore.embedding_lookup_group([dram, dram2], [ids[:100], ids[100:]], training=training)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.numpy(), y.numpy())
    assert_same(state(tier), state(dram))
    assert_same(state(tier2), state(dram2))


def test_sharded_tiered_ev_equals_sharded_all_dram_ev(tmp_path):
    dram, tier = make(tmp_path, False, shards=3), make(tmp_path, True, shards=3)
    o1, o2 = evstore.optimizers.Adam(0.05), evstore.optimizers.Adam(0.05)
    for step in range(8):
        train_step(dram, o1, step)
        train_step(tier, o2, step)
    assert_same(state(tier), state(dram))


def test_full_and_delta_checkpoints_round_trip_through_tiered_storage(tmp_path):
    dram, tier = make(tmp_path, False, filter=evstore.CounterFilter(2)), make(tmp_path, True,
                                                                               filter=evstore.CounterFilter(2))
    o1, o2 = evstore.optimizers.Adam(0.05), evstore.optimizers.Adam(0.05)
    m_dram = checkpoint.CheckpointManager(str(tmp_path / "dram"), {"t": dram})
    m_tier = checkpoint.CheckpointManager(str(tmp_path / "tier_ckpt"), {"t": tier})
    for step in range(6):
        train_step(dram, o1, step)
        train_step(tier, o2, step)
    m_dram.save_full()
    m_tier.save_full()
    for step in range(6, 10):
        train_step(dram, o1, step)
        train_step(tier, o2, step)
        dram.remove(batch_keys(step)[:5])
        tier.remove(batch_keys(step)[:5])
    m_dram.save_delta()
    m_tier.save_delta()
    # A tiered EV restores the tiered chain, an all-DRAM one too, and both
    # equal the trained all-DRAM EV.
    fresh_tier, fresh_dram = make(tmp_path, True, filter=evstore.CounterFilter(2)), make(tmp_path, False)
    checkpoint.CheckpointManager(str(tmp_path / "tier_ckpt"), {"t": fresh_tier}, lease=False).restore()
    checkpoint.CheckpointManager(str(tmp_path / "tier_ckpt"), {"t": fresh_dram}, lease=False).restore()
    assert_went_to_disk(fresh_tier)
    assert_same(state(fresh_tier), state(dram))
    assert_same(state(fresh_dram), state(dram))
    m_dram.close()
    m_tier.close()


def bundle_content(commit_dir):
    """What a commit holds, key by key (the order of rows in a bundle is not a contract: a tiered full
    writes its cold rows in the tier file's order), read with stock tf.train.load_checkpoint: per bundle
    and EV, every key-aligned tensor's row by key (the serving view's by the main bundle's keys), the
    filtered keys' columns by key, the deleted keys as a set, and every other tensor whole."""
    readers = {p.name[:-len(".index")]: tf.train.load_checkpoint(str(p)[:-len(".index")])
               for p in Path(commit_dir).glob("*.index")}
    main = readers[BUNDLE_PREFIX]
    names = set(main.get_variable_to_shape_map())
    evs = [n[:-len(schema.KEYS)] for n in names if n.endswith(schema.KEYS)]
    out, aligned_names = {}, set()

    def key_of(k):
        return k if isinstance(k, bytes) else int(k)

    for ev in evs:
        keys = [key_of(k) for k in main.get_tensor(ev + schema.KEYS)]
        assert len(set(keys)) == len(keys), f"{ev}: a key twice"
        aligned = [ev + schema.VALUES, ev + schema.VERSIONS, ev + schema.FREQS]
        aligned += sorted(n for n in names if n.startswith(ev + schema.SLOT_SEPARATOR) and n.endswith(schema.SLOT_VALUES))
        cols = [(BUNDLE_PREFIX, n) for n in aligned]
        for prefix, r in readers.items():   # the serving view: row-aligned with the main bundle's keys
            if prefix != BUNDLE_PREFIX:
                cols += [(prefix, n) for n in r.get_variable_to_shape_map() if n.startswith(ev + "-")]
        arrays = {c: readers[c[0]].get_tensor(c[1]) for c in cols}
        out[ev, "rows"] = {k: tuple(arrays[c][i].tobytes() for c in cols) for i, k in enumerate(keys)}
        fkeys = [key_of(k) for k in main.get_tensor(ev + schema.KEYS_FILTERED)]
        fcols = [main.get_tensor(ev + n) for n in (schema.FREQS_FILTERED, schema.SEEN_FILTERED)]
        out[ev, "filtered"] = {k: tuple(int(c[i]) for c in fcols) for i, k in enumerate(fkeys)}
        if ev + schema.DELETED_KEYS in names:
            out[ev, "deleted"] = {key_of(k) for k in main.get_tensor(ev + schema.DELETED_KEYS)}
        aligned_names |= {(p, n) for p, n in cols} | {(BUNDLE_PREFIX, ev + n) for n in (
            schema.KEYS, schema.KEYS_FILTERED, schema.FREQS_FILTERED, schema.SEEN_FILTERED, schema.DELETED_KEYS)}
    for prefix, r in readers.items():
        for n in r.get_variable_to_shape_map():
            if (prefix, n) not in aligned_names:
                out[prefix, n] = r.get_tensor(n).tobytes()
    return out


def commits(root):
    return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))


@pytest.mark.parametrize("key_dtype", [tf.int64, tf.string])
def test_a_tiered_chain_holds_the_all_dram_chain_s_content_key_by_key(tmp_path, key_dtype):
    """Every key's row, slots, version and frequency, the filtered and the deleted keys, the serving
    view row-aligned with the keys, and everything else, equal in every commit; read by stock TF."""
    def ids(step):
        k = batch_keys(step)
        return np.array([b"user-%d" % x for x in k], dtype=object) if key_dtype == tf.string else k

    dram = make(tmp_path, False, key_dtype=key_dtype, filter=evstore.CounterFilter(2))
    tier = make(tmp_path, True, key_dtype=key_dtype, filter=evstore.CounterFilter(2))
    o1, o2 = evstore.optimizers.Adam(0.05), evstore.optimizers.Adam(0.05)
    m1 = checkpoint.CheckpointManager(str(tmp_path / "a"), {"t": dram}, lease=False, serving_view="int8")
    m2 = checkpoint.CheckpointManager(str(tmp_path / "b"), {"t": tier}, lease=False, serving_view="int8")
    for step in range(12):
        train_step(dram, o1, step, ids(step))
        train_step(tier, o2, step, ids(step))
    assert_went_to_disk(tier)
    m1.save_full()
    m2.save_full()
    for step in range(12, 15):
        train_step(dram, o1, step, ids(step))
        train_step(tier, o2, step, ids(step))
        dram.remove(ids(step)[:5])
        tier.remove(ids(step)[:5])
    m1.save_delta()
    m2.save_delta()
    assert commits(tmp_path / "a") == commits(tmp_path / "b") and len(commits(tmp_path / "a")) == 2
    for c in commits(tmp_path / "a"):
        a, b = bundle_content(tmp_path / "a" / c), bundle_content(tmp_path / "b" / c)
        assert a[("t", "rows")] and a[("t", "filtered")], c
        assert sorted(a, key=repr) == sorted(b, key=repr), c
        for k in a:
            assert a[k] == b[k], (c, k)
    # The tiered chain verifies and restores to a table equal to the all-DRAM one.
    checked, problems = checkpoint.tools.verify(str(tmp_path / "b"))
    assert len(checked) == 2 and not problems, problems
    fresh = make(tmp_path, False, key_dtype=key_dtype, filter=evstore.CounterFilter(2))
    checkpoint.CheckpointManager(str(tmp_path / "b"), {"t": fresh}, lease=False).restore()
    assert_same(state(fresh), state(dram))
    m1.close()
    m2.close()


def merged_state(ev):
    """state() over all shards at once, by key: shard-count independent."""
    parts = [e.export() for e in ev.shards]
    keys = np.concatenate([x["keys"].numpy() for x in parts])
    order = np.argsort(keys)
    out = {"keys": keys[order]}
    for n in ("values", "versions", "freqs"):
        out[n] = np.concatenate([x[n].numpy() for x in parts])[order]
    for s in parts[0]["slots"]:
        out["slot:" + s] = np.concatenate([x["slots"][s].numpy() for x in parts])[order]
    return out


@pytest.mark.parametrize("restored_shards, restored_tiered", [(3, False), (1, True)])
def test_a_tiered_sharded_chain_restores_into_another_shard_count(tmp_path, restored_shards, restored_tiered):
    dram, tier = make(tmp_path, False, shards=2), make(tmp_path, True, shards=2)
    o1, o2 = evstore.optimizers.Adam(0.05), evstore.optimizers.Adam(0.05)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "c"), {"t": tier}, lease=False)
    for step in range(5):
        train_step(dram, o1, step)
        train_step(tier, o2, step)
    mgr.save_full()
    for step in range(5, 7):
        train_step(dram, o1, step)
        train_step(tier, o2, step)
    mgr.save_delta()
    fresh = make(tmp_path, restored_tiered, name="t", shards=restored_shards)
    checkpoint.CheckpointManager(str(tmp_path / "c"), {"t": fresh}, lease=False).restore()
    assert_same(merged_state(fresh), merged_state(dram))
    mgr.close()


def test_restore_of_a_chain_bigger_than_the_budget(tmp_path):
    big = make(tmp_path, False)
    keys = np.arange(20000, dtype=np.int64) * 13
    vals = np.random.default_rng(0).normal(size=(20000, DIM)).astype(np.float32)
    big.load(keys, vals)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "c"), {"t": big}, lease=False)
    mgr.save_full()
    big.load(keys[:500], vals[:500] * 2)
    mgr.save_delta()
    fresh = make(tmp_path, True)
    checkpoint.CheckpointManager(str(tmp_path / "c"), {"t": fresh}, lease=False).restore()
    st = fresh.stats()
    assert st["admitted"] == 20000 and st["cache_rows"] < 1000, st
    assert_same(state(fresh), state(big))


def tier_dirs(tmp_path):
    return sorted(d for d in os.listdir(tmp_path / "tier") if d.startswith("evstore-tier-"))


def _trained_then_committed(tmp_path):
    """A tiered EV with a committed full and steps after it; returns (ev, manager, committed state)."""
    ev, opt = make(tmp_path, True), evstore.optimizers.Adam(0.05)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "c"), {"t": ev}, lease=False)
    for step in range(5):
        train_step(ev, opt, step)
    mgr.save_full()
    committed = state(ev)
    for step in range(5, 8):
        train_step(ev, opt, step)
    return ev, mgr, committed


def test_a_rollback_of_a_running_tiered_ev_loads_a_tiered_table_and_leaves_one_tier_directory(tmp_path):
    ev, mgr, committed = _trained_then_committed(tmp_path)
    live = tier_dirs(tmp_path)
    mgr.restore()   # the chain loads into a staging table (its own tier directory), then the EV takes it
    assert_same(state(ev), committed)
    assert_went_to_disk(ev)
    after = tier_dirs(tmp_path)
    assert len(after) == 1 and after != live, (live, after)   # the replaced table's directory went with it
    mgr.close()


def test_a_refused_rollback_of_a_tiered_ev_leaves_its_table_and_tier_directory(tmp_path):
    ev, mgr, _ = _trained_then_committed(tmp_path)
    before, live = state(ev), tier_dirs(tmp_path)
    full = mgr.chain()[0]
    biggest = max((n for n in full.files if ".data-" in n), key=lambda n: full.files[n]["size"])
    values = tmp_path / "c" / full.dir / biggest
    b = bytearray(values.read_bytes())
    b[len(b) // 2] ^= 0x10
    values.write_bytes(bytes(b))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=values.name + ".*corrupt"):
        mgr.restore()
    assert_same(state(ev), before)
    assert tier_dirs(tmp_path) == live   # the staging table's directory is gone, the EV's kept
    mgr.close()


KILLED_TRAINER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    import checkpoint, evstore
    from test_tiered import make, train_step, state
    import pathlib
    tmp = pathlib.Path(sys.argv[1])
    ev = make(tmp, True, filter=evstore.CounterFilter(2))
    opt = evstore.optimizers.Adam(0.05)
    mgr = checkpoint.CheckpointManager(str(tmp / "ckpt"), {{"t": ev}}, lease=False)
    for step in range(5):
        train_step(ev, opt, step)
    mgr.save_full()
    for step in range(5, 8):
        train_step(ev, opt, step)
    mgr.save_delta()
    np.savez(tmp / "committed.npz", **state(ev))
    for step in range(8, 12):
        train_step(ev, opt, step)   # not committed: lost with the process
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_sigkilled_trainer_restores_exactly_and_its_tier_is_cleared(tmp_path):
    script = KILLED_TRAINER.format(tests=os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    stale = [d for d in os.listdir(tmp_path / "tier") if d.startswith("evstore-tier-")]
    assert stale, "the killed trainer's private directory is left behind"
    fresh = make(tmp_path, True, filter=evstore.CounterFilter(2))
    left = [d for d in os.listdir(tmp_path / "tier") if d.startswith("evstore-tier-")]
    assert not set(stale) & set(left), "a stale directory survived the next tiered EV's creation"
    checkpoint.CheckpointManager(str(tmp_path / "ckpt"), {"t": fresh}, lease=False).restore()
    committed = dict(np.load(tmp_path / "committed.npz"))
    assert_same(state(fresh), committed)


FULL_DISK = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import tensorflow as tf
    sys.path.insert(0, {tests!r})
    import evstore
    from evstore import training
    from test_tiered import make, batch_keys, state, assert_same, DIM
    import pathlib
    tmp = pathlib.Path(sys.argv[1])
    dram, tier = make(tmp, False), make(tmp, True)

    def step(ev, i):
        # Lookup and apply as separate ops: each is tried, whatever the other did.
        keys = batch_keys(i)
        errors = []
        for op in (lambda: evstore.embedding_lookup(ev, keys),
                   lambda: training.sparse_apply_adagrad(
                       ev, tf.IndexedSlices(tf.fill([len(keys), DIM], 0.25), keys), 0.1, i)):
            try:
                op()
            except tf.errors.ResourceExhaustedError as e:
                errors.append(str(e))
        return errors

    for i in range(3):
        assert not step(tier, i) and not step(dram, i)
    # Python ignores SIGXFSZ: writes past the limit fail with EFBIG.
    resource.setrlimit(resource.RLIMIT_FSIZE, (tier.stats()["disk_bytes"], resource.RLIM_INFINITY))
    errors = []
    for i in range(3, 8):
        errors += step(tier, i)
        assert not step(dram, i)
    assert errors, "no error on a full disk"
    assert "stays in memory" in errors[0] and "free disk space or raise dram_bytes" in errors[0], errors[0]
    if sys.argv[2:] == ["reads"]:
        # The store's cleaner keeps trying (and failing) to write rows back
        # while these run: reading the table is never an error.
        for _ in range(30):
            state(tier)
            tier.stats()
        print("READS OK")
        sys.exit(0)
    if sys.argv[2:] == ["resident"]:
        # Batch 7's rows were trained under the limit: dirty, they cannot leave DRAM, so training them
        # again faults no row in and is not an error, while the store's cleaner keeps failing to write
        # other rows back. Its failures go to the next op that faults a row in: new keys' lookup.
        for _ in range(30):
            assert not step(tier, 7), "an op that faulted nothing in reported another's write-back"
        assert step(tier, 100), "the next op faulting rows in reported nothing"
        print("RESIDENT OK")
        sys.exit(0)
    assert_same(state(tier), state(dram))   # nothing lost: the rows stayed in DRAM
    # Space again: training goes on without errors and still agrees.
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    for i in range(8, 10):
        assert not step(tier, i) and not step(dram, i)
    assert_same(state(tier), state(dram))
    print("ERROR:", errors[0])
""")


def _on_a_full_disk(tmp_path, *mode):
    """Runs FULL_DISK (in its own process: the file-size limit stays there) in `mode`; returns its stdout."""
    script = FULL_DISK.format(tests=os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path), *mode], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def test_a_full_disk_is_a_clear_error_that_loses_no_row(tmp_path):
    assert "ERROR:" in _on_a_full_disk(tmp_path)


def test_reading_a_table_whose_disk_refuses_write_backs_is_not_an_error(tmp_path):
    assert "READS OK" in _on_a_full_disk(tmp_path, "reads")


def test_training_rows_all_in_dram_beside_a_disk_refusing_write_backs_is_not_an_error(tmp_path):
    assert "RESIDENT OK" in _on_a_full_disk(tmp_path, "resident")


def test_storage_arguments_are_checked():
    with pytest.raises(ValueError):
        evstore.TieredStorage(dram_bytes=0)
    with pytest.raises(TypeError):
        evstore.TieredStorage(dram_bytes=1.5)
    with pytest.raises(TypeError):
        evstore.EmbeddingVariable("x", 4, storage="disk")


def test_a_tier_path_on_a_ram_file_system_warns_in_one_line():
    if not os.path.isdir("/dev/shm"):
        pytest.fail("this test needs /dev/shm (a tmpfs on Linux)")
    with pytest.warns(evstore.storage.RamTierWarning) as caught:
        evstore.TieredStorage(dram_bytes=1 << 20, path="/dev/shm/evstore-tier-test")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "\n" not in message and "tmpfs" in message and "/dev/shm/evstore-tier-test" in message


def test_a_tier_path_on_a_disk_does_not_warn(recwarn):
    # The checkout is on a disk (tmp_path may be a tmpfs on some hosts); the
    # storage object creates nothing until a table uses it.
    evstore.TieredStorage(dram_bytes=1 << 20, path=os.path.join(REPO, "tier-path-probe"))
    assert not [w for w in recwarn if issubclass(w.category, evstore.storage.RamTierWarning)]


def test_a_tiered_ev_with_one_index_segment_trains_exactly_and_settles_within_its_budget(tmp_path):
    # With one segment a batch cannot evict rows of the segment it holds; the
    # store's cleaner thread evicts them once the op has let the lock go.
    tiered = make(tmp_path, True, "one_tiered", num_segments=1)
    dram = make(tmp_path, False, "one_dram", num_segments=1)
    budget_rows = BUDGET // (DIM * 3 * 4 + 8)
    for ev in (tiered, dram):
        opt = evstore.optimizers.Adam(0.01)
        for step in range(12):
            train_step(ev, opt, step)
    assert_same(state(tiered), state(dram))
    deadline = time.monotonic() + 60  # a liveness bound for the cleaner, not a speed claim
    while tiered.stats()["cache_rows"] > budget_rows and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tiered.stats()["cache_rows"] <= budget_rows, tiered.stats()
    assert_went_to_disk(tiered)


def test_private_directory_goes_away_with_the_ev(tmp_path):
    ev = make(tmp_path, True)
    train_step(ev, evstore.optimizers.SGD(0.1), 0)
    assert [d for d in os.listdir(tmp_path / "tier") if d.startswith("evstore-tier-")]
    del ev
    import gc
    gc.collect()
    assert not [d for d in os.listdir(tmp_path / "tier") if d.startswith("evstore-tier-")]
