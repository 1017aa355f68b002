"""The rewrite rule of each control-flow and sequence op for ``passes.control_flow``'s resolver
(``_HANDLERS``): If inlined, Scan and Loop unrolled, sequences kept as lists of tensor names,
optionals as what they hold. A rule returns the nodes that replace its node, or None while
what it needs (a constant, a shape, a resolved sequence) is not known yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import UnsupportedModelError

if TYPE_CHECKING:
    from .control_flow import _Resolver


def _label(node: onnx.NodeProto) -> str:
    return f"node {node.name or node.op_type!r} ({node.op_type}, ai.onnx)"


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


# ---- If ------------------------------------------------------------------------------------


def _if(r: _Resolver, node: onnx.NodeProto):
    cond = r.const(node.input[0])
    if cond is None:
        return None  # decided by data: the sub-plan If's (or a later round's) business
    branch = _attr(node, "then_branch" if bool(np.asarray(cond).reshape(-1)[0])
                   else "else_branch")
    return r.inline(branch, {}, list(node.output))[0]


# ---- Scan ----------------------------------------------------------------------------------


def _scan(r: _Resolver, node: onnx.NodeProto):
    body = _attr(node, "body")
    k = int(_attr(node, "num_scan_inputs"))
    if r.opset < 9:
        return _scan8(r, node, body, k)
    states, scans = list(node.input[:len(node.input) - k]), list(node.input[len(node.input) - k:])
    shapes = [r.shape(x) for x in scans]
    if any(s is None for s in shapes):
        return None
    in_axes = [a % len(s) for a, s in zip(_attr(node, "scan_input_axes") or [0] * k, shapes)]
    in_dirs = _attr(node, "scan_input_directions") or [0] * k
    n_out = len(body.output) - len(states)
    out_axes = list(_attr(node, "scan_output_axes") or [0] * n_out)
    out_dirs = _attr(node, "scan_output_directions") or [0] * n_out
    length = shapes[0][in_axes[0]]
    nodes, finals, pieces = _unroll_scan(r, node, body, states, scans, in_axes, in_dirs, length)
    nodes += [r.node("Identity", [f], [o]) for f, o in zip(finals, node.output) if o]
    for j, out in enumerate(node.output[len(states):]):
        if not out:
            continue
        seq = pieces[j][::-1] if out_dirs[j] else pieces[j]
        rank = len(body.output[len(states) + j].type.tensor_type.shape.dim)
        nodes += r.stack(seq, out_axes[j] % (rank + 1), out)
    return nodes


def _unroll_scan(r, node, body, states, scans, in_axes, in_dirs, length):
    """Body inlined ``length`` times: (nodes, final state names, per scan output the names
    of its pieces in step order)."""
    if length == 0:
        raise UnsupportedModelError(f"{_label(node)}: a scan of length 0 has empty outputs, "
                                    "which a plan does not hold", [])
    nodes, pieces = [], [[] for _ in range(len(body.output) - len(states))]
    for t in range(length):
        slices = []
        for x, axis, direction in zip(scans, in_axes, in_dirs):
            index = r.constant(np.array(length - 1 - t if direction else t, np.int64),
                               "cf/step")
            slices.append(r.fresh(f"{x}/step{t}"))
            nodes.append(r.node("Gather", [x, index], [slices[-1]], axis=axis))
        bindings = {i.name: v for i, v in zip(body.input, states + slices)}
        inlined, results = r.inline(body, bindings)
        nodes += inlined
        states = results[:len(states)]
        for j, name in enumerate(results[len(states):]):
            pieces[j].append(name)
    return nodes, states, pieces


def _scan8(r, node, body, k):
    """Opset 8: inputs (sequence_lens, states..., scans...), axis 0 a batch axis and axis 1
    the scan axis; unrolled per batch entry, then restacked on axis 0."""
    lens, rest = node.input[0], list(node.input[1:])
    states, scans = rest[:len(rest) - k], rest[len(rest) - k:]
    shapes = [r.shape(x) for x in scans]
    if any(s is None for s in shapes):
        return None
    batch, length = shapes[0][0], shapes[0][1]
    if lens:
        value = r.const(lens)
        if value is None or np.any(np.asarray(value) != length):
            raise UnsupportedModelError(
                f"{_label(node)}: sequence_lens must be a constant equal to the scan length "
                f"{length} (shorter sequences are not unrolled)", [])
    dirs = _attr(node, "directions") or [0] * k
    n_out = len(body.output) - len(states)
    nodes, finals, outs = [], [[] for _ in states], [[] for _ in range(n_out)]
    for b in range(batch):
        index = r.constant(np.array(b, np.int64), "cf/batch")
        picked = []
        for x in states + scans:
            picked.append(r.fresh(f"{x}/batch{b}"))
            nodes.append(r.node("Gather", [x, index], [picked[-1]], axis=0))
        more, last, pieces = _unroll_scan(r, node, body, picked[:len(states)],
                                          picked[len(states):], [0] * k, dirs, length)
        nodes += more
        for j, f in enumerate(last):
            finals[j].append(f)
        for j, p in enumerate(pieces):
            stacked = r.fresh(f"{node.output[len(states) + j] or 'scan'}/batch{b}")
            nodes += r.stack(p, 0, stacked)
            outs[j].append(stacked)
    for names, out in zip(finals + outs, node.output):
        if out:
            nodes += r.stack(names, 0, out)
    return nodes


# ---- Loop ----------------------------------------------------------------------------------


def _static_cond(r: _Resolver, body: onnx.GraphProto):
    """'pass' when the body's condition output is its condition input (through Identity), a
    bool when it is a constant, else None (computed from loop values)."""
    produced = {o: n for n in body.node for o in n.output}
    name = body.output[0].name
    while name in produced and produced[name].op_type == "Identity":
        name = produced[name].input[0]
    if name == body.input[1].name:
        return "pass"
    node = produced.get(name)
    if node is not None and node.op_type == "Constant" and node.attribute[0].name == "value":
        return bool(numpy_helper.to_array(node.attribute[0].t).reshape(-1)[0])
    for t in body.initializer:
        if t.name == name:
            return bool(numpy_helper.to_array(t).reshape(-1)[0])
    value = r.const(name) if name not in produced else None
    return None if value is None else bool(np.asarray(value).reshape(-1)[0])


# iterations of one Loop unrolled one at a time (each a round of folding over the model) before
# the rest runs as a loop, at run time
MAX_PEELED_ITERATIONS = 64


def _loop(r: _Resolver, node: onnx.NodeProto):
    """Unrolled all at once when the body's condition stays what it is; when the body computes
    it, one iteration at a time: the step, then a Loop for the rest, whose condition the next
    round's folding decides. A Loop left (a condition or trip count from data, too many
    iterations to unroll) runs as a loop at run time (``subplan.Iterations``), where
    ``check_resolved`` lets it."""
    m, cond = (list(node.input) + ["", ""])[:2]
    trip = r.const(m) if m else None
    go = r.const(cond) if cond else np.array(True)
    if (m and trip is None) or go is None:
        return None
    body = _attr(node, "body")
    static = _static_cond(r, body)
    go = bool(np.asarray(go).reshape(-1)[0])
    trip = None if trip is None else int(np.asarray(trip).reshape(-1)[0])
    if trip is None and static in ("pass", True) and go:
        raise UnsupportedModelError(f"{_label(node)}: no trip count and a condition that "
                                    "stays true: the loop never ends", [])
    if not go or trip == 0:
        count = 0
    elif static is None:
        key = tuple(node.output[:len(node.input) - 2])
        r.peeled[key] = r.peeled.get(key, 0) + 1
        if r.peeled[key] > MAX_PEELED_ITERATIONS:  # each peel is a round over the model
            r.at_run_time[node.output[0]] = (f"its condition was still open after "
                                             f"{MAX_PEELED_ITERATIONS} iterations unrolled")
            return None
        return _loop_step(r, node, body, trip)
    else:
        count = trip if static in ("pass", True) else 1
        # checked before the first iteration: a trip count of 2**31 - 1 would otherwise
        # spend hours inlining (an empty body emits no node to trip the node bound; issue 35
        # item 5); such a loop runs as a loop, at run time
        per_iteration = len(body.node) + 1  # its nodes, and its iteration's constants
        if count * per_iteration > r.max_nodes - r.emitted:
            r.at_run_time[node.output[0]] = (
                f"{count} iterations of its body ({len(body.node)} nodes) would unroll into "
                f"more than {r.max_nodes} nodes (the most a plan may inline, "
                "MAX_UNROLLED_NODES)")
            return None
    states = list(node.input[2:])
    nodes, states, pieces, _ = _loop_iterations(r, body, states, count)
    nodes += [r.node("Identity", [s], [o]) for s, o in zip(states, node.output) if o]
    for j, out in enumerate(node.output[len(states):]):
        before, final = r.scan_prefix.pop(out, ([], out))
        if not out:
            continue
        if not before + pieces[j]:
            raise UnsupportedModelError(f"{_label(node)}: a loop of 0 iterations has empty "
                                        "scan outputs, which a plan does not hold", [])
        nodes += r.stack(before + pieces[j], 0, final)
    return nodes


def _loop_iterations(r: _Resolver, body: onnx.GraphProto, states: list[str], count: int):
    """``body`` inlined ``count`` times: (nodes, final states, pieces per scan output, the
    last iteration's condition output)."""
    iter_shape = declared_shape(body.input[0].type)
    nodes, pieces, cond = [], [[] for _ in range(len(body.output) - 1 - len(states))], ""
    for t in range(count):
        bindings = {body.input[0].name: r.constant(np.full(iter_shape, t, np.int64), "cf/iter"),
                    body.input[1].name: r.constant(np.full(declared_shape(body.input[1].type),
                                                           True), "cf/cond")}
        bindings.update({i.name: v for i, v in zip(body.input[2:], states)})
        inlined, results = r.inline(body, bindings)
        nodes += inlined
        cond, states = results[0], results[1:1 + len(states)]
        for j, name in enumerate(results[1 + len(states):]):
            pieces[j].append(name)
    return nodes, states, pieces, cond


def _loop_step(r: _Resolver, node: onnx.NodeProto, body: onnx.GraphProto, trip: int | None):
    """One iteration of ``node``, then a Loop for the rest: its body counts on from 1 (an Add
    of the offset to its iteration number), its condition is the step's, and its scan outputs
    are remembered (``scan_prefix``) to be stacked after this step's pieces when it ends."""
    states = list(node.input[2:])
    nodes, after, pieces, cond = _loop_iterations(r, body, states, 1)
    rest = onnx.GraphProto()
    rest.CopyFrom(body)
    counter = r.fresh(f"{body.input[0].name}/counted")
    offset = numpy_helper.from_array(np.array(1, np.int64), r.fresh("cf/offset"))
    rest.initializer.append(offset)
    rest.input[0].name = counter
    shifted = [helper.make_node("Add", [counter, offset.name], [body.input[0].name])]
    shifted += list(rest.node)
    del rest.node[:]
    rest.node.extend(shifted)
    m = r.constant(np.array(trip - 1, np.int64), "cf/trip") if trip is not None else ""
    outs = list(node.output[:len(states)])
    for j, out in enumerate(node.output[len(states):]):
        before, final = r.scan_prefix.pop(out, ([], out)) if out else ([], "")
        name = r.fresh(f"{final}/rest") if final else ""
        if name:
            r.scan_prefix[name] = (before + pieces[j], final)
        outs.append(name)
    rest_loop = r.node("Loop", [m, cond] + after, outs, body=rest)
    rest_loop.name = node.name or rest_loop.name  # errors name the user's node
    return nodes + [rest_loop]


def declared_shape(tp: onnx.TypeProto) -> tuple[int, ...]:
    """A loop body's iteration number or condition (in or out): its declared static shape
    ((): a scalar where it says nothing, as the spec has it). Also read by
    ``subplan.Iterations``."""
    t = tp.tensor_type
    if not t.HasField("shape") or not all(d.HasField("dim_value") for d in t.shape.dim):
        return ()
    return tuple(int(d.dim_value) for d in t.shape.dim)


# ---- sequences -----------------------------------------------------------------------------


def _seq(r: _Resolver, name: str) -> list[str] | None:
    return r.seqs.get(name)


def _position(r: _Resolver, node: onnx.NodeProto, index: int, length: int, default: int,
              insert: bool = False) -> int | None:
    if len(node.input) <= index or not node.input[index]:
        return default
    value = r.const(node.input[index])
    if value is None:
        return None
    pos = int(np.asarray(value).reshape(-1)[0])
    if not -length <= pos <= (length if insert else length - 1):
        raise UnsupportedModelError(f"{_label(node)}: position {pos} is outside a sequence of "
                                    f"{length}", [])
    return pos + length if pos < 0 else pos


def _construct(r, node):
    r.seqs[node.output[0]] = list(node.input)
    return []


def _empty(r, node):
    r.seqs[node.output[0]] = []
    r.seq_types[node.output[0]] = int(_attr(node, "dtype", onnx.TensorProto.FLOAT))
    return []


def _insert(r, node):
    seq = _seq(r, node.input[0])
    if seq is None:
        return None
    pos = _position(r, node, 2, len(seq), len(seq), insert=True)
    if pos is None:
        return None
    r.seqs[node.output[0]] = seq[:pos] + [node.input[1]] + seq[pos:]
    return []


def _erase(r, node):
    seq = _seq(r, node.input[0])
    if seq is None:
        return None
    pos = _position(r, node, 1, len(seq), len(seq) - 1)
    if pos is None:
        return None
    r.seqs[node.output[0]] = seq[:pos] + seq[pos + 1:]
    return []


def _at(r, node):
    seq = _seq(r, node.input[0])
    if seq is None:
        return None
    pos = _position(r, node, 1, len(seq), 0)
    return None if pos is None else [r.node("Identity", [seq[pos]], [node.output[0]])]


def _length(r, node):
    seq = _seq(r, node.input[0])
    if seq is None:
        return None
    # a node, not an initializer: the value may be a model output
    return [r.node("Identity", [r.constant(np.array(len(seq), np.int64), "cf/length")],
                   [node.output[0]])]


# ---- optionals: what an optional holds (a tensor's or a sequence's name), or None ---------


def _optional(r, node):
    r.opts[node.output[0]] = node.input[0] if node.input and node.input[0] else None
    return []


def _holds(r, name: str):
    """(known, the value ``name`` holds or None); a plain tensor or sequence holds itself."""
    if not name:
        return True, None
    if name in r.opts:
        return True, r.opts[name]
    tp = r.types.get(name)
    if name in r.seqs or name in r.inits or (tp is not None and (
            tp.HasField("tensor_type") or tp.HasField("sequence_type"))):
        return True, name
    return False, None


def _has_element(r, node):
    known, value = _holds(r, node.input[0] if node.input else "")
    if not known:
        return None
    return [r.node("Identity", [r.constant(np.array(value is not None), "cf/has")],
                   [node.output[0]])]


def _get_element(r, node):
    known, value = _holds(r, node.input[0])
    if not known:
        return None
    if value is None:
        raise UnsupportedModelError(f"{_label(node)}: the optional is empty", [])
    if value in r.seqs:
        r.seqs[node.output[0]] = list(r.seqs[value])
        return []
    return [r.node("Identity", [value], [node.output[0]])]


def _split(r, node):
    shape = r.shape(node.input[0])
    if shape is None:
        return None
    axis = int(_attr(node, "axis", 0)) % len(shape)
    keepdims = int(_attr(node, "keepdims", 1))
    total = shape[axis]
    split = r.const(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if len(node.input) > 1 and node.input[1] and split is None:
        return None
    if split is None:
        sizes = [1] * total
    elif np.ndim(split) == 0:
        step = int(split)
        sizes = [step] * (total // step) + ([total % step] if total % step else [])
    else:
        sizes = [int(s) for s in np.asarray(split).reshape(-1)]
    names = [r.fresh(f"{node.output[0]}/{i}") for i in range(len(sizes))]
    sizes_name = r.constant(np.array(sizes, np.int64), "cf/split")
    nodes = [r.node("Split", [node.input[0], sizes_name], names, axis=axis)
             if r.opset >= 13 else r.node("Split", [node.input[0]], names, axis=axis,
                                          split=sizes)]
    if split is None and not keepdims:
        squeezed = [r.fresh(f"{n}/squeezed") for n in names]
        nodes += [r.squeeze(n, axis, s) for n, s in zip(names, squeezed)]
        names = squeezed
    r.seqs[node.output[0]] = names
    return nodes


def _concat(r, node):
    seq = _seq(r, node.input[0])
    if seq is None:
        return None
    if not seq:
        raise UnsupportedModelError(f"{_label(node)}: concatenating an empty sequence", [])
    axis = int(_attr(node, "axis"))
    if int(_attr(node, "new_axis", 0)):
        rank = r.shape(seq[0])
        if rank is None:
            return None
        return r.stack(seq, axis % (len(rank) + 1), node.output[0])
    return [r.node("Concat", seq, [node.output[0]], axis=axis)]


def _map(r, node):
    body = _attr(node, "body")
    seqs = [_seq(r, i) for i in node.input]
    if seqs[0] is None:
        return None
    for i, s in zip(node.input[1:], seqs[1:]):
        if s is None and r.types.get(i, onnx.TypeProto()).HasField("sequence_type"):
            return None  # a sequence not resolved yet
    nodes, outs = [], [[] for _ in node.output]
    for e in range(len(seqs[0])):
        bindings = {b.name: s[e] if s is not None else i
                    for b, i, s in zip(body.input, node.input, seqs)}
        inlined, results = r.inline(body, bindings)
        nodes += inlined
        for j, name in enumerate(results):
            outs[j].append(name)
    for out, names in zip(node.output, outs):
        r.seqs[out] = names
    return nodes


_HANDLERS = {
    "If": _if, "Scan": _scan, "Loop": _loop,
    "SequenceConstruct": _construct, "SequenceEmpty": _empty, "SequenceInsert": _insert,
    "SequenceErase": _erase, "SequenceAt": _at, "SequenceLength": _length,
    "SplitToSequence": _split, "ConcatFromSequence": _concat, "SequenceMap": _map,
    "Optional": _optional, "OptionalHasElement": _has_element,
    "OptionalGetElement": _get_element,
}
