"""Keras only where a process uses it (evstore/lazy_keras.py, evstore_app/tf_without_keras.py): a
process that imports TensorFlow without Keras imports evstore, checkpoint and serving_loader
without it, and Keras imported later, by any route, gets evstore's patches and layer before the
importer sees it. Each case is a fresh process: what is imported is the claim."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(code):
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split()


PATCHED = ("from evstore import keras_compat, generic\n"
           "from keras.src.optimizers import base_optimizer\n"
           "print(base_optimizer.BaseOptimizer.apply is not keras_compat.original('BaseOptimizer.apply'),\n"
           "      keras.saving.get_registered_object('evstore>Embedding') is evstore.keras.Embedding)\n")


@pytest.mark.parametrize("route", ["import keras", "tf.keras.layers", "evstore.optimizers.Adam"])
def test_keras_imported_after_a_keras_free_start_gets_evstores_patches_and_layer(route):
    out = run("import sys\n"
              "from evstore_app.tf_without_keras import import_tensorflow_without_keras\n"
              "tf = import_tensorflow_without_keras()\n"
              "import evstore, checkpoint, serving_loader\n"
              "print('keras' in sys.modules)\n"
              f"{route}\n"
              "import keras\n" + PATCHED)
    assert out == ["False", "True", "True"]


def test_a_process_importing_tensorflow_as_usual_has_evstores_patches_at_import_evstore():
    out = run("import tensorflow as tf, sys\n"
              "print('keras' in sys.modules)\n"
              "import evstore, keras\n" + PATCHED)
    assert out == ["True", "True", "True"]


def test_checkpoint_callback_is_imported_with_keras_when_first_named():
    out = run("import sys\n"
              "from evstore_app.tf_without_keras import import_tensorflow_without_keras\n"
              "import_tensorflow_without_keras()\n"
              "import checkpoint\n"
              "print('keras' in sys.modules)\n"
              "callback = checkpoint.CheckpointCallback\n"
              "import keras\n"
              "print(issubclass(callback, keras.callbacks.Callback))\n")
    assert out == ["False", "True"]


def test_the_ckpt_commands_process_never_imports_keras(tmp_path):
    out = run("import sys\n"
              "from evstore_app import cli\n"
              f"rc = cli.main(['ckpt', 'inspect', {str(tmp_path)!r}])\n"
              "print(rc, 'tensorflow' in sys.modules, 'evstore' in sys.modules, 'keras' in sys.modules)\n")
    assert out[-3:] == ["True", "True", "False"]
