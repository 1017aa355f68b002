"""Plugins as a user writes them: the installed packages in plugins/ (found through their entry
points), `plugins=[...]`, explicit priority and overrides, bad plugins, training and exporting
models with custom ops, and docs/plugins.md's example run verbatim.

The packages are installed by the test command (`pip install -e plugins/...`); their gradient
tables are in grad_cases_plugins.py, run by test_gradients.py with the builtin ones.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnx
import pytest
import tr_onnx_example_ops
import tr_onnx_qat
from gradcheck import GradCase, check_case
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import tr_onnx
from tr_onnx.cli import main as cli_main
from tr_onnx.errors import RegistryError
from tr_onnx.optim import AdamW
from tr_onnx.plugin import CudaKernel
from tr_onnx.registry import OpKey, build_registry, default_registry

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE, QUANT = tr_onnx_example_ops.DOMAIN, tr_onnx_qat.DOMAIN


def _digits(n=256):
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data[:n] / 16.0).astype(np.float32), d.target[:n].astype(np.int64)


def _train(session, x, y, steps=30, batch=64):
    losses = []
    for step in range(steps):
        i = (step * batch) % len(x)
        losses.append(session.train_step({"input": x[i:i + batch]}, y[i:i + batch]))
    return losses


def _cli_json(*args, env=None) -> dict:
    out = subprocess.run([sys.executable, "-m", "tr_onnx.cli", *args], capture_output=True,
                         text=True, env=env, check=True).stdout
    return json.loads(out)


@pytest.fixture
def tmp_module(tmp_path, monkeypatch):
    """Writes a module into tmp_path and imports it (dedented source)."""
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name: str, body: str):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
        written.append(name)
        return importlib.import_module(name)

    yield write
    for name in written:
        sys.modules.pop(name, None)


# ---- discovery -------------------------------------------------------------------------------

def test_installed_plugins_are_listed_with_origin_ops_and_overrides(capsys):
    assert cli_main(["plugins", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    example, qat = info["plugins"]["example_ops"], info["plugins"]["qat"]
    assert example["origin"].startswith(
        f"tr-onnx-example-ops {version('tr-onnx-example-ops')} (entry point example_ops")
    assert qat["origin"].startswith(f"tr-onnx-qat {version('tr-onnx-qat')} (entry point qat")
    assert {"com.example.Swish", "com.example.BiasGelu"} <= set(example["ops"])
    assert set(qat["ops"]) == {"gradient of ai.onnx.Round", "com.example.quant.FakeQuantize"}
    assert not any(name.startswith("tr_onnx.ops.") for name in info["plugins"])
    ste = [line for line in info["overrides"] if "Round" in line]
    # the gradient goes to every registered binding of Round: each version on each backend
    bound = [(k.since_version, k.backend) for k in default_registry().keys()
             if k.op_type == "Round" and k.domain == ""]
    assert {"numpy", "cuda"} <= {backend for _, backend in bound}
    assert sorted(ste) == sorted(
        f"qat adds a gradient of op Round (domain 'ai.onnx', since_version {v}, backend '{b}')"
        f" ({'tr_onnx.ops.unary' if b == 'numpy' else 'tr_onnx.backends.cuda.ops.unary'})"
        for v, b in bound)
    assert ste == [line for line in default_registry().overrides if "Round" in line]
    assert cli_main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "example_ops: tr-onnx-example-ops" in text and "com.example.Swish" in text
    assert "override: qat adds a gradient of op Round (domain 'ai.onnx', since_version 22" in text
    assert cli_main(["plugins", "--json", "--builtin"]) == 0
    assert "tr_onnx.ops.elementwise" in json.loads(capsys.readouterr().out)["plugins"]


def test_disable_autoload_hides_installed_plugins():
    env = {**os.environ, "TR_ONNX_DISABLE_PLUGIN_AUTOLOAD": "1"}
    info = _cli_json("plugins", "--json", env=env)
    assert info == {"plugins": {}, "overrides": []}
    env.pop("TR_ONNX_DISABLE_PLUGIN_AUTOLOAD")
    assert set(_cli_json("plugins", "--json", env=env)["plugins"]) == {"example_ops", "qat"}


# ---- priority and bad plugins -------------------------------------------------------------

RELU_PLUGIN = """
    import numpy as np
    from tr_onnx.plugin import OpDef, hookimpl

    def leaky(ctx):
        def run(ins, outs, ws):
            np.multiply(ins[0], 0.5, out=outs[0])
            np.maximum(ins[0], outs[0], out=outs[0])
        return run

    @hookimpl
    def tr_onnx_op_definitions():
        return [OpDef("Relu", (14,), {{"numpy": leaky}}, overrides={overrides})]
"""


def _relu_model():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_plugin_op_for_a_builtin_key_needs_overrides(tmp_module):
    plugin = tmp_module("demo_relu_plain", RELU_PLUGIN.format(overrides=False))
    twice = r"Relu .*registered twice: by 'tr_onnx.ops.unary' and by 'demo_relu_plain'"
    with pytest.raises(RegistryError, match=twice + ".*overrides=True"):
        build_registry([plugin], autoload=False)


def test_override_replaces_the_builtin_and_is_reported(tmp_module):
    plugin = tmp_module("demo_relu_override", RELU_PLUGIN.format(overrides=True))
    registry = build_registry([plugin], autoload=False)
    assert registry.source_of(OpKey("", "Relu", 14, "numpy")) == "demo_relu_override"
    assert registry.overrides == [("demo_relu_override overrides op Relu (domain 'ai.onnx', "
                                   "since_version 14, backend 'numpy') of "
                                   "tr_onnx.ops.unary")]
    x = np.array([[-2, -1, 0], [1, 2, 3]], np.float32)
    y = tr_onnx.InferenceSession(_relu_model(), plugins=[plugin]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(y, np.maximum(x, 0.5 * x))


def test_two_overrides_of_one_key_name_both(tmp_module):
    a = tmp_module("demo_relu_a", RELU_PLUGIN.format(overrides=True))
    b = tmp_module("demo_relu_b", RELU_PLUGIN.format(overrides=True))
    with pytest.raises(RegistryError, match="twice: by 'demo_relu_a' and by 'demo_relu_b'"):
        build_registry([a, b], autoload=False)


def test_two_gradients_for_one_op_name_both(tmp_module):
    other = tmp_module("demo_round_grad", """
        from tr_onnx.plugin import GradientDef, hookimpl

        @hookimpl
        def tr_onnx_op_definitions():
            return [GradientDef("Round", (22,), lambda b, node, gys, needed: [gys[0]])]
    """)
    with pytest.raises(RegistryError, match="gradient of Round .*'qat' and by 'demo_round_grad'"):
        build_registry([other])


def test_misspelt_hookimpl_is_an_error(tmp_module):
    typo = tmp_module("demo_typo_hook", """
        from tr_onnx.plugin import hookimpl

        @hookimpl
        def tr_onnx_op_definition():
            return []
    """)
    with pytest.raises(RegistryError, match="demo_typo_hook.*tr_onnx_op_definition"):
        build_registry([typo], autoload=False)


def test_plugin_raising_on_import_warns_and_the_rest_work(tmp_path, monkeypatch):
    (tmp_path / "demo_exploding.py").write_text("raise RuntimeError('kaboom at import')\n")
    info = tmp_path / "demo_exploding-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-exploding\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[tr_onnx]\nexploding = demo_exploding\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TR_ONNX_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    with pytest.warns(UserWarning, match="plugin 'exploding' .*kaboom at import"):
        registry = build_registry()
    assert {"example_ops", "qat"} <= set(registry.plugins) and "exploding" not in registry.plugins
    assert registry.lookup(EXAMPLE, "Swish", 1, "numpy") is not None


def test_unregistered_custom_op_names_the_domain_and_the_docs():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    node = helper.make_node("Frobnicate", ["x"], ["y"], name="frob0", domain="com.acme")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]), opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.acme", 1)])
    with pytest.raises(tr_onnx.UnsupportedModelError) as err:
        tr_onnx.InferenceSession(model)
    message = str(err.value)
    assert "Frobnicate (domain 'com.acme', since_version 1) at node(s) 'frob0'" in message
    assert "plugin package providing domain 'com.acme'" in message
    assert "docs/plugins.md" in message


# ---- plugins=[...] ------------------------------------------------------------------------

def _custom_mlp(seed=0) -> onnx.ModelProto:
    """64 -> MatMul -> com.example BiasGelu -> com.example Swish(beta) -> Gemm -> 10."""
    rng = np.random.default_rng(seed)

    def init(name, *shape, scale=0.2):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32),
                                       name)

    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h1"]),
        helper.make_node("BiasGelu", ["h1", "b1"], ["a1"], domain=EXAMPLE),
        helper.make_node("Swish", ["a1"], ["a2"], domain=EXAMPLE, beta=1.5),
        helper.make_node("Gemm", ["a2", "w2", "b2"], ["logits"], transB=1),
    ]
    inits = [init("w1", 64, 48), init("b1", 48), init("w2", 10, 48), init("b2", 10)]
    graph = helper.make_graph(
        nodes, "custom_mlp", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                            ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(EXAMPLE, 1)])
    onnx.checker.check_model(model)
    return model


def test_plugins_argument_registers_for_both_sessions(monkeypatch):
    monkeypatch.setenv("TR_ONNX_DISABLE_PLUGIN_AUTOLOAD", "1")
    model = _custom_mlp()
    with pytest.raises(tr_onnx.UnsupportedModelError, match="Swish"):
        tr_onnx.TrainingSession(model, plugins=[tr_onnx_qat])
    x, y = _digits(64)
    (logits,) = tr_onnx.InferenceSession(model, plugins=[tr_onnx_example_ops]).run(
        None, {"input": x})
    ref = ReferenceEvaluator(model, new_ops=tr_onnx_example_ops.REFERENCE_OPS)
    np.testing.assert_allclose(logits, ref.run(None, {"input": x})[0], rtol=1e-5, atol=1e-5)
    session = tr_onnx.TrainingSession(model, optimizer=AdamW(lr=1e-2),
                                      plugins=[tr_onnx_example_ops])
    losses = _train(session, x, y, steps=3)
    assert np.isfinite(losses).all()
    assert "tr_onnx_example_ops" in session.registry.plugins
    assert "example_ops" not in session.registry.plugins  # autoload is off


# ---- training and export with custom ops ----------------------------------------------------

def test_train_custom_op_model_then_export_runs_in_onnx_reference(tmp_path):
    session = tr_onnx.TrainingSession(_custom_mlp(), optimizer=AdamW(lr=1e-2))
    x, y = _digits(512)
    losses = _train(session, x, y, steps=40)
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    path = session.export(tmp_path / "trained.onnx")
    exported = onnx.load(path)
    onnx.checker.check_model(exported)
    kept = {(n.domain, n.op_type) for n in exported.graph.node if n.domain}
    assert kept == {(EXAMPLE, "Swish"), (EXAMPLE, "BiasGelu")}
    swish = next(n for n in exported.graph.node if n.op_type == "Swish")
    assert helper.get_attribute_value(swish.attribute[0]) == pytest.approx(1.5)
    assert {(o.domain, o.version) for o in exported.opset_import} >= {(EXAMPLE, 1)}
    ref = ReferenceEvaluator(exported, new_ops=tr_onnx_example_ops.REFERENCE_OPS)
    (ours,) = session.run(None, {"input": x[:64]})
    np.testing.assert_allclose(ours, ref.run(None, {"input": x[:64]})[0], rtol=1e-5, atol=1e-5)


def _quantized_mlp() -> onnx.ModelProto:
    """model_zoo/mlp.onnx with FakeQuantize on both hidden Gemms' weights and Round-based fake
    quantization (Div/Round/Clip/Mul, standard ops) of the first hidden activation."""
    model = onnx.load(ROOT / "model_zoo" / "mlp.onnx")
    g = model.graph
    weights = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    for name in ("0.weight", "2.weight"):
        g.initializer.append(numpy_helper.from_array(
            np.array(np.abs(weights[name]).max() / 127, np.float32), f"{name}.scale"))
    g.initializer.extend([numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
                          [("act.scale", 4.0 / 127), ("act.qmin", -128.0), ("act.qmax", 127.0)]])
    act = "/1/Relu_output_0"
    for node in g.node:
        node.input[:] = ["act.fq" if i == act else i for i in node.input]
    nodes = []
    for node in g.node:
        if node.op_type == "Gemm" and node.input[1] in ("0.weight", "2.weight"):
            w = node.input[1]
            nodes.append(helper.make_node("FakeQuantize", [w, f"{w}.scale"], [f"{w}.fq"],
                                          domain=QUANT, name=f"fq_{w}"))
            node.input[1] = f"{w}.fq"
        nodes.append(node)
        if node.output[0] == act:
            nodes += [helper.make_node("Div", [act, "act.scale"], ["act.q"]),
                      helper.make_node("Round", ["act.q"], ["act.r"]),
                      helper.make_node("Clip", ["act.r", "act.qmin", "act.qmax"], ["act.c"]),
                      helper.make_node("Mul", ["act.c", "act.scale"], ["act.fq"])]
    del g.node[:]
    g.node.extend(nodes)
    model.opset_import.append(helper.make_opsetid(QUANT, 1))
    onnx.checker.check_model(model)
    return model


def test_quantization_aware_fine_tuning_of_the_zoo_mlp(tmp_path):
    model = _quantized_mlp()
    session = tr_onnx.TrainingSession(model, optimizer=AdamW(lr=3e-3))
    x, y = _digits(512)
    losses = _train(session, x, y, steps=40)
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    trained = session.parameters()
    before = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert not np.allclose(trained["0.weight"], before["0.weight"])  # STE reached the weights
    np.testing.assert_array_equal(trained["0.weight.scale"], before["0.weight.scale"])
    exported = onnx.load(session.export(tmp_path / "qat.onnx"))
    onnx.checker.check_model(exported)
    assert [n.name for n in exported.graph.node if n.domain == QUANT] == ["fq_0.weight",
                                                                          "fq_2.weight"]
    assert (QUANT, 1) in {(o.domain, o.version) for o in exported.opset_import}
    ref = ReferenceEvaluator(exported, new_ops=tr_onnx_qat.REFERENCE_OPS)
    (ours,) = session.run(None, {"input": x[:32]})
    np.testing.assert_allclose(ours, ref.run(None, {"input": x[:32]})[0], rtol=1e-5, atol=1e-5)


# ---- CUDA kernel sources ------------------------------------------------------------------

def _cuda_kernels():
    registry = default_registry()
    registered = registry.keys()
    keys = [k for k in registered if k.backend == "cuda"]
    return {f"{k.domain}.{k.op_type}": registry.lookup(*k) for k in keys
            if registry.source_of(k) == "example_ops"}


CUDA_KERNELS = _cuda_kernels()


def test_cuda_kernels_are_registered_for_every_example_op():
    assert set(CUDA_KERNELS) == {"com.example.Swish", "com.example.BiasGelu",
                                 "com.example.BiasGeluGrad", "com.example.MatMulBiasRelu"}


# MatMulBiasRelu's cuda kernel is a cuDNN graph, not a source: tests/test_plugin_cudnn_graph.py
CUDA_SOURCES = {op: d for op, d in CUDA_KERNELS.items() if op != "com.example.MatMulBiasRelu"}


@pytest.mark.parametrize("op", sorted(CUDA_SOURCES))
def test_cuda_kernel_source_is_well_formed(op):
    kernel = CUDA_SOURCES[op].kernels["cuda"]
    assert isinstance(kernel, CudaKernel)
    src = kernel.source
    entry_points = [f"{kernel.function}_f32", f"{kernel.function}_f16"]  # float, float16
    for name in entry_points:
        assert re.search(rf'extern "C" __global__ void {name}\(', src), name
    for opening, closing in ("{}", "()", "[]"):
        assert src.count(opening) == src.count(closing), (op, opening)
    assert "#include" not in src  # compiles with NVRTC without an include path
    nvrtc = _nvrtc()
    if nvrtc is None:
        return  # no NVRTC here: the cuda backend's tests compile them
    prog = nvrtc.createProgram(src, f"{kernel.function}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=sm_90", "-std=c++17"])
    except nvrtc.NVRTCError as exc:
        raise AssertionError(f"{op}: {exc}\n{nvrtc.getProgramLog(prog)}") from None
    cubin = nvrtc.getCUBIN(prog)
    nvrtc.destroyProgram(prog)
    assert all(name.encode() in cubin for name in entry_points)


def _nvrtc():
    """CuPy's NVRTC binding if it loads (it compiles without a GPU or driver), else None."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except (ImportError, RuntimeError):
        return None
    return nvrtc


# ---- docs/plugins.md's example, verbatim -- ------------------------------------------------------

def _doc_block(marker: str) -> str:
    page = (ROOT / "docs" / "plugins.md").read_text()
    section = re.search(rf"<!-- plugin-example:{marker} -->\n```\w+\n(.*?)```\n"
                        rf"<!-- /plugin-example:{marker} -->", page, re.DOTALL)
    assert section, f"docs/plugins.md lost the plugin-example:{marker} block"
    return section.group(1)


def test_plugins_doc_example_registers_trains_and_has_correct_gradients(tmp_module):
    project = tomllib.loads(_doc_block("pyproject"))
    ((_, module_name),) = project["project"]["entry-points"]["tr_onnx"].items()
    plugin = tmp_module(module_name, _doc_block("module"))
    registry = build_registry([plugin], autoload=False)
    assert registry.plugins[module_name]["ops"] == ["com.mycompany.ScaledTanh"]

    rng = np.random.default_rng(3)
    case = GradCase("docs_ScaledTanh", "ScaledTanh", [rng.standard_normal((3, 5))],
                    {"alpha": 1.7}, domain=plugin.DOMAIN, fd_oracle="ours")
    check_case(case, plugins=[plugin])

    w1 = numpy_helper.from_array((rng.standard_normal((4, 8)) * 0.5).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((8, 1)) * 0.5).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["input", "w1"], ["h"]),
             helper.make_node("ScaledTanh", ["h"], ["a"], domain=plugin.DOMAIN, alpha=2.0),
             helper.make_node("MatMul", ["a", "w2"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])], [w1, w2]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(plugin.DOMAIN, 1)])
    session = tr_onnx.TrainingSession(model, loss="mse", optimizer=AdamW(lr=3e-2),
                                      plugins=[plugin])
    x = rng.standard_normal((32, 4)).astype(np.float32)
    target = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    losses = [session.train_step({"input": x}, target) for _ in range(40)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_custom_op_chain_gets_shapes_and_attribute_defaults():
    """custom -> standard -> custom: the importer types the chain pass by pass; Swish without
    its beta attribute takes the OpDef's attr_defaults."""
    rng = np.random.default_rng(5)
    w1 = numpy_helper.from_array(rng.standard_normal((6, 8)), "w1")
    b1 = numpy_helper.from_array(rng.standard_normal(8), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((8, 4)), "w2")
    c2 = numpy_helper.from_array(rng.standard_normal(4), "c2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("BiasGelu", ["h", "b1"], ["g"], domain="com.example"),
             helper.make_node("MatMul", ["g", "w2"], ["m"]),
             helper.make_node("Add", ["m", "c2"], ["a"]),
             helper.make_node("Swish", ["a"], ["y"], domain="com.example")]
    graph = helper.make_graph(nodes, "chain", [
        helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["n", 6])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["n", 4])], [w1, b1, w2, c2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.example", 1)])
    x = rng.standard_normal((3, 6))
    want = ReferenceEvaluator(model, new_ops=tr_onnx_example_ops.REFERENCE_OPS).run(None,
                                                                                   {"x": x})[0]
    got = tr_onnx.InferenceSession(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
