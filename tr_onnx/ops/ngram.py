"""TfIdfVectorizer: counts of the n-grams of a pool in integer sequences (token ids), weighted.

An op of its own family: no other op reads n-grams. Not differentiable (integer input).
"""

from __future__ import annotations

import numpy as np

from ..hookspecs import hookimpl
from ..opdef import PLAIN_ONLY, OpDef


def _pool_ngrams(attrs) -> dict[tuple[int, ...], int]:
    """{n-gram: output index}: ``pool_int64s`` holds the 1-grams, then the 2-grams... each
    group starting at ``ngram_counts[n - 1]``; ``ngram_indexes`` gives the n-grams' outputs in
    pool order."""
    pool = [int(v) for v in attrs.get("pool_int64s", ())]
    starts = [int(v) for v in attrs["ngram_counts"]] + [len(pool)]
    indexes = iter(int(v) for v in attrs["ngram_indexes"])
    grams = {}
    for n, (lo, hi) in enumerate(zip(starts, starts[1:]), start=1):
        for at in range(lo, hi, n):
            grams[tuple(pool[at:at + n])] = next(indexes)
    return grams


def tfidf_vectorizer_numpy(ctx):
    """Per row, how often each pool n-gram (``min_gram_length`` <= n <= ``max_gram_length``)
    occurs with its items ``skip + 1`` apart, for every skip up to ``max_skip_count`` (1-grams
    counted once); ``TF`` the counts, ``IDF`` the weight where the count is non-zero, ``TFIDF``
    count times weight (weights default to 1)."""
    attrs = ctx.attrs
    if attrs.get("pool_strings"):
        raise ctx.error("pool_strings: string inputs are not supported")
    grams = _pool_ngrams(attrs)
    n_lo, n_hi = int(attrs["min_gram_length"]), int(attrs["max_gram_length"])
    max_skip = int(attrs["max_skip_count"])
    mode = attrs["mode"].decode() if isinstance(attrs["mode"], bytes) else attrs["mode"]
    weights = np.asarray(attrs.get("weights") or [1.0] * (max(grams.values()) + 1), np.float64)

    def counts(row: np.ndarray) -> np.ndarray:
        row = [int(v) for v in row]
        found = np.zeros(len(weights))
        for n in range(n_lo, n_hi + 1):
            for skip in range(max_skip + 1 if n > 1 else 1):
                step = skip + 1
                for start in range(len(row) - (n - 1) * step):
                    index = grams.get(tuple(row[start:start + (n - 1) * step + 1:step]))
                    if index is not None:
                        found[index] += 1
        if mode == "IDF":
            return (found > 0) * weights
        return found * weights if mode == "TFIDF" else found

    def run(ins, outs, ws):
        x, y = ins[0], outs[0]
        if x.ndim == 1:
            np.copyto(y, counts(x))
            return
        for i in range(x.shape[0]):
            np.copyto(y[i], counts(x[i]))

    return run


@hookimpl
def tr_onnx_op_definitions():
    return [OpDef("TfIdfVectorizer", (9,), {"numpy": tfidf_vectorizer_numpy}, layout=PLAIN_ONLY,
                  differentiable=False)]
