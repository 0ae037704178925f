"""Checkpoint work a task does on its own host, asked for by the chief.

Why: on a cluster whose tasks share no filesystem, a parameter server's rows
must go from its memory to the object store without passing through the
chief, and without touching the PS's own disk. The native writer already
runs on the PS (an op placed on its device); this module is the other half:
Python code in the task's process (`evstore server`) that opens an object
sink there (checkpoint/object_sink.py: the writer streams each data file
into the root with fsspec), gives the written files their names in the
commit, and, for a restore, verifies the files a shard loads and lets the
native loader read them from the object store (checkpoint/object_source.py).

Channel: TensorFlow's own runtime. Every evstore task process registers
`_handle` in its py_func registry under TOKEN (`install()`, done by
`evstore_app.cluster.start_server` and by importing this module); the chief
runs an `EagerPyFunc` op with that token placed on the task's device, which
calls `_handle` in the task's process with one JSON request and returns one
JSON answer. No extra port, no polling; a dead task fails the call like any
op on it (UnavailableError). A task without the service (not started by
`evstore server`) answers "callback not found", reported as such.

Requests ({"op": ...}); every directory is one this process created:
  sink url, options, dirname   -> {"dir"}: an object sink's directory for checkpoint directory
                                  `dirname` of the root (a part is streamed there)
  put  dir, files{name: [final, size]}
                               -> gives each written file (its size checked first) its name in the
                                  checkpoint directory, then closes the sink; {"bytes"}
  read dir, name               -> {"data": base64} of a small file of a sink (a part's index, in memory)
  get  url, options, dirname, files{name: {size, crc32c}}, restore (an id per restore),
       verify (ObjectSource.verify: true, "index" or false), reread (files the task's loads read more
       than once), index (base64: the main bundle's index, read and checked by the chief)
                               -> {"dir", "bytes"}: an object source's directory over the files
                                  (checkpoint/object_source.py), verified as asked (true: each read
                                  once, size and crc32c, kept in memory within its budget; "index":
                                  sizes only, each tensor's crc32c checked by the loader as it
                                  streams it); the native loader on this task reads them through it;
                                  nothing is written on the task's disk; sources another restore
                                  left open (its chief died) are closed first
  rm   dir                     -> closes one of its sinks (deleting what it still holds) or sources
                                  (nothing if it is gone); {"bytes"}: what a source read from the root
Errors come back as {"error", "corrupt"} and are raised by `call` as
CheckpointError (CorruptCheckpointError for a file that does not match the
manifest).
"""
import base64
import json
import os
import threading
import types

import tensorflow as tf

from checkpoint import _failpoints
from checkpoint.errors import CheckpointError, CorruptCheckpointError
from checkpoint.manifest import BUNDLE_PREFIX
from checkpoint.object_sink import ObjectSink, is_sink, read, sink_of
from checkpoint.object_source import ObjectSource, is_source, source_of

__all__ = ["install", "call", "TOKEN"]

TOKEN = "evstore.checkpoint.task_service.v1"
_OWNED = set()           # directories this process created for the chief
_OWNED_LOCK = threading.Lock()
_RESTORES = {}           # source directory -> the id of the restore that opened it


def install():
    """Registers the service in this process's py_func registry, and the object sink's and source's
    callbacks with its native writer and loader (idempotent)."""
    from tensorflow.python.ops import script_ops   # the registry EagerPyFunc kernels look tokens up in
    script_ops._py_funcs._funcs[TOKEN] = _handle   # a WeakValueDictionary: _handle is module-global
    from checkpoint import object_sink, object_source
    object_sink.install()
    object_source.install()


def _storage(req):
    from checkpoint.storage import Storage
    return Storage(req["url"], req.get("options") or None)


def _owned(path):
    with _OWNED_LOCK:
        if path not in _OWNED:
            raise CheckpointError(f"{path} is not a directory this task's checkpoint service created")
    return path


def _op_sink(req):
    sink = ObjectSink(_storage(req), req["dirname"])
    with _OWNED_LOCK:
        _OWNED.add(sink.directory)
    return {"dir": sink.directory}


def _op_put(req):
    sink = sink_of(_owned(req["dir"]))
    for name, (_, size) in req["files"].items():
        have = sink.sizes.get(name)
        if have != size:
            raise CheckpointError(f"{sink.storage.display(sink.dirname, name)}: {have} bytes streamed by the task, "
                                  f"its writer reported {size}{'; ' + sink.error() if sink.error() else ''}")
    _failpoints.hit("task-before-upload")
    sent = sink.publish({name: target for name, (target, _) in req["files"].items()})
    _op_rm({"dir": sink.directory})   # in place (the chief read the part's index before): nothing stays held
    return {"bytes": sent}


def _op_get(req):
    # One restore at a time (the chief holds the lease): the sources of another restore are of a chief
    # that died before it released them, and would hold their kept files for the process's life.
    with _OWNED_LOCK:
        stale = [d for d, r in _RESTORES.items() if r != req.get("restore")]
    for d in stale:
        _op_rm({"dir": d})
    # The manifest's fields a source reads: the directory, and each file's size and crc32c.
    listed = types.SimpleNamespace(dir=req["dirname"], files=dict(req["files"]))
    source = ObjectSource(_storage(req), listed)
    if req.get("index"):   # the main bundle's index, read and checked by the chief
        source.keep(BUNDLE_PREFIX + ".index", base64.b64decode(req["index"]))
    with _OWNED_LOCK:
        _OWNED.add(source.directory)
        _RESTORES[source.directory] = req.get("restore")
    try:
        check = req.get("verify", True)
        problems = source.verify(data=check != "index", reread=req.get("reread", ())) if check else []
        if problems:
            raise CorruptCheckpointError("; ".join(problems))
    except BaseException:
        _op_rm({"dir": source.directory})
        raise
    return {"dir": source.directory, "bytes": source.bytes_read}


def _op_rm(req):
    with _OWNED_LOCK:
        if req["dir"] not in _OWNED:   # removed already (after its upload), or never this task's: nothing to do
            return {}
    d = req["dir"]
    read = 0
    if is_source(d):
        try:
            source = source_of(d)
            source.close()
            read = source.bytes_read
        except KeyError:
            pass
    elif is_sink(d):
        try:
            sink = sink_of(d)
        except KeyError:
            sink = None
        if sink is not None:
            sink.discard()
            sink.close()
    with _OWNED_LOCK:
        _OWNED.discard(d)
        _RESTORES.pop(d, None)
    return {"bytes": read}


def _op_read(req):
    return {"data": base64.b64encode(read(_owned(req["dir"]), os.path.basename(req["name"]))).decode()}


_OPS = {"sink": _op_sink, "put": _op_put, "get": _op_get, "rm": _op_rm, "read": _op_read}


def _handle(request):
    """The py_func: one JSON request tensor in, one JSON answer tensor out; never raises."""
    try:
        req = json.loads(request.numpy().decode())
        out = _OPS[req["op"]](req)
    except CorruptCheckpointError as e:
        out = {"error": str(e), "corrupt": True}
    except Exception as e:  # noqa: BLE001 - every failure goes back to the chief as an answer
        out = {"error": f"{type(e).__name__}: {e}"}
    return tf.constant(json.dumps(out))


def call(task, request):
    """Runs `request` (a dict) on `task` ("/job:ps/replica:0/task:1"); returns the answer dict.

    Raises:
      CheckpointError: the task failed it, or runs no checkpoint service.
      CorruptCheckpointError: a file read on the task does not match the manifest.
      tf.errors.OpError: the task is unreachable.
    """
    try:
        with tf.device(task + "/device:CPU:0"):
            (out,) = tf.raw_ops.EagerPyFunc(input=[tf.constant(json.dumps(request))], token=TOKEN, Tout=[tf.string])
        answer = json.loads(out.numpy().decode())
    except (tf.errors.InvalidArgumentError, tf.errors.UnknownError) as e:
        if "Could not find callback" in str(e):
            raise CheckpointError(f"task {task} runs no evstore checkpoint service: start every parameter-server "
                                  "task with `evstore server` (or evstore_app.cluster.start_server)") from None
        raise
    if "error" in answer:
        cls = CorruptCheckpointError if answer.get("corrupt") else CheckpointError
        raise cls(f"task {task}: {request['op']}: {answer['error']}")
    return answer


def read_bytes(task, directory, name):
    """The bytes of small file `name` in `directory` on `task`."""
    return base64.b64decode(call(task, {"op": "read", "dir": directory, "name": name})["data"])


install()
