"""checkpoint: full and delta checkpoints of evstore models (docs/ARCHITECTURE.md, "Checkpoints").

    manager = checkpoint.CheckpointManager("/data/ckpt", model)
    manager.save_full(); manager.save_delta(metadata={"offset": 1234})
    manager.restore()              # newest chain, bit for bit
    manager.start(delta_every=60, full_every=3600); ...; manager.stop()
    model.fit(ds, callbacks=[checkpoint.CheckpointCallback("/data/ckpt", delta_every=100)])
"""
import importlib

from checkpoint.chain import resolve_chain, scan, verify_files
from checkpoint.errors import ChainError, CheckpointError, CorruptCheckpointError, NoCheckpointError
from checkpoint.lease import LeaseHeldError, LeaseLostError
from checkpoint.manager import CheckpointManager
from checkpoint.manifest import Manifest
from checkpoint.storage import Storage

__all__ = ["CheckpointManager", "CheckpointCallback", "QualityMetric", "Manifest", "Storage", "scan", "resolve_chain", "verify_files",
           "CheckpointError", "CorruptCheckpointError", "ChainError", "NoCheckpointError", "LeaseHeldError",
           "LeaseLostError"]


def __getattr__(name):
    """CheckpointCallback and QualityMetric are Keras classes (checkpoint/fit.py): imported, with
    Keras, when first used, so that `import checkpoint` does not import Keras."""
    if name in ("CheckpointCallback", "QualityMetric"):
        return getattr(importlib.import_module("checkpoint.fit"), name)
    raise AttributeError(f"module 'checkpoint' has no attribute {name!r}")
