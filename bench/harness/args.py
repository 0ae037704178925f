"""The flags both sides of a comparison must agree on (any venv)."""


def add_size_args(ap, fill_help="keys per insert while filling"):
    """The size and sampling flags both sides of a comparison must agree on."""
    ap.add_argument("--keys", type=int, default=1_000_000, help="keys in the table (default 1M)")
    ap.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    ap.add_argument("--batch", type=int, default=65536, help="keys per batch (default 65536)")
    ap.add_argument("--batches", type=int, default=20, help="timed rounds per workload (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds before each workload (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed for batch key indices (default 0)")
    ap.add_argument("--fill-chunk", type=int, default=1 << 20, help=fill_help)


def add_stream_args(ap):
    """The stream flags both sides of the filter comparison must agree on."""
    ap.add_argument("--lookups", type=int, default=2_000_000, help="ids in the stream (default 2M)")
    ap.add_argument("--batch", type=int, default=8192, help="ids per step (default 8192)")
    ap.add_argument("--window", type=int, default=200_000, help="Zipf ranks (default 200k)")
    ap.add_argument("--shift", type=int, default=800, help="ids the window moves per step (default 800)")
    ap.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    ap.add_argument("--save-every", type=int, default=10, help="steps between saves: evict / restrict (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="stream seed (default 0)")
