"""A plugin whose hook raises, or returns something that is not a list of OpDef, GradientDef
and KernelDef, is a warning naming the plugin and what was wrong, like a plugin that fails to
import (issue 12, item 11); none of its definitions is registered and everything else works:
before, it broke every command, even for models that do not use it."""

import importlib
import json
import sys
import textwrap

import numpy as np
import pytest
from onnx import TensorProto, helper

import tr_onnx
from tr_onnx import registry as registry_module
from tr_onnx.cli import main as cli_main
from tr_onnx.registry import OpKey, build_registry

GOOD_OP = """
    import numpy as np
    from tr_onnx.plugin import OpDef

    def triple(ctx):
        def run(ins, outs, ws):
            np.multiply(ins[0], 3.0, out=outs[0])
        return run

    GOOD = OpDef("Triple", (1,), {"numpy": triple}, domain="com.test.failures",
                 shape=lambda node, shapes, dtypes: [(shapes[0], dtypes[0])])
"""

BAD_HOOKS = {
    "raises": ("raise RuntimeError('kaboom in the hook')", r"raised RuntimeError\('kaboom in "
               r"the hook'\)"),
    "returns_a_string": ("return 'Triple'", r"returned 'Triple' \(str\), not a list"),
    "returns_one_opdef": ("return GOOD", r"returned OpDef\(.*\), not a list"),
    "returns_a_dict": ("return {'Triple': GOOD}", r"returned \{'Triple': .* \(dict\), not a "
                       "list"),
    "holds_a_string": ("return [GOOD, 'Swish']", r"item 1 of what its tr_onnx_op_definitions"
                       r"\(\) returned is 'Swish' \(str\), not an OpDef, GradientDef or "
                       "KernelDef"),
    "holds_a_broken_opdef": ("return [GOOD, OpDef('Quad', None, {})]",
                             r"OpDef 'Quad'.*TypeError"),
}


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """Writes a plugin module (GOOD_OP, then a hook with ``body``) and imports it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name: str, body: str):
        source = textwrap.dedent(GOOD_OP) + textwrap.dedent(f"""
            from tr_onnx.plugin import hookimpl

            @hookimpl
            def tr_onnx_op_definitions():
                {body}
        """)
        (tmp_path / f"{name}.py").write_text(source)
        written.append(name)
        return importlib.import_module(name)

    yield write
    for name in written:
        sys.modules.pop(name, None)


def _relu_model():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("case", list(BAD_HOOKS), ids=list(BAD_HOOKS))
def test_a_bad_hook_warns_naming_the_plugin_and_registers_none_of_it(plugin_module, case):
    body, what = BAD_HOOKS[case]
    name = f"demo_bad_hook_{case}"
    plugin = plugin_module(name, body)
    with pytest.warns(UserWarning, match=rf"tr_onnx plugin {name!r} .*{what}"):
        registry = build_registry([plugin], autoload=False)
    assert name not in registry.plugins
    assert not registry.plugin_manager.is_registered(plugin)
    assert registry.lookup("com.test.failures", "Triple", 1, "numpy") is None  # not half of it
    assert registry.lookup("", "Relu", 14, "numpy") is not None
    x = np.array([[-2, -1, 0], [1, 2, 3]], np.float32)
    with pytest.warns(UserWarning, match=name):
        session = tr_onnx.InferenceSession(_relu_model(), plugins=[plugin])
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], np.maximum(x, 0))


def test_a_good_hook_still_registers(plugin_module):
    plugin = plugin_module("demo_good_hook", "return [GOOD]")
    registry = build_registry([plugin], autoload=False)
    assert registry.source_of(OpKey("com.test.failures", "Triple", 1, "numpy")) == \
        "demo_good_hook"


def test_an_installed_plugin_whose_hook_raises_leaves_every_command_working(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "demo_exploding_hook.py").write_text(textwrap.dedent("""
        from tr_onnx.plugin import hookimpl

        @hookimpl
        def tr_onnx_op_definitions():
            raise ValueError("kaboom when asked for ops")
    """))
    info = tmp_path / "demo_exploding_hook-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-exploding-hook\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text("[tr_onnx]\nexploding_hook = demo_exploding_hook\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TR_ONNX_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setattr(registry_module, "_default", None)  # the process-wide one, rebuilt
    try:
        with pytest.warns(UserWarning, match=r"plugin 'exploding_hook' .*ValueError\('kaboom "
                                             r"when asked for ops'\)"):
            assert cli_main(["plugins", "--json"]) == 0
    finally:
        sys.modules.pop("demo_exploding_hook", None)
    listed = json.loads(capsys.readouterr().out)["plugins"]
    assert "exploding_hook" not in listed
    assert cli_main(["ops", "--json"]) == 0
    ops = json.loads(capsys.readouterr().out)
    assert any(row["op"] == "Relu" for row in ops)
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(tr_onnx.InferenceSession(_relu_model()).run(None, {"x": x})[0],
                                  x)
