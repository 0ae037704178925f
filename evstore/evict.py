"""Feature eviction policies: which keys leave the table.

Pass one policy or a list to `EmbeddingVariable(..., evict=...)` (or
`evstore.keras.Embedding(..., evict=...)`). A key is evicted when ANY policy
selects it. Eviction runs when asked, `ev.evict(global_step)`, and before every
checkpoint save (the checkpoint manager calls `ev.evict(step)` for every EV
whose `ev.evict_policies` is non-empty; a `tf.train.Checkpoint` save evicts at
the EV's clock, the highest global step it has seen). An evicted key is erased
exactly like `ev.remove`: its row goes to the free list (reused by the next new
key, so a table whose live set is constant does not grow) and the key joins the
deleted set, so the next delta checkpoint deletes it. A key evicted and seen
again comes back as a new key: fresh initial row, frequency counted from zero.

Policies are small classes behind one interface (`EvictPolicy`), mirrored by
one C++ class each (evstore/native/core/evict_policy.h: GlobalStepEviction,
L2WeightEviction); the native table applies them in one pass. Several policies
of one kind are merged by that kind (`_merge`): the shortest `steps_to_live`,
the highest L2 threshold.
"""
import abc

import math

from evstore.policy_config import ConfiguredPolicy

__all__ = ["EvictPolicy", "GlobalStepEvict", "L2WeightEvict"]


class EvictPolicy(ConfiguredPolicy, abc.ABC):
    """Base class of eviction policies (the interface the EV uses)."""

    @abc.abstractmethod
    def _native_attrs(self):
        """Attributes of the EvEvict op that enable this policy."""

    @classmethod
    @abc.abstractmethod
    def _merge(cls, policies):
        """One policy of this class equivalent to `policies` (all of this class)
        applied together: a key any of them selects is selected."""

    @abc.abstractmethod
    def get_config(self):
        """The constructor's arguments, a JSON-serialisable dict (Keras's
        serialization: a layer's config holds its policies so)."""


class GlobalStepEvict(EvictPolicy):
    """Evict keys not updated for more than `steps_to_live` global steps.

    At `ev.evict(global_step)` a key is evicted when
    `global_step - reference > steps_to_live`, where the reference is:
      * its version (the global step of its last optimizer update);
      * for a key admitted but never updated: the step it was admitted at,
        i.e. the EV's clock at that lookup (the highest global step the EV had
        seen from optimizer applies and evict calls; a lookup of step t usually
        runs after the apply of step t-1, so admission counts from t-1);
      * for a key counted but not admitted (CounterFilter): the step it was
        last looked up at (the clock, likewise).
    A key whose reference is unknown (admitted before the EV saw any global
    step, rows loaded without versions, filtered keys restored from a
    checkpoint older than `-seen_filtered` or through tf.train.Checkpoint) is not
    evicted by that call: it is stamped with `global_step` and counts from it.

    Raises:
      ValueError: `steps_to_live` is not an int >= 0.
    """

    def __init__(self, steps_to_live):
        if isinstance(steps_to_live, bool) or not isinstance(steps_to_live, int) or steps_to_live < 0:
            raise ValueError(f"GlobalStepEvict: steps_to_live must be an int >= 0, got {steps_to_live!r}")
        self.steps_to_live = steps_to_live

    def _native_attrs(self):
        return {"steps_to_live": self.steps_to_live}

    def get_config(self):
        return {"steps_to_live": self.steps_to_live}

    @classmethod
    def _merge(cls, policies):
        return cls(min(p.steps_to_live for p in policies))

    def __repr__(self):
        return f"GlobalStepEvict(steps_to_live={self.steps_to_live})"


class L2WeightEvict(EvictPolicy):
    """Evict admitted keys whose embedding's L2 norm is below `threshold`.

    Only the embedding (not optimizer slots) is measured. Rows zeroed by a
    group-lasso optimizer are the typical candidates. Keys without a row are
    never evicted by this policy.

    Raises:
      ValueError: `threshold` is not a finite number > 0.
    """

    def __init__(self, threshold):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
                math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"L2WeightEvict: threshold must be a finite number > 0, got {threshold!r}")
        self.threshold = float(threshold)

    def _native_attrs(self):
        return {"l2_threshold": self.threshold}

    def get_config(self):
        return {"threshold": self.threshold}

    @classmethod
    def _merge(cls, policies):
        return cls(max(p.threshold for p in policies))

    def __repr__(self):
        return f"L2WeightEvict(threshold={self.threshold})"


def normalize(evict):
    """`evict` argument -> tuple of policies (TypeError for anything else)."""
    if evict is None:
        return ()
    policies = tuple(evict) if isinstance(evict, (list, tuple)) else (evict,)
    for p in policies:
        if not isinstance(p, EvictPolicy):
            raise TypeError("evict must be an evstore.GlobalStepEvict, evstore.L2WeightEvict, a list of them "
                            f"or None, got {type(p).__name__}")
    return policies


def native_attrs(policies):
    """EvEvict attributes for `policies` (any selects): each policy class merges
    its own instances (`_merge`), then contributes its own attributes."""
    by_class = {}
    for p in policies:
        by_class.setdefault(type(p), []).append(p)
    attrs = {}
    for cls, group in by_class.items():
        attrs.update(cls._merge(group)._native_attrs())
    return attrs
