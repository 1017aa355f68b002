"""The op registry: every (domain, op_type, since_version, backend) an op set provides.

Op sets are pluggy plugins implementing ``tr_onnx_op_definitions`` (see ``hookspecs``). Ours
are loaded by module name, the way pytest loads its builtin plugins; third-party ones through
the entry-point group ``tr_onnx``. Dispatch happens once, when a plan is made.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from dataclasses import replace
from functools import lru_cache
from typing import NamedTuple

import onnx
import pluggy

from . import hookspecs
from .domains import ONNX_DOMAINS
from .errors import RegistryError
from .opdef import GradientDef, KernelDef, OpDef

BUILTIN_OPSETS = (
    "tr_onnx.ops.elementwise",
    "tr_onnx.ops.dropout",
    "tr_onnx.ops.unary",
    "tr_onnx.ops.tensor",
    "tr_onnx.ops.pad",
    "tr_onnx.ops.cumulative",
    "tr_onnx.ops.indexing",
    "tr_onnx.ops.matmul",
    "tr_onnx.ops.conv",
    "tr_onnx.ops.conv_grad",
    "tr_onnx.ops.conv_variants",
    "tr_onnx.ops.fused_conv",
    "tr_onnx.ops.pool",
    "tr_onnx.ops.normalization",
    "tr_onnx.ops.batch_norm",
    "tr_onnx.ops.lrn",
    "tr_onnx.ops.reduce",
    "tr_onnx.ops.losses",
    "tr_onnx.ops.attention",
    "tr_onnx.ops.attention_inference",
    "tr_onnx.ops.layout_convert",
    "tr_onnx.ops.optimizers",
    "tr_onnx.ops.collective",
    "tr_onnx.ops.random",
    "tr_onnx.ops.resize",
    "tr_onnx.ops.grid_sample",
    "tr_onnx.ops.spatial_transform",
    "tr_onnx.ops.dynamic",
    "tr_onnx.ops.recurrent",
    "tr_onnx.ops.quantize",
    "tr_onnx.ops.sequence",
    "tr_onnx.ops.signal",
    "tr_onnx.ops.ngram",
    "tr_onnx.ops.tree_ensemble",
)
# each backend's bindings of the builtin ops, one module per op family (importable without the
# backend's libraries: CuPy is imported only when a device is made)
BUILTIN_BACKEND_KERNELS = tuple(f"tr_onnx.backends.cuda.ops.{family}" for family in (
    "elementwise", "unary", "tensor", "indexing", "matmul", "conv", "pool", "normalization",
    "reduce", "losses", "layout_convert", "optimizers", "collective", "resize", "attention",
    "recurrent", "spatial_transform", "quantize", "random", "lrn", "dynamic"))


class OpKey(NamedTuple):
    domain: str
    op_type: str
    since_version: int
    backend: str


def _key_words(key: OpKey) -> str:
    return (f"{key.op_type} (domain {key.domain or 'ai.onnx'!r}, since_version "
            f"{key.since_version}, backend {key.backend!r})")


def canonical_domain(domain: str) -> str:
    return "" if domain in ONNX_DOMAINS else domain


@lru_cache(maxsize=4096)  # asked per node of every plan; onnx's lookup costs ~20 us
def schema_for(domain: str, op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    """The ONNX schema in force for ``op_type`` at ``opset`` of ``domain``, or None."""
    try:
        return onnx.defs.get_schema(op_type, max_inclusive_version=opset,
                                    domain=canonical_domain(domain))
    except onnx.defs.SchemaError:
        return None


class OpRegistry:
    """Keys -> (OpDef, source). Built from a pluggy PluginManager; read-only afterwards."""

    def __init__(self) -> None:
        self._entries: dict[OpKey, tuple[OpDef, str]] = {}
        self.plugin_manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.plugin_manager.add_hookspecs(hookspecs)
        self.overrides: list[str] = []  # what plugins replaced on purpose, in words
        self.plugins: dict[str, dict] = {}  # plugin name -> {"origin": ..., "ops": [...]}
        self._overridden: dict[tuple, str] = {}  # key (or gradient key) -> overriding source

    def register(self, opdef: OpDef | GradientDef, source: str) -> None:
        """Add every key ``opdef`` covers. A key another source already has is an error naming
        both, unless the new definition says ``overrides=True`` (then it replaces the old one
        and the override is reported); two overrides of one key are an error too."""
        if isinstance(opdef, GradientDef):
            return self._register_gradient(opdef, source)
        if isinstance(opdef, KernelDef):
            return self._register_kernel(opdef, source)
        for version in opdef.versions:
            for backend in opdef.kernels:
                key = OpKey(canonical_domain(opdef.domain), opdef.op_type, version, backend)
                self._claim(key, source, opdef.overrides)
                self._entries[key] = (opdef, source)

    def _claim(self, key: OpKey, source: str, overrides: bool) -> None:
        """``source`` takes ``key``: an error naming both sources if another has it, unless
        ``overrides`` (then the override is reported; a second override is an error too)."""
        if key not in self._entries:
            return
        other = self._entries[key][1]
        if not overrides or key in self._overridden:
            raise RegistryError(
                f"op {_key_words(key)} is registered twice: by {other!r} and by {source!r}"
                + ("" if overrides else " (a plugin replaces an op or a kernel with "
                   "overrides=True)"))
        self._overridden[key] = source
        self._report(f"{source} overrides op {_key_words(key)} of {other}")

    def _register_kernel(self, kdef: KernelDef, source: str) -> None:
        """A backend's kernel for an op registered elsewhere: every key of the op's versions
        (all backends) then sees the OpDef with ``kernels[backend]`` added, and the new key
        is the KernelDef's source's."""
        domain = canonical_domain(kdef.domain)
        have = sorted({k.since_version for k in self._entries
                       if k.domain == domain and k.op_type == kdef.op_type})
        versions = have if kdef.versions is None else list(kdef.versions)
        unknown = [v for v in versions if v not in have]
        if not versions or unknown:
            raise RegistryError(f"{source}: {kdef.backend} kernel for {kdef.op_type} (domain "
                                f"{kdef.domain or 'ai.onnx'!r}, versions {unknown or 'all'}), "
                                f"which no op set registers (registered versions: {have})")
        for version in versions:
            key = OpKey(domain, kdef.op_type, version, kdef.backend)
            self._claim(key, source, kdef.overrides)
            same_op = [k for k in self._entries if k[:3] == key[:3]]
            opdef = self._entries[same_op[0]][0]
            merged = replace(opdef, kernels={**opdef.kernels, kdef.backend: kdef.kernel})
            for k in same_op:
                self._entries[k] = (merged, self._entries[k][1])
            self._entries[key] = (merged, source)

    def _register_gradient(self, grad: GradientDef, source: str) -> None:
        keys = [k for k in self._entries if k.domain == canonical_domain(grad.domain)
                and k.op_type == grad.op_type and k.since_version in grad.versions]
        if not keys:
            raise RegistryError(f"{source}: gradient for {grad.op_type} (domain "
                                f"{grad.domain or 'ai.onnx'!r}, versions {list(grad.versions)}), "
                                "which no op set registers")
        for key in keys:
            gkey = ("gradient", key)
            if gkey in self._overridden:
                raise RegistryError(f"gradient of {_key_words(key)} is given twice: by "
                                    f"{self._overridden[gkey]!r} and by {source!r}")
            opdef, owner = self._entries[key]
            self._overridden[gkey] = source
            what = "replaces the gradient" if opdef.gradient is not None else "adds a gradient"
            self._report(f"{source} {what} of op {_key_words(key)} ({owner})")
            self._entries[key] = (replace(opdef, gradient=grad.gradient, differentiable=True,
                                          grad_inputs=grad.grad_inputs), owner)

    def _report(self, message: str) -> None:
        self.overrides.append(message)
        logging.getLogger("tr_onnx").info(message)

    def add_plugin(self, plugin, name: str | None = None, origin: str | None = None) -> None:
        """Register a module/object implementing the hooks and collect its op definitions."""
        try:
            name = self.plugin_manager.register(plugin, name=name)
            self.plugin_manager.check_pending()
        except pluggy.PluginValidationError as exc:
            if name is not None and self.plugin_manager.get_plugin(name) is not None:
                self.plugin_manager.unregister(name=name)
            raise RegistryError(f"op-set plugin {name or plugin!r}: {exc}") from None
        origin = origin or getattr(plugin, "__file__", None) or repr(plugin)
        plugin = self.plugin_manager.get_plugin(name)
        if origin == "builtin":  # ours: a failure is a bug to see, not to step around
            return self._collect(plugin, name, origin)
        saved = dict(self._entries), list(self.overrides), dict(self._overridden)
        try:
            self._collect(plugin, name, origin)
        except RegistryError:  # two sources for one key: the user must choose (see _claim)
            raise
        except _BadHook as exc:  # a broken third-party plugin must not stop the rest
            self._entries, self.overrides, self._overridden = saved
            self.plugin_manager.unregister(plugin)
            warnings.warn(f"tr_onnx plugin {name!r} ({origin}): {exc}; none of its op "
                          "definitions is registered", stacklevel=3)

    def _collect(self, plugin, name: str, origin: str) -> None:
        ops = []
        for impl in self.plugin_manager.hook.tr_onnx_op_definitions.get_hookimpls():
            if impl.plugin is plugin:
                for opdef in _definitions(impl.function):
                    try:
                        self.register(opdef, name)
                    except RegistryError:
                        raise
                    except Exception as exc:  # a definition whose fields are not what they
                        raise _BadHook(f"{type(opdef).__name__} {opdef.op_type!r} it returned "
                                       f"does not register: {exc!r}") from None  # say
                    kind = ("gradient of " if isinstance(opdef, GradientDef) else
                            f"{opdef.backend} kernel of " if isinstance(opdef, KernelDef)
                            else "")
                    ops.append(f"{kind}{opdef.domain or 'ai.onnx'}.{opdef.op_type}")
        self.plugins[name] = {"origin": origin, "ops": ops}

    def load_entry_points(self) -> None:
        """Load third-party op sets from the entry-point group ``tr_onnx``.

        A plugin that fails to import is reported as a warning naming it; the rest keep working.
        """
        from importlib.metadata import entry_points

        for ep in entry_points(group=hookspecs.PROJECT):
            if self.plugin_manager.get_plugin(ep.name) is not None:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party package must not stop the rest
                warnings.warn(f"tr_onnx plugin {ep.name!r} ({ep.value}) failed to load: {exc!r}",
                              stacklevel=2)
                continue
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "?"
            self.add_plugin(plugin, name=ep.name,
                            origin=f"{dist} (entry point {ep.name} = {ep.value})")

    def lookup(self, domain: str, op_type: str, since_version: int, backend: str) -> OpDef | None:
        entry = self._entries.get(OpKey(canonical_domain(domain), op_type, since_version, backend))
        return entry[0] if entry else None

    def resolve_version(self, domain: str, op_type: str, opset: int) -> int | None:
        """The since_version that the model's ``opset`` of ``domain`` selects for ``op_type``.

        ONNX domains map through the schema; a domain without schemas (a plugin's) takes the
        newest registered version not above ``opset``.
        """
        schema = schema_for(domain, op_type, opset)
        if schema is not None:
            return schema.since_version
        versions = [k.since_version for k in self._entries
                    if k.domain == canonical_domain(domain) and k.op_type == op_type
                    and k.since_version <= opset]
        return max(versions) if versions else None

    def source_of(self, key: OpKey) -> str | None:
        entry = self._entries.get(key)
        return entry[1] if entry else None

    def source_of_node(self, node, backend: str) -> str | None:
        return self.source_of(OpKey(canonical_domain(node.domain), node.op_type,
                                    node.since_version, backend))

    def keys(self) -> list[OpKey]:
        return sorted(self._entries)

    def registered_versions(self, domain: str, op_type: str, backend: str) -> list[int]:
        return sorted(k.since_version for k in self._entries
                      if k.domain == canonical_domain(domain) and k.op_type == op_type
                      and k.backend == backend)

    def op_types(self, backend: str | None = None) -> set[tuple[str, str]]:
        return {(k.domain, k.op_type) for k in self._entries if backend in (None, k.backend)}


class _BadHook(Exception):
    """A plugin's hook raised or returned something that is not its op definitions."""


def _definitions(hook) -> list:
    """What ``hook`` (a plugin's ``tr_onnx_op_definitions``) returned, checked to be a list of
    ``OpDef``/``GradientDef``/``KernelDef`` (None: nothing); ``_BadHook`` saying what is wrong
    otherwise."""
    try:
        defs = hook()
    except Exception as exc:
        raise _BadHook(f"its tr_onnx_op_definitions() raised {exc!r}") from None
    if defs is None:
        return []
    if not isinstance(defs, (list, tuple)):
        raise _BadHook(f"its tr_onnx_op_definitions() returned {_short(defs)} "
                       f"({type(defs).__name__}), not a list of OpDef, GradientDef and KernelDef")
    for i, d in enumerate(defs):
        if not isinstance(d, (OpDef, GradientDef, KernelDef)):
            raise _BadHook(f"item {i} of what its tr_onnx_op_definitions() returned is "
                           f"{_short(d)} ({type(d).__name__}), not an OpDef, GradientDef or "
                           "KernelDef")
    return list(defs)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_default: OpRegistry | None = None


def build_registry(plugins=(), autoload: bool | None = None) -> OpRegistry:
    """A registry with the builtin op sets, entry-point plugins and ``plugins`` (modules or
    objects)."""
    registry = OpRegistry()
    for module_name in BUILTIN_OPSETS + BUILTIN_BACKEND_KERNELS:
        registry.add_plugin(importlib.import_module(module_name), name=module_name,
                            origin="builtin")
    if autoload is None:
        autoload = os.environ.get("TR_ONNX_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0")
    if autoload:
        registry.load_entry_points()
    for plugin in plugins:
        if registry.plugin_manager.is_registered(plugin):
            continue  # an installed plugin passed explicitly too: its entry point loaded it
        registry.add_plugin(plugin, name=getattr(plugin, "__name__", None))
    return registry


def default_registry() -> OpRegistry:
    """The process-wide registry (builtins + entry points), built on first use."""
    global _default
    if _default is None:
        _default = build_registry()
    return _default
