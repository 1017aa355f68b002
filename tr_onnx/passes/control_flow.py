"""Static control flow, resolved when a model is specialised (before the IR is built).

A plan runs a fixed list of kernels, so control flow becomes straight-line ops here, on the
ONNX graph, once the input shapes (and the inputs a plan specialises on) are bound and
constants folded:

- If with a condition known now (a constant, or a bool model input bound as a const feed):
  the branch taken is inlined, its values renamed uniquely, its outputs copied (Identity) into
  the If's outputs; names from the outer scope resolve as they are.
- Scan: unrolled over its static length: a Gather picks each step's slice of every scan input
  (honouring axes and directions), the body is inlined with the state carried, and the scan
  outputs are stacked (Unsqueeze + Concat) on their axes and in their directions. Opset 8's
  batch axis is unrolled too. autodiff then differentiates the unrolled body.
- Loop: unrolled when its trip count is known and its condition stays constant (passed
  through from the input, or a constant); the loop-carried values must keep static shapes.
- Sequences are lists of tensor values while the graph is rewritten: SequenceConstruct makes
  one, SequenceAt with a constant position picks a tensor, SplitToSequence is a Split,
  ConcatFromSequence a Concat, SequenceMap inlines its body per element.

One round rewrites every node it can; then constants are folded and shapes inferred again
(an inlined branch may decide a nested If's condition, an unrolled step a Scan's length), until
nothing changes. A node still unresolved is a named error, except an If whose condition depends
on data: it is left for the data-dependent If (planned as sub-plans), whose kernel is the hook.
This module drives the rounds and edits the graph (``_Resolver``); the rule of each op is
passes/control_flow_rules.py's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..domains import ONNX_DOMAINS
from ..errors import UnsupportedModelError
from ..ir import proto_reads, subgraphs
from .control_flow_rules import _HANDLERS, _label, _static_cond

MAX_UNROLLED_NODES = 100_000  # nodes one specialisation may inline; more is a named error
CONTROL_OPS = frozenset({"If", "Loop", "Scan"})
SEQUENCE_OPS = frozenset({"SequenceConstruct", "SequenceEmpty", "SequenceInsert",
                          "SequenceErase", "SequenceAt", "SequenceLength", "SplitToSequence",
                          "ConcatFromSequence", "SequenceMap", "Optional", "OptionalHasElement",
                          "OptionalGetElement"})
_STRUCTURAL = CONTROL_OPS | SEQUENCE_OPS


def _is_structural(node: onnx.NodeProto) -> bool:
    return node.domain in ONNX_DOMAINS and node.op_type in _STRUCTURAL


def resolve(model: onnx.ModelProto, fold: Callable[[onnx.ModelProto], onnx.ModelProto],
            param_names=frozenset(), max_nodes: int | None = None) -> onnx.ModelProto:
    """``model`` (folded, shapes inferred) with its static control flow and sequences resolved
    into plain ops. ``fold(model)`` infers shapes and folds constants again between rounds;
    ``param_names`` are trainable initializers, never read as plan-time values; ``max_nodes``
    (default ``MAX_UNROLLED_NODES``) bounds the nodes unrolling may make."""
    if not any(_is_structural(n) for n in model.graph.node):
        return model
    if model.ir_version < 4:  # the initializers made here are not graph inputs (IR 3 wanted)
        model.ir_version = 4
    resolver = _Resolver(model, param_names,
                         MAX_UNROLLED_NODES if max_nodes is None else max_nodes)
    previous = None
    while True:
        signature = [(n.op_type, tuple(n.output)) for n in model.graph.node]
        if signature == previous or not any(_is_structural(n) for n in model.graph.node):
            break
        previous = signature
        resolver.round(model)
        model = fold(model)
    listed = resolver.list_optional_outputs(model)
    if resolver.list_sequence_outputs(model) or listed:
        model = fold(model)
    resolver.check_resolved(model)
    return model


def listed_outputs(output: str, names) -> list[str]:
    """The plan outputs (among ``names``) holding the tensors of the model's sequence output
    ``output``, in order (``resolve`` names them ``output[i]``)."""
    prefix = f"{output}["
    found = [n for n in names if n.startswith(prefix) and n.endswith("]")
             and n[len(prefix):-1].isdigit()]
    return sorted(found, key=lambda n: int(n[len(prefix):-1]))


def output_value(read, name: str, tp: onnx.TypeProto, names):
    """A model output as ONNX gives it, from a plan whose outputs are ``names`` (``read(name)``
    reads one): a tensor, a list (a sequence, ``listed_outputs``), or an optional's value or
    None (``resolve`` names what an optional holds ``name[held]``)."""
    if tp.HasField("optional_type"):
        held = f"{name}[held]"
        if held not in names and not listed_outputs(held, names):
            return None
        name, tp = held, tp.optional_type.elem_type
    if tp.HasField("sequence_type"):
        return [read(n) for n in listed_outputs(name, names)]
    return read(name)


def output_reader(executor, name: str, tp: onnx.TypeProto, names) -> Callable[[], object]:
    """``output_value(executor.read_output, name, tp, names)`` for a caller that reads it every
    run: a tensor output is the executor's prepared reader (the TypeProto is not asked again)."""
    if tp.HasField("optional_type") or tp.HasField("sequence_type"):
        return partial(output_value, executor.read_output, name, tp, names)
    return executor.output_reader(name)


class _Resolver:
    def __init__(self, model: onnx.ModelProto, param_names, max_nodes: int):
        self.opset = next((o.version for o in model.opset_import if o.domain in ONNX_DOMAINS),
                          1)
        self.param_names = param_names
        self.max_nodes = max_nodes
        self.emitted = 0
        self.used: set[str] = set()
        _collect_names(model.graph, self.used)
        self.seqs: dict[str, list[str]] = {}  # a resolved sequence value -> its tensors' names
        self.seq_types: dict[str, int] = {}  # element type of every sequence seen (SequenceEmpty)
        # a Loop unrolled a step at a time: its rest's scan output -> (pieces so far, the name
        # the stacked output takes when the loop ends)
        self.scan_prefix: dict[str, tuple[list[str], str]] = {}
        self.opts: dict[str, str | None] = {}  # an optional value -> what it holds (None: empty)
        self.peeled: dict[tuple, int] = {}  # a Loop's carried outputs -> iterations peeled
        # a Loop left to run at run time (its first output) -> why it is not unrolled
        self.at_run_time: dict[str, str] = {}

    # ---- one round ----------------------------------------------------------------------

    def round(self, model: onnx.ModelProto) -> None:
        """Rewrite every node that can be now, in order; nodes an inlined body brings in are
        rewritten in the same pass (a sequence built in a branch is a list at once)."""
        g = model.graph
        self.round_info(model)
        self.new_inits: list[onnx.TensorProto] = []
        for name, tp in self.types.items():
            if tp.HasField("sequence_type"):
                self.seq_types[name] = tp.sequence_type.elem_type.tensor_type.elem_type
        work, out, replaced = deque(g.node), [], set()
        while work:
            node = work.popleft()
            result = self._rewrite(node)
            if result is None:
                out.append(node)
                continue
            replaced.update(node.output)
            work.extendleft(reversed(result))
        out = self._rematerialise(out, [o.name for o in g.output])
        del g.node[:]
        g.node.extend(out)
        g.initializer.extend(self.new_inits)
        # shapes of replaced values are inferred anew from what replaced them
        keep = [vi for vi in g.value_info if vi.name not in replaced
                and vi.type.HasField("tensor_type")]
        del g.value_info[:]
        g.value_info.extend(keep)

    def _rewrite(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """The nodes replacing ``node`` ([] when it becomes a list or a constant), or None
        when it stays (not structural, or not resolvable yet)."""
        if node.domain not in ONNX_DOMAINS:
            return None
        if node.op_type == "Identity" and node.input[0] in self.seqs:
            self.seqs[node.output[0]] = list(self.seqs[node.input[0]])
            return []
        if node.op_type == "Identity" and node.input[0] in self.opts:
            self.opts[node.output[0]] = self.opts[node.input[0]]
            return []
        handler = _HANDLERS.get(node.op_type)
        return None if handler is None else handler(self, node)

    def _rematerialise(self, nodes: list, graph_outputs: list[str]) -> list:
        """A resolved sequence still read by a node that stays (or a graph output) is built
        again with SequenceConstruct, so the graph stays whole; the blocking node is named by
        ``check_resolved`` if nothing resolves it later."""
        produced = {o for n in nodes for o in n.output}
        wanted = [i for n in nodes for i in proto_reads(n)] + graph_outputs
        extra, wraps, seen = [], [], set()
        for name in wanted:
            if name in self.opts and name not in produced:
                held = self.opts.pop(name)
                if held is not None:
                    wanted.append(held)  # rebuilt below if it is a sequence
                    wraps.append(helper.make_node("Optional", [held], [name]))
                elif name in self.types and self.types[name].HasField("optional_type"):
                    wraps.append(helper.make_node(
                        "Optional", [], [name], type=self.types[name].optional_type.elem_type))
            if name in self.seqs and name not in produced and name not in seen:
                seen.add(name)
                elems = self.seqs.pop(name)
                extra.append(helper.make_node("SequenceConstruct", elems, [name]) if elems else
                             helper.make_node("SequenceEmpty", [], [name],
                                              dtype=self.seq_types.get(name, 1)))
        return extra + wraps + nodes

    def list_optional_outputs(self, model: onnx.ModelProto) -> bool:
        """An optional model output known to hold a value becomes an output of that value,
        named ``output[held]`` (a sequence then listed as ``output[held][i]``); one known to be
        empty is dropped. True if any was."""
        g = model.graph
        producer = {o: n for n in g.node for o in n.output}
        read = {i for n in g.node for i in proto_reads(n)}
        changed, outputs = False, []
        for vi in g.output:
            node = producer.get(vi.name)
            if node is None or node.op_type != "Optional" or vi.name in read or \
                    not vi.type.HasField("optional_type"):
                outputs.append(vi)
                continue
            changed = True
            g.node.remove(node)
            if not node.input or not node.input[0]:
                continue  # empty: the adapter reads None
            held = onnx.ValueInfoProto()
            held.name = f"{vi.name}[held]"
            held.type.CopyFrom(vi.type.optional_type.elem_type)
            source = producer.get(node.input[0])
            if source is not None and source.op_type in ("SequenceConstruct", "SequenceEmpty") \
                    and not any(node.input[0] in proto_reads(n) for n in g.node):
                source.output[0] = held.name  # listed by list_sequence_outputs
            else:
                g.node.append(helper.make_node("Identity", [node.input[0]], [held.name],
                                               name=self.fresh(f"cf/{held.name}")))
            outputs.append(held)
        if changed:
            del g.output[:]
            g.output.extend(outputs)
        return changed

    def list_sequence_outputs(self, model: onnx.ModelProto) -> bool:
        """A sequence model output made of known tensors becomes one tensor output per element,
        named ``output[i]`` (``listed_outputs`` finds them); True if any did."""
        g = model.graph
        producer = {o: n for n in g.node for o in n.output}
        read = {i for n in g.node for i in proto_reads(n)}
        listed, outputs = False, []
        for vi in g.output:
            node = producer.get(vi.name)
            if node is None or node.op_type not in ("SequenceConstruct", "SequenceEmpty") or \
                    not vi.type.HasField("sequence_type") or vi.name in read:
                outputs.append(vi)
                continue
            listed = True
            elem = vi.type.sequence_type.elem_type.tensor_type.elem_type
            g.node.remove(node)
            for i, x in enumerate(node.input):
                name = f"{vi.name}[{i}]"
                g.node.append(helper.make_node("Identity", [x], [name],
                                               name=self.fresh(f"cf/{name}")))
                outputs.append(helper.make_tensor_value_info(name, elem, None))
        if listed:
            del g.output[:]
            g.output.extend(outputs)
        return listed

    def check_resolved(self, model: onnx.ModelProto) -> None:
        """A named error for the first structural node still in ``model`` (a data-dependent
        If stays: the sub-plan If takes it; so does a Loop that can run at run time)."""
        self.round_info(model)
        left = [n for n in model.graph.node if _is_structural(n) and n.op_type != "If"
                and not (n.op_type == "Loop" and self._runs_at_run_time(n))]
        # a SequenceConstruct left is one rebuilt for a node that could not take its list
        for node in sorted(left, key=lambda n: n.op_type in ("SequenceConstruct",
                                                             "SequenceEmpty")):
            raise UnsupportedModelError(f"{_label(node)}: {self._why(node)}", [])
        for o in model.graph.output:
            if not o.type.HasField("tensor_type"):
                raise UnsupportedModelError(
                    f"model output {o.name!r} is a {o.type.WhichOneof('value')}: a plan's "
                    "outputs are tensors (a sequence output is resolved only through the ONNX "
                    "backend adapter, which lists its tensors)", [])

    def round_info(self, model: onnx.ModelProto) -> None:
        """What a round reads: the initializers (plan-time values) and the inferred types."""
        g = model.graph
        self.inits = {t.name: t for t in g.initializer}
        self.types = {vi.name: vi.type for vi in list(g.input) + list(g.value_info)
                      + list(g.output)}

    def _runs_at_run_time(self, node: onnx.NodeProto) -> bool:
        """A Loop left that ``subplan.Iterations`` runs: it carries tensors only, has no scan
        outputs (their length would be known only at run time) and ends (a trip count, or a
        condition the body computes)."""
        carried = len(node.input) - 2
        m = (list(node.input) + [""])[0]
        body = next(a.g for a in node.attribute if a.name == "body")
        return (not any(node.output[carried:])
                and all(self._is_tensor(n) for n in node.input[2:])
                and (bool(m) or _static_cond(self, body) not in ("pass", True)))

    def _is_tensor(self, name: str) -> bool:
        """Not a sequence or optional: an initializer, or a value typed as a tensor."""
        return name in self.inits or self.types.get(name, onnx.TypeProto()).HasField(
            "tensor_type")

    def _why(self, node: onnx.NodeProto) -> str:
        if node.op_type == "Loop":
            return self._why_loop(node)
        if node.op_type == "Scan":
            return "a scan input has no static shape, so its length is unknown"
        return ("its sequence input or position is not known when the plan is made (a "
                "sequence model input, or a position computed from data)")

    def _why_loop(self, node: onnx.NodeProto) -> str:
        """Why a Loop is not unrolled, and why it cannot run as a loop either."""
        m, cond = (list(node.input) + ["", ""])[:2]
        if node.output[0] in self.at_run_time:
            reason = self.at_run_time[node.output[0]]
        elif m and self.const(m) is None:
            reason = f"its trip count {m!r} depends on data (not known when the plan is made)"
        elif cond and self.const(cond) is None:
            reason = f"its condition {cond!r} depends on data"
        else:
            reason = "its body computes its condition from the values it carries"
        scans = [self.scan_prefix.get(o, (None, o))[1]  # a peeled loop's: the user's name
                 for o in node.output[len(node.input) - 2:] if o]
        if scans:
            return (f"{reason}, so it would run as a loop at run time, where it cannot have "
                    f"scan outputs ({scans}: one slice per iteration, a length known only "
                    "then); tr_onnx unrolls a Loop with scan outputs")
        if not all(self._is_tensor(n) for n in node.input[2:]):
            return (f"{reason}, so it would run as a loop at run time, where it carries "
                    "tensors only, not sequences or optionals")
        return (f"{reason}, and it has no trip count while its body passes the condition "
                "through: once it starts it never ends")

    # ---- helpers ------------------------------------------------------------------------

    def const(self, name: str) -> np.ndarray | None:
        """The plan-time value of ``name`` (a non-trainable initializer), or None."""
        t = self.inits.get(name)
        if t is None or name in self.param_names:
            return None
        return numpy_helper.to_array(t)

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name in self.inits:
            return tuple(self.inits[name].dims)
        tp = self.types.get(name)
        if tp is None or not tp.HasField("tensor_type") or \
                not tp.tensor_type.HasField("shape"):
            return None
        dims = tp.tensor_type.shape.dim
        if not all(d.HasField("dim_value") for d in dims):
            return None
        return tuple(int(d.dim_value) for d in dims)

    def fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.used:
            i += 1
            name = f"{base}__{i}"
        self.used.add(name)
        return name

    def constant(self, value, base: str) -> str:
        name = self.fresh(base)
        self.new_inits.append(numpy_helper.from_array(np.asarray(value), name))
        self.inits[name] = self.new_inits[-1]
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], **attrs) -> onnx.NodeProto:
        self.emitted += 1
        if self.emitted > self.max_nodes:
            raise UnsupportedModelError(
                f"unrolling control flow makes more than {self.max_nodes} nodes (an unrolled "
                "Loop or Scan this long is too large to plan; MAX_UNROLLED_NODES)", [])
        return helper.make_node(op, inputs, outputs, name=self.fresh(f"cf/{op}"), **attrs)

    def unsqueeze(self, x: str, axis: int, out: str) -> onnx.NodeProto:
        if self.opset >= 13:
            return self.node("Unsqueeze", [x, self.constant(np.array([axis], np.int64),
                                                            "cf/axes")], [out])
        return self.node("Unsqueeze", [x], [out], axes=[axis])

    def squeeze(self, x: str, axis: int, out: str) -> onnx.NodeProto:
        if self.opset >= 13:
            return self.node("Squeeze", [x, self.constant(np.array([axis], np.int64),
                                                          "cf/axes")], [out])
        return self.node("Squeeze", [x], [out], axes=[axis])

    def stack(self, pieces: list[str], axis: int, out: str) -> list[onnx.NodeProto]:
        """Unsqueeze each piece at ``axis`` (>= 0) and Concat them into ``out``."""
        nodes, names = [], []
        for p in pieces:
            names.append(self.fresh(f"{out}/piece"))
            nodes.append(self.unsqueeze(p, axis, names[-1]))
        return nodes + [self.node("Concat", names, [out], axis=axis)]

    def inline(self, graph: onnx.GraphProto, bindings: dict[str, str],
               outputs: list[str] | None = None) -> tuple[list[onnx.NodeProto], list[str]]:
        """``graph``'s nodes with its inputs bound to outer names (``bindings``), every value
        it defines renamed uniquely, and free names left to the outer scope. Returns the
        nodes and the outer names of its outputs; with ``outputs``, Identity nodes copy them
        into those names ('' skips one)."""
        mapping = dict(bindings)
        for t in graph.initializer:
            mapping[t.name] = self.fresh(f"{graph.name}/{t.name}")
            copy = onnx.TensorProto()
            copy.CopyFrom(t)
            copy.name = mapping[t.name]
            self.new_inits.append(copy)
            self.inits[copy.name] = copy
        nodes = []
        for n in graph.node:
            for o in n.output:
                if o:
                    mapping[o] = self.fresh(f"{graph.name}/{o}")
            new = onnx.NodeProto()
            new.CopyFrom(n)
            new.name = self.fresh(f"{graph.name}/{n.name or n.op_type}")
            del new.input[:]
            new.input.extend(mapping.get(i, i) if i else "" for i in n.input)
            del new.output[:]
            new.output.extend(mapping[o] if o else "" for o in n.output)
            for sub in subgraphs(new):
                _rename_free(sub, mapping)
            nodes.append(new)
            self.emitted += 1
        if self.emitted > self.max_nodes:
            self.node("Identity", [], [])  # raises the named limit error
        results = [mapping.get(o.name, o.name) for o in graph.output]
        if outputs is not None:
            nodes += [self.node("Identity", [r], [o]) for r, o in zip(results, outputs) if o]
        return nodes, results


def _collect_names(graph: onnx.GraphProto, names: set) -> None:
    names.update(i.name for i in graph.input)
    names.update(t.name for t in graph.initializer)
    for n in graph.node:
        names.update(n.output)
        names.update(n.input)
        if n.name:
            names.add(n.name)
        for sub in subgraphs(n):
            _collect_names(sub, names)


def _rename_free(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename, in place, the names ``graph`` reads from outer scopes (those it does not define
    itself), through ``mapping``: a nested body of an inlined graph follows its renaming."""
    local = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {
        o for n in graph.node for o in n.output}
    inner = {k: v for k, v in mapping.items() if k not in local}
    for n in graph.node:
        for k, i in enumerate(n.input):
            if i in inner:
                n.input[k] = inner[i]
        for sub in subgraphs(n):
            _rename_free(sub, inner)
    for o in graph.output:  # an output that is an outer value, passed through
        if o.name in inner:
            o.name = inner[o.name]
