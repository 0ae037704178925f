"""Checkpoint tools: inspect, verify, compact and export a checkpoint root
without the training job (`evstore ckpt inspect|verify|compact|to-parquet ROOT`).

Every tool reads a root exactly as `CheckpointManager.restore()` does: a
checkpoint exists iff its MANIFEST.json parses (checkpoint.chain.scan), and
"the chain" is the full plus the deltas that `restore(seq=N)` would apply (the
newest committed checkpoint at or before N, followed back by parent links;
checkpoint.chain.resolve_chain). Chains are materialised into temporary
EmbeddingVariables (one per EV of the chain, created with the manifest's dim and
key dtype, unique resource names) with the same native loader restore uses
(checkpoint.bundle.load_ev), after every file of the chain has been checked
against its manifest (size and crc32c). Such a table lives in memory: compact
and to-parquet need about as much memory as the training job's tables.

compact writes with `write_full`, the reusable "write a full checkpoint of
these EVs and dense tensors" step: seal each EV's snapshot, stream the bundle
(checkpoint.bundle.write_bundle), check it, upload it (remote roots), write
the manifest last (the commit point), then commit the snapshots. Like every
writer of a root it must be the only one: do not compact a root while a
training job is saving into it (the job would see the compaction's directory as
a dead save and remove it, or pick the same sequence number).

Expected failures raise checkpoint.errors classes (or ValueError for bad
arguments) with a message naming the root, checkpoint or file; `cli()` turns
them into one line on stderr and exit code 1.
"""
import contextlib
import datetime
import gc
import json
import logging
import os
import posixpath
import sys
import urllib.parse
import uuid

from checkpoint.bundle import GLOBAL_STEP, load_ev, read_dense
from checkpoint.chain import resolve_chain, scan, verify_files
from checkpoint.commit import commit_checkpoint
from checkpoint.errors import ChainError, CheckpointError, CorruptCheckpointError
from checkpoint.fetch import fetch
from checkpoint.manifest import MANIFEST, parse_dir_name
from checkpoint.storage import Storage

__all__ = ["RootNotFoundError", "inspect", "format_inspect", "verify", "compact", "write_full", "to_parquet",
           "materialize", "cli"]

CHUNK_ROWS = 65536
log = logging.getLogger("evstore.checkpoint")


class RootNotFoundError(CheckpointError):
    """The checkpoint root does not exist."""


def _open_root(root, storage_options=None):
    storage = root if isinstance(root, Storage) else Storage(root, storage_options)
    if not storage.fs.exists(storage.path):
        raise RootNotFoundError(f"checkpoint root {storage.url} does not exist")
    return storage


# ---- inspect ----------------------------------------------------------------------
def inspect(root, storage_options=None):
    """Describes a checkpoint root as a JSON-serialisable dict.

    Returns:
      {"root", "checkpoints": [{"seq", "kind", "dir", "parent", "base",
       "global_step", "wall_time", "wall_time_utc", "total_bytes", "files",
       "evs": {name: {"dim", "key_dtype", "slots", "rows", "filtered",
       "deleted"}}, "dense_vars" (dense variables, global_step not counted),
       "metadata", "in_restore_chain"}],
       "restore_chain": [seq...] (what restore() applies; [] if it cannot),
       "restore_error": why restore() would fail, or None,
       "uncommitted": [{"seq", "dir"}] (no manifest: in flight or abandoned;
       readers ignore them), "corrupt": [{"seq", "error"}] (unreadable manifest)}
    Raises:
      RootNotFoundError: the root does not exist.
    """
    storage = _open_root(root, storage_options)
    sc = scan(storage)
    chain, error = [], None
    if sc.manifests or sc.corrupt:
        try:
            chain = [m.seq for m in resolve_chain(sc, where=storage.url)]
        except CheckpointError as e:
            error = str(e)
    else:
        error = f"{storage.url} holds no committed checkpoint"
        if parse_dir_name(posixpath.basename(storage.path.rstrip("/\\"))) or storage.fs.exists(
                storage.join(MANIFEST)):
            parent = storage.url.rstrip("/").rsplit("/", 1)[0] if not storage.local else os.path.dirname(storage.path)
            error += f" (it is one checkpoint's own directory; the root is its parent: evstore ckpt inspect {parent})"
    cks = []
    for seq, m in sorted(sc.manifests.items()):
        cks.append({
            "seq": seq, "kind": m.kind, "dir": m.dir, "parent": m.parent, "base": m.base,
            "global_step": m.global_step, "wall_time": m.wall_time, "wall_time_utc": _utc(m.wall_time),
            "total_bytes": m.total_bytes, "files": len(m.files),
            "evs": {n: {k: e.get(k) for k in ("dim", "key_dtype", "slots", "rows", "filtered", "deleted")}
                    for n, e in sorted(m.evs.items())},
            "dense_vars": len([n for n in m.dense if n != GLOBAL_STEP]),
            "metadata": m.metadata, "in_restore_chain": seq in chain})
    return {"root": storage.url, "checkpoints": cks, "restore_chain": chain, "restore_error": error,
            "uncommitted": [{"seq": q, "dir": d} for q, d in sorted(sc.uncommitted.items())],
            "corrupt": [{"seq": q, "error": e} for q, e in sorted(sc.corrupt.items())]}


def _utc(t):
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _human(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_inspect(info):
    """The text `evstore ckpt inspect` prints for an `inspect()` result."""
    out = [f"checkpoint root {info['root']}: {len(info['checkpoints'])} committed checkpoint(s)"]
    if info["restore_chain"]:
        out.append("restore() applies: " + " -> ".join(str(q) for q in info["restore_chain"])
                   + "   (marked * below)")
    else:
        out.append(f"restore() cannot run: {info['restore_error']}")
    if info["checkpoints"]:
        out.append("")
        head = ["", "seq", "kind", "parent", "base", "step", "wall time (UTC)", "bytes", "dense", "EVs: rows/filtered/deleted"]
        rows = []
        for c in info["checkpoints"]:
            evs = ", ".join(f"{n} {e['rows']}/{e['filtered']}/{e['deleted']}" for n, e in c["evs"].items()) or "-"
            rows.append(["*" if c["in_restore_chain"] else "", str(c["seq"]), c["kind"],
                         "-" if c["parent"] is None else str(c["parent"]), str(c["base"]), str(c["global_step"]),
                         c["wall_time_utc"], _human(c["total_bytes"]), str(c["dense_vars"]), evs])
        widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head) - 1)]
        for r in [head] + rows:
            out.append("  ".join(x.ljust(w) for x, w in zip(r, widths)) + "  " + r[-1])
        dims = {}   # per EV, from the newest checkpoint that saved its slots (an initial full has none yet)
        for c in reversed(info["checkpoints"]):
            for n, e in c["evs"].items():
                if n not in dims or (not dims[n][2] and e["slots"]):
                    dims[n] = (e["dim"], e["key_dtype"], e["slots"])
        out.append("")
        for n, (d, kd, sl) in sorted(dims.items()):
            out.append(f"EV {n}: dim {d}, {kd} keys, slots {', '.join(sl) if sl else '(none)'}")
    for u in info["uncommitted"]:
        out.append(f"uncommitted (no {MANIFEST}; ignored by readers, removed by the next save): {u['dir']}")
    for c in info["corrupt"]:
        out.append(f"corrupt manifest (seq {c['seq']}): {c['error']}")
    return "\n".join(out)


# ---- verify -------------------------------------------------------------------------
def verify(root, seq=None, storage_options=None):
    """Checks a root's committed checkpoints against their manifests.

    Every file of every committed checkpoint (or, with `seq`, of the chain that
    `restore(seq=seq)` would apply) must have its manifest's size and crc32c;
    the chain restore() would apply must resolve (no gap, no wrong parent), as
    must every other committed delta's chain when `seq` is None; a corrupt
    manifest is a problem.

    Returns:
      (checked, problems): the Manifests checked and a list of one-line
      problems, each naming the file or checkpoint at fault (empty: sound).
    Raises:
      RootNotFoundError: the root does not exist.
    """
    storage = _open_root(root, storage_options)
    sc = scan(storage)
    problems = []
    if seq is not None:
        try:
            checked = resolve_chain(sc, seq, where=storage.url)
        except CheckpointError as e:
            return [], [str(e)]
    else:
        checked = [m for _, m in sorted(sc.manifests.items())]
        for q, err in sorted(sc.corrupt.items()):
            problems.append(err)
        if not sc.manifests and not sc.corrupt:
            problems.append(f"{storage.url} holds no committed checkpoint")
        seen = set()
        for q in sorted(sc.manifests):
            try:
                resolve_chain(sc, q, where=storage.url)
            except ChainError as e:
                if str(e) not in seen:
                    seen.add(str(e))
                    problems.append(str(e))
            except CheckpointError:
                pass  # a newer corrupt manifest: reported above
    for m in checked:
        problems += verify_files(storage, m)
    return checked, problems


# ---- materialising a chain ------------------------------------------------------------
def _chain(storage, seq):
    return resolve_chain(scan(storage), seq, where=storage.url)


def _verify_chain(storage, chain):
    problems = [p for m in chain for p in verify_files(storage, m)]
    if problems:
        raise CorruptCheckpointError("; ".join(problems))


@contextlib.contextmanager
def _read_chain(storage, chain):
    """[directory the native loader reads each checkpoint of `chain` from], every file verified against
    its manifest first: a local root's checkpoint directories, or object sources over a remote root's
    (checkpoint/object_source.py: nothing written on this host)."""
    if storage.local:
        _verify_chain(storage, chain)
        yield [storage.join(m.dir) for m in chain]
        return
    fetched = []
    try:
        for m in chain:
            fetched.append(fetch(storage, m, files=list(m.files)))
        yield [f.dir for f in fetched]
    finally:
        for f in fetched:
            f.close()


def _ev_layout(chain):
    """{name: (dim, key_dtype, [(index in chain, slots)])}: the EVs of a chain (union, first seen first)."""
    out = {}
    for i, m in enumerate(chain):
        for name, e in m.evs.items():
            dim, kd, parts = out.setdefault(name, (int(e["dim"]), str(e["key_dtype"]), []))
            if (int(e["dim"]), str(e["key_dtype"])) != (dim, kd):
                raise ChainError(f"{m.dir}: EmbeddingVariable {name!r} has dim {e['dim']} / {e['key_dtype']} keys, "
                                 f"but earlier checkpoints of the chain hold dim {dim} / {kd}")
            parts.append((i, list(e.get("slots") or [])))
    return out


def _temp_ev(name, dim, key_dtype):
    import evstore
    # A unique resource per call; the initializer bank is never used (rows are imported).
    return evstore.EmbeddingVariable(f"{name}.tmp-{uuid.uuid4().hex[:8]}", dim=dim, key_dtype=key_dtype,
                                     initializer_bank_size=1)


def _load_chain_ev(dirs, name, dim, key_dtype, parts, chunk_rows):
    ev = _temp_ev(name, dim, key_dtype)
    for j, (i, slots) in enumerate(parts):
        load_ev(dirs[i], ev, name, slots, clear=(j == 0), chunk_rows=chunk_rows)
    return ev


def materialize(root, seq=None, storage_options=None, chunk_rows=CHUNK_ROWS):
    """The state `restore(seq=seq)` would produce, in new objects.

    Returns:
      (chain, evs, dense): the Manifests applied; {checkpoint name:
      EmbeddingVariable}, temporary tables (one per EV of the chain, even one
      first saved by a delta) holding the rows, slots, versions, freqs and
      filtered keys restore would load, with nothing dirty; {name: numpy
      array} of every dense tensor of the last checkpoint, global_step included.
    Raises:
      RootNotFoundError, NoCheckpointError, ChainError, CorruptCheckpointError.
    """
    storage = _open_root(root, storage_options)
    chain = _chain(storage, seq)
    with _read_chain(storage, chain) as dirs:
        evs = {name: _load_chain_ev(dirs, name, dim, kd, parts, chunk_rows)
               for name, (dim, kd, parts) in _ev_layout(chain).items()}
        dense = read_dense(dirs[-1], list(chain[-1].dense))
    return chain, evs, dense


# ---- writing a full ---------------------------------------------------------------------
def write_full(root, evs, dense, global_step, metadata=None, seq=None, storage_options=None,
               chunk_rows=CHUNK_ROWS, shard_info=None, serving_view=None):
    """Writes and commits a full checkpoint of `evs` and `dense` under `root`.

    The same commit protocol as CheckpointManager.save_full: each EV's changes
    are sealed into a snapshot, the bundle streams into the checkpoint
    directory (local) or a staging directory (then uploaded), its files are
    checked, MANIFEST.json is written last, and only then are the snapshots
    committed; any failure aborts the snapshots and removes the directory.

    Args:
      root: a path, fsspec URL or checkpoint.Storage.
      evs: {checkpoint name: EmbeddingVariable} (saved under these names,
        whatever the EVs' own names).
      dense: {name: tensor or array} (not "global_step").
      global_step: int, stored as the `global_step` tensor and in the manifest.
      metadata: JSON-serialisable dict for the manifest (what restore() returns).
      seq: the new sequence number (default: one above every directory of the root);
        it must be above every existing one.
      shard_info: {name: manifest "shard" entry} for EVs that are parts of a
        sharded EV (checkpoint/shards.py); compact keeps the chain's.
      serving_view: None, or the dtype of a serving view written into the
        same commit (checkpoint/serving_view.py), as CheckpointManager's.
    Returns:
      The committed Manifest.
    """
    storage = root if isinstance(root, Storage) else Storage(root, storage_options)
    if GLOBAL_STEP in dense:
        raise ValueError(f"dense must not hold {GLOBAL_STEP!r}: pass it as global_step")
    if metadata is not None and not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    top = scan(storage).max_seq
    if seq is None:
        seq = top + 1
    elif seq <= top:
        raise ValueError(f"seq must be above every checkpoint of {storage.url} (the newest is {top}), got {seq}")
    return commit_checkpoint(storage, "full", seq, evs, dense_fn=lambda: dict(dense),
                             prepare=lambda: (int(global_step), dict(metadata or {}), None), chunk_rows=chunk_rows,
                             shard_info=shard_info, serving_view=serving_view)


# ---- compact ------------------------------------------------------------------------------
def chain_view(chain):
    """The serving view dtype every commit of `chain` holds, or None (no view, or views of several dtypes)."""
    views = {(m.serving_view or {}).get("dtype") for m in chain}
    return views.pop() if len(views) == 1 else None


def compact(root, seq=None, storage_options=None, chunk_rows=CHUNK_ROWS):
    """Folds the chain `restore(seq=seq)` would apply into one new full.

    Verifies every file of the chain, applies it to temporary tables, and
    writes a full holding exactly that state (rows, slots, versions, freqs,
    filtered keys, the last checkpoint's dense tensors, global step and
    metadata) with sequence number one above every directory of the root.
    `restore()` then applies just that full (it is the newest checkpoint);
    nothing is deleted: CheckpointManager's retention removes old chains.
    When every commit of the chain holds a serving view of one dtype, the
    full holds one too (the same codec, from its float32 rows), so replicas
    serve it as they served the chain.
    Needs the chain's tables in memory. Do not run it while a job saves into
    the same root.

    Returns:
      (chain, manifest): the Manifests folded and the new full's Manifest.
    Raises:
      RootNotFoundError, NoCheckpointError, ChainError, CorruptCheckpointError.
    """
    storage = _open_root(root, storage_options)
    chain, evs, dense = materialize(storage, seq, chunk_rows=chunk_rows)
    try:
        step = int(dense.pop(GLOBAL_STEP))
        shard_info = {n: e["shard"] for m in chain for n, e in m.evs.items() if e.get("shard")}
        manifest = write_full(storage, evs, dense, step, metadata=chain[-1].metadata, chunk_rows=chunk_rows,
                              shard_info=shard_info, serving_view=chain_view(chain))
        return chain, manifest
    finally:
        evs.clear()
        gc.collect()


# ---- to-parquet ----------------------------------------------------------------------------
def parquet_names(ev_name):
    """(rows file, filtered file) names of EV `ev_name` ("/" and other unsafe characters %-quoted)."""
    q = urllib.parse.quote(ev_name, safe="")
    return f"{q}.parquet", f"{q}.filtered.parquet"


def to_parquet(root, out_dir, seq=None, storage_options=None, chunk_rows=CHUNK_ROWS, row_group_rows=1 << 20):
    """Writes the state after the chain `restore(seq=seq)` applies as Parquet, one EV at a time.

    Per EV `<name>` (name %-quoted, see `parquet_names`), in `out_dir` (a path
    or fsspec URL, created if missing):
      `<name>.parquet`: one row per admitted key: key (int64, int32, or binary
        for string keys), version
        (int64), freq (int64), value (fixed_size_list<float32>[dim]) and one
        column `slot_<slot>` (fixed_size_list<float32>[dim]) per optimizer slot;
      `<name>.filtered.parquet`: keys counted but not admitted yet: key, freq.
    Rows are in table order (not sorted). Each file's schema metadata holds
    the EV name, dim, seq and global step. The table is read with
    `ev.export()` from a temporary table holding the chain (so one EV's rows
    are in memory twice while it is written, an analysis tool's trade-off);
    Parquet row groups hold `row_group_rows` rows.

    Returns:
      {"seq": last seq of the chain, "files": {ev name: {"rows": path,
      "filtered": path, "count": rows, "filtered_count": filtered rows}}}
    """
    import fsspec
    import numpy as np
    from fsspec.implementations.local import LocalFileSystem
    import pyarrow as pa
    import pyarrow.parquet as pq

    storage = _open_root(root, storage_options)
    chain = _chain(storage, seq)
    with _read_chain(storage, chain) as dirs:
        last = chain[-1]
        ofs, opath = fsspec.core.url_to_fs(str(out_dir))
        local = isinstance(ofs, LocalFileSystem)
        ofs.makedirs(opath, exist_ok=True)
        result = {"seq": last.seq, "files": {}}
        for name, (dim, kd, parts) in _ev_layout(chain).items():
            ev = _load_chain_ev(dirs, name, dim, kd, parts, chunk_rows)
            ex = ev.export()
            del ev
            keys = ex["keys"].numpy()
            cols = {"key": keys, "version": ex["versions"].numpy(), "freq": ex["freqs"].numpy(),
                    "value": ex["values"].numpy()}
            for s in sorted(ex["slots"]):
                cols[f"slot_{s}"] = ex["slots"][s].numpy()
            fcols = {"key": ex["filtered_keys"].numpy(), "freq": ex["filtered_freqs"].numpy()}
            del ex
            meta = {b"evstore": json.dumps({"ev": name, "dim": dim, "key_dtype": kd, "seq": last.seq,
                                            "global_step": last.global_step, "root": storage.url}).encode()}
            rows_name, filt_name = parquet_names(name)
            paths = {}
            for fname, data in ((rows_name, cols), (filt_name, fcols)):
                fields = [pa.field(c, pa.list_(pa.float32(), dim) if a.ndim == 2 else
                                   pa.binary() if a.dtype == object else pa.from_numpy_dtype(a.dtype))
                          for c, a in data.items()]
                schema = pa.schema(fields, metadata=meta)
                path = (os.path.join if local else posixpath.join)(opath, fname)
                n = len(data["key"])
                with ofs.open(path, "wb") as f, pq.ParquetWriter(f, schema) as w:
                    for s in range(0, max(n, 1), row_group_rows):
                        e = min(n, s + row_group_rows)
                        arrays = [pa.FixedSizeListArray.from_arrays(np.ascontiguousarray(a[s:e]).reshape(-1), dim)
                                  if a.ndim == 2 else pa.array(a[s:e]) for a in data.values()]
                        w.write_table(pa.Table.from_arrays(arrays, schema=schema))
                paths[fname] = path if local else ofs.unstrip_protocol(path)
            result["files"][name] = {"rows": paths[rows_name], "filtered": paths[filt_name],
                                     "count": len(cols["key"]), "filtered_count": len(fcols["key"])}
            del cols, fcols
            gc.collect()
        return result


# ---- command line ---------------------------------------------------------------------------
def cli(args):
    """Runs `evstore ckpt <tool>` for parsed `args` (see evstore_app/cli.py); returns the exit code.

    0: done / sound; 1: the root has problems (verify) or an expected error
    (missing root, corrupt or missing files, gaps), reported on stderr in one
    line without a traceback.
    """
    try:
        if args.tool == "inspect":
            info = inspect(args.root)
            print(json.dumps(info, indent=1) if args.json else format_inspect(info))
            return 0
        if args.tool == "verify":
            checked, problems = verify(args.root, seq=args.seq)
            for p in problems:
                print(p)
            nfiles = sum(len(m.files) for m in checked)
            if problems:   # the whole report on stdout; the exit status says it failed
                print(f"FAILED: {len(problems)} problem(s) in {args.root}")
                return 1
            print(f"OK: {len(checked)} checkpoint(s), {nfiles} file(s) match their manifests"
                  + (f"; the chain {' -> '.join(str(m.seq) for m in checked)} resolves" if args.seq is not None
                     else ""))
            return 0
        if args.tool == "compact":
            chain, m = compact(args.root, seq=args.seq)
            rows = ", ".join(f"{n} {e['rows']}/{e['filtered']}" for n, e in m.evs.items()) or "no EVs"
            view = f"; serving view {m.serving_view['dtype']}" if m.serving_view else ""
            print(f"compacted {' -> '.join(str(c.seq) for c in chain)} into {m.dir} (step {m.global_step}, "
                  f"{_human(m.total_bytes)}; rows/filtered: {rows}{view})")
            return 0
        if args.tool == "to-parquet":
            res = to_parquet(args.root, args.out_dir, seq=args.seq)
            for name, f in res["files"].items():
                print(f"{name}: {f['count']} rows -> {f['rows']}; {f['filtered_count']} filtered keys -> "
                      f"{f['filtered']}")
            return 0
        raise ValueError(f"unknown tool {args.tool!r}")
    except (CheckpointError, ValueError, OSError) as e:
        print(f"evstore ckpt {args.tool}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - TF errors (e.g. DataLoss read after verification)
        import tensorflow as tf
        if isinstance(e, tf.errors.OpError):
            print(f"evstore ckpt {args.tool}: error: {e.message}", file=sys.stderr)
            return 1
        raise
