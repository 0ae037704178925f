"""What a CheckpointManager saves: the EVs and dense variables reachable from
a Keras model, a tf.Module, an optimizer, or a list / dict of those.

Names are the checkpoint's tensor names, so they must be stable across
processes and unique: an EV is saved under `ev.name`, a Keras variable under
its `path` ("dense/kernel"), an optimizer's variables as "optimizer/<name>"
("optimizer/iteration"; Keras numbers optimizer names per process), a
tf.Variable under its name without ":0". A dict {name: variable_or_ev} names
things explicitly (a dict value that is an optimizer is saved as
"<key>/<variable>").

A ShardedEmbeddingVariable `<name>` of N shards is saved as N EVs
`<name>/part_<i>`, each with `shard_info` {"ev": name, "index": i, "count": N,
"route": SHARD_ROUTE} recorded in the manifest (checkpoint/shards.py restores
them into any number of shards).
"""
import tensorflow as tf

from evstore.collective import CollectiveEmbeddingVariable, owner_of
from evstore.lazy_keras import isinstance_of
from evstore.schema import SHARD_ROUTE
from evstore.variable import EmbeddingVariable, ev_for_variable

__all__ = ["Collected", "collect"]


class Collected:
    def __init__(self):
        self.evs = {}        # name -> unsharded EmbeddingVariable (a sharded EV's shards: "<name>/part_<i>")
        self.shard_info = {}  # shard's name -> {"ev", "index", "count", "route"}
        self.sharded = {}    # name -> ShardedEmbeddingVariable
        self.dense = {}      # name -> tf.Variable or keras.Variable
        self.optimizers = []
        self._seen = set()

    def add_sharded(self, sev, name=None):
        if id(sev) in self._seen:
            return
        self._seen.add(id(sev))
        name = name or sev.name
        self._check_new(name, sev)
        self.sharded[name] = sev
        for i, ev in enumerate(sev.shards):
            part = f"{name}/part_{i}"
            self._seen.add(id(ev))
            self._check_new(part, ev)
            self.evs[part] = ev
            self.shard_info[part] = {"ev": name, "index": i, "count": sev.num_shards, "route": SHARD_ROUTE}

    def add_collective(self, cev, name=None):
        """A CollectiveEmbeddingVariable: its local shard, saved as the part
        of this worker (`<name>/part_<rank>` of `num_workers`)."""
        if id(cev) in self._seen:
            return
        self._seen.add(id(cev))
        name = name or cev.name
        self._check_new(name, cev)
        self.sharded[name] = cev
        part = f"{name}/part_{cev.rank}"
        self._seen.add(id(cev.local))
        self._check_new(part, cev.local)
        self.evs[part] = cev.local
        self.shard_info[part] = dict(cev.shard_info, ev=name)

    def logical_evs(self):
        """{name: EV or ShardedEmbeddingVariable}: what a model calls its tables."""
        out = {}
        for n, ev in self.evs.items():   # in the order they were found
            info = self.shard_info.get(n)
            if info is None:
                out[n] = ev
            elif info["ev"] not in out:
                out[info["ev"]] = self.sharded[info["ev"]]
        return out

    def add_ev(self, ev, name=None):
        if isinstance(ev, CollectiveEmbeddingVariable):
            self.add_collective(ev, name)
            return
        if ev.sharded:
            self.add_sharded(ev, name)
            return
        if id(ev) in self._seen:
            return
        if ev.owner is not None:   # a shard found on its own is saved with its siblings
            self.add_sharded(ev.owner)
            return
        owner = owner_of(ev)
        if owner is not None:
            self.add_collective(owner)
            return
        self._seen.add(id(ev))
        name = name or ev.name
        self._check_new(name, ev)
        self.evs[name] = ev

    def add_dense(self, v, name=None):
        if id(v) in self._seen:
            return
        ev = ev_for_variable(v)
        if ev is not None:  # an EV's proxy weight: the EV is what holds the state
            self._seen.add(id(v))
            self.add_ev(ev)
            return
        self._seen.add(id(v))
        if v.shape.num_elements() == 0:
            # Nothing to save: e.g. an optimizer's slots of an EV proxy, whose
            # number depends on the shard count, which a restore may change.
            return
        if name is None:
            name = getattr(v, "path", None) if isinstance_of(v, "Variable") else v.name.split(":")[0]
        self._check_new(name, v)
        self.dense[name] = v

    def _check_new(self, name, obj):
        if not name or name == "global_step":
            raise ValueError(f"cannot checkpoint {obj!r} under the name {name!r}: pass a dict {{name: variable}}")
        if name in self.evs or name in self.dense or name in self.sharded:
            raise ValueError(f"two different objects would be saved under the name {name!r}; pass a dict "
                             "{name: variable} to name them explicitly")
        for other in list(self.evs):
            if name.startswith(other + "/") or other.startswith(name + "/"):
                raise ValueError(f"checkpoint names {name!r} and {other!r} would collide (an EV's slot "
                                 "tensors are named '<ev>/<slot>-values'); rename one")


def _is_keras_optimizer(obj):
    return isinstance_of(obj, "optimizers.Optimizer")


def _walk(obj, out, name=None):
    if isinstance(obj, CollectiveEmbeddingVariable):
        out.add_collective(obj, name)
    elif isinstance(obj, EmbeddingVariable):
        out.add_ev(obj, name)
    elif isinstance(obj, tf.Variable) or isinstance_of(obj, "Variable"):
        out.add_dense(obj, name)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            named = (isinstance(v, (EmbeddingVariable, tf.Variable)) or isinstance_of(v, "Variable")
                     or _is_keras_optimizer(v))
            _walk(v, out, k if named else None)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, out)
    elif _is_keras_optimizer(obj):
        out.optimizers.append(obj)
        # Keras names optimizers per process ("adam", "adam_1", ...): save their
        # variables as "optimizer/<variable>" so another process finds them.
        for v in obj.variables:
            path = getattr(v, "path", v.name)
            local = path[len(obj.name) + 1:] if path.startswith(obj.name + "/") else path
            out.add_dense(v, f"{name or 'optimizer'}/{local}")
    elif isinstance_of(obj, "layers.Layer"):
        for layer in obj._flatten_layers(include_self=True):
            ev = getattr(layer, "ev", None)
            if isinstance(ev, EmbeddingVariable):
                out.add_ev(ev)
        for v in obj.variables:
            out.add_dense(v)
        opt = getattr(obj, "optimizer", None)
        if _is_keras_optimizer(opt):
            if not opt.built:
                # Slots must exist before a restore can fill them, and a save
                # and a restore must see the same variables.
                opt.build(obj.trainable_variables)
            _walk(opt, out)
    elif isinstance(obj, tf.Module):
        for ev in obj._flatten(predicate=lambda x: isinstance(x, EmbeddingVariable),
                               expand_composites=False):
            _walk(ev, out)
        for v in obj.variables:
            out.add_dense(v)
    else:
        raise TypeError(f"cannot checkpoint {type(obj).__name__}: pass a Keras model, a tf.Module, an optimizer, "
                        "EmbeddingVariables and variables, or a list / dict of them")


def collect(obj):
    """A Collected with every EV and dense variable reachable from `obj`."""
    out = Collected()
    _walk(obj, out)
    return out
