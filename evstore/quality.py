"""Model quality of a stretch of training data, by progressive validation: the one definition.

Progressive validation scores every batch with the model as it is *before*
training on that batch, so each example is held out from the model that
predicts it. A quality record summarises the examples trained since the
previous checkpoint commit (docs/ARCHITECTURE.md, "Checkpoints"):

    {"auc": 0.74, "logloss": 0.52, "examples": 40960, "label_rate": 0.31,
     "hist": {"pos": [...], "neg": [...], "loss": 21299.2}}

  auc         ROC AUC of the scores (Mann-Whitney, ties averaged); null when
              one class is missing or there are no examples
  logloss     mean binary cross-entropy of the scores (clipped to [1e-7, 1 - 1e-7]);
              null without examples
  examples    number of examples scored (an integer >= 0)
  label_rate  fraction of positive labels; null without examples

  reference   optional: the record (these fields and `hist`) of the same
              examples scored by the reference model, the model the commit
              replaces (evstore_app.job.reference: the trainer's model as of
              the last commit that ended a judged run), so a gate compares like
              with like (evstore/gate.py: `reference`, `reference.<metric>`).
              It merges with the record (`merge`) when every record has one.

  hist        optional: the mergeable form of the record. `pos` / `neg`
              count the positive / negative examples per score bin (HIST_BINS
              bins, equal in logit over [-HIST_LOGIT, HIST_LOGIT], the ends
              open), `loss` is the summed cross-entropy. Records of adjacent
              stretches merge exactly by adding them (`merge`): examples,
              label rate and log loss of any run of commits follow exactly,
              and its AUC within the binning (ties within a bin count half;
              `hist_auc` of one record is measured to agree with the exact
              AUC within 0.005 in tests/checkpoint/test_ckpt_quality.py).
              Records without it (older commits, a caller's record) do not
              merge.

Scores are probabilities of the positive class; labels are 0 / 1.

`SCHEMA` is the record's JSON schema (the checkpoint manifest embeds it),
`FIELDS` its metric names (what a gate expression may name, evstore/gate.py), `normalize` checks and converts a caller's record
(NaN -> null, numpy scalars -> Python numbers), `measure` computes one from
labels and scores, and `ProgressiveQuality` accumulates the scores of a
training loop and answers the record of everything since a position, and
`merge` joins the records of adjacent stretches into the record of all of them.
`Scored` holds scored examples not yet summarised: what each worker of a
synchronous job contributes, so that a commit's record is measured once over
every worker's examples (AUC does not average across parts).
"""
import math
import numbers
import threading
import typing

import numpy as np

__all__ = ["FIELDS", "SCHEMA", "HIST_BINS", "HIST_LOGIT", "normalize", "measure", "merge", "from_hist", "hist_auc", "auc",
           "logloss",
           "Scored", "ProgressiveQuality"]

FIELDS = ("auc", "logloss", "examples", "label_rate")
HIST_BINS = 160       # score bins of `hist`: 0.125 wide in logit
HIST_LOGIT = 10.0     # logits beyond +-10 (scores within 4.5e-5 of 0 or 1) share the end bins

_UNIT = {"oneOf": [{"type": "null"}, {"type": "number", "minimum": 0, "maximum": 1}]}
_COUNTS = {"type": "array", "minItems": HIST_BINS, "maxItems": HIST_BINS,
           "items": {"type": "integer", "minimum": 0}}
_RECORD = {
    "type": "object",
    "required": list(FIELDS),
    "additionalProperties": False,
    "properties": {
        "auc": _UNIT,
        "logloss": {"oneOf": [{"type": "null"}, {"type": "number", "minimum": 0}]},
        "examples": {"type": "integer", "minimum": 0},
        "label_rate": _UNIT,
        "hist": {"type": "object", "required": ["pos", "neg", "loss"], "additionalProperties": False,
                 "properties": {"pos": _COUNTS, "neg": _COUNTS, "loss": {"type": "number", "minimum": 0}}},
    },
}
SCHEMA = dict(_RECORD, properties=dict(_RECORD["properties"], reference=_RECORD))

_EPS = 1e-7


def auc(labels, scores):
    """ROC AUC (Mann-Whitney U, ties averaged); nan when one class is missing."""
    labels = np.asarray(labels, np.float64).reshape(-1)
    scores = np.asarray(scores, np.float64).reshape(-1)
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s))
    # average ranks of ties: each run of equal scores gets the mean of its positions
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    mean_rank = (starts + ends - 1) / 2 + 1
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def logloss(labels, scores):
    """Mean binary cross-entropy of probabilities `scores`; nan without examples."""
    y = np.asarray(labels, np.float64).reshape(-1)
    p = np.clip(np.asarray(scores, np.float64).reshape(-1), _EPS, 1 - _EPS)
    if y.size == 0:
        return float("nan")
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def measure(labels, scores, reference=None):
    """The quality record of `labels` (0 / 1) and `scores` (probabilities);
    `reference`: the reference model's scores of the same examples, measured
    into the record's `reference`."""
    y = np.asarray(labels, np.float64).reshape(-1)
    p = np.asarray(scores, np.float64).reshape(-1)
    if y.shape != p.shape:
        raise ValueError(f"labels and scores differ in length: {y.size} and {p.size}")
    out = {"auc": auc(y, p), "logloss": logloss(y, p), "examples": int(y.size),
           "label_rate": float(np.mean(y > 0.5)) if y.size else None, "hist": _hist(y, p)}
    if reference is not None:
        out["reference"] = measure(y, reference)
    return normalize(out)


def _hist(y, p):
    pc = np.clip(p, _EPS, 1 - _EPS)
    z = np.clip(np.log(pc) - np.log1p(-pc), -HIST_LOGIT, HIST_LOGIT)
    b = np.minimum(((z + HIST_LOGIT) * (HIST_BINS / (2 * HIST_LOGIT))).astype(np.int64), HIST_BINS - 1)
    pos = y > 0.5
    loss = -(y * np.log(pc) + (1 - y) * np.log(1 - pc))
    return {"pos": np.bincount(b[pos], minlength=HIST_BINS).tolist(),
            "neg": np.bincount(b[~pos], minlength=HIST_BINS).tolist(), "loss": float(loss.sum())}


def from_hist(pos, neg, loss):
    """The record (with its `hist`) of per-label histograms `pos` / `neg`
    (HIST_BINS integer counts each) and summed cross-entropy `loss`."""
    pos, neg = np.asarray(pos, np.int64), np.asarray(neg, np.int64)
    n_pos, n_neg = int(pos.sum()), int(neg.sum())
    n = n_pos + n_neg
    if n_pos and n_neg:   # Mann-Whitney over bins: a negative in a lower bin counts 1, in the same bin 1/2
        below = np.cumsum(neg) - neg
        a = float((pos * (below + 0.5 * neg)).sum() / (n_pos * n_neg))
    else:
        a = None
    return {"auc": a, "logloss": loss / n if n else None, "examples": n,
            "label_rate": n_pos / n if n else None,
            "hist": {"pos": pos.tolist(), "neg": neg.tolist(), "loss": float(loss)}}


def hist_auc(quality):
    """The AUC of a record's histogram (what `merge` computes), None without one."""
    h = quality.get("hist") if quality else None
    return None if h is None else from_hist(np.asarray(h["pos"], np.int64), np.asarray(h["neg"], np.int64),
                                           h["loss"])["auc"]


def merge(records):
    """The record of the adjacent stretches of `records` together (in any
    order), from their histograms: exact examples, label rate and log loss,
    the AUC of the bins (module docstring). None when `records` is empty or
    one of them is None or has no `hist`. The merged record has a
    `reference` when every record of some examples has one (with its `hist`)."""
    records = list(records)
    if not records or any(r is None or r.get("hist") is None for r in records):
        return None
    if len(records) == 1:
        return records[0]
    pos = np.sum([np.asarray(r["hist"]["pos"], np.int64) for r in records], axis=0)
    neg = np.sum([np.asarray(r["hist"]["neg"], np.int64) for r in records], axis=0)
    out = from_hist(pos, neg, sum(float(r["hist"]["loss"]) for r in records))
    ref = merge([r.get("reference") for r in records if r["examples"]])   # an empty record has none to give
    if ref is not None:
        out["reference"] = ref
    return out


def normalize(quality):
    """Checks a quality record and returns it as plain JSON values (NaN -> None).

    Raises:
      TypeError: `quality` is not a mapping, or a field has the wrong type.
      ValueError: missing or unknown fields, or a value out of its range.
    """
    if not hasattr(quality, "keys"):
        raise TypeError(f"quality must be a dict with fields {list(FIELDS)}, got {type(quality).__name__}")
    return _normalize(quality, nested=False)


def _normalize(quality, nested):
    where = "quality['reference']" if nested else "quality"
    if not hasattr(quality, "keys"):
        raise TypeError(f"{where} must be a dict with fields {list(FIELDS)}, got {type(quality).__name__}")
    optional = {"hist"} if nested else {"hist", "reference"}
    missing = [f for f in FIELDS if f not in quality]
    unknown = sorted(set(quality) - set(FIELDS) - optional)
    if missing or unknown:
        raise ValueError(f"{where} must have exactly the fields {list(FIELDS)} (and optionally "
                         f"{', '.join(repr(f) for f in sorted(optional))}); missing {missing}, unknown {unknown}")
    out = {}
    for f in FIELDS:
        v = quality[f]
        if f == "examples":
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise TypeError(f"quality['examples'] must be an integer >= 0, got {v!r}")
            out[f] = int(v)
            continue
        if v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isnan(v)):
            out[f] = None
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"quality[{f!r}] must be a number or None, got {v!r}")
        v = float(v)
        high = math.inf if f == "logloss" else 1.0
        if not 0.0 <= v <= high:
            raise ValueError(f"quality[{f!r}] = {v} is outside [0, {high}]")
        out[f] = v
    if quality.get("hist") is not None:
        out["hist"] = _normalize_hist(quality["hist"], out["examples"])
    if quality.get("reference") is not None:
        out["reference"] = _normalize(quality["reference"], nested=True)
        if out["reference"]["examples"] != out["examples"]:
            raise ValueError(f"quality['reference'] covers {out['reference']['examples']} examples, the record "
                             f"{out['examples']}: a reference scores the same examples")
    return out


def _normalize_hist(h, examples):
    if not hasattr(h, "keys") or set(h) != {"pos", "neg", "loss"}:
        raise ValueError("quality['hist'] must be a dict with exactly the fields ['pos', 'neg', 'loss']")
    out = {}
    for f in ("pos", "neg"):
        c = np.asarray(h[f])
        if c.shape != (HIST_BINS,) or c.dtype.kind not in "iu" or (c < 0).any():
            raise ValueError(f"quality['hist'][{f!r}] must be {HIST_BINS} integers >= 0")
        out[f] = [int(v) for v in c]
    loss = h["loss"]
    if isinstance(loss, bool) or not isinstance(loss, numbers.Real) or not 0.0 <= float(loss) < math.inf:
        raise ValueError(f"quality['hist']['loss'] must be a finite number >= 0, got {loss!r}")
    out["loss"] = float(loss)
    if isinstance(examples, numbers.Integral) and sum(out["pos"]) + sum(out["neg"]) != examples:
        raise ValueError(f"quality['hist'] counts {sum(out['pos']) + sum(out['neg'])} examples, the record "
                         f"{examples}")
    return out


class Scored(typing.NamedTuple):
    """Examples scored before training, not yet summarised: `labels` (0 / 1)
    and `scores` (probabilities), float64 vectors of one length, and
    optionally `reference`, the reference model's scores of them. `concat`
    joins parts (one per worker); `measure()` is their quality record."""

    labels: np.ndarray
    scores: np.ndarray
    reference: typing.Optional[np.ndarray] = None

    @classmethod
    def of(cls, labels, scores, reference=None):
        """Checked and converted to float64 vectors.

        Raises:
          ValueError: labels and scores (or reference) differ in length.
        """
        y = np.asarray(labels, np.float64).reshape(-1)
        p = np.asarray(scores, np.float64).reshape(-1)
        if y.shape != p.shape:
            raise ValueError(f"labels and scores differ in length: {y.size} and {p.size}")
        if reference is not None:
            reference = np.asarray(reference, np.float64).reshape(-1)
            if reference.shape != y.shape:
                raise ValueError(f"labels and reference scores differ in length: {y.size} and {reference.size}")
        return cls(y, p, reference)

    @classmethod
    def concat(cls, parts):
        """The parts together; with `reference` only when every part has one."""
        parts = list(parts)
        if not parts:
            return cls(np.zeros(0), np.zeros(0))
        ref = (np.concatenate([q.reference for q in parts]) if all(q.reference is not None for q in parts)
               else None)
        return cls(np.concatenate([q.labels for q in parts]), np.concatenate([q.scores for q in parts]), ref)

    def measure(self):
        return measure(self.labels, self.scores, reference=self.reference)


class ProgressiveQuality:
    """Accumulates a training loop's progressive scores, keyed by a
    monotone position (the examples trained so far, say), and answers the
    quality record of the batches after a position.

        pq.record(position_after_batch, labels, scores)   # scores from before training
        pq.since(last_committed_position)                 # the record a commit carries

    `record(..., reference=...)` adds the reference model's scores of the
    batch; a record has a `reference` when every batch it covers had one.

    `since(p)` also forgets the batches at or before `p` (they belong to a
    commit already). Thread-safe: a checkpoint schedule calls `since` from
    its own thread.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._batches = []   # (position, Scored)

    def record(self, position, labels, scores, reference=None):
        q = Scored.of(labels, scores, reference)
        with self._lock:
            self._batches.append((position, q))

    def scored_since(self, position):
        """The examples recorded after `position` (None: all of them), as
        `Scored`; forgets those at or before it."""
        with self._lock:
            if position is not None:
                self._batches = [b for b in self._batches if b[0] > position]
            return Scored.concat(b[1] for b in self._batches)

    def since(self, position):
        """The quality record of the batches recorded after `position`
        (None: all of them)."""
        return self.scored_since(position).measure()
