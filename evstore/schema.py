"""The schema shared with the native core: checkpoint tensor names, stats
fields, op input names and the shard route's name, mirrored from evstore/native/core/schema.h (the one
definition; tests/native/test_schema.py checks this mirror and the registered
ops against it).

Checkpoint tensors of an EmbeddingVariable `<ev>` (our bundles):
  `<ev>-keys`, `<ev>-values`, `<ev>-versions`, `<ev>-freqs`,
  `<ev>/<slot>-values` per optimizer slot with `<ev>/<slot>-initial_value`
  (the value the slot starts at in rows admitted later; absent in checkpoints
  written before it existed), `<ev>-keys_filtered`,
  `<ev>-freqs_filtered`, `<ev>-seen_filtered`, `<ev>-clock`, with a BloomFilter
  `<ev>-bloom_geometry`, `<ev>-bloom_blocks`, `<ev>-bloom_counters`, and in
  deltas `<ev>-deleted_keys`.
A tf.train.Checkpoint packs the slots as `<ev>-slots` and `<ev>-slot_names`, and
holds their initial values as `<ev>-slot_initial_values` (with `<ev>-slot_names`)
in the table's child object `slot_initial_values` (optional: older
checkpoints lack it).
"""

__all__ = ["KEYS", "VALUES", "VERSIONS", "FREQS", "KEYS_FILTERED", "FREQS_FILTERED", "DELETED_KEYS", "SEEN_FILTERED", "CLOCK",
           "BLOOM_GEOMETRY", "BLOOM_BLOCKS", "BLOOM_COUNTERS", "SLOTS",
           "SLOT_NAMES", "SLOT_SEPARATOR", "SLOT_VALUES", "SLOT_INITIAL_VALUE", "SLOT_INITIAL_VALUES", "EV_TENSORS",
           "tensor", "slot_prefix", "slot_tensor", "slot_initial_value_tensor",
           "STATS_FIELDS", "HANDLE", "KEYS_INPUT", "GRADS_INPUT", "GLOBAL_STEP_INPUT", "APPLY_INPUTS",
           "MAX_STRING_KEY_BYTES", "SHARD_ROUTE"]

# ---- checkpoint tensor names (schema.h: kKeys ...) ----
KEYS = "-keys"
VALUES = "-values"
VERSIONS = "-versions"
FREQS = "-freqs"
KEYS_FILTERED = "-keys_filtered"
FREQS_FILTERED = "-freqs_filtered"
SEEN_FILTERED = "-seen_filtered"
CLOCK = "-clock"
BLOOM_GEOMETRY = "-bloom_geometry"    # BloomFilter only
BLOOM_BLOCKS = "-bloom_blocks"        # BloomFilter only
BLOOM_COUNTERS = "-bloom_counters"    # BloomFilter only
DELETED_KEYS = "-deleted_keys"
SLOTS = "-slots"              # tf.train.Checkpoint only
SLOT_NAMES = "-slot_names"    # tf.train.Checkpoint only
SLOT_SEPARATOR = "/"
SLOT_VALUES = "-values"
SLOT_INITIAL_VALUE = "-initial_value"            # [1], after slot_prefix
SLOT_INITIAL_VALUES = "-slot_initial_values"     # tf.train.Checkpoint only

# The tensors every EV has in every bundle (full or delta), slots aside.
EV_TENSORS = (KEYS, VALUES, VERSIONS, FREQS, KEYS_FILTERED, FREQS_FILTERED, SEEN_FILTERED, CLOCK)


def tensor(ev, suffix):
    """`<ev><suffix>`, e.g. tensor("user", KEYS) == "user-keys"."""
    return ev + suffix


def slot_prefix(ev, slot):
    """`<ev>/<slot>`: how a checkpoint names the slot."""
    return ev + SLOT_SEPARATOR + slot


def slot_tensor(ev, slot):
    """`<ev>/<slot>-values`: the slot's tensor."""
    return slot_prefix(ev, slot) + SLOT_VALUES


def slot_initial_value_tensor(ev, slot):
    """`<ev>/<slot>-initial_value`: the slot's initial value for rows admitted later."""
    return slot_prefix(ev, slot) + SLOT_INITIAL_VALUE


# ---- stats fields: EvStats' output vector, in order (schema.h: EVSTORE_STATS_FIELDS) ----
STATS_FIELDS = ("size", "admitted", "filtered", "free_rows", "index_bytes", "meta_bytes",
                "row_bytes", "dirty", "deleted", "evicted", "filter_bytes", "zero_rows",
                "cache_hits", "cache_misses", "cache_rows", "disk_bytes", "cache_capacity")

# ---- key limits (schema.h: kMaxStringKeyBytes) ----
MAX_STRING_KEY_BYTES = 65535
"""The longest string key in bytes; a longer key fails its op and changes nothing."""

# ---- shard routing (schema.h: kShardRoute) ----
SHARD_ROUTE = "mix64-v1"
"""The name of the key -> shard route (native/core/shard.h), recorded with each
shard in checkpoint manifests; a chain restores shard by shard only under it."""

# ---- op inputs (schema.h: kHandle, kApplyInputs) ----
HANDLE = "handle"
KEYS_INPUT = "keys"
GRADS_INPUT = "grads"
GLOBAL_STEP_INPUT = "global_step"
APPLY_INPUTS = (HANDLE, KEYS_INPUT, GRADS_INPUT, GLOBAL_STEP_INPUT)
