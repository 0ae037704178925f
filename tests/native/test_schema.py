"""The schema is defined once (evstore/native/core/schema.h) and mirrored in
Python (evstore/schema.py): these tests read the header and check the mirror,
the registered ops and the running kernels against it."""
import re
from pathlib import Path

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

import checkpoint
import evstore
from evstore import schema
from evstore._ops import gen

HEADER = (Path(__file__).resolve().parents[2] / "evstore" / "native" / "core" / "schema.h").read_text()


def _header_string(name):
    m = re.search(r'inline constexpr const char\* %s = "([^"]*)";' % name, HEADER)
    assert m, f"schema.h defines no {name}"
    return m.group(1)


def _header_stats_fields():
    body = HEADER[HEADER.index("#define EVSTORE_STATS_FIELDS(X)"):]
    body = body[:body.index("\n\n")]
    return tuple(re.findall(r"X\((\w+),", body))


TF_DIR = Path(__file__).resolve().parents[2] / "evstore" / "native" / "tf"
REGISTERED = sorted({m for f in TF_DIR.glob("*_ops.cc") for m in re.findall(r'REGISTER_OP\("(\w+)"\)', f.read_text())})


def _op_inputs(op_name):
    op = op_def_registry.get(op_name)
    assert op is not None, f"no op {op_name} registered"
    return [a.name for a in op.input_arg]


def test_checkpoint_tensor_names_match_the_header():
    pairs = {"kKeys": schema.KEYS, "kValues": schema.VALUES, "kVersions": schema.VERSIONS, "kFreqs": schema.FREQS,
             "kKeysFiltered": schema.KEYS_FILTERED, "kFreqsFiltered": schema.FREQS_FILTERED,
             "kDeletedKeys": schema.DELETED_KEYS, "kSeenFiltered": schema.SEEN_FILTERED, "kClock": schema.CLOCK,
             "kBloomGeometry": schema.BLOOM_GEOMETRY, "kBloomBlocks": schema.BLOOM_BLOCKS,
             "kBloomCounters": schema.BLOOM_COUNTERS, "kSlots": schema.SLOTS, "kSlotNames": schema.SLOT_NAMES,
             "kSlotSeparator": schema.SLOT_SEPARATOR, "kSlotValues": schema.SLOT_VALUES,
             "kSlotInitialValue": schema.SLOT_INITIAL_VALUE, "kSlotInitialValues": schema.SLOT_INITIAL_VALUES}
    for cname, pyvalue in pairs.items():
        assert _header_string(cname) == pyvalue, cname
    assert schema.slot_tensor("user", "m") == "user/m-values"
    assert schema.slot_initial_value_tensor("user", "m") == "user/m-initial_value"


def test_stats_fields_match_the_header_and_the_op():
    assert schema.STATS_FIELDS == _header_stats_fields()
    ev = evstore.EmbeddingVariable("schema_stats", 2)
    raw = gen.ev_stats(ev.resource_handle, key_dtype=tf.int64).numpy()
    assert raw.shape == (len(schema.STATS_FIELDS),)
    assert set(ev.stats()) == set(schema.STATS_FIELDS) | {"bytes"}


def test_every_fused_apply_takes_the_apply_inputs_first():
    assert schema.APPLY_INPUTS == tuple(_header_string(n) for n in
                                        ("kHandle", "kKeysInput", "kGradsInput", "kGlobalStepInput"))
    applies = [name for name in REGISTERED if name.startswith("EvApply")]
    assert len(applies) >= 8
    for name in applies:
        assert tuple(_op_inputs(name)[:4]) == schema.APPLY_INPUTS, name


def _bundle_tensors(root):
    """{tensor name: reader} over every bundle written under root."""
    out = {}
    for index in Path(root).rglob("*.index"):
        reader = tf.train.load_checkpoint(str(index)[:-len(".index")])
        out.update({n: reader for n in reader.get_variable_to_shape_map()})
    return out


def test_saved_bundles_hold_exactly_the_schema_tensor_names(tmp_path):
    ev = evstore.EmbeddingVariable("schema_ev", 2)
    opt = evstore.optimizers.Adam(0.1)

    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(evstore.embedding_lookup(ev, tf.constant(ids, tf.int64)))
        opt.apply_gradients([(tape.gradient(loss, ev), ev)])

    step([1, 2])
    mgr = checkpoint.CheckpointManager(str(tmp_path / "full"), [ev, opt])
    mgr.save_full()
    full = _bundle_tensors(tmp_path / "full")
    want = {schema.tensor("schema_ev", s) for s in schema.EV_TENSORS}
    want |= {f("schema_ev", s) for s in ("m", "v") for f in (schema.slot_tensor, schema.slot_initial_value_tensor)}
    assert {n for n in full if n.startswith("schema_ev")} == want
    keys = schema.tensor("schema_ev", schema.KEYS)
    assert sorted(full[keys].get_tensor(keys).tolist()) == [1, 2]
    ev.remove(tf.constant([2], tf.int64))
    mgr.save_delta()
    delta = {n for n in _bundle_tensors(tmp_path / "full") if n.startswith("schema_ev")}
    assert delta == want | {schema.tensor("schema_ev", schema.DELETED_KEYS)}


def test_the_string_key_limit_matches_the_header():
    m = re.search(r"inline constexpr int kMaxStringKeyBytes = (\d+);", HEADER)
    assert m and int(m.group(1)) == schema.MAX_STRING_KEY_BYTES == evstore.MAX_STRING_KEY_BYTES


def test_the_shard_route_name_matches_the_header():
    assert _header_string("kShardRoute") == schema.SHARD_ROUTE
