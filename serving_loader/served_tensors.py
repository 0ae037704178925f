"""What a serving replica reads of a checkpoint, and how it becomes served rows.

A replica serves keys, rows, and the keys to drop (a delta's deleted keys),
plus the export's dense weights. It reads the rows from the commit's serving
view when there is one (checkpoint/serving_view.py) and the replica uses
views, else the float32 `<ev>-values`. Nothing else of the checkpoint is
named, so nothing else is read (checkpoint/fetch.py): not the versions or
optimizer slots of EVs (nor their frequencies, except for an evstore serving
table, whose tier's cache policy weighs them), not the dense optimizer state,
and not the counted-not-admitted keys (they read the default value, as absent
keys do): a full replaces the served rows whole, and a delta whose manifest
says `deleted_complete` lists every key that lost its row among its deleted
keys. Only a delta without it (an older writer's, also a synchronous job's of
before) has its filtered keys read and erased, since a key evicted and counted again
within it is only there.
"""
import dataclasses

import numpy as np

from checkpoint.manifest import BUNDLE_PREFIX
from checkpoint.serving_view import VIEW_PREFIX, codec, view_tensors
from evstore import schema

__all__ = ["Plan", "plan"]


@dataclasses.dataclass
class Plan:
    tensors: dict   # {bundle prefix: [tensor names]}: the argument of checkpoint.fetch
    parts: dict     # {served EV: [checkpoint entry names (a sharded EV's parts)]}
    kind: str       # "full" or "delta"
    view: str       # "float32" or the view's dtype
    deleted_complete: bool = False   # the delta's deleted keys list every key that lost its row

    def ev_arrays(self, t, name, dim):
        """(keys, float32 rows [N, dim], keys to erase) of served EV `name`
        from Fetched `t`. Raises ValueError when the view does not match the
        keys (a corrupt commit)."""
        keys, values, erase = [], [], []
        for p in self.parts[name]:
            k = t[schema.tensor(p, schema.KEYS)]
            if self.view == "float32":
                v = t[schema.tensor(p, schema.VALUES)]
            else:
                c = codec(self.view)
                v = c.decode({s: t[VIEW_PREFIX, schema.tensor(p, s)] for s in c.suffixes()}, dim)
                if len(v) != len(k):
                    raise ValueError(f"the serving view holds {len(v)} rows of {p!r} for {len(k)} keys")
            keys.append(k)
            values.append(v)
            erase += [t[n] for n in _erase_tensors(self.kind, self.deleted_complete, p)]
        if not erase:   # a full: the served rows are replaced whole
            erase = [keys[0][:0]]
        return np.concatenate(keys), np.concatenate(values), np.concatenate(erase)

    def ev_freqs(self, t, name):
        """The training frequencies of `ev_arrays`' keys (read only for the EVs
        `plan` was asked `freqs` of)."""
        return np.concatenate([t[schema.tensor(p, schema.FREQS)] for p in self.parts[name]])


def plan(manifest, parts, dense, use_view=True, freqs=()):
    """The Plan for checkpoint `manifest`: served EVs `parts` ({name: entry
    names}), dense weights `dense` (names); `use_view`: read the serving view
    when the commit has one; `freqs`: served EVs whose keys' frequencies are
    read too (an evstore serving table weighs them in its cache policy)."""
    view = (manifest.serving_view or {}).get("dtype") if use_view else None
    main, extra = [], []
    for name, entries in parts.items():
        for p in entries:
            main += [schema.tensor(p, schema.KEYS)] + _erase_tensors(manifest.kind, manifest.deleted_complete, p)
            if name in freqs:
                main.append(schema.tensor(p, schema.FREQS))
            if view:
                extra += view_tensors(view, p)
            else:
                main.append(schema.tensor(p, schema.VALUES))
    tensors = {BUNDLE_PREFIX: main + list(dense)}
    if view:
        tensors[VIEW_PREFIX] = extra
    return Plan(tensors, parts, manifest.kind, view or "float32", manifest.deleted_complete)


def _erase_tensors(kind, deleted_complete, p):
    """The tensors of entry `p` holding keys a replica erases from its served rows."""
    if kind == "full":
        return []
    if deleted_complete:
        return [schema.tensor(p, schema.DELETED_KEYS)]
    return [schema.tensor(p, schema.DELETED_KEYS), schema.tensor(p, schema.KEYS_FILTERED)]
