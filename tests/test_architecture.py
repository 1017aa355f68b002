"""The folder rules of docs/ARCHITECTURE.md, held by parsing every module's imports (module
level and inside functions; ``if TYPE_CHECKING:`` blocks are type hints, not imports), and the
module size limits the cuda-backend issue set (no module over 900 lines, the executor under
500)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tr_onnx"
CORE = ("ir", "layouts", "dtypes", "errors", "opdef", "hookspecs", "registry", "memory",
        "importer", "feeds", "export_advice", "legacy_opsets", "shape_checks", "host_blas",
        "torch_metadata")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(p for p in parts if p != "__init__")] = path
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in ast.walk(node):
                if hasattr(child, "lineno"):
                    lines.add(child.lineno)
    return lines


def imports_of(name: str, path: Path) -> set[str]:
    """The tr_onnx modules ``name`` imports (``ops.conv``, ``backends.cuda.bind``...) and any
    third-party top-level package it imports at module level (prefixed ``ext:``)."""
    tree = ast.parse(path.read_text())
    hints = _type_checking_lines(tree)
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in hints:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{a.name}".lstrip(".") for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module.startswith("tr_onnx"):
            found.add(node.module.removeprefix("tr_onnx").lstrip("."))
    for node in tree.body:  # module-level third-party imports
        if isinstance(node, ast.Import):
            found.update(f"ext:{a.name.split('.')[0]}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(f"ext:{node.module.split('.')[0]}")
    return found


def _under(target: str, prefixes) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


RULES = {  # module prefix -> packages it must not import
    "ops": ("passes", "backends", "training", "compiler", "session"),
    "passes": ("ops", "backends", "training", "compiler", "session"),
    "backends": ("training", "session", "testing"),
    **{core: ("ops", "passes", "backends", "training", "compiler", "session") for core in CORE},
}


@pytest.mark.parametrize("prefix", sorted(RULES))
def test_imports_go_down_the_stack(prefix):
    modules = {n: p for n, p in _modules().items() if _under(n, [prefix])}
    assert modules, prefix
    bad = {n: sorted(t for t in imports_of(n, p) if _under(t, RULES[prefix]))
           for n, p in modules.items()}
    assert not {n: t for n, t in bad.items() if t}


def test_cupy_and_cudnn_are_imported_only_inside_functions():
    for name, path in _modules().items():
        assert not {"ext:cupy", "ext:cudnn", "ext:cupy_backends"} & imports_of(name, path), name


def test_no_module_over_900_lines_and_the_cuda_executor_under_500():
    sizes = {n: len(p.read_text().splitlines()) for n, p in _modules().items()}
    assert max(sizes.values()) <= 900, max(sizes, key=sizes.get)
    assert sizes["backends.cuda.executor"] < 500
