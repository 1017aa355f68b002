"""Bind every node to its OpDef for one backend, once, at plan time."""

from __future__ import annotations

from functools import partial

from ..errors import UnsupportedModelError, unsupported_message
from ..ir import Graph
from ..registry import OpRegistry


def dispatch(graph: Graph, registry: OpRegistry, backend: str) -> None:
    """Set ``node.opdef`` for every node; one error lists all nodes without a kernel."""
    missing: dict[tuple[str, str, int], list[str]] = {}
    for node in graph.nodes:
        node.opdef = registry.lookup(node.domain, node.op_type, node.since_version, backend)
        if node.opdef is not None:
            for name, value in node.opdef.attr_defaults.items():
                node.attrs.setdefault(name, value)
        if node.opdef is None:
            key = (node.domain, node.op_type, node.since_version)
            missing.setdefault(key, []).append(node.name)
    if missing:
        entries = [(d, o, v, n) for (d, o, v), n in missing.items()]
        raise UnsupportedModelError(unsupported_message(entries, backend, registered=partial(
            registry.registered_versions, backend=backend)), entries)
