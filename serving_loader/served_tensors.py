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
from checkpoint.serving_view import SCALE, VIEW_PREFIX, codec, view_tensors
from evstore import schema

__all__ = ["Plan", "plan", "ViewRows"]


@dataclasses.dataclass
class ViewRows:
    """Rows in a serving view's precision, not decoded: `codes` [N, dim] in
    the view's dtype and, for int8, `scales` [N] float32 (checkpoint/serving_view.py).
    An evstore serving table in that precision stores them as they are."""
    view: str
    codes: np.ndarray
    scales: np.ndarray = None

    def __len__(self):
        return len(self.codes)

    @property
    def shape(self):
        return self.codes.shape

    def __getitem__(self, index):
        return ViewRows(self.view, self.codes[index], None if self.scales is None else self.scales[index])


@dataclasses.dataclass
class Plan:
    tensors: dict   # {bundle prefix: [tensor names]}: the argument of checkpoint.fetch
    parts: dict     # {served EV: [checkpoint entry names (a sharded EV's parts)]}
    kind: str       # "full" or "delta"
    view: str       # "float32" or the view's dtype
    deleted_complete: bool = False   # the delta's deleted keys list every key that lost its row

    def ev_arrays(self, t, name, dim, decode=True):
        """(keys, rows, keys to erase) of served EV `name` from Fetched `t`:
        rows float32 [N, dim], or with a view and `decode=False` the view's
        ViewRows as stored. Raises ValueError when the view does not match the
        keys (a corrupt commit)."""
        keys, values, erase = [], [], []
        for p in self.parts[name]:
            k = t[schema.tensor(p, schema.KEYS)]
            if self.view == "float32":
                v = t[schema.tensor(p, schema.VALUES)]
            else:
                c = codec(self.view)
                tensors = {s: t[VIEW_PREFIX, schema.tensor(p, s)] for s in c.suffixes()}
                v = c.decode(tensors, dim)   # checks the view's dtypes and shapes
                if len(v) != len(k):
                    raise ValueError(f"the serving view holds {len(v)} rows of {p!r} for {len(k)} keys")
                if not decode:
                    v = ViewRows(self.view, tensors[schema.VALUES], tensors.get(SCALE))
            keys.append(k)
            values.append(v)
            erase += [t[n] for n in _erase_tensors(self.kind, self.deleted_complete, p)]
        if not erase:   # a full: the served rows are replaced whole
            erase = [keys[0][:0]]
        if values and isinstance(values[0], ViewRows):
            rows = ViewRows(self.view, np.concatenate([v.codes for v in values]),
                            np.concatenate([v.scales for v in values]) if values[0].scales is not None else None)
        else:
            rows = np.concatenate(values)
        return np.concatenate(keys), rows, np.concatenate(erase)

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
