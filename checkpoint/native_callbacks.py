"""What the object sink and the object source (object_sink.py, object_source.py)
share: naming the Python object behind a native path ("<scheme><id>/<name>"),
and the guard around every ctypes callback. A callback never raises into native
code: an exception is recorded on the object it concerns (its `errors` list, for
the caller's error message), logged, and turned into the callback's failure
value, which the native side turns into a failed save or load."""

__all__ = ["owner", "split", "guard"]


def owner(path, scheme, registry, lock):
    """The object of `path` ("<scheme><id>[/name]", str) among `registry`; KeyError if it is closed or never was."""
    sid = str(path)[len(scheme):].split("/", 1)[0]
    with lock:
        return registry[sid]


def split(path, scheme, registry, lock):
    """(object, name) of native `path` (bytes) among `registry` (id -> object); KeyError if absent."""
    sid, _, name = path.decode()[len(scheme):].partition("/")
    with lock:
        return registry[sid], name


def guard(fail, *, owner_of, what, log, quiet=()):
    """Decorator for a callback returning `fail` instead of raising. `owner_of(first argument)`
    names the object to record the error on; exceptions of the `quiet` types are not logged."""
    def wrap(fn):
        def run(*args):
            try:
                return fn(*args)
            except BaseException as e:  # noqa: BLE001 - a callback never raises into native code
                owner = None
                try:
                    owner = owner_of(args[0])
                except Exception:  # noqa: BLE001
                    pass
                if owner is not None:
                    owner.errors.append(f"{type(e).__name__}: {e}")
                if not isinstance(e, quiet):
                    log.error("%s: %s failed: %s: %s", what, fn.__name__.lstrip("_"), type(e).__name__, e)
                return fail
        return run
    return wrap
