"""Peer benchmark: TFRA 0.8.1's training path with TensorFlow's optimizers.

Run ONLY with the peer venv's python (driven by bench/tables/bench_optimizers.py):

    .peer-tfra/bin/python -m bench.peers.peer_tfra_optimizers --keys 1000000 --dim 16 --serve

The table and batches are peer_tfra.py's (a `de.keras.layers.Embedding(dim)`
filled with N keys; bench/harness/workload.py batches). Workload `apply_<opt>` is one
training step of batch i through TFRA's Keras path: Embedding lookup under a
GradientTape, loss = sum(emb), gradient, then
`de.DynamicEmbeddingOptimizer(tf_keras.optimizers.<Opt>).apply_gradients`;
it answers [apply_gradients seconds, whole step seconds]. <opt>: adam, ftrl,
adagrad, sgd, adamw, rmsprop, nadam (tf_keras' classes with their default hyper-parameters
except the learning rate). Each optimizer keeps its own slot tables.
"""
import sys

from bench.peers import peer_tfra
from bench.peers.peer_tfra import TfraPeer

OPTIMIZERS = {"adam": "Adam", "ftrl": "Ftrl", "adagrad": "Adagrad", "sgd": "SGD", "adamw": "AdamW",
              "rmsprop": "RMSprop", "nadam": "Nadam"}


class TfraOptimizerPeer(TfraPeer):
    def __init__(self, args):
        super().__init__(args)
        self.opts = {}

    def run(self, workload, i):
        if not workload.startswith("apply_"):
            return super().run(workload, i)
        name = workload[len("apply_"):]
        if name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; one of {sorted(OPTIMIZERS)}")
        if name not in self.opts:
            opt = getattr(self.tfk.optimizers, OPTIMIZERS[name])(learning_rate=1e-3)
            self.opts[name] = self.de.DynamicEmbeddingOptimizer(opt)
            self.meta[f"optimizer_{name}"] = type(opt).__module__ + "." + type(opt).__name__
        t0, t1, t2 = self.timed_step(self.opts[name], self.ex[i % self.bt.count])
        return [t2 - t1, t2 - t0]


def main():
    peer_tfra.main(__doc__, TfraOptimizerPeer, ["apply_" + o for o in OPTIMIZERS])


if __name__ == "__main__":
    sys.exit(main())
