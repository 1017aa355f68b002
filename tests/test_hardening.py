"""Issue 35's fixed items, each on the smallest model or file that showed it: a wrong result
checked against onnxruntime and onnx.reference, a crash or hang run in a subprocess (a signal
or a hang must fail this test, not kill or stall the suite), a traceback turned into a clean
``TrOnnxError`` naming what was wrong."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import tr_onnx
from tr_onnx.data import npz
from tr_onnx.errors import InputError, TrOnnxError, UnsupportedModelError
from tr_onnx.importer import InputSpec

ROOT = Path(__file__).resolve().parent.parent


def _run_python(code: str, timeout: float = 60, memory_bytes: int | None = None):
    """``code`` in a fresh interpreter importing this worktree's tr_onnx (optionally under an
    address-space limit)."""
    if memory_bytes is not None:
        code = (f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({memory_bytes}, "
                f"{memory_bytes}))\n") + code
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def _references(model: onnx.ModelProto, feed: dict) -> tuple[list, list]:
    ref = ReferenceEvaluator(model).run(None, feed)
    rt = ort.InferenceSession(model.SerializeToString(),
                              providers=["CPUExecutionProvider"]).run(None, feed)
    return ref, rt


# ---- item 1: LSTM with hidden_size=1 and a batch of 2 or more --------------------------------


def _recurrent_model(op: str, direction: str, bias: bool, t=4, n=3, i=2, h=1):
    d = 2 if direction == "bidirectional" else 1
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((d, gates * h, i)).astype(np.float32),
                                     "W"),
             numpy_helper.from_array(rng.standard_normal((d, gates * h, h)).astype(np.float32),
                                     "R")]
    if bias:
        inits.append(numpy_helper.from_array(
            rng.standard_normal((d, 2 * gates * h)).astype(np.float32), "B"))
    node = helper.make_node(op, ["x", "W", "R", "B" if bias else ""], ["y", "y_h"],
                            hidden_size=h, direction=direction)
    graph = helper.make_graph(
        [node], "recurrent", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [t, n, i])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [t, d, n, h]),
         helper.make_tensor_value_info("y_h", TensorProto.FLOAT, [d, n, h])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_a_recurrent_layer_of_hidden_size_1_over_a_batch_of_3_equals_both_references(
        op, direction, bias):
    model = _recurrent_model(op, direction, bias)
    feed = {"x": np.random.default_rng(1).standard_normal((4, 3, 2)).astype(np.float32)}
    ref, rt = _references(model, feed)
    ours = tr_onnx.InferenceSession(model).run(None, feed)
    for a, b, c in zip(ours, ref, rt, strict=True):
        np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-6)  # the references agree
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---- item 1's NumPy loop elsewhere: np.negative into strided views ------------------------------


@pytest.mark.parametrize("dtype,stride", [(np.float32, 4), (np.int32, 4), (np.float64, 8),
                                          (np.int64, 8), (np.float32, 3), (np.float64, 4)])
def test_negate_is_right_where_numpys_negative_loop_is_not(dtype, stride):
    from tr_onnx.host_math import negate

    x = np.arange(1, 4 * 7 * stride + 1).astype(dtype).reshape(7 * 4, stride)[:, 1]
    out = np.zeros((7 * 4, 5), dtype)[:, 2]
    negate(x, out)
    np.testing.assert_array_equal(out, -np.array(x))
    inplace = x.copy().repeat(stride).reshape(-1, stride)[:, 0]  # stride elements apart
    negate(inplace, inplace)
    np.testing.assert_array_equal(inplace, -np.array(x))


@pytest.mark.parametrize("op", ["Neg", "Softplus", "Sigmoid", "Selu"])
@pytest.mark.parametrize("elem,align", [(TensorProto.FLOAT, 4), (TensorProto.DOUBLE, 8)],
                         ids=["float32_align4", "float64_align8"])
def test_a_one_channel_conv_then_a_negating_op_equals_onnxruntime(op, elem, align):
    """One output channel padded to ``align`` lanes makes the activation a column of 16-byte
    (float32) or 64-byte (float64) stride: NumPy's negative loop wrote wrong values into it
    (Conv then Neg was off by 2.05)."""
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((1, 3, 1, 1)).astype(dtype), "w")
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node(op, ["c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", elem, [2, 3, 4, 4])],
        [helper.make_tensor_value_info("y", elem, [2, 1, 4, 4])], [w]),
        opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((2, 3, 4, 4)).astype(dtype)
    got = tr_onnx.InferenceSession(model, channel_align=align).run(None, {"x": x})[0]
    if elem == TensorProto.FLOAT:
        ref, rt = _references(model, {"x": x})
        np.testing.assert_allclose(got, rt[0], rtol=1e-6, atol=1e-6)
    else:  # onnxruntime has no float64 Conv
        ref = ReferenceEvaluator(model).run(None, {"x": x})
    tol = 1e-6 if elem == TensorProto.FLOAT else 1e-12
    np.testing.assert_allclose(got, ref[0], rtol=tol, atol=tol)


# ---- item 3: MaxPool with a zero-width output -------------------------------------------------


def test_a_max_pool_with_a_zero_width_output_returns_the_empty_result_of_both_references():
    # in a subprocess: before the fix oneDNN's primitive construction raised SIGFPE
    code = textwrap.dedent("""
        import numpy as np
        from onnx import TensorProto, helper
        import tr_onnx
        node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 3], strides=[1, 2])
        graph = helper.make_graph(
            [node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3, 1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2, 0])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        x = np.random.default_rng(0).random((1, 4, 3, 1), dtype=np.float32)
        (y,) = tr_onnx.InferenceSession(model).run(None, {"x": x})
        print(y.shape, y.dtype)
    """)
    done = _run_python(code)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 3], strides=[1, 2])], "p",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2, 0])]),
        opset_imports=[helper.make_opsetid("", 13)])
    ref, rt = _references(model, {"x": np.zeros((1, 4, 3, 1), np.float32)})
    assert ref[0].shape == rt[0].shape == (1, 4, 2, 0)
    assert done.stdout.split("\n")[0] == "(1, 4, 2, 0) float32"


# ---- item 4: attributes onnx's shape inference reads unchecked ---------------------------------


def _conv_transpose_then_eye_like(kernel_shape, dilations) -> onnx.ModelProto:
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["c"], kernel_shape=kernel_shape,
                              auto_pad="SAME_LOWER", dilations=dilations),
             helper.make_node("EyeLike", ["c"], ["y"], dtype=0)]
    return helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
        [numpy_helper.from_array(np.ones((1, 1, 1, 1), np.float32), "w")]),
        opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("kernel_shape", [[0], [1], [0, 0]])
def test_a_model_that_crashes_onnx_shape_inference_is_refused_before_it(tmp_path, kernel_shape):
    """Before: onnx's shape inference, called by the importer, died with SIGSEGV (in a
    subprocess, so a crash fails this test rather than the suite)."""
    model = _conv_transpose_then_eye_like(kernel_shape, [2, 2])
    onnx.checker.check_model(model)  # the model passes the checker
    onnx.save(model, tmp_path / "m.onnx")
    done = _run_python(textwrap.dedent(f"""
        import tr_onnx
        try:
            tr_onnx.InferenceSession({str(tmp_path / 'm.onnx')!r})
        except tr_onnx.ModelLoadError as exc:
            print("refused:", exc)
    """))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "refused:" in done.stdout and "node 'ConvTranspose_0' (ConvTranspose)" in done.stdout


def _window_model(op, attrs, x_shape=(1, 2, 5, 5), w_shape=(3, 2, 3, 3)):
    inputs = ["x", "w"] if "Conv" in op else ["x"]
    inits = [numpy_helper.from_array(np.ones(w_shape, np.float32), "w")] if "Conv" in op else []
    return helper.make_model(helper.make_graph(
        [helper.make_node(op, inputs, ["y"], name="n", **attrs)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list("nchw"))], inits),
        opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op,attrs,message", [
    ("Conv", dict(strides=[1, 0]), "'strides' is [1, 0]"),
    ("Conv", dict(dilations=[-1, 1]), "'dilations' is [-1, 1]"),
    ("Conv", dict(kernel_shape=[3]), "'kernel_shape' ([3]) describes 1 spatial axis but "
                                     "input 'x' (rank 4) describes 2"),
    ("ConvTranspose", dict(pads=[0, 0, 0]), "odd number"),
    ("MaxPool", dict(kernel_shape=[2, 2], strides=[1, 1, 1]), "describes 3 spatial axes"),
    ("AveragePool", dict(kernel_shape=[2, 2, 2]), "input 'x' (rank 4) describes 2"),
])
def test_window_attributes_onnx_reads_unchecked_are_refused_by_node(op, attrs, message):
    with pytest.raises(tr_onnx.ModelLoadError, match=r"node 'n' \(" + op + r"\)") as caught:
        tr_onnx.InferenceSession(_window_model(op, attrs))
    assert message in str(caught.value)


def test_an_element_type_attribute_of_0_is_refused_also_inside_a_subgraph():
    cast = helper.make_node("Cast", ["x"], ["c"], name="cast", to=0)
    branch = helper.make_graph([cast], "then", [], [helper.make_tensor_value_info(
        "c", TensorProto.FLOAT, [2])])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("If", ["b"], ["y"], then_branch=branch, else_branch=branch)], "g",
        [helper.make_tensor_value_info("b", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(tr_onnx.ModelLoadError, match="attribute 'then_branch'.*node 'cast' "
                       r"\(Cast\): attribute 'to' is 0, which is no ONNX element type"):
        tr_onnx.InferenceSession(model)


# ---- item 5: a Loop of 2**31 - 1 iterations --------------------------------------------------


@pytest.mark.parametrize("body_nodes", [0, 1], ids=["empty_body", "one_add"])
def test_a_loop_of_2_to_the_31_iterations_is_planned_at_once_to_run_as_a_loop(body_nodes):
    """Before: hours of unrolling while planning. Too long to unroll, it runs as a loop at run
    time (tests/test_runtime_loop.py checks such loops against onnxruntime); this one would
    run its 2**31 - 1 iterations, so only its plan is made here."""
    nodes = [helper.make_node("Add", ["v", "one"], ["v_next"])] if body_nodes else []
    body = helper.make_graph(
        nodes, "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_next" if body_nodes else "v", TensorProto.FLOAT,
                                       [2])],
        [numpy_helper.from_array(np.ones(2, np.float32), "one")] if body_nodes else [])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["M", "", "x"], ["y"], body=body)], "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.array(2 ** 31 - 1, np.int64), "M")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    code = textwrap.dedent(f"""
        import numpy as np, onnx, tr_onnx
        model = onnx.load_from_string(bytes.fromhex({model.SerializeToString().hex()!r}))
        plan = tr_onnx.InferenceSession(model).plan_for({{"x": np.zeros(2, np.float32)}})
        print([n.op_type for n in plan.graph.nodes])
    """)
    done = _run_python(code, timeout=60)  # before the fix: hours of unrolling
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['RunLoop']", done.stdout


# ---- items 6 and 7: .npz files that are not what they declare ---------------------------------


SPECS = [InputSpec("input", (None, 2), np.dtype(np.float32))]


def _npz_member(name: str, header: dict, data: bytes) -> bytes:
    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, header)
    member.write(data)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr(name, member.getvalue())
    return out.getvalue()


def _npy_bytes(a: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, a)
    return out.getvalue()


def _bad_npz(kind: str) -> bytes:
    if kind == "empty_file":
        return b""
    if kind == "an_npy_named_npz":
        return _npy_bytes(np.zeros((4, 2), np.float32))
    if kind == "header_declares_2_to_the_40":
        return _npz_member("labels.npy", {"descr": "<f4", "fortran_order": False,
                                          "shape": (2 ** 40,)}, bytes(64))
    if kind == "corrupt_deflate_stream":  # zlib.error while decompressing (the fuzzer's find)
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("labels.npy", _npy_bytes(np.arange(1000, dtype=np.float32)))
        data = bytearray(out.getvalue())
        data[80:96] = b"\xff" * 16
        return bytes(data)
    assert kind == "not_an_array_member"
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("labels.txt", "0 1 2")
    return out.getvalue()


@pytest.mark.parametrize("kind", ["empty_file", "an_npy_named_npz",
                                  "header_declares_2_to_the_40", "not_an_array_member",
                                  "corrupt_deflate_stream"])
def test_a_malformed_npz_is_an_input_error_naming_the_file(tmp_path, kind):
    path = tmp_path / "data.npz"
    path.write_bytes(_bad_npz(kind))
    with pytest.raises(InputError, match="data.npz"):
        npz.load(path, SPECS, "index", np.dtype(np.float32), {})


def test_an_npz_member_declaring_2_to_the_40_elements_names_the_member_and_sizes(tmp_path):
    path = tmp_path / "data.npz"
    path.write_bytes(_bad_npz("header_declares_2_to_the_40"))
    with pytest.raises(InputError, match=r"'labels.npy' declares shape \[1099511627776\] of "
                                         r"float32 \(4398046511104 bytes\) but holds 64 bytes"):
        npz.load(path, SPECS, "index", np.dtype(np.float32), {})


def test_an_npz_larger_than_the_memory_left_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.npz"  # 1.2 GB of zeros decompressed, 1.2 MB compressed
    rows = 150_000_000
    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        member, {"descr": "<f4", "fortran_order": False, "shape": (rows, 2)})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("input.npy", "w", force_zip64=True) as f:
            f.write(member.getvalue())
            chunk = bytes(1 << 24)
            for _ in range(rows * 8 // len(chunk)):
                f.write(chunk)
            f.write(bytes(rows * 8 % len(chunk)))
        archive.writestr("labels.npy", _npy_bytes(np.zeros(3, np.int64)))
    code = textwrap.dedent(f"""
        import numpy as np
        from pathlib import Path
        from tr_onnx.data import npz
        from tr_onnx.errors import InputError
        from tr_onnx.importer import InputSpec
        specs = [InputSpec("input", (None, 2), np.dtype(np.float32))]
        try:
            npz.load(Path({str(path)!r}), specs, "index", np.dtype(np.float32), {{}})
        except InputError as exc:
            print("refused:", exc)
    """)
    done = _run_python(code, memory_bytes=1 << 30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "1200000024 bytes in memory" in done.stdout, done.stdout


# ---- item 12: OneDnnError is a TrOnnxError ------------------------------------------------------


# ---- item 6 (sizes a model declares): checked before anything that size is allocated ----------


@pytest.mark.parametrize("command", ["inspect", "run"])
def test_a_declared_input_of_a_trillion_elements_is_a_clean_cli_error(tmp_path, command):
    """Before: a MemoryError traceback, even from ``inspect``, which needs no data."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [10 ** 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [10 ** 12])]),
        opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    done = _run_python(textwrap.dedent(f"""
        import sys
        from tr_onnx import cli
        sys.exit(cli.main([{command!r}, {str(tmp_path / 'm.onnx')!r}]))
    """), memory_bytes=3 << 30)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    assert done.returncode == 2, done.stderr[-1500:]
    assert last.startswith("tr-onnx: error: the numpy plan for inputs {'x': [1000000000000]} "
                           "holds 'x' [1000000000000] float32 (3725.29 GiB"), last


def test_a_constant_range_too_large_for_the_process_names_its_node():
    """A Range of 2**31 - 1 constant elements (16 GiB) is computed when its kernel is built:
    under a 3 GiB address-space limit that was a MemoryError traceback."""
    done = _run_python(textwrap.dedent("""
        import numpy as np
        from onnx import TensorProto, helper, numpy_helper
        import tr_onnx
        consts = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(
            np.array(v, np.int64))) for n, v in (("a", 0), ("b", 2 ** 31 - 1), ("d", 1))]
        model = helper.make_model(helper.make_graph(
            consts + [helper.make_node("Range", ["a", "b", "d"], ["y"], name="r")], "g", [],
            [helper.make_tensor_value_info("y", TensorProto.INT64, ["n"])]),
            opset_imports=[helper.make_opsetid("", 17)])
        try:
            tr_onnx.InferenceSession(model).run(None, {})
        except tr_onnx.ArenaSizeError as exc:
            print("refused:", exc)
    """), memory_bytes=3 << 30)
    assert done.returncode == 0, done.stderr[-1500:]
    assert "refused: node 'r' (Range" in done.stdout and "output [[2147483647]]" in done.stdout


# ---- item 8: a run whose validation loss is not finite ------------------------------------------


def test_a_run_whose_validation_loss_is_not_finite_prints_its_summary(tmp_path, capsys):
    """A running variance of NaN: training normalises by the batch's statistics (finite),
    evaluation by the running ones (NaN), so the validation loss is NaN, kept as None in the
    records. Before: the final summary raised a TypeError after the model was exported."""
    F = TensorProto.FLOAT
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in [
        ("s", np.full(4, 1.5)), ("b", np.full(4, 0.1)), ("m", np.zeros(4)),
        ("v", np.full(4, np.nan)), ("W", rng.standard_normal((4, 3))), ("B", np.full(3, 0.2))]]
    model = helper.make_model(helper.make_graph(
        [helper.make_node("BatchNormalization", ["input", "s", "b", "m", "v"], ["h"]),
         helper.make_node("Gemm", ["h", "W", "B"], ["logits"])], "g",
        [helper.make_tensor_value_info("input", F, ["N", 4])],
        [helper.make_tensor_value_info("logits", F, ["N", 3])], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", input=rng.standard_normal((64, 4)).astype(np.float32),
             labels=rng.integers(0, 3, 64).astype(np.int64))
    out = tmp_path / "out.onnx"
    assert tr_onnx.cli.main(["train", str(tmp_path / "m.onnx"), "--data",
                             str(tmp_path / "d.npz"), "--epochs", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert ", val loss not finite acc " in next(p for p in printed if p.startswith("epoch 1/1:")
                                                and "val loss" in p)
    assert any(p.startswith("final val accuracy ") and p.endswith(
        "(val loss not finite) after 1 epochs, 2 steps") for p in printed), printed
    assert out.is_file()


# ---- item 10: a model rewritten before import (a new head, LoRA) gets the import's checks -----


def _duplicated_functions_model(path: Path) -> None:
    F = TensorProto.FLOAT
    relu = [helper.make_function("local", "f", ["a"], ["b"], [helper.make_node("Relu", ["a"],
                                                                              ["b"])],
                                 [helper.make_opsetid("", 17)]) for _ in range(2)]
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3)).astype(
        np.float32), "W")
    onnx.save(helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]),
         helper.make_node("f", ["h"], ["y"], domain="local")], "g",
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("y", F, ["N", 3])], [w]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
        functions=relu), path)


@pytest.mark.parametrize("model", ["duplicated_functions", "not_onnx"])
@pytest.mark.parametrize("finetune", [["--num-classes", "2", "--head", "h"], ["--lora", "rank=2"]],
                         ids=["new_head", "lora"])
def test_a_bad_model_given_to_fine_tuning_is_one_error_line(tmp_path, capsys, model, finetune):
    """Before: onnx's ValidationError (duplicated local functions) and protobuf's DecodeError
    (not a model) escaped from the head and LoRA rewrites, which loaded the file with
    onnx.load before the importer's checks."""
    path = tmp_path / "m.onnx"
    if model == "not_onnx":
        path.write_bytes(b"garbage")
    else:
        _duplicated_functions_model(path)
    np.savez(tmp_path / "d.npz", input=np.ones((8, 4), np.float32),
             labels=np.zeros(8, np.int64))
    assert tr_onnx.cli.main(["train", str(path), "--data", str(tmp_path / "d.npz"), "--epochs",
                             "1", "--out", str(tmp_path / "out.onnx"), *finetune]) == 2
    why = ("fails onnx.checker: Model contains multiple local functions"
           if model == "duplicated_functions" else "not a valid ONNX model")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tr-onnx: error: {path}: {why}"), lines


# ---- item 14: tr_onnx's internal ops in a user's model ------------------------------------------


def _dropout_training_model(in_subgraph: bool) -> onnx.ModelProto:
    F = TensorProto.FLOAT
    node = helper.make_node("DropoutTraining", ["x"], ["y"], name="dt", domain="ai.tr_onnx",
                            ratio=0.5, seed=1)
    if in_subgraph:
        branch = helper.make_graph([node], "b", [], [helper.make_tensor_value_info("y", F,
                                                                                  [2, 4])])
        node = helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)
    inputs = [helper.make_tensor_value_info("x", F, [2, 4])] + (
        [helper.make_tensor_value_info("c", TensorProto.BOOL, [])] if in_subgraph else [])
    return helper.make_model(
        helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", F, [2, 4])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.tr_onnx", 1)])


@pytest.mark.parametrize("in_subgraph", [False, True], ids=["top_level", "in_an_if_branch"])
@pytest.mark.parametrize("session", ["inference", "training"])
def test_an_internal_op_in_a_users_model_is_refused_by_name(session, in_subgraph):
    """Before: DropoutTraining (a form the training pass makes, with the inputs that pass
    gives it) failed inside its kernel with an IndexError."""
    model = _dropout_training_model(in_subgraph)
    with pytest.raises(UnsupportedModelError, match=r"node 'dt' \(DropoutTraining\): "
                       r"DropoutTraining is one of tr_onnx's internal ops"):
        if session == "inference":
            tr_onnx.InferenceSession(model)
        else:
            tr_onnx.TrainingSession(model, optimizer=tr_onnx.optim.SGD(lr=0.1),
                                    backend="numpy")


def test_a_onednn_error_is_a_tr_onnx_error():
    from tr_onnx import onednn

    assert issubclass(onednn.OneDnnError, TrOnnxError)


def test_a_training_session_of_a_model_with_no_outputs_is_a_clean_error():
    """Issue 35 item 11: a model with no outputs was an IndexError in TrainingSession."""
    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])], []),
        opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InputError, match="no outputs"):
        tr_onnx.TrainingSession(model, optimizer=tr_onnx.optim.SGD(lr=0.1), backend="numpy")


@pytest.mark.parametrize("stash_type", [0, TensorProto.INT32])
def test_a_layer_norm_with_a_stash_type_the_schema_lacks_is_refused_by_name(stash_type):
    """Issue 35 item 13: LayerNormalization's stash_type=0 was a TypeError from the dtype
    table; the schema's stash types are float ones."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "s"], ["y"], stash_type=stash_type)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.ones(3, np.float32), "s")]),
        opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedModelError, match="stash_type"):
        tr_onnx.InferenceSession(model).run(None, {"x": np.ones((2, 3), np.float32)})


@pytest.mark.parametrize("axis", [3, -3])
def test_a_dequantize_with_an_axis_outside_the_rank_is_refused_by_name(axis):
    """Issue 35 item 13: DequantizeLinear with an axis past x's rank was an IndexError."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=axis)], "g",
        [helper.make_tensor_value_info("q", TensorProto.INT8, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.ones(3, np.float32), "s")]),
        opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedModelError, match=f"axis {axis} is outside"):
        tr_onnx.InferenceSession(model).run(None, {"q": np.ones((2, 3), np.int8)})


def test_inspect_train_on_a_rank_1_output_is_a_clean_error(tmp_path, capsys):
    """Issue 35 item 9: `tr-onnx inspect --train` on an output of rank 1 (no class axis for
    cross-entropy) was a ValueError traceback."""
    from tr_onnx import cli
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])]),
        opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    assert cli.main(["inspect", "--train", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert "tr-onnx: error:" in err and "class axis" in err and "Traceback" not in err


@pytest.mark.parametrize("loss", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
@pytest.mark.parametrize("bad", [-2, 4])
def test_a_label_outside_the_classes_is_refused_not_read_from_another_row(loss, bad):
    """Issue 35 item 2: a target of -2 (not ignore_index) read the previous sample's scores,
    and 4 of 4 classes the next sample's; onnx.reference indexes from the back (-2) or
    raises (4). Both are refused, naming the label; ignore_index and in-range labels still
    equal the reference."""
    def model(labels, **attrs):
        return helper.make_model(helper.make_graph(
            [helper.make_node(loss, ["x", "t"], ["y"], reduction="none", **attrs)], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
            [numpy_helper.from_array(np.array(labels, np.int64), "t")]),
            opset_imports=[helper.make_opsetid("", 17)])
    x = -np.arange(12, dtype=np.float32).reshape(3, 4) / 8
    with pytest.raises(TrOnnxError, match=f"a label is {bad}"):
        tr_onnx.InferenceSession(model([0, bad, 1])).run(None, {"x": x})
    good = model([0, bad, 1], ignore_index=bad)
    (want,) = ReferenceEvaluator(good).run(None, {"x": x})
    (got,) = tr_onnx.InferenceSession(good).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("op", ["AveragePool", "LpPool"])
def test_a_pool_with_a_zero_width_output_returns_the_empty_result(op):
    """Issue 35 item 11: AveragePool with a zero-width output was an IndexError (MaxPool's
    SIGFPE is item 3); the result is empty, as onnx.reference's."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node(op, ["x"], ["y"], kernel_shape=[2, 3], strides=[1, 2])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2, 0])]),
        opset_imports=[helper.make_opsetid("", 18)])
    x = np.ones((1, 4, 3, 1), np.float32)
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    (got,) = tr_onnx.InferenceSession(model).run(None, {"x": x})
    assert got.shape == want.shape == (1, 4, 2, 0)
