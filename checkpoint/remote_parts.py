"""A checkpoint whose parts are written on several hosts and meet only in the
object store (an fsspec root no two tasks share as a filesystem).

Saving (the parameter-server save, checkpoint/commit.py, and the synchronous
save, checkpoint/sync.py):
  1. each task streams its part bundle `ckpt_part<k>` with the native writer
     into the root through an object sink of its own process
     (checkpoint/object_sink.py: each data file under a temporary key, the
     part index in memory; nothing on the task's disk; a PS's sink is opened
     by the chief through checkpoint/task_service.py; the chief's part holds
     the dense tensors and the global step);
  2. the part indexes (a few KB: one entry per tensor) are merged here into
     the commit's one `ckpt.index` (`merge_indexes`: every entry keeps its
     offset, size and crc32c; part k's data file s becomes
     `ckpt.data-<offset_k + s>-of-<total>`, exactly what
     MergeV2Checkpoints would name it);
  3. every task renames its own data files to those names (a server-side
     copy: each shard's rows crossed the network once, from its host to the
     object store, while they were written); the chief uploads the merged
     index;
  4. the chief checks every listed object's size in the root, then writes
     MANIFEST.json (the commit point, checkpoint/commit.py).
The result is one ordinary TensorFlow bundle, as on a local root:
`tf.train.load_checkpoint` reads every tensor of a downloaded commit.

Bytes through the chief per save: its own part (the dense tensors, global
step), the part indexes and the merged index; no embedding row.

Restoring (CheckpointManager.restore with shards on other tasks): the chief
reads each commit's index (checked against the manifest) and opens an object
source (checkpoint/object_source.py) over the index and the data files of
the dense tensors and of its own EVs; each task opens one, through its
checkpoint service, over the index and the data files of the entries its
shards load (its own part when the layout is unchanged, every part when it
changed: shards.load_plan) and verifies their sizes and crc32c against the
manifest (their sizes; the chief sends each task the indexes, read once);
the native loader then streams them on that task from the object store into
a staging table per EV shard (evstore/staging.py), checking each tensor's
crc32c as it loads; every EV adopts its staging table only once every task
loaded (CheckpointManager.restore). Nothing is applied before every task's
files are checked, each byte is read once, and no task writes a checkpoint
byte to its disk.
"""
import base64
import concurrent.futures
import dataclasses
import os
import uuid

import tensorflow as tf

from checkpoint.errors import CheckpointError
from checkpoint.index import build_index, data_file, parse_index
from checkpoint.manifest import BUNDLE_PREFIX
from checkpoint.object_sink import read, sink_of
from checkpoint.serving_view import VIEW_PREFIX
from checkpoint.task_service import call, read_bytes

__all__ = ["Part", "write_parts", "publish_parts", "discard_parts", "merge_indexes", "crc32c_bytes", "data_files_of",
           "entry_tensors", "bundle_subset", "reread_files", "stage_on_tasks", "release_on_tasks"]


@dataclasses.dataclass
class Part:
    task: str | None        # None: this process
    dir: str                # its object sink's directory on that task
    prefix: str             # ckpt_part<k>
    names: list             # EV names it holds
    files: dict = None      # {file: {"size", "crc32c"}} as its writer reported
    counts: dict = None     # per-EV counts (bundle.write_bundle)

    @property
    def view_prefix(self):
        """Its serving view's bundle (serving_part<k>), written beside its part when the commit has one."""
        return VIEW_PREFIX + self.prefix[len(BUNDLE_PREFIX):]

    def has_view(self):
        return bool(self.files) and self.view_prefix + ".index" in self.files


def crc32c_bytes(data):
    """crc32c (unmasked) of `data`."""
    from evstore import ops
    return int(ops.ev_crc32c_extend(tf.constant(0, tf.int64), tf.constant(data)))


def merge_indexes(indexes, prefixes, where="checkpoint", into=BUNDLE_PREFIX):
    """(merged index bytes, [{part data file: merged data file}]) of part
    indexes `indexes` (bytes, in part order) of bundles `prefixes`, merged
    into bundle `into` (the main bundle, or the serving view's).

    Raises CheckpointError when two parts hold a tensor of the same name."""
    parsed = [parse_index(b, f"{where}/{p}.index") for b, p in zip(indexes, prefixes)]
    total = sum(n for n, _ in parsed)
    entries, renames, seen, offset = [], [], set(), 0
    for (n, held), prefix in zip(parsed, prefixes):
        renames.append({data_file(prefix, s, n): data_file(into, offset + s, total) for s in range(n)})
        for e in held.values():
            if e.name in seen:
                raise CheckpointError(f"{where}: tensor {e.name!r} is in two parts")
            seen.add(e.name)
            # An empty tensor points at zero bytes of its part's shard 0, which
            # a part without data files lacks: any existing file holds zero bytes.
            shard = offset + e.shard_id if e.size else min(offset + e.shard_id, max(total - 1, 0))
            entries.append((e.name, e.dtype, e.shape, shard, e.offset, e.size, e.crc32c))
        offset += n
    return build_index(entries, total, crc32c_bytes), renames


def write_parts(storage, dirname, staging, groups, write):
    """Step 1 for a parameter-server save into checkpoint `dirname` of `storage`.
    `groups`: {task ("" = here): [EV names]}; `staging`: this process's object
    sink directory; `write(directory, names, prefix, device, with_dense)`
    streams one part and returns write_bundle's (files, counts). Returns
    [Part], this process's last (it holds the dense tensors). A failure
    discards every part written."""
    groups = dict(groups)
    local = groups.pop("", [])
    parts = []
    try:
        for k, (task, names) in enumerate(sorted(groups.items())):
            sink = call(task, {"op": "sink", "url": storage.url, "options": storage.options, "dirname": dirname})
            parts.append(Part(task, sink["dir"], f"{BUNDLE_PREFIX}_part{k}", names))
        parts.append(Part(None, staging, f"{BUNDLE_PREFIX}_part{len(parts)}", local))

        def run(p):
            device = None if p.task is None else p.task + "/device:CPU:0"
            p.files, p.counts = write(p.dir, p.names, p.prefix, device, p.task is None)

        with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
            for f in [pool.submit(run, p) for p in parts]:
                f.result()
    except BaseException:
        discard_parts(parts)
        raise
    return parts


def publish_parts(storage, dirname, staging, parts):
    """Steps 2-3: merges the part indexes, has every task rename its data files
    to their merged names, renames this process's and uploads the merged
    index into `dirname` of `storage`, and checks every object's size there.
    Returns (files {name: {"size", "crc32c"}}, counts, bytes this process sent,
    the merged index)."""
    def index_of(p, prefix):
        return read_bytes(p.task, p.dir, prefix + ".index") if p.task else read(p.dir, prefix + ".index")

    indexes = [index_of(p, p.prefix) for p in parts]
    index, renames = merge_indexes(indexes, [p.prefix for p in parts], storage.display(dirname))
    sent = sum(len(b) for p, b in zip(parts, indexes) if p.task)   # the remote part indexes came here
    merged_indexes = {BUNDLE_PREFIX + ".index": index}
    viewed = [k for k, p in enumerate(parts) if p.has_view()]
    if viewed:   # the parts' serving views merge into one `serving` bundle the same way
        vindexes = [index_of(parts[k], parts[k].view_prefix) for k in viewed]
        sent += sum(len(b) for k, b in zip(viewed, vindexes) if parts[k].task)
        vindex, vrenames = merge_indexes(vindexes, [parts[k].view_prefix for k in viewed],
                                         storage.display(dirname), into=VIEW_PREFIX)
        merged_indexes[VIEW_PREFIX + ".index"] = vindex
        for k, names in zip(viewed, vrenames):
            renames[k] = {**renames[k], **names}
    files, counts = {}, {}
    for p, names in zip(parts, renames):
        counts.update(p.counts)
        for local, merged in names.items():
            files[merged] = p.files[local]
    storage.makedirs(storage.join(dirname))

    def upload(p, names):
        if p.task is None:
            sink_of(p.dir).publish(names)
            return
        call(p.task, {"op": "put", "dir": p.dir, "files": {lo: [m, p.files[lo]["size"]] for lo, m in names.items()}})

    with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
        for f in [pool.submit(upload, p, names) for p, names in zip(parts, renames)]:
            f.result()
    sent += sum(parts[-1].files[lo]["size"] for lo in renames[-1])
    for name, data in merged_indexes.items():
        storage.fs.pipe_file(storage.join(dirname, name), data)
        files[name] = {"size": len(data), "crc32c": crc32c_bytes(data)}
        sent += len(data)
    check_uploaded(storage, dirname, files)
    return files, counts, sent, index


def check_uploaded(storage, dirname, files):
    """Every file of `files` is in `dirname` of the root with its size (one listing)."""
    path = storage.join(dirname)
    try:
        storage.fs.invalidate_cache(path)
    except Exception:  # noqa: BLE001 - not every filesystem caches listings
        pass
    found = {os.path.basename(str(i["name"]).rstrip("/")): i.get("size") for i in storage.fs.ls(path, detail=True)}
    for name, info in files.items():
        if found.get(name) != info["size"]:
            raise CheckpointError(f"{storage.display(dirname, name)}: {found.get(name)} bytes in the root after the "
                                  f"upload, its writer wrote {info['size']}; nothing is committed")


def discard_parts(parts):
    """Closes every task's part sink, deleting what it still holds (this process's is its caller's)."""
    for p in parts:
        if p.task is not None:
            try:
                call(p.task, {"op": "rm", "dir": p.dir})
            except Exception:  # noqa: BLE001 - a dead task's directory dies with its host's temp
                pass


def data_files_of(index_bytes, tensor_names, where):
    """The data files of the main bundle that hold `tensor_names` (those the index lists)."""
    num_shards, entries = parse_index(index_bytes, where)
    return sorted({data_file(BUNDLE_PREFIX, entries[n].shard_id, num_shards)
                   for n in tensor_names if n in entries and entries[n].size})


# ---- restoring: each task opens a source over the files its shards load ------
def entry_tensors(manifest, index_bytes, entries):
    """Names of the main bundle's tensors of EV entries `entries` of `manifest`."""
    from evstore import schema
    _, held = parse_index(index_bytes, manifest.dir)
    heads = tuple(n + "-" for n in entries) + tuple(
        schema.slot_prefix(n, s) + "-" for n in entries for s in manifest.evs.get(n, {}).get("slots", ()))
    return [t for t in held if t.startswith(heads)]


def bundle_subset(manifest, index_bytes, tensors):
    """The main bundle's index and the data files holding `tensors`."""
    return [BUNDLE_PREFIX + ".index"] + data_files_of(index_bytes, tensors, manifest.dir)


def reread_files(manifest, index_bytes, loads):
    """The data files of `manifest`'s main bundle holding a tensor that loads `loads` (EV entry names,
    one per load: an entry loaded into shards of a process in k places appears k times) read more than once."""
    seen, again = set(), set()
    for entry in loads:
        for t in entry_tensors(manifest, index_bytes, [entry]):
            (again if t in seen else seen).add(t)
    return data_files_of(index_bytes, sorted(again), manifest.dir)


def stage_on_tasks(storage, chain, indexes, wanted, verify=True, reread=None):
    """Has each task open an object source over the files it loads and verify them (`verify`:
    ObjectSource.verify's check, "index" for data=False; False: none). Each task is sent the indexes
    (`indexes`, read here and checked): it reads none of them again.

    `wanted`: {task: [entry names per chain member]}; `reread`: {task: [files its loads read more than
    once, per chain member]} (ObjectSource.verify). Returns {task: [its
    source's directory per chain member]}; release with `release_on_tasks`.
    A failure releases what was staged and raises (CorruptCheckpointError for
    a file that does not match its manifest)."""
    staged = {task: [] for task in wanted}
    restore = uuid.uuid4().hex   # a task closes the sources of any other restore (a chief that died mid-restore)

    def run(task):
        again = (reread or {}).get(task) or [()] * len(chain)
        for m, idx, entries, twice in zip(chain, indexes, wanted[task], again):
            names = bundle_subset(m, idx, entry_tensors(m, idx, entries))
            missing = [n for n in names if n not in m.files]
            if missing:
                from checkpoint.errors import CorruptCheckpointError
                raise CorruptCheckpointError(f"{storage.display(m.dir, missing[0])}: not listed in the manifest")
            staged[task].append(call(task, {"op": "get", "url": storage.url, "options": storage.options,
                                            "dirname": m.dir, "files": {n: m.files[n] for n in names},
                                            "restore": restore, "verify": verify, "reread": list(twice),
                                            "index": base64.b64encode(idx).decode()})["dir"])

    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(wanted))) as pool:
            for f in [pool.submit(run, task) for task in wanted]:
                f.result()
    except BaseException:
        release_on_tasks(staged)
        raise
    return staged


def release_on_tasks(staged):
    """Closes every task's sources; returns the bytes they read from the root (of the tasks that
    answered)."""
    read = 0
    for task, dirs in staged.items():
        for d in dirs:
            try:
                read += call(task, {"op": "rm", "dir": d}).get("bytes", 0)
            except Exception:  # noqa: BLE001 - a dead task's source died with it
                pass
    return read
