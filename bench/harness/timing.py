"""Timing shared by the benchmarks and their peers (numpy-free, any venv)."""
import statistics
import time


def timed(fn, *a):
    """Seconds taken by fn(*a)."""
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def on_host(tensor):
    """An eager op's output as a host array that aliases the tensor's buffer.

    An eager op on the CPU has finished when it returns; this hands its result
    over as a caller reading it would, without `EagerTensor.numpy()`'s copy
    (`.numpy()` copies the array it gets from `__array__`). At 65,536 x 64
    float32 that copy is 16 MiB on one thread per batch, the same for every
    system timed, so it pulled every table ratio toward 1."""
    return tensor.__array__()


def rate(batch, times):
    """Median keys/s of a list of per-batch seconds (None if no times)."""
    return batch / statistics.median(times) if times else None


def open_loop(seconds, hz, make_request, send):
    """Open-loop requests for `seconds`: request i is due at t0 + i/hz, built by
    make_request() and sent by send(request). Returns (latency from each due
    time, time in send) lists, in seconds."""
    lat, call = [], []
    period = 1.0 / hz
    t0 = time.perf_counter()
    i = 0
    while True:
        due = t0 + i * period
        if due - t0 > seconds:
            break
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        req = make_request()
        t = time.perf_counter()
        send(req)
        end = time.perf_counter()
        lat.append(end - due)
        call.append(end - t)
        i += 1
    return lat, call
