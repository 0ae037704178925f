"""The flags both sides of a comparison must agree on (any venv), and the
table-driven numeric flags every driver and the soak use."""


def add_numbers(ap, specs):
    """Numeric flags from (flag, default, help) triples: the flag's type is its
    default's (int or float), and its help ends with "(default <value>)"."""
    for flag, default, text in specs:
        shown = f"{default:,}" if isinstance(default, int) else f"{default:g}"
        ap.add_argument(flag, type=type(default), default=default, help=f"{text} (default {shown})")


def add_size_args(ap, fill_help="keys per insert while filling"):
    """The size and sampling flags both sides of a comparison must agree on."""
    add_numbers(ap, (("--keys", 1_000_000, "keys in the table"),
                     ("--dim", 16, "embedding dim"),
                     ("--batch", 65536, "keys per batch"),
                     ("--batches", 20, "timed rounds per workload"),
                     ("--warmup", 2, "untimed rounds before each workload"),
                     ("--seed", 0, "RNG seed for batch key indices"),
                     ("--fill-chunk", 1 << 20, fill_help)))


def add_stream_args(ap):
    """The stream flags both sides of the filter comparison must agree on."""
    add_numbers(ap, (("--lookups", 2_000_000, "ids in the stream"),
                     ("--batch", 8192, "ids per step"),
                     ("--window", 200_000, "Zipf ranks"),
                     ("--shift", 800, "ids the window moves per step"),
                     ("--dim", 16, "embedding dim"),
                     ("--save-every", 10, "steps between saves: evict / restrict"),
                     ("--seed", 0, "stream seed")))
