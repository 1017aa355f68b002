"""ai.onnx.ml TreeEnsemble (opset 5): decision trees over feature rows, their leaves' weights
aggregated per target.

Inference only: a tree's output is piecewise constant in its input, so nothing here has a
gradient. The trees are walked per row in Python at run time (the node suite's sizes).
"""

from __future__ import annotations

import operator

import numpy as np
from onnx import TensorProto, numpy_helper

from ..hookspecs import hookimpl
from ..opdef import PLAIN_ONLY, OpDef

# nodes_modes: BRANCH_LEQ, LT, GTE, GT, EQ, NEQ, then 6 = MEMBER (a set of values)
_COMPARE = (operator.le, operator.lt, operator.ge, operator.gt, operator.eq, operator.ne)
_MEMBER = 6
_AGGREGATE = {0: "average", 1: "sum", 2: "min", 3: "max"}


def _array(value) -> np.ndarray:
    return numpy_helper.to_array(value) if isinstance(value, TensorProto) else np.asarray(value)


def tree_ensemble_numpy(ctx):
    """Each root's walk ends at a leaf (a weight and a target); per row and target the leaves
    are summed, averaged over the trees, or reduced by min / max. A NaN feature follows the
    true branch where ``nodes_missing_value_tracks_true`` says so."""
    a = ctx.attrs
    if int(a.get("post_transform", 0)) != 0:
        raise ctx.error("post_transform other than NONE is not implemented")
    aggregate = _AGGREGATE[int(a.get("aggregate_function", 1))]
    modes = _array(a["nodes_modes"]).astype(int)
    splits = _array(a["nodes_splits"]).astype(np.float64)
    features = [int(v) for v in a["nodes_featureids"]]
    true_ids, false_ids = list(a["nodes_truenodeids"]), list(a["nodes_falsenodeids"])
    true_leaf, false_leaf = list(a["nodes_trueleafs"]), list(a["nodes_falseleafs"])
    missing_true = list(a.get("nodes_missing_value_tracks_true") or [0] * len(modes))
    leaf_weights = _array(a["leaf_weights"]).astype(np.float64)
    leaf_targets = [int(v) for v in a["leaf_targetids"]]
    roots = [int(v) for v in a["tree_roots"]]
    members: dict[int, set[float]] = {}
    if a.get("membership_values") is not None:  # one NaN-ended set per MEMBER node, in order
        values = iter(_array(a["membership_values"]).astype(np.float64).tolist())
        for i in np.flatnonzero(modes == _MEMBER):
            members[int(i)] = _take_set(values)
    n_targets = int(a["n_targets"])
    start = {"min": np.inf, "max": -np.inf}.get(aggregate, 0.0)

    def leaf_of(row: np.ndarray, root: int) -> int:
        node = root
        if true_leaf[node] and false_leaf[node] and true_ids[node] == false_ids[node]:
            return true_ids[node]  # a tree that is one leaf
        while True:
            x = float(row[features[node]])
            if np.isnan(x):
                go = bool(missing_true[node])
            elif modes[node] == _MEMBER:
                go = x in members[node]
            else:
                go = _COMPARE[modes[node]](x, splits[node])
            nxt, is_leaf = (true_ids[node], true_leaf[node]) if go else \
                (false_ids[node], false_leaf[node])
            if is_leaf:
                return nxt
            node = nxt

    def run(ins, outs, ws):
        x = ins[0]
        for r in range(x.shape[0]):
            acc = np.full(n_targets, start)
            for root in roots:
                leaf = leaf_of(x[r], root)
                t, wv = leaf_targets[leaf], leaf_weights[leaf]
                acc[t] = min(acc[t], wv) if aggregate == "min" else \
                    max(acc[t], wv) if aggregate == "max" else acc[t] + wv
            if aggregate == "average":
                acc /= len(roots)
            np.copyto(outs[0][r], acc)

    return run


def _take_set(values) -> set[float]:
    """The values up to the next NaN (consumed)."""
    found = set()
    for v in values:
        if np.isnan(v):
            break
        found.add(v)
    return found


@hookimpl
def tr_onnx_op_definitions():
    return [OpDef("TreeEnsemble", (5,), {"numpy": tree_ensemble_numpy}, domain="ai.onnx.ml",
                  layout=PLAIN_ONLY, differentiable=False)]
