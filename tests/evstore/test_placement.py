"""An EV lives on the device its creation is placed on (docs/ARCHITECTURE.md, "Ops and Python API": placement)."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ev_created_under_tf_device_lives_and_trains_there():
    # Two logical CPUs must be configured before TensorFlow initialises: a fresh interpreter.
    code = textwrap.dedent("""
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import evstore
        with tf.device("/CPU:1"):
            ev = evstore.EmbeddingVariable("placed", dim=4)
        assert ev.resource_handle.device.endswith("CPU:1"), ev.resource_handle.device
        opt = evstore.optimizers.SGD(0.5)
        ids = tf.constant([3, 4, 3], tf.int64)
        with tf.device("/CPU:0"):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(evstore.embedding_lookup(ev, ids))
            opt.apply_gradients([(tape.gradient(loss, ev), ev)])
        print("size", int(ev.size()), "freq", ev.frequency([3, 4]).numpy().tolist())
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "size 2 freq [2, 1]" in r.stdout, r.stdout
