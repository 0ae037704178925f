"""Errors raised by checkpoint/: each names the file or checkpoint at fault and what to do."""

__all__ = ["CheckpointError", "CorruptCheckpointError", "ChainError", "NoCheckpointError"]


class CheckpointError(Exception):
    """Base class of checkpoint errors."""


class CorruptCheckpointError(CheckpointError):
    """A file of a committed checkpoint is missing, truncated or fails its checksum."""


class ChainError(CheckpointError):
    """A chain cannot be restored: a delta is missing, or a manifest names a wrong parent or base."""


class NoCheckpointError(CheckpointError):
    """The root holds no committed checkpoint (or none at or before the requested sequence)."""
