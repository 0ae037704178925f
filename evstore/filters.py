"""Feature admission filters: which keys earn a row.

A filter is passed to `EmbeddingVariable(..., filter=...)` (or
`evstore.keras.Embedding(..., filter=...)`). Without one every key is admitted
on first sight. Both filters count every occurrence of a key in a training
lookup (`[1, 1, 2]` adds 2 to key 1) and admit it on the lookup whose batch
brings its count to `min_freq`: every occurrence of the key in that batch reads
its fresh initial row. Until then the key reads the EV's `default_value`, owns
no row and ignores gradients. Read-only lookups (`training=False`) never count.

| filter                          | cost of a key not yet admitted | counts              |
|---------------------------------|--------------------------------|---------------------|
| `CounterFilter(min_freq)`       | one index entry (~20 bytes)    | exact               |
| `BloomFilter(min_freq, ...)`    | nothing per key (fixed counters) | estimate, never low |

Filters are small classes behind one interface (`AdmissionFilter`): each tells
the native table how to build its admission policy (`_native_attrs`).
"""
import abc

import math

from evstore.policy_config import ConfiguredPolicy

__all__ = ["AdmissionFilter", "CounterFilter", "BloomFilter"]


def _check_min_freq(cls, min_freq, upper=None):
    if isinstance(min_freq, bool) or not isinstance(min_freq, int) or min_freq < 1:
        raise ValueError(f"{cls}: min_freq must be an int >= 1, got {min_freq!r}")
    if upper is not None and min_freq > upper:
        raise ValueError(f"{cls}: min_freq must be <= {upper} (its counters are 8-bit), got {min_freq}")


class AdmissionFilter(ConfiguredPolicy, abc.ABC):
    """Base class of admission filters (the interface the EV uses)."""

    min_freq = 1

    @abc.abstractmethod
    def _native_attrs(self):
        """Attributes of the table's create op (EvCreate) that set this policy."""

    @abc.abstractmethod
    def get_config(self):
        """The constructor's arguments, a JSON-serialisable dict (Keras's
        serialization: a layer's config holds its filter so)."""


class CounterFilter(AdmissionFilter):
    """Admit a key once it has been seen `min_freq` times (exact counts).

    A key below `min_freq` reads the EV's default value, owns no row (only an
    index entry holding its count and the step it was last seen at) and ignores
    gradients. The training lookup that brings its count to `min_freq` admits
    it. Counts of keys not yet admitted are saved with the EV (checkpoint
    tensors `-keys_filtered` / `-freqs_filtered`, with the step each was last
    seen at in `-seen_filtered`) and survive a restore; an EV
    restored with another `min_freq` keeps admitted keys admitted. With an
    eviction policy, keys not yet admitted are evicted too (by the step they
    were last seen at, see `evstore.GlobalStepEvict`).

    Raises:
      ValueError: `min_freq` is not an int >= 1.
    """

    def __init__(self, min_freq):
        _check_min_freq("CounterFilter", min_freq)
        self.min_freq = min_freq

    def _native_attrs(self):
        return {"min_freq": self.min_freq, "bloom_capacity": 0}

    def get_config(self):
        return {"min_freq": self.min_freq}

    def __repr__(self):
        return f"CounterFilter(min_freq={self.min_freq})"


class BloomFilter(AdmissionFilter):
    """Admit a key once a counting Bloom filter estimates `min_freq` sightings.

    Keys not yet admitted cost nothing per key: their sightings go to a fixed
    array of 8-bit counters sized for `capacity` distinct keys at false-positive
    rate `fp_rate`: m = -capacity * ln(fp_rate) / ln(2)^2 counters (one byte
    each; 9.6 MB for 1 M keys at 1%) and k = round(m / capacity * ln 2) hashes.
    A key gets an index entry and a row only when admitted; its frequency then
    starts from the filter's estimate and is exact afterwards.

    False positives: the estimate is the minimum of the key's k counters, each
    raised by conservative update, so it is never below the key's true count. A
    key is therefore never admitted late, but may be admitted early when other
    keys share all of its counters: with at most `capacity` distinct keys
    counted, about `fp_rate` of keys or fewer. Counters never decrease, so once
    more than `capacity` distinct keys were counted early admissions grow
    (`ev.stats()["filtered"]` estimates the distinct keys counted and not
    admitted). A key evicted and seen again is re-admitted at once (its counters
    still hold its count): an early admission.

    The counters are saved with the EV (checkpoint tensors `-bloom_geometry`,
    `-bloom_blocks`, `-bloom_counters`: every non-zero block of 4096 counters
    in a full, the blocks raised since the last save in a delta), so a restored
    job admits exactly as the saved one would have. They restore only into a
    filter of the same `capacity`, `fp_rate` and shard layout; otherwise (or
    through `tf.train.Checkpoint`) keys not yet admitted count from zero.

    Args:
      min_freq: sightings needed for admission, an int in [1, 255].
      capacity: expected distinct keys (>= 1).
      fp_rate: target false-positive rate, in (0, 1).

    Raises:
      ValueError: `min_freq`, `capacity` or `fp_rate` out of range.
    """

    def __init__(self, min_freq, capacity=1_000_000, fp_rate=0.01):
        _check_min_freq("BloomFilter", min_freq, upper=255)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"BloomFilter: capacity must be an int >= 1, got {capacity!r}")
        if isinstance(fp_rate, bool) or not isinstance(fp_rate, (int, float)) or not 0.0 < fp_rate < 1.0:
            raise ValueError(f"BloomFilter: fp_rate must be a float in (0, 1), got {fp_rate!r}")
        self.min_freq = min_freq
        self.capacity = capacity
        self.fp_rate = float(fp_rate)

    @property
    def num_counters(self):
        """Counters (bytes) the filter allocates, before rounding per segment."""
        return math.ceil(-self.capacity * math.log(self.fp_rate) / math.log(2) ** 2)

    @property
    def num_hashes(self):
        return min(30, max(1, round(self.num_counters / self.capacity * math.log(2))))

    def _native_attrs(self):
        return {"min_freq": self.min_freq, "bloom_capacity": self.capacity, "bloom_fp_rate": self.fp_rate}

    def get_config(self):
        return {"min_freq": self.min_freq, "capacity": self.capacity, "fp_rate": self.fp_rate}

    def __repr__(self):
        return f"BloomFilter(min_freq={self.min_freq}, capacity={self.capacity}, fp_rate={self.fp_rate})"
