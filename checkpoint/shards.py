"""Sharded EVs in checkpoints: where each shard's bundle is written, and which
saved tensors each shard restores from.

Saving. A sharded EV `<name>` of N shards is N EVs `<name>/part_<i>` in the
checkpoint, each with a manifest entry carrying
`"shard": {"ev": <name>, "index": i, "count": N, "route": "mix64-v1"}`.
EVs are grouped by the task that holds them (job, replica, task of the
resource's device). With one group (everything in this process) the bundle
is written as always. Otherwise each group's bundle `ckpt_part<k>` is
streamed by the native writer running *on that task* (a parameter server
writes its own shards: no row crosses the network), the dense tensors and the
global step go to a bundle written here, and TensorFlow's MergeV2Checkpoints
joins them into one `ckpt` bundle (it merges the small index files and
renames the data files; the data is not copied). The checkpoint is then one
ordinary TensorFlow bundle: `tf.train.load_checkpoint` reads every tensor.
That is on a local root, which every task must see at the same path (one
machine, or a shared filesystem). On any other root (an object store) each
task writes its part on its own host and uploads it, and the chief merges the
part indexes instead (checkpoint/remote_parts.py).

Restoring. Saved entries are matched to the model by logical name (the EV,
not the part). Shard j of an M-shard EV restores
  - from `<name>/part_j` alone when the checkpoint has M parts of the same
    route (the common case: same layout);
  - otherwise from every saved part (or the unsharded `<name>`), keeping only
    the keys routed to j (EvLoadBundle's shard filter runs on the shard's
    task, streaming): N shards restore into M, and sharded into unsharded.
"""
import tensorflow as tf

from evstore.schema import SHARD_ROUTE

__all__ = ["logical_name", "logical_entries", "load_plan", "load_units", "device_groups"]


def logical_name(name, entry):
    """The EV a manifest entry belongs to: its `shard.ev`, else its own name."""
    shard = entry.get("shard") if isinstance(entry, dict) else None
    return shard["ev"] if shard else name


def logical_entries(manifest):
    """{logical EV name: [entry names]} of a manifest (parts in index order)."""
    out = {}
    for name, e in manifest.evs.items():
        out.setdefault(logical_name(name, e), []).append(name)
    for names in out.values():
        names.sort(key=lambda n: (manifest.evs[n].get("shard") or {}).get("index", 0))
    return out


def load_plan(manifest, target, target_shard=None):
    """[(entry name, shard_index, num_shards)] to load into EV `target`.

    `target_shard`: the target's shard info ({"ev", "index", "count",
    "route"}) or None for an unsharded EV. num_shards 1 loads every key.
    """
    logical = target_shard["ev"] if target_shard else target
    names = logical_entries(manifest).get(logical, [])
    if not target_shard:
        return [(n, 0, 1) for n in names]
    j, m = target_shard["index"], target_shard["count"]
    same = [n for n in names
            if (manifest.evs[n].get("shard") or {}).get("count") == m
            and manifest.evs[n]["shard"].get("route") == SHARD_ROUTE
            and manifest.evs[n]["shard"]["index"] == j]
    if len(same) == 1 and all((manifest.evs[n].get("shard") or {}).get("count") == m for n in names):
        return [(same[0], 0, 1)]
    return [(n, j, m) for n in names]


def load_units(manifest, names, shard_info, place):
    """[(entry name, [(target EV, shard_index)], num_shards)]: the loads that bring EVs `names` (in
    order; `shard_info`: {name: shard info} of the sharded ones) their entries of `manifest`. An entry of
    another shard count (num_shards > 1) is loaded once into every shard of its EV that `place(name)`
    puts in one place (a device and a table kind), each key to its shard: a process holding k shards
    reads each part once, not k times. Every other entry is loaded into its one EV."""
    units, merged = [], {}
    for name in names:
        for src, j, n in load_plan(manifest, name, shard_info.get(name)):
            if n == 1:
                units.append((src, [(name, j)], n))
                continue
            key = (shard_info[name]["ev"], place(name), src, n)
            if key not in merged:
                merged[key] = (src, [], n)
                units.append(merged[key])
            merged[key][1].append((name, j))
    return units


def _task_of(device):
    if not device:
        return ""
    spec = tf.DeviceSpec.from_string(device)
    return f"/job:{spec.job}/replica:{spec.replica or 0}/task:{spec.task or 0}" if spec.job else ""


def device_groups(evs):
    """{task ("" = this process): [names]} of `evs` {name: EV}, in first-seen order."""
    here = _task_of(tf.constant(0).device) if tf.executing_eagerly() else ""
    groups = {}
    for name, ev in evs.items():
        task = _task_of(ev.device)
        groups.setdefault("" if task == here else task, []).append(name)
    return groups
