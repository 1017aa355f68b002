"""``InferenceSession``: onnxruntime's call shape over a tr_onnx plan, so a user can swap it in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import onnx

from .backends import Backend, ExecutorAPI, backend_for, check_cuda_graphs
from .compiler import (
    DEFAULT_MAX_PLAN_BYTES,
    DEFAULT_MAX_PLANS,
    CompiledPlan,
    PlanCache,
    compile_plan,
    plan_key,
)
from .feeds import check_feed, check_output_names
from .importer import (
    DEFAULT_FOLD_LIMIT_BYTES,
    ImportedModel,
    InputSpec,
    check_byte_limit,
    import_model,
)
from .passes.control_flow import output_reader
from .passes.inference_folds import (
    apply_inference_folds,
    finite_rewrites,
    freeze_parameters,
    fuse_matmul_bias,
)
from .passes.value_bounds import BOUNDED_DTYPES
from .registry import build_registry, default_registry

_TYPE_NAMES = {np.dtype(np.float32): "tensor(float)", np.dtype(np.float64): "tensor(double)",
               np.dtype(np.float16): "tensor(float16)", np.dtype(np.bool_): "tensor(bool)"}


@dataclass(frozen=True)
class NodeArg:
    """What ``get_inputs``/``get_outputs`` return, like onnxruntime's NodeArg."""

    name: str
    shape: list
    type: str


def _node_arg(spec: InputSpec) -> NodeArg:
    shape = list(spec.shape) if spec.shape is not None else None
    return NodeArg(spec.name, shape, _TYPE_NAMES.get(spec.dtype, f"tensor({spec.dtype.name})"))


def _inference_folds(graph, registry, backend: str, fuse: bool = True) -> float | None:
    """What an inference plan may rewrite because its parameters never change and nothing
    reads its intermediate values afterwards. Returns the limit on the float inputs' values its
    fused activations need (``finite_rewrites``), or None."""
    apply_inference_folds(graph)
    freeze_parameters(graph)
    limit = finite_rewrites(graph, registry, backend) if fuse else None
    fuse_matmul_bias(graph, registry, backend)  # exact: in the unfused plan too
    return limit


_EXACT = ("unfused",)  # the key suffix of a plan without limits on its inputs' values


def _within(feed, names: tuple[str, ...], limit: float) -> bool:
    """Whether the named inputs are finite and within +-``limit`` (NaN fails both tests).

    A sum of squares first, one BLAS dot (0.6-0.8 us on LeNet's [32, 1, 8, 8] and the MLP's
    [32, 64], where the max and the min take 2.2-2.8): at most (limit / 2)^2, every |x| is
    below the limit, float32 rounding included for fewer than 10^7 elements (the sum is then
    within 60% of the exact one). A larger sum, inf or NaN leaves it to the max and the min."""
    for name in names:
        x = feed[name]
        if not x.size:
            continue
        if x.size < _SQUARES_EXACT_ENOUGH and x.flags.c_contiguous:
            flat = x.reshape(-1)
            if np.dot(flat, flat) <= (limit / 2) ** 2:
                continue
        if not (np.maximum.reduce(x, axis=None) <= limit and
                np.minimum.reduce(x, axis=None) >= -limit):
            return False
    return True


_SQUARES_EXACT_ENOUGH = 10 ** 7


class InferenceSession:
    """Run an ONNX model with tr_onnx.

    ``model``: a path, bytes or ``onnx.ModelProto``. ``backend``: ``"numpy"``, ``"cuda"``,
    ``"auto"`` (cuda when a GPU is usable) or a ``backends.Backend`` (the tests' cuda over the
    host emulator, ``testing.host_emulator.emulated_cuda``). ``channel_align``: pad channels of
    feature maps to this multiple (default: the backend's, 1 for numpy, 8 for cuda; 8 reproduces
    the GPU's layout on the CPU). ``plugins``: op-set modules or objects to register for this
    session in addition to the installed ones. A plan is made per concrete input shape (symbolic
    dimensions stay symbolic until then) and cached. ``cuda_graphs`` (cuda): ``"fallback"``
    (default) captures each plan's run into a CUDA graph and, where that fails, warns naming the
    node and runs it eagerly; ``"require"`` raises instead; ``"off"`` never captures.
    ``external_data_dir``: the folder a model given as bytes or a ModelProto keeps its external
    data in (without it, such a model may not reference external data; a path's model reads it
    beside the file). ``fold_limit_bytes``: constant folding makes no value larger than this
    (default 64 MiB; None: no limit); a larger one runs as a node. ``max_arena_bytes``: a plan
    whose arena would be larger is an ``ArenaSizeError`` naming its largest values, before
    anything is allocated (default None: the machine's physical memory on numpy). ``max_plans``:
    compiled plans kept (default 8, the most recently used; each holds its arena); an evicted
    one is compiled again when its shapes come back. ``max_plan_bytes``: of those, only as many,
    most recently used first, as fit in this many bytes (``compiler.plan_bytes``: arenas and the
    arrays kernels made at plan time; default 256 MiB; None: no limit); the current plan stays
    whatever its size.
    """

    def __init__(self, model: str | Path | bytes | onnx.ModelProto,
                 backend: str | Backend = "numpy", channel_align: int | None = None,
                 plugins=(), reuse_memory: bool = True, cuda_graphs: str = "fallback",
                 external_data_dir: str | Path | None = None,
                 fold_limit_bytes: int | None = DEFAULT_FOLD_LIMIT_BYTES,
                 max_arena_bytes: int | None = None, max_plans: int = DEFAULT_MAX_PLANS,
                 max_plan_bytes: int | None = DEFAULT_MAX_PLAN_BYTES):
        self.target: Backend = backend_for(backend)  # what its plans are compiled for
        self.backend = self.target.name
        self.cuda_graphs = check_cuda_graphs(cuda_graphs)
        self.channel_align = channel_align or self.target.channel_align
        if self.channel_align < 1:
            raise ValueError(f"channel_align must be >= 1, got {channel_align}")
        self.max_arena_bytes = check_byte_limit("max_arena_bytes", max_arena_bytes)
        self._plans = PlanCache(max_plans, max_plan_bytes)
        self._bound: dict[tuple, _BoundRun] = {}  # plan key -> its prepared run
        self._runs: dict[tuple, _BoundRun] = {}  # feed signature -> the same
        registry = build_registry(plugins) if plugins else default_registry()
        self.imported: ImportedModel = import_model(model, registry, self.backend,
                                                    external_data_dir=external_data_dir,
                                                    fold_limit_bytes=fold_limit_bytes)
        self.reuse_memory = reuse_memory
        self._output_names = check_output_names(None, self.imported.outputs)  # run(None, ...)

    def get_inputs(self) -> list[NodeArg]:
        return [_node_arg(s) for s in self.imported.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(s) for s in self.imported.outputs]

    def get_providers(self) -> list[str]:
        return [f"tr_onnx:{self.backend}"]

    def plan_for(self, feed: dict[str, np.ndarray]) -> CompiledPlan:
        """The compiled plan for these input shapes (and const-feed values), made once (and
        again if it was evicted since: ``max_plans``, ``max_plan_bytes``)."""
        return self._plan(*plan_key(feed, self.imported.const_feeds))

    def _plan(self, key: tuple, shapes: dict, const_feeds: dict) -> CompiledPlan:
        """The plan for ``key``; a key ending in ``_EXACT`` has no fused activations."""
        plan = self._plans.lookup(key)
        if plan is None:
            transform = partial(_inference_folds, registry=self.imported.registry,
                                backend=self.backend, fuse=key[-len(_EXACT):] != _EXACT)
            plan = compile_plan(self.imported, shapes, const_feeds, self.target,
                                self.channel_align, reuse=self.reuse_memory,
                                cuda_graphs=self.cuda_graphs, max_arena_bytes=self.max_arena_bytes,
                                transform=transform)
            self._plans[key] = plan
            if self._plans.evict():  # their runs go with them (each holds its plan's arena)
                self._bound = {k: r for k, r in self._bound.items() if k in self._plans}
                self._runs = {s: r for s, r in self._runs.items() if r.key in self._plans}
        return plan

    def run(self, output_names: list[str] | None, input_feed: dict[str, np.ndarray],
            run_options=None) -> list[np.ndarray]:
        """Outputs named in ``output_names`` (all when None), as compact NCHW host arrays. A bad
        feed or output name is an ``InputError`` (``tr_onnx.feeds``) before anything runs."""
        names = self._output_names if output_names is None else \
            check_output_names(output_names, self.imported.outputs)
        signature = None if self.imported.const_feeds else _signature(input_feed)
        bound = self._runs.get(signature) if signature is not None else None
        if bound is None:
            feed = check_feed(input_feed, self.imported.inputs)
            bound = self._bind(feed)
            if signature is not None:
                self._runs[signature] = bound
        else:  # the same names, order, shapes and dtypes as a feed checked before: it passes
            feed = input_feed
            self._plans.move_to_end(bound.key)
        if bound.input_limit is not None and \
                not _within(feed, bound.limited_inputs, bound.input_limit):
            bound = self._bind(feed, exact=True)  # a value the fused plan is not proven for
        writers = bound.writers
        for name, x in feed.items():
            if name in writers:  # const feeds are part of the plan, not written
                writers[name](x)
        bound.executor.run()
        readers = bound.readers
        return [readers[n]() for n in names]

    def _bind(self, feed: dict[str, np.ndarray], exact: bool = False) -> _BoundRun:
        """The prepared run of the plan for this checked feed, made once per plan (``exact``:
        of the plan without fused activations)."""
        key, shapes, const_feeds = plan_key(feed, self.imported.const_feeds)
        if exact:
            key = (*key, *_EXACT)
        plan = self._plan(key, shapes, const_feeds)
        bound = self._bound.get(key)
        if bound is None:
            executor = plan.executor
            types = {vi.name: vi.type for vi in self.imported.proto.graph.output}
            listed = [v.name for v in plan.graph.outputs]
            bound = self._bound[key] = _BoundRun(
                key, executor,
                {s.name: executor.input_writer(s.name) for s in self.imported.inputs
                 if s.name not in self.imported.const_feeds},
                {o.name: output_reader(executor, o.name, types[o.name], listed)
                 for o in self.imported.outputs},
                plan.info, tuple(v.name for v in plan.graph.inputs
                                 if v.dtype in BOUNDED_DTYPES and v.name in feed))
        return bound


@dataclass(frozen=True, eq=False)
class _BoundRun:
    """What ``InferenceSession.run`` does on one plan that no feed value changes, prepared
    once: the plan's cache key, its executor, a writer per data input and a reader per model
    output (each on views made once; together they were ~30 µs of a 0.1 ms MLP run);
    ``input_limit``: the plan's fused activations are proven exact only while the float inputs
    ``limited_inputs`` are finite and within +-``input_limit`` (None: no limit)."""

    key: tuple
    executor: ExecutorAPI
    writers: dict[str, Callable[[np.ndarray], None]]
    readers: dict[str, Callable[[], object]]
    input_limit: float | None = None
    limited_inputs: tuple[str, ...] = ()


def _signature(feed) -> tuple | None:
    """(name, shape, dtype) of every value of a dict of plain arrays, in the dict's order (None
    for anything else): a feed with the signature of one ``check_feed`` passed passes too."""
    if type(feed) is not dict:
        return None
    signature = []
    for name, x in feed.items():
        if type(x) is not np.ndarray:
            return None
        signature.append((name, x.shape, x.dtype))
    return tuple(signature)
