"""What an op module declares: its OpDef (versions, layout rule, kernels) and the KernelContext
a kernel factory receives at plan time.

A kernel factory runs once, when the plan is made. It reads attributes, shapes and plan-time
constants from the ``KernelContext``, asks for workspace buffers, and returns the function the
step calls: ``run(ins, outs, ws) -> None``. ``ins``/``outs`` are arena views (``None`` for an
absent optional input/output) and ``ws`` the workspace views, in the order they were asked
for. ``run`` writes its outputs in place and allocates nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from . import ir
from .errors import UnsupportedModelError
from .layouts import Layout

RunFn = Callable[[list, list, list], None]
KernelFactory = Callable[["KernelContext"], RunFn]

# Input layout requirements
STRIDED = "strided"  # any StridedLayout; the kernel reads a logical (ONNX axis order) view
PLAIN = "plain"  # compact logical layout; the layout pass inserts a conversion if needed
CHANNELS_LAST = "channels_last"  # input 0 is a channels-last feature map (spatial ops)
# Output layout policies
FOLLOW = "follow"  # an output takes the channels-last layout of a same-rank input
# Weight layouts (for PARAM inputs of spatial ops)
CONV_WEIGHT = "conv_weight"
CHANNEL_VECTOR = "channel_vector"


@dataclass(frozen=True)
class LayoutRule:
    """How an op reads and writes physical layouts; the layout pass applies it.

    ``inputs``: what input 0 needs (``STRIDED``, ``PLAIN`` or ``CHANNELS_LAST``); other
    activation inputs need ``PLAIN`` when input 0 does, else any strided layout.
    ``outputs``: ``FOLLOW`` (every output of the same rank as a channels-last input is
    channels-last), ``PLAIN``, or ``CHANNELS_LAST`` (output 0; the other outputs plain).
    ``weights``: input index -> ``CONV_WEIGHT`` / ``CHANNEL_VECTOR`` for parameters of a
    spatial op, so they are stored the way the backend's kernels read them.
    ``absorbs_flatten``: input 0 may be a feature map flattened in its physical order
    (Gemm/MatMul); the weight in input 1 is then stored with the same row order.
    ``channel_axis``: the logical channel axis of input 0 by the op's ONNX definition.
    Padded lanes are zero (the arena starts zeroed) and kernels never write them, which keeps
    sums, matmuls and convolutions over padded channels exact.
    """

    inputs: str = STRIDED
    outputs: str = FOLLOW
    weights: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    absorbs_flatten: bool = False
    channel_axis: int = 1


ELEMENTWISE = LayoutRule()
SPATIAL = LayoutRule(inputs=CHANNELS_LAST, outputs=CHANNELS_LAST)
PLAIN_ONLY = LayoutRule(inputs=PLAIN, outputs=PLAIN)
STRIDED_TO_PLAIN = LayoutRule(inputs=STRIDED, outputs=PLAIN)
MATMUL = LayoutRule(inputs=STRIDED, outputs=PLAIN, absorbs_flatten=True)


@dataclass(frozen=True)
class OpDef:
    """One op (or a family sharing a body) as an op set provides it.

    ``versions`` are the ONNX schema ``since_version`` values this definition implements (one
    body for all; ``ctx.since_version`` tells them apart where semantics changed).
    ``kernels`` maps a backend name (``"numpy"``, ``"cuda"``) to a kernel factory.
    ``const_inputs``: input indices that must be known when the plan is made (Reshape's shape,
    Slice's starts...). A graph input in such a position makes the plan specialise on its value.
    ``alias_output``: output 0 may share input 0's memory when both are plain (Reshape,
    Identity...): then no kernel runs at all.
    ``shape``: ``shape(node, input_shapes, input_dtypes) -> [(shape, dtype), ...]`` for ops that
    ONNX shape inference does not know (custom domains).
    ``gradient``: the gradient rule, ``vjp(b, node, gys, needed) -> [gx or None per input]``
    (see ``tr_onnx.passes.autodiff``): it builds IR nodes through the GradBuilder ``b``, never
    arrays; ``gys`` holds the output gradients (None where no gradient flows) and ``needed``
    says which inputs want one. ``differentiable`` declares that the op has a rule (a test
    holds every such OpDef to it); non-differentiable ops (Shape, comparisons, ArgMax...) have
    neither, and autodiff stops at them.
    ``grad_inputs``: the inputs a gradient can flow to (None: every floating-point input);
    BatchNormalization's running statistics, Clip's bounds and the like are not among them,
    so a parameter feeding only such inputs is not trainable.
    ``param_inputs``: the inputs at which an initializer is one of the model's learned
    parameters (PyTorch's ``model.parameters()``): Conv's weight and bias, a normalization's
    scale and bias, Gather's table, MatMul's constant operand; ``"all"``: every input
    (Concat's learned tokens, Einsum). An initializer trains by default when a differentiable
    path takes it to one of them (or to the model's output), unchanged or transformed on the
    way; ``training.parameters`` says which constants stay frozen (scalars, Clip bounds, Pow
    exponents, Sub/Div buffers). ``None``: undeclared -- no input for ops of the ONNX domains,
    every input a gradient flows to for other domains (a plugin's weights train).
    ``param_min_size``: a constant at a ``param_inputs`` input is a parameter only with at
    least this many elements (Add/Mul: 2 -- a bias or layer scale is a tensor, a scalar there
    is an exporter's multiplier or epsilon).
    ``constant_operands``: differentiable inputs that hold an exporter's constant or a buffer,
    never a learned parameter, with the reason ``tr-onnx inspect`` gives (Sub's subtrahend and
    Div's divisor: an input's mean and std; Pow's exponent).
    ``forwards_params``: input 0 reaches the outputs unchanged in value (Reshape, Transpose,
    Cast...): an initializer there is a parameter where those outputs go.
    ``straight_through``: the op's non-float outputs carry a gradient, a float tensor shaped
    like them (a straight-through estimator counts QuantizeLinear's rounding as the identity);
    autodiff passes it to their consumers' rules instead of stopping at integer values.
    ``updates_inputs``: inputs the kernel writes in place (optimizer and assignment ops); such
    nodes run after everything that reads the old values.

    What the op means beyond its forward kernel, for the passes that rewrite a graph (each
    optional; the passes ask the node's OpDef, never its op_type):

    ``training``: ``training(node, ctx) -> bool``, the op's training-mode form: the rule
    rewrites ``node`` in ``ctx.graph`` (BatchNormalization into BatchNormTraining with batch
    statistics, Dropout into a mask drawn per step, a random op into a draw driven by the
    step counter) through the ``TrainingContext`` the train pass hands it, and returns
    whether it did (a Dropout of ratio 0 stays). ``training.train_pass.to_training_mode``.
    ``inference``: ``inference(node, graph) -> bool``, its eval form, for a model exported in
    training mode: the rule edits ``node`` in place (BatchNormalization reads its running
    statistics, Dropout passes x through) and returns whether it changed anything.
    ``training.train_pass.to_inference_mode``.
    ``inference_fold``: ``fold(node, graph) -> bool``, for inference plans only (parameters
    constant): the rule merges ``node`` into its neighbours where that keeps the results
    (an inference BatchNormalization into the Conv before it) and returns whether it did.
    ``passes.inference_folds.apply_inference_folds``.
    ``export``: ``export(node, graph, used) -> None``, the same for the exported ModelProto:
    ``node`` is the op's ``onnx.NodeProto`` in ``graph`` (an ``onnx.GraphProto``), ``used``
    the names some node or graph output reads. ``training.export.inference_form``.
    ``fp32_inputs`` / ``fp32_outputs``: ports that stay float32 in a half-precision training
    graph (cuDNN's BatchNorm takes its per-channel tensors in float32); ``"all"``: every
    input. ``training.precision``.
    ``value_bounds``: ``rule(node, bound, stats) -> float | None``, a number M with |y| <= M
    for every element of output 0 given ``bound(v)`` (the bound proven for input ``v``, or
    None) and ``stats`` (``passes.value_bounds.ConstantStats``: the constants' numbers); None
    where it proves nothing. ``bounded_like_input`` and ``unit_bounded`` below are the common
    rules. ``passes.value_bounds``.
    ``traits``: facts the graph analyses ask of an op instead of listing op types (the
    constants below: ``training.parameters``, ``export_advice``).
    """

    op_type: str
    versions: tuple[int, ...]
    kernels: Mapping[str, KernelFactory]
    domain: str = ""
    layout: LayoutRule = ELEMENTWISE
    const_inputs: tuple[int, ...] = ()
    alias_output: bool = False
    shape: Callable | None = None
    differentiable: bool | None = None  # None: undeclared (an error if autodiff meets it)
    doc: str = ""
    gradient: Callable | None = None
    grad_inputs: tuple[int, ...] | None = None
    param_inputs: tuple[int, ...] | str | None = None
    param_min_size: int = 1
    constant_operands: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    forwards_params: bool = False
    straight_through: bool = False
    updates_inputs: tuple[int, ...] = ()
    training: Callable | None = None
    inference: Callable | None = None
    inference_fold: Callable | None = None
    export: Callable | None = None
    fp32_inputs: tuple[int, ...] | str = ()
    fp32_outputs: tuple[int, ...] = ()
    value_bounds: Callable | None = None
    traits: frozenset[str] = frozenset()
    overrides: bool = False  # replace an op already registered (e.g. a builtin) on purpose
    # Defaults of attributes for ops without an ONNX schema (custom domains), filled into
    # node.attrs at dispatch, so kernels, rules and backends read ctx.attrs[name] directly.
    attr_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


# OpDef.traits
NORMALIZATION = "normalization"  # normalises activations: a net with one kept its BatchNorms
CHANNEL_NORMALIZATION = "channel_normalization"  # per channel: cancels a bias added before it
CONVOLUTION = "convolution"  # a sliding-window layer (weight, optional bias)
BATCHNORM_FOLDS_INTO = "batchnorm_folds_into"  # exporters fold a following BatchNorm into it
LINEAR = "linear"  # x @ W: its weight names the layer of the bias added after it
SOFTMAX = "softmax"  # normalises scores: an additive mask before it is a constant
MASK_PATH = "mask_path"  # may lie between an additive attention mask and its Softmax
BROADCASTS = "broadcasts"  # forwards a value into a larger one: a scalar there is a fill
LAYOUT_ONLY = "layout_only"  # moves values: exporters put it between a layer and its norm


def bounded_like_input(node, bound, stats) -> float | None:
    """``OpDef.value_bounds`` of an op whose output is bounded by input 0's: a selection, a max
    or a mean of its values, or the values themselves moved (Relu, MaxPool, Reshape...)."""
    return bound(node.inputs[0])


def unit_bounded(node, bound, stats) -> float | None:
    """``OpDef.value_bounds`` of an op with values in [-1, 1] for any finite input (Sigmoid,
    Tanh, Softmax...)."""
    return 1.0 if bound(node.inputs[0]) is not None else None


@dataclass
class TrainingContext:
    """What an ``OpDef.training`` rule is handed by the train pass
    (``training.train_pass.to_training_mode``), for one node.

    ``graph``: the graph being rewritten (``ir.Graph``). ``seed``: this node's random key (the
    session's seed and the node's position). ``step_counter``: the per-step count of
    micro-batches seen, the input that moves a random stream on each step.
    ``make_node(op_type, name, inputs, outputs, attrs, domain=INTERNAL_DOMAIN, since_version=1)``:
    a dispatched ``ir.Node`` for the plan's backend (an error where none is registered).
    ``trains(value)``: whether ``value`` is a parameter the session trains.
    ``sample_offset(x)``: data parallelism's per-step row offset of this rank's share of the
    batch for a tensor ``x`` whose axis 0 is the batch, else None.
    ``unbiased_running_var``, ``frozen_batchnorm_eval``, ``sync_world`` (the world id whose
    ranks share batch statistics, or None): the session's BatchNorm options.
    ``commits``: (state value, its new value) pairs (``commit``), which the step's commit
    phase assigns after a step with finite loss and gradients (running statistics).
    """

    graph: Any
    seed: int
    step_counter: Any
    make_node: Callable
    trains: Callable
    sample_offset: Callable
    unbiased_running_var: bool = False
    frozen_batchnorm_eval: bool = False
    sync_world: int | None = None
    commits: list = field(default_factory=list)

    def new_value(self, base: str, shape, dtype) -> ir.Value:
        """A new activation of the graph, named uniquely after ``base``."""
        v = ir.Value(self.graph.unique_name(base), tuple(shape), np.dtype(dtype))
        self.graph.values[v.name] = v
        return v

    def commit(self, state: ir.Value, new: ir.Value) -> None:
        """``state`` takes ``new``'s value after each step with finite loss and gradients,
        where it is a stored parameter (a running statistic); a computed one keeps none."""
        if state.kind == ir.PARAM:
            self.commits.append((state, new))


@dataclass(frozen=True)
class GradientDef:
    """A gradient rule for an op registered elsewhere (a builtin with none, or one to replace):
    returned from ``tr_onnx_op_definitions`` like an OpDef. The op keeps its kernels; the
    registry reports the change (``tr-onnx plugins``)."""

    op_type: str
    versions: tuple[int, ...]
    gradient: Callable
    domain: str = ""
    grad_inputs: tuple[int, ...] | None = None


@dataclass(frozen=True)
class KernelDef:
    """One backend's kernel for an op whose OpDef another op set (or module) registers: its
    shape, layout and gradient rules stay in that OpDef, which gains ``kernels[backend]``.
    Returned from ``tr_onnx_op_definitions`` like an OpDef; the builtin cuda bindings
    (``backends/cuda/ops/<family>.py``) are KernelDefs of the ``ops/<family>.py`` OpDefs.

    ``versions``: the since_versions the kernel implements; None means every version
    registered for the op when the KernelDef is (the registry lists them, so ``tr-onnx ops``
    shows each). A key the backend already has is the registry's usual error, unless
    ``overrides=True``."""

    op_type: str
    backend: str
    kernel: KernelFactory | CudaKernel
    versions: tuple[int, ...] | None = None
    domain: str = ""
    overrides: bool = False


@dataclass(frozen=True)
class CudaKernel:
    """A CUDA C++ kernel for the cuda backend. ``source`` defines ``extern "C" __global__``
    entry points ``<function>_f32`` and ``<function>_f16`` (float16 passed as raw 16-bit
    ``unsigned short``). ``launch`` says how the backend calls them: ``"elementwise"`` passes
    ``(const T* in0, ..., T* out0, ..., long long n)`` over the logical elements, then the
    attributes named in ``scalar_attrs`` as float scalars; ``"bias_last_axis"`` is the same with
    the length of a last-axis bias input after ``n``. Compiled with NVRTC when the cuda backend
    plans a model; a CPU test compiles every registered source for sm_90."""

    source: str
    function: str
    launch: str = "elementwise"
    scalar_attrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class TensorInfo:
    """What a kernel knows of one input/output at plan time.

    ``shape`` is the shape of the array the kernel receives: the logical shape, except for a
    ``GatherRowsLayout`` value (flattened feature map, permuted weight) where it is physical.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    layout: Layout
    logical_shape: tuple[int, ...]


class KernelContext:
    """Everything a kernel factory may use at plan time."""

    def __init__(self, node, inputs, outputs, consts, backend: str):
        self.node = node
        self.attrs: dict[str, Any] = node.attrs
        self.inputs: list[TensorInfo | None] = inputs
        self.outputs: list[TensorInfo | None] = outputs
        self.backend = backend
        self.since_version: int = node.since_version
        self._consts: list[np.ndarray | None] = consts
        self.workspace_requests: list[tuple[tuple[int, ...], np.dtype]] = []

    @property
    def name(self) -> str:
        return self.node.name

    def const(self, index: int) -> np.ndarray | None:
        """Input ``index``'s value if it is a plan-time constant, else None (also if absent).

        Constants are folded values, non-float initializers and ``const_inputs``; a parameter
        (a float initializer, trainable) is read in ``run``, never captured here."""
        if index >= len(self._consts):
            return None
        return self._consts[index]

    def has_input(self, index: int) -> bool:
        return index < len(self.inputs) and self.inputs[index] is not None

    def has_output(self, index: int) -> bool:
        return index < len(self.outputs) and self.outputs[index] is not None

    def workspace(self, shape, dtype) -> int:
        """Reserve a scratch buffer live only while this node runs; returns its index in ``ws``."""
        self.workspace_requests.append((tuple(int(d) for d in shape), np.dtype(dtype)))
        return len(self.workspace_requests) - 1

    def error(self, message: str) -> Exception:
        return UnsupportedModelError(f"{self.node.label}: {message}", [])
