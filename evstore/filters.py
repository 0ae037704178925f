"""Feature admission filters: which keys earn a row."""

__all__ = ["CounterFilter"]


class CounterFilter:
    """Admit a key once it has been seen `min_freq` times (exact counts).

    A key below `min_freq` reads the EV's default value, owns no row (only an
    index entry holding its count) and ignores gradients. The training lookup
    that brings its count to `min_freq` admits it: every occurrence of the key
    in that batch reads its fresh initial row. Counts include every occurrence
    in a batch (`[1, 1, 2]` adds 2 to key 1).

    Raises:
      ValueError: `min_freq` is not an int >= 1.
    """

    def __init__(self, min_freq):
        if isinstance(min_freq, bool) or not isinstance(min_freq, int) or min_freq < 1:
            raise ValueError(f"CounterFilter: min_freq must be an int >= 1, got {min_freq!r}")
        self.min_freq = min_freq

    def __repr__(self):
        return f"CounterFilter(min_freq={self.min_freq})"
