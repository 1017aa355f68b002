"""Control flow and sequences: Loop, Scan, the Sequence and Optional ops, as the registry knows
them (If is ops/dynamic.py's: what reaches a kernel there is an If decided by data).

None of them runs as a kernel. A plan is static, so ``passes.control_flow`` resolves them when a
model is specialised: an If whose condition is known then is replaced by its branch, Loop and
Scan are unrolled (their bodies inlined once per iteration), and a sequence becomes the list of
tensors it holds, so SequenceAt picks one, ConcatFromSequence becomes a Concat and so on. What
is left are ordinary ops, and autodiff differentiates an unrolled Scan (or Loop, or inlined If)
through its body's own rules: that is what ``differentiable`` means for Scan (Loop is declared
forward only, as issue 13 asks: a single-node Loop cannot be typed for the finite-difference
table, whose model outputs need static shapes).

They are registered so that import accepts them, ``tr-onnx ops`` lists them, and the node
suite counts their cases. A node that reaches a kernel was not resolvable; its factory names it
and says why, on every backend alike (resolution happens before a backend is involved, so the
cuda backend registers the same factory: the same named error, not "no cuda binding").
"""

from __future__ import annotations

from ..errors import UnsupportedModelError
from ..hookspecs import hookimpl
from ..opdef import OpDef
from .dynamic import loop_shape

_WHY = {
    "Loop": "its trip count or condition is not known when the plan is made",
    "Scan": "its scan length is not static",
}


def unresolved(ctx):
    """The kernel factory of every op here: reaching it means specialisation could not resolve
    the node; a named error says which and why."""
    why = _WHY.get(ctx.node.op_type, "its sequence positions or lengths are not known when the "
                   "plan is made")
    raise ctx.error(f"control flow and sequences are resolved when the plan is made "
                    f"(passes.control_flow), and this node was not: {why}")


def unrolled_vjp(b, node, gys, needed):
    """Never called: an unrolled node is gone before autodiff, which then differentiates the
    body's ops with their own rules. Reaching it is a bug; the error names the node."""
    raise UnsupportedModelError(f"{node.label}: reached autodiff without being resolved at "
                                "specialisation", [])


def _structural(op_type: str, versions: tuple[int, ...], doc: str,
                differentiable: bool = False, const_inputs: tuple[int, ...] = (),
                shape=None) -> OpDef:
    """``const_inputs``: positions, split sizes, trip counts: model inputs reaching them make
    the plan specialise on their values."""
    return OpDef(op_type, versions, {"numpy": unresolved, "cuda": unresolved},
                 const_inputs=const_inputs, shape=shape,
                 differentiable=differentiable, gradient=unrolled_vjp if differentiable else None,
                 doc=doc)


_CONTROL_VERSIONS = (1, 11, 13, 16, 19, 21, 23, 24, 25)


@hookimpl
def tr_onnx_op_definitions():
    return [

        # M and cond known when the plan is made unroll the loop: model inputs reaching M
        # (which decides the scan outputs' length, as Reshape's shape decides a shape) or read
        # directly as cond make the plan specialise on their values (const_feeds). A Loop left
        # becomes RunLoop (ops.dynamic) when the graph is specialised.
        _structural("Loop", _CONTROL_VERSIONS, "forward: unrolled at plan time, given a known "
                    "trip count and a condition that stays constant (passed through or a "
                    "constant); otherwise, or when unrolling would make too many nodes, run "
                    "as a loop (RunLoop)", const_inputs=(0,), shape=loop_shape),
        _structural("Scan", (8, 9, 11, 16, 19, 21, 23, 24, 25), "unrolled at plan time (Gather "
                    "per step, body inlined, outputs stacked by Unsqueeze+Concat): input/output "
                    "axes and directions, opset 8's batch axis; differentiable when its body is",
                    True),
        _structural("SequenceConstruct", (11,), "a list of its input tensors"),
        _structural("SequenceEmpty", (11,), "an empty list"),
        _structural("SequenceInsert", (11,), "list insert at a constant position",
                    const_inputs=(2,)),
        _structural("SequenceErase", (11,), "list removal at a constant position",
                    const_inputs=(1,)),
        _structural("SequenceAt", (11,), "the tensor at a constant position",
                    const_inputs=(1,)),
        _structural("SequenceLength", (11,), "a constant"),
        _structural("SplitToSequence", (11, 24), "a Split (and Squeeze) over a static axis",
                    const_inputs=(1,)),
        _structural("ConcatFromSequence", (11,), "a Concat (Unsqueeze first with new_axis)"),
        _structural("SequenceMap", (17,), "the body inlined per element"),
        _structural("Optional", (15, 28), "holds its input or nothing, known at plan time"),
        _structural("OptionalHasElement", (15, 18, 28), "a constant"),
        _structural("OptionalGetElement", (15, 18, 28), "what the optional holds"),
    ]
