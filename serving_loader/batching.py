"""Server-side batching of concurrent requests, with TF Serving's semantics.

Each request (a "task") carries its input arrays, whose 0th dimension is its
size. Tasks queue; a batch is formed from the oldest task on and is closed
when the next task would push it past `max_batch_size` rows, or when
`batch_timeout_micros` have passed since its first task was enqueued (0: run
with whatever has arrived, never wait). The model is called once per batch
(the inputs concatenated along dimension 0), under the model's read lock, so
every answer of a batch comes from the same applied checkpoint; the outputs
are split back along dimension 0 into each task's rows. A task larger than
`max_batch_size` is refused (INVALID_ARGUMENT, as TF Serving does without
large-batch splitting); past `max_enqueued_batches` full batches of queued
rows a task is refused with UNAVAILABLE. `num_batch_threads` threads run
batches (TF Serving's option of the same name). A task may carry a deadline
(a gRPC call's grpc-timeout): one still queued when its batch is formed after
that deadline is not run, and fails with DEADLINE_EXCEEDED. A task may also
carry a `cancelled()` test (a gRPC call its client has reset): one cancelled
when its batch is formed is not run either, and fails with CANCELLED.

If a batch of several tasks fails as a whole with an error about its inputs,
each task is run alone, so one bad request cannot fail its neighbours.
"""
import collections
import concurrent.futures
import logging
import threading
import time

import numpy as np

from serving_loader.tfs import ServingError

__all__ = ["Batcher", "BatchingOptions", "deadline_exceeded", "cancelled_by_client"]

log = logging.getLogger("evstore.serving")


class BatchingOptions:
    """TF Serving's BatchingParameters that apply here.

    Args:
      max_batch_size: most rows in one model call (default 1000, TF Serving's).
      batch_timeout_micros: longest wait for a batch to fill, from its first
        task's arrival (default 0: run what is queued at once).
      max_enqueued_batches: queue bound, in batches of `max_batch_size` rows.
      num_batch_threads: threads running batches.
    """

    def __init__(self, max_batch_size=1000, batch_timeout_micros=0, max_enqueued_batches=100, num_batch_threads=1):
        for name, v, lo in (("max_batch_size", max_batch_size, 1), ("batch_timeout_micros", batch_timeout_micros, 0),
                            ("max_enqueued_batches", max_enqueued_batches, 1),
                            ("num_batch_threads", num_batch_threads, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        self.max_batch_size = max_batch_size
        self.batch_timeout_micros = batch_timeout_micros
        self.max_enqueued_batches = max_enqueued_batches
        self.num_batch_threads = num_batch_threads


def deadline_exceeded():
    """The error of a call whose deadline passed before it ran (gRPC's words)."""
    return ServingError("DEADLINE_EXCEEDED", "Deadline Exceeded")


def cancelled_by_client():
    """The error of a call its client cancelled before it ran (gRPC's words)."""
    return ServingError("CANCELLED", "Cancelled by the client before it ran")


class _Task:
    # done: an asyncio future of `loop` (resolved on that loop, one wake-up per
    # batch), or, without a loop, a callback(value, error) run on the batch thread.
    # deadline: time.monotonic() after which the task is not run (None: never).
    # cancelled: a callable, true once the task's caller has gone (None: never).
    __slots__ = ("inputs", "size", "enqueued", "done", "loop", "deadline", "cancelled")

    def __init__(self, inputs, size, done, loop, deadline=None, cancelled=None):
        self.inputs = inputs
        self.size = size
        self.enqueued = time.monotonic()
        self.done = done
        self.loop = loop
        self.deadline = deadline
        self.cancelled = cancelled


def _future_setter(fut):
    """A callback(value, error) that resolves concurrent.futures.Future `fut`."""
    def done(value, error):
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)
    return done


class Batcher:
    """Batches calls of `run(inputs) -> (outputs, version)` (inputs and
    outputs {name: ndarray}, batch on dimension 0).

    `submit(inputs, loop=None, callback=None, deadline=None)` returns a
    future of (outputs, version) for this task's rows: an asyncio future of
    `loop` when given (resolved on that loop, one wake-up per batch), else a
    concurrent.futures.Future; with `callback`, nothing: `callback(value,
    error)` is called on the batch thread instead (no future, no lock). A task
    whose `deadline` (time.monotonic()) has passed when its batch is formed
    is not run: it fails with deadline_exceeded(); nor is one whose
    `cancelled()` is true then: it fails with cancelled_by_client().
    Counters: `batches`, `tasks` (run), `expired`, `dropped` (cancelled; for
    metrics and tests).
    """

    def __init__(self, run, options=None):
        self.run = run
        self.options = options or BatchingOptions()
        self._queue = collections.deque()
        self._queued_rows = 0
        self._cond = threading.Condition()
        self._stopped = False
        self.batches = 0
        self.tasks = 0
        self.expired = 0
        self.dropped = 0
        self._threads = [threading.Thread(target=self._loop, name=f"batch-{i}", daemon=True)
                         for i in range(self.options.num_batch_threads)]
        for t in self._threads:
            t.start()

    def submit(self, inputs, loop=None, callback=None, deadline=None, cancelled=None):
        sizes = {a.shape[0] if a.ndim else None for a in inputs.values()}
        if len(sizes) != 1 or None in sizes:
            raise ServingError("INVALID_ARGUMENT", "Batching session Run() input tensors must have equal "
                                                   f"0th-dimension size, got {sorted(map(str, sizes))}")
        (size,) = sizes
        o = self.options
        if size > o.max_batch_size:
            raise ServingError("INVALID_ARGUMENT", f"Task size {size} is larger than maximum input batch size "
                                                   f"{o.max_batch_size}")
        fut = None
        if loop is not None:
            done = fut = loop.create_future()
        elif callback is not None:
            done = callback
        else:
            fut = concurrent.futures.Future()
            done = _future_setter(fut)
        task = _Task(inputs, size, done, loop, deadline, cancelled)
        with self._cond:
            if self._stopped:
                raise ServingError("UNAVAILABLE", "the server is shutting down")
            if self._queued_rows + size > o.max_enqueued_batches * o.max_batch_size:
                raise ServingError("UNAVAILABLE", "The batch scheduling queue to which this task was submitted "
                                                  "is full")
            self._queue.append(task)
            self._queued_rows += size
            self._cond.notify()
        return fut

    def stop(self):
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    # ---- batch threads ---------------------------------------------------------
    def _next_batch(self):
        o = self.options
        timeout = o.batch_timeout_micros / 1e6
        with self._cond:
            while not self._queue:
                if self._stopped:
                    return None
                self._cond.wait()
            deadline = self._queue[0].enqueued + timeout
            batch, rows = [], 0
            while True:
                while self._queue and rows + self._queue[0].size <= o.max_batch_size:
                    t = self._queue.popleft()
                    batch.append(t)
                    rows += t.size
                    self._queued_rows -= t.size
                full = rows == o.max_batch_size or (self._queue and rows + self._queue[0].size > o.max_batch_size)
                left = deadline - time.monotonic()
                if full or left <= 0 or self._stopped:
                    return batch
                self._cond.wait(left)

    def _loop(self):
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            now = time.monotonic()
            live, expired, gone = [], [], []
            for t in batch:
                if t.deadline is not None and t.deadline <= now:
                    expired.append(t)
                elif t.cancelled is not None and t.cancelled():
                    gone.append(t)
                else:
                    live.append(t)
            if expired or gone:   # their callers have given up: answer them, run the rest
                self.expired += len(expired)
                self.dropped += len(gone)
                _deliver(expired, [(None, deadline_exceeded()) for _ in expired])
                _deliver(gone, [(None, cancelled_by_client()) for _ in gone])
                batch = live
                if not batch:
                    continue
            results = self._run_batch(batch)
            self.batches += 1
            self.tasks += len(batch)
            _deliver(batch, results)

    def _run_batch(self, batch):
        """[(result, None) | (None, exception)], one per task."""
        if len(batch) == 1:
            return self._call(batch[0].inputs, [batch[0].size])
        try:
            inputs = {n: np.concatenate([t.inputs[n] for t in batch]) for n in batch[0].inputs}
        except (ValueError, TypeError, KeyError):   # tasks of other shapes / names: each alone
            return [r for t in batch for r in self._call(t.inputs, [t.size])]
        results = self._call(inputs, [t.size for t in batch])
        error = results[0][1]
        if isinstance(error, ServingError) and error.code == "INVALID_ARGUMENT":
            return [r for t in batch for r in self._call(t.inputs, [t.size])]
        return results

    def _call(self, inputs, sizes):
        """One model call for tasks of `sizes` rows: their (result, error) pairs."""
        try:
            outputs, version = self.run(inputs)
        except Exception as e:  # noqa: BLE001 - delivered to the callers
            return [(None, e)] * len(sizes)
        total = sum(sizes)
        for n, a in outputs.items():
            if a.ndim == 0 or a.shape[0] != total:
                e = ServingError("INTERNAL", f"Batched output tensor {n!r} has 0th dimension "
                                             f"{a.shape[0] if a.ndim else None}, not the {total} rows of the "
                                             "batch's inputs")
                return [(None, e)] * len(sizes)
        if len(sizes) == 1:
            return [((outputs, version), None)]
        parts, start = [], 0
        for s in sizes:
            parts.append((({n: a[start:start + s] for n, a in outputs.items()}, version), None))
            start += s
        return parts


def _deliver(batch, results):
    by_loop = {}
    for task, (value, error) in zip(batch, results):
        if task.loop is None:
            try:
                task.done(value, error)
            except Exception:  # noqa: BLE001 - one caller's failure is not the batch's
                log.exception("a batched call's callback failed")
        else:
            by_loop.setdefault(task.loop, []).append((task.done, value, error))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, items)
        except RuntimeError:   # the loop is closed: nobody waits any more
            pass


def _resolve(items):
    for fut, value, error in items:
        if fut.cancelled():
            continue
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)
