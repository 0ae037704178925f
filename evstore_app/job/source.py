"""The user's data as a stream: Parquet or CSV files read with pyarrow,
joined (optional), sorted by timestamp, cut into batches. A position is the
row offset in that order; a restored job resumes from the saved position."""
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import tensorflow as tf

__all__ = ["FileStream", "column_ids", "label_values", "read_table"]

_ROW = "__evstore_row"   # read order, the tiebreak of the timestamp sort


def _names(table):
    return [c for c in table.column_names if c != _ROW]


def _read(path, fmt):
    fmt = fmt or ("parquet" if path.endswith((".parquet", ".pq")) else "csv")
    if fmt == "parquet":
        return pq.read_table(path)
    if fmt == "csv":
        return pacsv.read_csv(path)
    raise ValueError(f"spec: data.format must be 'csv' or 'parquet', got {fmt!r}")


def column_ids(col, field, where):
    """A sparse field's keys from its column, as the field's "keys" says (spec.py):
    int64 [N]; string: an object array of bytes, [N], or [N, max_ids] padded
    with b"" for a split field; hash: int64 [N]."""
    kind = field.get("keys", "int64")
    if kind == "int64":
        if not pa.types.is_integer(col.type):
            raise ValueError(f"{where}: column {field['column']!r} holds {col.type}, not integers: set \"keys\": "
                             "\"string\" (its values as string keys) or \"hash\" (hashed to int64 ids)")
        return col.to_numpy(zero_copy_only=False).astype(np.int64)
    text = pc.fill_null(col.cast(pa.string()), "")
    if kind == "hash":
        strings = tf.constant(text.to_numpy(zero_copy_only=False).astype(object))
        return tf.strings.to_hash_bucket_fast(strings, 2**62).numpy()
    binary = text.cast(pa.binary())
    if "split" not in field:
        return binary.to_numpy(zero_copy_only=False)
    # Vectorized: split every row, drop empty pieces, keep each row's first max_ids (no Python loop per row).
    n = field["max_ids"]
    lists = pc.split_pattern(binary, field["split"].encode())
    flat = pc.list_flatten(lists)
    real = pc.greater(pc.binary_length(flat), 0)
    pieces = pc.filter(flat, real).to_numpy(zero_copy_only=False)
    rows = pc.filter(pc.list_parent_indices(lists), real).to_numpy()
    first = np.searchsorted(rows, rows)          # rows is sorted: each piece's row starts at its first index
    slot = np.arange(len(rows)) - first
    keep = slot < n
    out = np.full((len(binary), n), b"", dtype=object)
    out[rows[keep], slot[keep]] = pieces[keep]
    return out


def label_values(lab, spec):
    """float32 0/1 labels from the label column's float64 values: >= the spec's
    threshold, else > 0."""
    thr = spec["label"].get("threshold")
    return ((lab >= thr) if thr is not None else (lab > 0)).astype(np.float32)


def read_table(data, spec, max_rows=None):
    """The rows of `data` (a file, or every data file of a directory) as the
    job trains them: the spec's joins applied, sorted by its timestamp column
    (read order breaking ties), the first `max_rows`. ValueError naming the
    spec field or column for a join or timestamp the data lacks."""
    d = spec.get("data", {})
    fmt = d.get("format")
    if os.path.isdir(data):
        ext = (".parquet", ".pq") if fmt == "parquet" else (".csv",) if fmt == "csv" else (".csv", ".parquet")
        joined = {j["file"] for j in d.get("join", [])}
        files = sorted(os.path.join(data, f) for f in os.listdir(data) if f.endswith(ext) and f not in joined)
        base = data
    else:
        files, base = [data], os.path.dirname(data)
    if not files:
        raise ValueError(f"no data files in {data}")
    table = pa.concat_tables([_read(f, fmt) for f in files])
    # The order is deterministic: files by name, rows as read, then a stable
    # sort by timestamp with the read order breaking ties (a join reorders
    # rows), so every run reads the same rows in the same order and a resumed
    # position means the same rows.
    table = table.append_column(_ROW, pa.array(np.arange(table.num_rows, dtype=np.int64)))
    for i, j in enumerate(d.get("join", [])):
        path = os.path.join(base, j["file"])
        right = _read(path, None)
        where = f"spec: data.join[{i}]"
        if j["on"] not in table.column_names:
            raise ValueError(f"{where}.on: column {j['on']!r} is not in the data (it has "
                             f"{_names(table)})")
        lacking = [c for c in [j["on"]] + list(j["columns"]) if c not in right.column_names]
        if lacking:
            raise ValueError(f"{where}: {path} has no column(s) {lacking} (it has {right.column_names})")
        right = right.select([j["on"]] + list(j["columns"]))
        table = table.join(right, keys=j["on"], join_type="left outer")
    ts = d.get("timestamp")
    if ts and ts not in table.column_names:
        raise ValueError(f"spec: data.timestamp: column {ts!r} is not in the data (it has {_names(table)})")
    table = table.sort_by(([(ts, "ascending")] if ts else []) + [(_ROW, "ascending")]).drop_columns([_ROW])
    if max_rows is not None:
        table = table.slice(0, max_rows)
    return table


class FileStream:
    """Batches of a data file (or every data file of a directory) in timestamp order."""

    def __init__(self, data, spec, max_rows=None):
        table = read_table(data, spec, max_rows)
        need = [f["column"] for f in spec["sparse"]] + list(spec["dense"]) + [spec["label"]["column"]]
        missing = [c for c in need if c not in table.column_names]
        if missing:
            raise ValueError(f"spec names columns {missing} that the data lacks (it has {_names(table)})")
        self.rows = table.num_rows
        self.batch_size = spec["batch_size"]
        self.cols = {f["column"]: column_ids(table[f["column"]], f, f"spec: sparse[{i}]")
                     for i, f in enumerate(spec["sparse"])}
        for c in spec["dense"]:
            self.cols[c] = pc.fill_null(table[c].cast(pa.float32()), 0.0).to_numpy(zero_copy_only=False)
        self.labels = label_values(table[spec["label"]["column"]].to_numpy(zero_copy_only=False).astype(np.float64),
                                   spec)

    def batches(self, start=0):
        """(position after the batch, (columns, labels)) from row `start` to the end."""
        for lo in range(start, self.rows, self.batch_size):
            hi = min(lo + self.batch_size, self.rows)
            yield hi, ({c: v[lo:hi] for c, v in self.cols.items()}, self.labels[lo:hi])
