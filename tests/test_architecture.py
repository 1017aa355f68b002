"""The folder rules of docs/ARCHITECTURE.md, held over EVERY module of the package (found by
walking it: a new module without a layer fails), by parsing each module's imports (module
level and inside functions; ``if TYPE_CHECKING:`` blocks are type hints, not imports):

* each module has a layer, and imports only from its own layer or those below;
* no import cycle among tr_onnx modules, function-level imports counted: an import moved into
  a function to dodge a cycle still makes one;
* an import inside a function is the standard library, an optional or heavy third-party
  package (imported where it is used, so ``import tr_onnx`` stays light), or named in
  ``FUNCTION_LEVEL`` with the reason;
* no module over 700 lines, the cuda executor under 500."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tr_onnx"

LAYERS = [  # bottom to top: (layer, module prefixes); "" is the package's __init__
    ("base", ("errors", "domains")),  # what every module may name: its errors, the op domains
    ("cpu_libraries", ("host_blas", "blas_threads", "onednn", "host_math")),
    ("core", ("ir", "layouts", "dtypes", "opdef", "hookspecs", "registry", "memory",
              "importer", "constant_folding", "const_feeds", "feeds", "export_advice",
              "legacy_opsets", "shape_checks", "torch_metadata")),
    ("standalone", ("distributed", "optim", "losses", "data", "finetune")),
    ("ops", ("ops",)),
    ("passes", ("passes", "plugin")),
    ("backends", ("backends",)),
    ("compiler", ("subplan", "compiler")),
    ("testing", ("testing",)),
    ("inference", ("session",)),
    ("training", ("training",)),
    ("application", ("", "__main__", "cli", "cli_train", "cli_train_args", "cli_resume",
                     "cli_finetune", "onnx_backend")),
]
NOT_SIDEWAYS = {"passes": ("ops",)}  # within the stack's order, still never imported
"""Gradient rules build IR through the ``GradBuilder`` they are handed: passes never see an
op family's module."""

OPTIONAL_PACKAGES = frozenset({
    "cupy", "cupy_backends", "cudnn", "cuda", "torch", "onnxruntime", "PIL", "pyarrow",
    "matplotlib", "tensorboardX", "datasets", "tokenizers", "sklearn", "mpi4py",
    "onnx",  # a dependency, but a heavy one: ``import tr_onnx`` defers it (PEP 562)
})
"""Third-party packages a function may import where it uses them: optional (an extra, or a
GPU) or costly to import."""

_CLI = ("each command imports what it runs, so `tr-onnx --help` and `tr-onnx ops` load no "
        "training stack")
FUNCTION_LEVEL = {  # module -> why its functions import tr_onnx modules (or private NumPy)
    "__main__": "the entry point imports the command line when run",
    "cli": _CLI,
    "cli_train": _CLI,
    "cli_finetune": _CLI,
    "cli_resume": _CLI,
    "cli_train_args": _CLI,
    "backends.cuda.device": "NVRTC and the cuDNN frontend run on a GPU only",
    "backends.cuda.deviceless": "the deviceless cuDNN check, run by `tr-onnx inspect`",
    "backends.cuda.nccl": "the MPI world, looked up only when a data-parallel plan binds",
    "testing.host_nccl": "the MPI world, looked up only when a data-parallel plan binds",
    "memory": "oneDNN's copy, loaded only for large strided float32 views",
    "ops.pool": "oneDNN's pooling, an optional library (onednn-cpu-gomp)",
    "training.batches": "datasets load on demand",
    "training.checkpoints": "LoRA, for LoRA checkpoints only",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(p for p in parts if p != "__init__")] = path
    return out


MODULES = _modules()


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in ast.walk(node):
                if hasattr(child, "lineno"):
                    lines.add(child.lineno)
    return lines


def _package_of(name: str, path: Path) -> list[str]:
    parts = name.split(".") if name else []
    return parts if path.name == "__init__.py" else parts[:-1]


def _targets(node: ast.ImportFrom | ast.Import, package: list[str]) -> set[str]:
    """The tr_onnx modules an import statement names (``ops.conv``...; a name imported from a
    package may be a module: ``from . import ir``), each a key of ``MODULES``, or the
    third-party top-level package (prefixed ``ext:``)."""
    if isinstance(node, ast.Import):
        return {a.name.removeprefix("tr_onnx.") if a.name.startswith("tr_onnx") else
                f"ext:{a.name.split('.')[0]}" for a in node.names}
    if node.level:
        base = ".".join(package[:len(package) - node.level + 1] +
                        ([node.module] if node.module else []))
    elif node.module.split(".")[0] == "tr_onnx":
        base = node.module.removeprefix("tr_onnx").lstrip(".")
    else:
        return {f"ext:{node.module.split('.')[0]}"}
    subs = {f"{base}.{a.name}".lstrip(".") for a in node.names}
    found = subs & set(MODULES)
    if found != subs:  # a name defined in the module (or package) itself
        found.add(base)
    return found


def imports_of(name: str, path: Path) -> dict[str, bool]:
    """Every module ``name`` imports -> whether only inside functions: tr_onnx modules by their
    ``MODULES`` key, third-party packages as ``ext:<package>``."""
    tree = ast.parse(path.read_text())
    hints = _type_checking_lines(tree)
    package = _package_of(name, path)
    found: dict[str, bool] = {}

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and child.lineno not in hints:
                for target in _targets(child, package):
                    found[target] = found.get(target, True) and in_function
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.Lambda,
                                                           ast.AsyncFunctionDef)))

    visit(tree, False)
    return found


IMPORTS = {name: imports_of(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> int | None:
    best = None  # the longest prefix decides ("" is only the package itself)
    for rank, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if name == p or (p and name.startswith(p + ".")):
                if best is None or len(p) > best[0]:
                    best = (len(p), rank)
    return None if best is None else best[1]


def test_every_module_has_a_layer():
    assert len(MODULES) > 100  # the walk found the package
    assert not [n or "<tr_onnx/__init__.py>" for n in MODULES if _layer(n) is None]


def test_imports_go_down_the_layers():
    up = {}
    for name, targets in IMPORTS.items():
        rank, layer = _layer(name), LAYERS[_layer(name)][0]
        bad = sorted(t for t in targets if t in MODULES and (
            _layer(t) > rank or any(t == p or t.startswith(p + ".")
                                    for p in NOT_SIDEWAYS.get(layer, ()))))
        if bad:
            up[name] = bad
    assert not up


def _cycles() -> list[list[str]]:
    """The strongly connected components (more than one module) of the import graph, Tarjan's
    algorithm; function-level imports are edges too."""
    graph = {n: sorted(t for t in targets if t in MODULES and t != n)
             for n, targets in IMPORTS.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_no_import_cycle_counting_function_level_imports():
    """A cycle's function-level imports are named: moving an import into a function hides a
    cycle from Python, not from the design."""
    hidden = {tuple(c): sorted(f"{n} -> {t}" for n in c for t, late in IMPORTS[n].items()
                               if late and t in c) for c in _cycles()}
    assert not hidden


def test_function_level_imports_are_optional_packages_or_named_with_a_reason():
    stdlib = set(sys.stdlib_module_names)
    unexplained = {}
    for name, targets in IMPORTS.items():
        late = sorted(t for t, in_function in targets.items() if in_function and not (
            t.startswith("ext:") and (t[4:] in stdlib or t[4:] in OPTIONAL_PACKAGES)))
        if late and name not in FUNCTION_LEVEL:
            unexplained[name] = late
    assert not unexplained
    assert not sorted(set(FUNCTION_LEVEL) - set(MODULES)), "a named module no longer exists"


def test_cupy_and_cudnn_are_imported_only_inside_functions():
    for name, targets in IMPORTS.items():
        eager = {t for t, late in targets.items() if not late}
        assert not {"ext:cupy", "ext:cudnn", "ext:cupy_backends"} & eager, name


def test_no_module_over_700_lines():
    """Issue 34's limit. Fails, naming every module over it, until the issue's splits land."""
    sizes = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    over = {n: lines for n, lines in sorted(sizes.items()) if lines > 700}
    assert not over, f"modules over 700 lines: {over}"


def test_the_cuda_executor_is_under_500_lines():
    assert len(MODULES["backends.cuda.executor"].read_text().splitlines()) < 500


@pytest.mark.parametrize("layer", [layer for layer, _ in LAYERS])
def test_every_layer_holds_a_module(layer):
    rank = [n for n, _ in LAYERS].index(layer)
    assert any(_layer(n) == rank for n in MODULES)


def test_the_architecture_page_names_every_module():
    """docs/ARCHITECTURE.md describes every module: a module is named there (its file stem as
    a word), a package by its folder (``data/``)."""
    page = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    missing = []
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            folder = path.parent.relative_to(PACKAGE).as_posix()
            named = f"{folder}/" in page if folder != "." else "`__init__.py`" in page
        else:
            named = re.search(rf"\b{re.escape(path.stem)}\b", page) is not None
        if not named:
            missing.append(name)
    assert not missing, f"docs/ARCHITECTURE.md does not name {missing}"
