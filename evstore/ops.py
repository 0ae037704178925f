"""The op library's kernels, by their registered names: the low-level public interface.

`evstore.ops.ev_<name>` is TensorFlow's generated wrapper of the kernel
registered as `Ev<Name>` (evstore/native/tf/*_ops.cc hold each op's inputs,
attributes and documentation). The Python API (EmbeddingVariable, lookups,
optimizers) is built on these; the layers above it use them where they drive
a kernel directly: checkpoint/ writes and reads bundles (`ev_save_bundle`,
`ev_load_bundle`) and checks files (`ev_file_crc32c`, `ev_crc32c_extend`);
benchmarks time single kernels. An op's inputs are positional, as registered;
docs/ARCHITECTURE.md ("Ops and Python API") describes them.

Importing this module loads the op library (ImportError if it is not built).
"""
from evstore._ops import gen as _gen


def __getattr__(name):
    try:
        return getattr(_gen, name)
    except AttributeError:
        raise AttributeError(f"module 'evstore.ops' has no attribute {name!r} (no such evstore op)") from None


def __dir__():
    return sorted(n for n in dir(_gen) if n.startswith("ev_"))
