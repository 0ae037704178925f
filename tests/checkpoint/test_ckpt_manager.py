"""CheckpointManager: fulls and deltas restore bit for bit, chains, retention,
failed saves, schedules. In-process; crash tests are in test_ckpt_crash.py."""
import json
import os
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import checkpoint
import evstore
from ckpt_model import assert_same_state, ev, make_model, state, train


@pytest.fixture
def model():
    return make_model()


def _restored(root, seq=None):
    fresh = make_model()
    meta = checkpoint.CheckpointManager(root, fresh).restore(seq)
    return fresh, meta


def test_full_then_deltas_restore_equals_live_state(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 4)
    mgr.save_full()
    train(model, 4, 7)
    mgr.save_delta()
    train(model, 7, 9)
    mgr.save_delta()
    fresh, _ = _restored(str(tmp_path))
    assert_same_state(state(fresh), state(model))


def test_restore_returns_the_saved_metadata(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 2)
    mgr.save_full(metadata={"file": "part-0", "row": 128})
    _, meta = _restored(str(tmp_path))
    assert meta == {"file": "part-0", "row": 128}


def test_restored_training_continues_exactly_like_the_uninterrupted_run(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 3)
    mgr.save_full()
    train(model, 3, 6)
    mgr.save_delta(metadata={"pos": 6})
    fresh, meta = _restored(str(tmp_path))
    train(model, 6, 10)
    train(fresh, meta["pos"], 10)
    assert_same_state(state(fresh), state(model))


def test_sequence_numbers_increase_across_fulls_and_deltas(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    seqs = [mgr.save_full(), mgr.save_delta(), mgr.save_full(), mgr.save_delta()]
    assert seqs == [1, 2, 3, 4]
    assert [m.dir for m in mgr.chain()] == ["full-0000000003", "delta-0000000004"]
    assert mgr.chain()[-1].parent == 3 and mgr.chain()[-1].base == 3


def test_empty_delta_commits_and_restores(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 2)
    mgr.save_full()
    seq = mgr.save_delta()
    m = mgr.latest()
    assert m.seq == seq and m.evs["user"]["rows"] == 0 and m.evs["user"]["deleted"] == 0
    fresh, _ = _restored(str(tmp_path))
    assert_same_state(state(fresh), state(model))


def test_delta_carries_only_changed_rows(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 6)
    mgr.save_full()
    total = int(ev(model, "user").size())
    x = tf.constant([[10, 10]], tf.int64), tf.constant([[1]], tf.int32)
    model.train_on_batch(list(x), np.ones((1, 1), np.float32))
    mgr.save_delta()
    assert mgr.latest().evs["user"]["rows"] == 1 < total


def test_delta_after_removal_carries_the_deleted_keys(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 4)
    mgr.save_full()
    user = ev(model, "user")
    gone = state(model)["user:keys"][:3]
    user.remove(tf.constant(gone, tf.int64))
    mgr.save_delta()
    reader = tf.train.load_checkpoint(os.path.join(str(tmp_path), mgr.latest().dir, "ckpt"))
    assert sorted(reader.get_tensor("user-deleted_keys").tolist()) == sorted(gone.tolist())
    fresh, _ = _restored(str(tmp_path))
    assert_same_state(state(fresh), state(model))
    assert not np.isin(gone, state(fresh)["user:keys"]).any()


def test_key_removed_and_seen_again_restores_as_new_key(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 4)
    mgr.save_full()
    user = ev(model, "user")
    k = int(state(model)["user:keys"][0])
    user.remove(tf.constant([k], tf.int64))
    evstore.embedding_lookup(user, tf.constant([k], tf.int64))  # back, counted once: filtered
    mgr.save_delta()
    fresh, _ = _restored(str(tmp_path))
    assert_same_state(state(fresh), state(model))
    assert k in state(fresh)["user:filtered_keys"]


def test_every_tensor_of_full_and_delta_reads_with_tf_load_checkpoint(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 3)
    mgr.save_full()
    train(model, 3, 4)
    mgr.save_delta()
    for m in mgr.chain():
        reader = tf.train.load_checkpoint(os.path.join(str(tmp_path), m.dir, "ckpt"))
        names = reader.get_variable_to_shape_map()
        want = {f"user{s}" for s in ("-keys", "-values", "-versions", "-freqs", "-keys_filtered",
                                     "-freqs_filtered")} | {"user/m-values", "user/v-values", "global_step"}
        if m.kind == "delta":
            want |= {"user-deleted_keys", "item-deleted_keys"}
        assert want <= set(names)
        for n in names:
            reader.get_tensor(n)
        assert names["user-values"][1] == 8 and names["user-keys"][0] == m.evs["user"]["rows"]


def test_restore_of_an_earlier_sequence_goes_back_in_time(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 3)
    mgr.save_full()
    train(model, 3, 5)
    mgr.save_delta()
    then = state(model)
    train(model, 5, 8)
    mgr.save_delta()
    fresh, _ = _restored(str(tmp_path), seq=2)
    assert_same_state(state(fresh), then)


def test_saving_after_going_back_in_time_continues_the_restored_branch(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 3)
    mgr.save_full()
    train(model, 3, 5)
    mgr.save_delta()
    train(model, 5, 8)
    mgr.save_delta()                        # seq 3, abandoned below
    fresh = make_model()
    mgr2 = checkpoint.CheckpointManager(str(tmp_path), fresh)
    mgr2.restore(seq=2)
    train(fresh, 5, 6)
    assert mgr2.save_delta() == 4 and mgr2.latest().parent == 2
    again, _ = _restored(str(tmp_path))
    assert_same_state(state(again), state(fresh))


def test_save_delta_without_a_full_is_refused(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    with pytest.raises(checkpoint.CheckpointError, match="save_full"):
        mgr.save_delta()


def test_restore_of_an_empty_root_says_so(tmp_path, model):
    with pytest.raises(checkpoint.NoCheckpointError, match="no committed checkpoint"):
        checkpoint.CheckpointManager(str(tmp_path / "nothing"), model).restore()


def test_memory_filesystem_root_round_trips(model):
    root = f"memory://evstore-test-{time.time_ns()}"
    mgr = checkpoint.CheckpointManager(root, model)
    train(model, 0, 3)
    mgr.save_full()
    train(model, 3, 5)
    mgr.save_delta()
    fresh, _ = _restored(root)
    assert_same_state(state(fresh), state(model))


def _checkpoint_dirs(root):
    """The checkpoint directories of a root (not the writer's lease file)."""
    return sorted(d for d in os.listdir(root) if d != "WRITER.lease")


def test_retention_keeps_the_last_chains(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model, keep_chains=2)
    for _ in range(4):
        mgr.save_full()
        mgr.save_delta()
    assert _checkpoint_dirs(tmp_path) == ["delta-0000000006", "delta-0000000008", "full-0000000005",
                                          "full-0000000007"]


def test_failed_save_aborts_and_the_next_delta_carries_every_change(tmp_path, model, monkeypatch):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 3)
    mgr.save_full()
    train(model, 3, 6)
    monkeypatch.setenv("EVSTORE_FAILPOINT", "before-manifest:raise")
    with pytest.raises(OSError, match="simulated"):
        mgr.save_delta()
    assert _checkpoint_dirs(tmp_path) == ["full-0000000001"]  # nothing half-written stays
    monkeypatch.delenv("EVSTORE_FAILPOINT")
    mgr.save_delta()
    fresh, _ = _restored(str(tmp_path))
    assert_same_state(state(fresh), state(model))


def test_many_saves_in_a_row_restore_exactly(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    mgr.save_full()
    for i in range(12):
        train(model, i, i + 1)
        mgr.save_delta(metadata={"pos": i + 1})
    fresh, meta = _restored(str(tmp_path))
    assert meta == {"pos": 12} and len(mgr.chain()) == 13
    assert_same_state(state(fresh), state(model))


def test_scheduled_saves_run_while_training_and_stop_commits_the_rest(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    mgr.start(delta_every=0.2, full_every=1.0)
    pos = 0
    deadline = time.time() + 2.5
    while time.time() < deadline or len(_checkpoint_dirs(tmp_path)) < 3:
        with mgr.lock:
            train(model, pos, pos + 1)
            pos += 1
    mgr.stop()
    assert mgr.failures == 0
    kinds = {m.kind for m in checkpoint.scan(mgr.storage).manifests.values()}
    assert kinds == {"full", "delta"}
    fresh, _ = _restored(str(tmp_path))
    assert_same_state(state(fresh), state(model))


def test_saves_concurrent_with_unlocked_training_lose_no_change(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    mgr.save_full()
    stop = threading.Event()
    errors = []

    def saver():
        try:
            while not stop.is_set():
                mgr.save_delta()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=saver)
    t.start()
    train(model, 0, 15)
    stop.set()
    t.join()
    mgr.save_delta()  # after training stopped: the chain must now equal the live state
    assert not errors and len(mgr.chain()) > 2
    fresh, _ = _restored(str(tmp_path))
    assert_same_state(state(fresh), state(model))


def test_restore_into_a_model_with_another_dim_is_refused_and_changes_nothing(tmp_path, model):
    import keras
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 2)
    mgr.save_full()
    other = evstore.EmbeddingVariable("user", dim=3)
    with pytest.raises(ValueError, match="dim 3"):
        checkpoint.CheckpointManager(str(tmp_path), {"user": other}).restore()
    assert int(other.size()) == 0
    del keras


def test_manifest_lists_sizes_checksums_counts_and_steps(tmp_path, model):
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 3)
    seq = mgr.save_full()
    d = json.loads((tmp_path / f"full-{seq:010d}" / "MANIFEST.json").read_text())
    assert d["kind"] == "full" and d["parent"] is None and d["base"] == seq and d["global_step"] == 3
    on_disk = {p.name for p in (tmp_path / f"full-{seq:010d}").iterdir()} - {"MANIFEST.json"}
    assert set(d["files"]) == on_disk
    for name, f in d["files"].items():
        assert (tmp_path / f"full-{seq:010d}" / name).stat().st_size == f["size"]
    assert d["evs"]["user"]["rows"] == int(ev(model, "user").size())
    assert d["evs"]["user"]["slots"] == ["m", "v"]


def _bytes_this_process_read():
    """Bytes this process's read calls returned so far (every thread's: /proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_a_local_restore_reads_each_byte_it_needs_once(tmp_path):
    keys = np.arange(100_000, dtype=np.int64) * 7
    rows = np.random.default_rng(0).normal(size=(len(keys), 16)).astype(np.float32)
    saved = evstore.EmbeddingVariable("t", 16)
    saved.load(keys, rows)
    mgr = checkpoint.CheckpointManager(str(tmp_path), {"t": saved}, lease=False)
    mgr.save_full()
    saved.load(keys[:20_000], rows[:20_000] * 2)
    mgr.save_delta()
    chain_bytes = sum(m.total_bytes for m in mgr.chain())
    got = evstore.EmbeddingVariable("t", 16)
    got.load(keys[-10:] + 1, rows[:10])   # rows of keys the chain lacks: the restored table replaces them all
    before = _bytes_this_process_read()
    checkpoint.CheckpointManager(str(tmp_path), {"t": got}, lease=False).restore()
    read = _bytes_this_process_read() - before
    assert_same_state(state({"t": got}), state({"t": saved}))
    # Every tensor is loaded, so each byte is read at least once; a check of whole files before the
    # load would read the chain twice.
    assert chain_bytes <= read < 1.5 * chain_bytes, (read, chain_bytes)


def _row_and_slot_columns(data, rows):
    """The data files holding the rows and Adam's two slots of `rows` x 16 floats, or [] where the file
    system refuses direct I/O, or lives in RAM (tmpfs, ramfs: since Linux 6.6 a tmpfs takes O_DIRECT,
    but its files are their page-cache pages): there the page cache carries the bytes, exact all the
    same, and there is no page-cache claim to check."""
    if evstore.storage._filesystem_of(data[0]) in evstore.storage._RAM_FILESYSTEMS:
        return []
    try:
        os.close(os.open(data[0], os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return []
    columns = [p for p in data if os.path.getsize(p) == rows * 16 * 4]
    assert len(columns) == 3, [os.path.getsize(p) for p in data]
    return columns


def _resident_pages(path):
    """(pages of `path` in the page cache, pages of the file): mincore over a mapping that touches none."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = os.path.getsize(path), os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)   # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        try:
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), len(vec)


def test_a_restore_reads_row_and_slot_columns_around_the_page_cache_and_exactly(tmp_path):
    # Three chunks of 65,536 rows, the last one's bytes not a whole number of 4 KiB blocks; Adam's two slots.
    keys = np.arange(150_000, dtype=np.int64) * 3 + 1
    rng = np.random.default_rng(1)
    rows, m, v = (rng.normal(size=(len(keys), 16)).astype(np.float32) for _ in range(3))
    saved = evstore.EmbeddingVariable("t", 16)
    saved.load(keys, rows, slots={"m": m, "v": v})
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), {"t": saved}, lease=False)
    mgr.save_full()
    data = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "ckpt") for f in fs if ".data-" in f]
    for path in data:   # written back by the save; now out of the page cache
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    got = evstore.EmbeddingVariable("t", 16)
    checkpoint.CheckpointManager(str(tmp_path / "ckpt"), {"t": got}, lease=False).restore()
    assert_same_state(state({"t": got}), state({"t": saved}))
    for path in _row_and_slot_columns(data, len(keys)):
        resident, pages = _resident_pages(path)
        assert resident <= 8, (path, resident, pages)   # the last chunk's tail, read through the cache


def test_a_full_save_writes_its_columns_around_the_page_cache_and_restores_exactly(tmp_path):
    # Columns of several 1 MiB write buffers and a tail that is not one; Adam's two slots; string keys too.
    keys = np.arange(150_000, dtype=np.int64) * 5 + 2
    rng = np.random.default_rng(2)
    rows, m, v = (rng.normal(size=(len(keys), 16)).astype(np.float32) for _ in range(3))
    saved = evstore.EmbeddingVariable("t", 16)
    saved.load(keys, rows, slots={"m": m, "v": v})
    names = evstore.EmbeddingVariable("s", 16, key_dtype=tf.string)
    names.load(np.array([f"key-{k}" for k in keys[:50_000]], dtype=object), rows[:50_000])
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), {"t": saved, "s": names}, lease=False)
    mgr.save_full()
    got, got_names = evstore.EmbeddingVariable("t", 16), evstore.EmbeddingVariable("s", 16, key_dtype=tf.string)
    checkpoint.CheckpointManager(str(tmp_path / "ckpt"), {"t": got, "s": got_names}, lease=False).restore()
    assert_same_state(state({"t": got, "s": got_names}), state({"t": saved, "s": names}))
    data = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "ckpt") for f in fs if ".data-" in f]
    for path in _row_and_slot_columns(data, len(keys)):
        resident, pages = _resident_pages(path)
        # The tail (less than one 1 MiB write buffer) is written through the cache; every byte was before.
        assert resident <= (1 << 20) // 4096 + 8 < pages, (path, resident, pages)


def test_a_local_fetch_for_staging_tables_reads_the_indexes_and_no_data_file_before_the_load(tmp_path, model):
    from checkpoint.fetch import fetch
    from checkpoint.storage import Storage
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 3)
    mgr.save_full()
    full = mgr.chain()[0]
    index_bytes = sum(i["size"] for n, i in full.files.items() if n.endswith(".index"))
    before = _bytes_this_process_read()
    with fetch(Storage(str(tmp_path)), full, verify="index") as f:   # sizes and the index's crc32c
        read = _bytes_this_process_read() - before
        assert f.dir is not None
    assert index_bytes <= read < full.total_bytes - index_bytes, (read, index_bytes, full.total_bytes)
