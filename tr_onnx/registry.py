"""The op registry: every (domain, op_type, since_version, backend) an op set provides.

Op sets are pluggy plugins implementing ``tr_onnx_op_definitions`` (see ``hookspecs``). Ours
are loaded by module name, the way pytest loads its builtin plugins; third-party ones through
the entry-point group ``tr_onnx``. Dispatch happens once, when a plan is made.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import NamedTuple

import onnx
import pluggy

from . import hookspecs
from .errors import RegistryError
from .opdef import OpDef

BUILTIN_OPSETS = (
    "tr_onnx.ops.elementwise",
    "tr_onnx.ops.tensor",
    "tr_onnx.ops.matmul",
    "tr_onnx.ops.conv",
    "tr_onnx.ops.pool",
    "tr_onnx.ops.normalization",
    "tr_onnx.ops.reduce",
    "tr_onnx.ops.losses",
    "tr_onnx.ops.layout_convert",
    "tr_onnx.ops.optimizers",
)
ONNX_DOMAINS = ("", "ai.onnx")


class OpKey(NamedTuple):
    domain: str
    op_type: str
    since_version: int
    backend: str


def canonical_domain(domain: str) -> str:
    return "" if domain in ONNX_DOMAINS else domain


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

    def register(self, opdef: OpDef, source: str) -> None:
        """Add every key ``opdef`` covers; a key another source already has is an error."""
        for version in opdef.versions:
            for backend in opdef.kernels:
                key = OpKey(canonical_domain(opdef.domain), opdef.op_type, version, backend)
                if key in self._entries:
                    other = self._entries[key][1]
                    raise RegistryError(
                        f"op {key.op_type} (domain {key.domain or 'ai.onnx'!r}, since_version "
                        f"{key.since_version}, backend {key.backend!r}) is registered twice: by "
                        f"{other!r} and by {source!r}")
                self._entries[key] = (opdef, source)

    def add_plugin(self, plugin, name: str | None = None) -> None:
        """Register a module/object implementing the hooks and collect its op definitions."""
        try:
            name = self.plugin_manager.register(plugin, name=name)
            self.plugin_manager.check_pending()
        except pluggy.PluginValidationError as exc:
            raise RegistryError(f"op-set plugin {name or plugin!r}: {exc}") from None
        self._collect(self.plugin_manager.get_plugin(name), name)

    def _collect(self, plugin, name: str) -> None:
        for impl in self.plugin_manager.hook.tr_onnx_op_definitions.get_hookimpls():
            if impl.plugin is plugin:
                for opdef in impl.function() or []:
                    self.register(opdef, name)

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
            self.add_plugin(plugin, name=ep.name)

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


_default: OpRegistry | None = None


def build_registry(plugins=(), autoload: bool | None = None) -> OpRegistry:
    """A registry with the builtin op sets, entry-point plugins and ``plugins`` (modules/objects)."""
    registry = OpRegistry()
    for module_name in BUILTIN_OPSETS:
        registry.add_plugin(importlib.import_module(module_name), name=module_name)
    if autoload is None:
        autoload = os.environ.get("TR_ONNX_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0")
    if autoload:
        registry.load_entry_points()
    for plugin in plugins:
        registry.add_plugin(plugin, name=getattr(plugin, "__name__", None))
    return registry


def default_registry() -> OpRegistry:
    """The process-wide registry (builtins + entry points), built on first use."""
    global _default
    if _default is None:
        _default = build_registry()
    return _default
