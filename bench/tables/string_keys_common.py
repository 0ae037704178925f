"""Keys and batches shared by bench_string_keys.py and its TFRA peer (no TF here)."""
import numpy as np


def make_keys(n, key_bytes, seed=0):
    """n distinct byte strings of exactly key_bytes bytes: a decimal id padded
    with random letters (object array of bytes)."""
    rng = np.random.default_rng(seed)
    pad = rng.integers(97, 123, size=(n, key_bytes), dtype=np.uint8)
    out = np.empty(n, object)
    for i in range(n):
        ident = str(i).encode()
        out[i] = ident + pad[i, :key_bytes - len(ident)].tobytes()
    return out


def batch_indices(n, batch, count, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n, size=batch) for _ in range(count)]

