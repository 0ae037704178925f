"""`model.export()` (Keras's serving export) refuses models holding evstore tables.

Keras's export traces the model's call into a SavedModel. For an
`evstore.keras.Embedding` that graph would hold evstore's own ops and table
resources: TensorFlow Serving and any process without evstore cannot load
it, and no checkpoint written after the export would ever reach it. evstore's
serving export is `serving_loader.export_serving_model(model, export_dir)`
(stock TensorFlow ops only, hot-applied checkpoints under `evstore serve`),
which lives in a package above this one; so `keras.Model.export` is wrapped
(by evstore/keras_compat.py) to refuse, naming the layers and that function,
before anything is written.
Models without an evstore layer export as Keras does.
"""
from evstore import keras_compat

__all__ = ["refusal", "refusing_export", "HOOKS"]


def refusal(model):
    """The error message `model.export()` raises for `model`, or None when it
    holds no evstore table layer."""
    names = [layer.name for layer in model._flatten_layers(include_self=False)
             if getattr(layer, "_evstore_table_layer", False)]
    if not names:
        return None
    return (f"model.export() cannot export the evstore table layer(s) {names}: the exported graph would hold "
            "evstore's own ops (TensorFlow Serving and processes without evstore cannot load it) and no later "
            "checkpoint would reach it. Export with serving_loader.export_serving_model(model, export_dir): a "
            "SavedModel of stock TensorFlow ops that `evstore serve` keeps up to date with every checkpoint")


def refusing_export(own):
    """`keras.Model.export` refusing models with evstore tables, calling Keras's
    `own` for the others (set by evstore/keras_compat.py)."""
    def export(self, filepath, *args, **kwargs):
        message = refusal(self)
        if message is not None:
            raise ValueError(message)
        return own(self, filepath, *args, **kwargs)

    export.__doc__ = own.__doc__
    return export


HOOKS = {"Model.export": refusing_export}   # set by evstore/keras_compat.py, below
keras_compat.install(HOOKS)
