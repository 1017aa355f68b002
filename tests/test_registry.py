"""The pluggy op registry: keys, duplicate detection, opset -> since_version mapping, entry-point
discovery and `tr-onnx ops`."""

import importlib
import json
import sys
import textwrap

import numpy as np
import pytest

from tr_onnx import hookimpl
from tr_onnx.cli import main as cli_main
from tr_onnx.errors import RegistryError
from tr_onnx.registry import OpKey, build_registry, default_registry


def _write_plugin(tmp_path, module: str, body: str, dist: str | None = None) -> None:
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(body))
    if dist:
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[tr_onnx]\n{dist} = {module}\n")


PLUGIN = """
    import numpy as np
    from tr_onnx import hookimpl
    from tr_onnx.opdef import OpDef

    def double(ctx):
        def run(ins, outs, ws):
            np.multiply(ins[0], 2, out=outs[0])
        return run

    @hookimpl
    def tr_onnx_op_definitions():
        return [OpDef({op!r}, (1,), {{"numpy": double}}, domain="com.example")]
"""


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("demo_")]:
        del sys.modules[name]


def test_builtin_keys_and_version_resolution():
    registry = default_registry()
    assert OpKey("", "Relu", 14, "numpy") in registry.keys()
    assert registry.resolve_version("", "Relu", 12) == 6
    assert registry.resolve_version("ai.onnx", "Relu", 14) == 14
    assert registry.source_of(OpKey("", "Relu", 14, "numpy")) == "tr_onnx.ops.unary"


def test_duplicate_key_names_both_sources(plugin_path):
    _write_plugin(plugin_path, "demo_a", PLUGIN.format(op="Twice"))
    _write_plugin(plugin_path, "demo_b", PLUGIN.format(op="Twice"))
    import demo_a
    import demo_b

    with pytest.raises(RegistryError,
                       match=r"Twice.*registered twice: by 'demo_a' and by 'demo_b'"):
        build_registry([demo_a, demo_b], autoload=False)


def test_duplicate_of_a_builtin_is_an_error(plugin_path):
    _write_plugin(plugin_path, "demo_relu", PLUGIN.format(op="Relu").replace(
        'domain="com.example"', 'domain=""').replace("(1,)", "(14,)"))
    import demo_relu

    with pytest.raises(RegistryError, match="tr_onnx.ops.unary.*demo_relu"):
        build_registry([demo_relu], autoload=False)


def test_hookimpl_without_hookspec_is_an_error(plugin_path):
    _write_plugin(plugin_path, "demo_typo", """
        from tr_onnx import hookimpl

        @hookimpl
        def tr_onnx_op_definitons():  # misspelt
            return []
    """)
    import demo_typo

    with pytest.raises(RegistryError, match="demo_typo.*tr_onnx_op_definitons"):
        build_registry([demo_typo], autoload=False)


def test_entry_point_plugins_load_and_broken_ones_warn(plugin_path, monkeypatch):
    _write_plugin(plugin_path, "demo_good", PLUGIN.format(op="Twice"), dist="demo-good")
    _write_plugin(plugin_path, "demo_broken", "raise ImportError('boom')\n", dist="demo-broken")
    monkeypatch.delenv("TR_ONNX_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    with pytest.warns(UserWarning, match="'demo-broken'.*boom"):
        registry = build_registry()
    assert registry.lookup("com.example", "Twice", 1, "numpy") is not None
    assert registry.source_of(OpKey("com.example", "Twice", 1, "numpy")) == "demo-good"
    monkeypatch.setenv("TR_ONNX_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert build_registry().lookup("com.example", "Twice", 1, "numpy") is None


def test_session_plugins_argument_runs_a_custom_op(plugin_path):
    import onnx
    from onnx import TensorProto, helper

    import tr_onnx

    _write_plugin(plugin_path, "demo_sess", PLUGIN.format(op="Twice"))
    import demo_sess

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    node = helper.make_node("Twice", ["x"], ["t"], domain="com.example")
    relu = helper.make_node("Relu", ["t"], ["y"])
    model = helper.make_model(helper.make_graph([node, relu], "g", [x], [y]), opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    model.graph.value_info.append(helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3]))
    onnx.checker.check_model(model)
    data = np.array([[-1, 2, 3], [4, -5, 6]], np.float32)
    with pytest.raises(tr_onnx.UnsupportedModelError, match="Twice"):
        tr_onnx.InferenceSession(model)
    out = tr_onnx.InferenceSession(model, plugins=[demo_sess]).run(None, {"x": data})[0]
    np.testing.assert_array_equal(out, np.maximum(2 * data, 0))


def test_ops_cli_lists_registered_ops(capsys):
    assert cli_main(["ops", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    relu = next(r for r in rows if r["op"] == "Relu")
    assert relu["domain"] == "ai.onnx" and 14 in relu["versions"]
    assert relu["backends"] == ["cuda", "numpy"] and relu["differentiable"] is True


CUDA_OPS = ["Conv", "BatchNormalization", "Gemm", "MatMul", "Relu", "MaxPool", "AveragePool",
            "GlobalAveragePool", "Add", "Softmax", "LayerNormalization", "Gather", "Concat",
            "SoftmaxCrossEntropyLoss", "ConvGradData", "BatchNormTraining", "SGDUpdate"]


def test_ops_cli_lists_cuda_with_versions_exactly_where_a_binding_exists(capsys):
    """``tr-onnx ops --json`` answers "does Conv v22 run on cuda?": a backend's versions per
    op, and cuda for exactly the ops the cuda bindings (builtin modules, plugin CudaKernels)
    register."""
    from tr_onnx.opdef import KernelDef, OpDef
    from tr_onnx.registry import BUILTIN_BACKEND_KERNELS, BUILTIN_OPSETS

    assert cli_main(["ops", "--json"]) == 0
    rows = {(r["domain"], r["op"]): r for r in json.loads(capsys.readouterr().out)}
    bound = {(k.domain or "ai.onnx", k.op_type) for name in BUILTIN_BACKEND_KERNELS
             for k in importlib.import_module(name).tr_onnx_op_definitions()
             if isinstance(k, KernelDef) and k.backend == "cuda"}
    # ops resolved before any backend runs them (control flow, sequences) name one factory for
    # both backends in their own OpDef
    bound |= {(o.domain or "ai.onnx", o.op_type) for name in BUILTIN_OPSETS
              for o in importlib.import_module(name).tr_onnx_op_definitions()
              if isinstance(o, OpDef) and "cuda" in o.kernels}
    bound |= {(o.domain or "ai.onnx", o.op_type) for o in _installed_plugin_defs()
              if "cuda" in getattr(o, "kernels", {})}
    assert {key for key, r in rows.items() if "cuda" in r["backends"]} == bound
    assert len(bound) >= 67
    for op in CUDA_OPS:
        row = next(r for (d, o), r in rows.items() if o == op)
        assert row["backend_versions"]["cuda"] == row["backend_versions"]["numpy"], op
    conv = rows[("ai.onnx", "Conv")]
    assert 22 in conv["backend_versions"]["cuda"]


def _installed_plugin_defs():
    from importlib.metadata import entry_points

    return [d for ep in entry_points(group="tr_onnx") for d in ep.load().tr_onnx_op_definitions()]


def test_custom_op_shape_rule_fills_what_onnx_inference_cannot(plugin_path):
    from onnx import TensorProto, helper

    import tr_onnx

    _write_plugin(plugin_path, "demo_shape", """
        import numpy as np
        from tr_onnx import hookimpl
        from tr_onnx.opdef import OpDef

        def pairs(ctx):
            def run(ins, outs, ws):
                n = ins[0].shape[-1] // 2
                np.add(ins[0][..., :n], ins[0][..., n:], out=outs[0])
            return run

        def pairs_shape(node, shapes, dtypes):
            *lead, last = shapes[0]
            return [((*lead, last // 2), dtypes[0])]

        @hookimpl
        def tr_onnx_op_definitions():
            return [OpDef("AddHalves", (1,), {"numpy": pairs}, domain="com.example",
                          shape=pairs_shape)]
    """)
    import demo_shape

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    nodes = [helper.make_node("AddHalves", ["x"], ["h"], domain="com.example"),
             helper.make_node("Relu", ["h"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    data = np.arange(-12, 12, dtype=np.float32).reshape(4, 6)
    out = tr_onnx.InferenceSession(model, plugins=[demo_shape]).run(None, {"x": data})[0]
    np.testing.assert_array_equal(out, np.maximum(data[:, :3] + data[:, 3:], 0))


class _KernelDefs:
    """A plugin object returning the KernelDefs it was made with."""

    def __init__(self, *defs):
        self.defs = defs

    @hookimpl
    def tr_onnx_op_definitions(self):
        return list(self.defs)


def _noop_binding(ctx):
    return lambda b, node: []


def _differentiable_op_without_cuda() -> str:
    """A standard op with several numpy versions, a gradient rule and no cuda binding yet
    (picked from the registry: the cuda bindings grow)."""
    registry = default_registry()
    for key in sorted(registry.keys()):
        if key.domain in ("", "ai.onnx") and key.backend == "numpy" \
                and len(registry.registered_versions("", key.op_type, "numpy")) > 1 \
                and not registry.registered_versions("", key.op_type, "cuda") \
                and registry.lookup("", key.op_type, key.since_version, "numpy").gradient:
            return key.op_type
    pytest.skip("every differentiable op has a cuda binding")


def test_kernel_def_adds_a_backend_to_every_version_of_an_op():
    from tr_onnx.opdef import KernelDef

    op = _differentiable_op_without_cuda()
    registry = build_registry(plugins=[_KernelDefs(KernelDef(op, "cuda", _noop_binding))])
    versions = registry.registered_versions("", op, "numpy")
    assert versions and registry.registered_versions("", op, "cuda") == versions
    for v in versions:
        numpy_def = registry.lookup("", op, v, "numpy")
        cuda_def = registry.lookup("", op, v, "cuda")
        assert numpy_def is cuda_def and cuda_def.kernels["cuda"] is _noop_binding
        assert cuda_def.gradient is not None  # the op's rules stay the op's


def test_a_second_kernel_for_a_backend_key_names_both_sources():
    from tr_onnx.opdef import KernelDef

    with pytest.raises(RegistryError, match=r"Relu .*backend 'cuda'.* registered twice: by "
                                            r"'tr_onnx.backends.cuda.ops.unary' and by"):
        build_registry(plugins=[_KernelDefs(KernelDef("Relu", "cuda", _noop_binding))])
    replaced = build_registry(plugins=[_KernelDefs(KernelDef("Relu", "cuda", _noop_binding,
                                                             overrides=True))])
    assert replaced.lookup("", "Relu", 14, "cuda").kernels["cuda"] is _noop_binding
    assert any("overrides op Relu" in line for line in replaced.overrides)


def test_a_kernel_for_an_op_nobody_registers_is_an_error():
    from tr_onnx.opdef import KernelDef

    with pytest.raises(RegistryError, match=r"cuda kernel for NoSuchOp .*no op set registers"):
        build_registry(plugins=[_KernelDefs(KernelDef("NoSuchOp", "cuda", _noop_binding))])
    with pytest.raises(RegistryError, match=r"versions \[99\]"):
        build_registry(plugins=[_KernelDefs(KernelDef("Relu", "cuda", _noop_binding,
                                                      versions=(99,)))])


def _documented_cuda_exclusions() -> set[str]:
    """The ops docs/gpu.md's "Ops the cuda backend does not run" names (its bullets' backticked
    names, a domain prefix kept where it has one)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "gpu.md").read_text()
    section = page.split("\n## Ops the cuda backend does not run\n", 1)[1].split("\nWhat CI", 1)[0]
    bullets = re.findall(r"^- (.*?(?:\n  .*?)*)$", section, flags=re.M)
    return {name for text in bullets
            for name in re.findall(r"`([\w.]+)`", text.split(": ", 1)[0])}


def test_cuda_runs_every_op_numpy_runs_but_the_documented_list(capsys):
    """Issue 30's rule: `tr-onnx ops --json` lists cuda for every op numpy lists, except the
    docs/gpu.md's short list of ops the cuda backend does not run, each with its reason."""
    assert cli_main(["ops", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    numpy_only = {(r["op"] if r["domain"] in ("ai.onnx", "ai.tr_onnx") else
                   f"{r['domain']}.{r['op']}") for r in rows
                  if "numpy" in r["backends"] and "cuda" not in r["backends"]}
    assert numpy_only == _documented_cuda_exclusions()
    for r in rows:  # and every version numpy runs
        if "cuda" in r["backends"] and "numpy" in r["backends"]:
            assert r["backend_versions"]["cuda"] == r["backend_versions"]["numpy"], r["op"]
