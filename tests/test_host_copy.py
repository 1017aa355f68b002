"""Copies between host arrays and channels-last arena views through oneDNN's reorder
(``onednn.Copier``, ``memory._onednn_copier``; the layout pass's ``LayoutTranspose`` through
``ops.tensor.onednn_transpose``): a session's input written, an output read, a training batch
written every step. The copy moves bits, so every check here is exact: the values against
onnxruntime's run of the same model where they are computed, and the bits of what was written
where they are only copied (NaN payloads, -0.0, infinities, subnormals)."""

from __future__ import annotations

import numpy as np
import pytest
from onednn_kernels import require_onednn, spy_kernels
from onnx import TensorProto, helper, numpy_helper
from oracles import ort_run

import tr_onnx
from tr_onnx import memory, onednn
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.ops import layout_convert

RNG = np.random.default_rng(23)
MAP = (32, 3, 16, 16)  # a batch of RGB images: 24576 values, past memory._ONEDNN_COPY_MIN


def conv_model(x_shape=MAP, out_channels: int = 16, tail: str | None = None):
    """x -> Conv 3x3 (pads 1) -> [tail] -> y; ``tail`` "plain": a Reshape to [N, C, H*W] then
    Softplus, which reads the map in NCHW order (the layout pass puts a LayoutTranspose in)."""
    n, c, h, w = x_shape
    weights = numpy_helper.from_array(
        (RNG.standard_normal((out_channels, c, 3, 3)) * 0.2).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c" if tail else "y"], pads=[1] * 4)]
    inits = [weights]
    y_shape = [n, out_channels, h, w]
    if tail == "plain":
        inits.append(numpy_helper.from_array(np.array([n, out_channels, h * w], np.int64), "s"))
        nodes += [helper.make_node("Reshape", ["c", "s"], ["r"]),
                  helper.make_node("Softplus", ["r"], ["y"])]
        y_shape = [n, out_channels, h * w]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, list(x_shape))], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, y_shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def copiers(monkeypatch):
    """The (shape, source strides, destination strides) of every oneDNN copy prepared."""
    require_onednn()
    made = []
    real = onednn.copier

    def spy(shape, src, dst):
        copier = real(shape, src, dst)
        if copier is not None:
            made.append((tuple(shape), tuple(src), tuple(dst)))
        return copier

    monkeypatch.setattr(onednn, "copier", spy)
    return made


def _executor(session):
    return next(iter(session._runs.values())).executor


@pytest.mark.parametrize("align", [1, 8])
def test_session_input_and_output_maps_copied_by_onednn_match_onnxruntime(copiers, align):
    model = conv_model()
    sess = tr_onnx.InferenceSession(model, channel_align=align)
    for _ in range(2):  # a second feed through the same prepared copies
        x = RNG.standard_normal(MAP).astype(np.float32)
        (y,) = sess.run(None, {"x": x})
        (want,) = ort_run(model, {"x": x})
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
        assert y.flags.c_contiguous and y.dtype == np.float32
    # the input written into its channels-last view, the [32, 16, 16, 16] output read out
    assert [shape for shape, _, _ in copiers] == [MAP, (32, 16, 16, 16)]
    ex = _executor(sess)
    for name in ("x", "y"):
        assert pad_lanes_are_zero(ex.arena, ex.plan.tensors[name])


def test_a_read_output_is_a_copy_that_later_runs_leave_alone(copiers):
    sess = tr_onnx.InferenceSession(conv_model())
    x1, x2 = (RNG.standard_normal(MAP).astype(np.float32) for _ in range(2))
    (y1,) = sess.run(None, {"x": x1})
    kept = y1.copy()
    (y2,) = sess.run(None, {"x": x2})
    np.testing.assert_array_equal(y1, kept)
    assert not np.array_equal(y1, y2)


def _special_bits(shape) -> np.ndarray:
    x = RNG.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[::5] = np.nan
    flat[1::5] = -0.0
    flat[2::97] = np.inf
    flat[3::97] = -np.inf
    flat[4::89] = np.float32(1e-41)  # subnormal
    bits = flat.view(np.uint32)
    bits[::10] |= 0x00123456  # NaN payloads
    return x


@pytest.mark.parametrize("align", [1, 8])
def test_writer_and_reader_move_bits(copiers, align):
    """The prepared writer and reader of a channels-last tensor copy every bit both ways,
    through oneDNN, and leave the padded channels zero."""
    sess = tr_onnx.InferenceSession(conv_model(), channel_align=align)
    sess.run(None, {"x": np.zeros(MAP, np.float32)})
    ex = _executor(sess)
    t = ex.plan.tensors["x"]
    x = _special_bits(MAP)
    write = ex.input_writer("x")
    write(x)
    view = t.kernel_view(ex.arena)
    assert not view.flags.c_contiguous
    np.testing.assert_array_equal(view.view(np.uint32), x.view(np.uint32))
    assert pad_lanes_are_zero(ex.arena, t)
    back = ex.output_reader("x")()
    assert back.flags.c_contiguous
    np.testing.assert_array_equal(back.view(np.uint32), x.view(np.uint32))
    assert len(copiers) >= 2


def test_feeds_onednn_cannot_read_take_numpys_copy(copiers):
    """A strided feed (a slice) runs through NumPy's copy, correctly; so does a big-endian
    array handed to the writer (a session refuses it as a feed; ``write_input`` takes it)."""
    model = conv_model()
    sess = tr_onnx.InferenceSession(model)
    x = RNG.standard_normal((32, 3, 16, 32)).astype(np.float32)[..., ::2]
    (y,) = sess.run(None, {"x": x})
    (want,) = ort_run(model, {"x": np.ascontiguousarray(x)})
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    ex = _executor(sess)
    big_endian = RNG.standard_normal(MAP).astype(">f4")
    ex.input_writer("x")(big_endian)
    np.testing.assert_array_equal(ex.plan.tensors["x"].kernel_view(ex.arena), big_endian)


def test_small_maps_keep_numpys_copy(copiers):
    """Below ``_ONEDNN_COPY_MIN`` values a oneDNN call costs more than it saves."""
    shape = (2, 3, 16, 16)
    model = conv_model(shape)
    x = RNG.standard_normal(shape).astype(np.float32)
    (y,) = tr_onnx.InferenceSession(model).run(None, {"x": x})
    (want,) = ort_run(model, {"x": x})
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert copiers == []


def test_write_input_prepares_its_writer_once(copiers):
    """``write_input`` (a training step's batch) keeps the writer it made: one oneDNN copy
    prepared for any number of writes, each landing exactly."""
    sess = tr_onnx.InferenceSession(conv_model())
    sess.run(None, {"x": np.zeros(MAP, np.float32)})
    ex = _executor(sess)
    before = len(copiers)
    for _ in range(3):
        x = _special_bits(MAP)
        ex.write_input("x", x)
        np.testing.assert_array_equal(ex.read_output("x").view(np.uint32), x.view(np.uint32))
    assert len(copiers) - before == 2  # one writer, one reader
    with pytest.raises(tr_onnx.errors.InputError, match="expected shape"):
        ex.write_input("x", np.zeros((1, *MAP[1:]), np.float32))


def test_a_single_write_or_read_does_not_prepare_a_onednn_copy(copiers):
    """``write_host`` / ``read_host`` without a prepared writer copy in NumPy: preparing a
    oneDNN copy (~0.1 ms) would cost more than one copy saves."""
    sess = tr_onnx.InferenceSession(conv_model())
    sess.run(None, {"x": np.zeros(MAP, np.float32)})
    ex = _executor(sess)
    before = len(copiers)
    x = _special_bits(MAP)
    memory.write_host(ex.arena, ex.plan.tensors["x"], x)
    back = memory.read_host(ex.arena, ex.plan.tensors["x"])
    np.testing.assert_array_equal(back.view(np.uint32), x.view(np.uint32))
    assert len(copiers) == before


@pytest.mark.parametrize("align", [1, 8])
def test_layout_transpose_of_a_large_map_runs_in_onednn(monkeypatch, align):
    require_onednn()
    built = spy_kernels(monkeypatch, layout_convert, ["onednn_transpose"])
    model = conv_model(tail="plain")
    x = RNG.standard_normal(MAP).astype(np.float32)
    (y,) = tr_onnx.InferenceSession(model, channel_align=align).run(None, {"x": x})
    assert built == ["onednn_transpose"]
    (want,) = ort_run(model, {"x": x})
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
