"""ImageDecoder (ops.dynamic): encoded bytes in, [H, W, C] uint8 out, against onnx.reference's
decoder; its size decided by the bytes, as a graph output (the plan is made for them) and
inside a computed part (a DynamicRegion); Pillow's absence named with the op."""

import io
import sys

import numpy as np
import onnx
import PIL.Image
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import tr_onnx

U8, F32 = TensorProto.UINT8, TensorProto.FLOAT


def _encoded(fmt: str, height=12, width=20) -> np.ndarray:
    """A random RGB image saved by Pillow in ``fmt``, as the bytes ImageDecoder reads."""
    image = np.random.default_rng(7).integers(0, 256, (height, width, 3), dtype=np.uint8)
    with io.BytesIO() as f:
        PIL.Image.fromarray(image).save(f, format=fmt)
        return np.frombuffer(f.getvalue(), np.uint8)


def _decoder(pixel_format: str, tail=()) -> onnx.ModelProto:
    """ImageDecoder of input ``x``, then ``tail`` (nodes from ``image`` to ``y``)."""
    nodes = [helper.make_node("ImageDecoder", ["x"], ["image"], pixel_format=pixel_format),
             *tail]
    out = "y" if tail else "image"
    graph = helper.make_graph(nodes, "decode", [helper.make_tensor_value_info("x", U8, [None])],
                              [helper.make_tensor_value_info(out, F32, []) if tail else
                               helper.make_tensor_value_info(out, U8, [None, None, None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("pixel_format", ["RGB", "BGR", "Grayscale"])
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "BMP"])
def test_image_decoder_gives_the_reference_decoders_pixels(fmt, pixel_format):
    model = _decoder(pixel_format)
    session = tr_onnx.InferenceSession(model)
    for height, width in ((12, 20), (7, 5)):  # a second size: a second plan
        x = _encoded(fmt, height, width)
        (ours,) = session.run(None, {"x": x})
        (theirs,) = ReferenceEvaluator(model).run(None, {"x": x})
        assert ours.dtype == np.uint8
        assert ours.shape == (height, width, 1 if pixel_format == "Grayscale" else 3)
        np.testing.assert_array_equal(ours, theirs)


def test_an_image_decoded_inside_the_graph_feeds_the_ops_after_it():
    """A static result (the mean pixel) from a decoded size: ImageDecoder runs eagerly as the
    root of a DynamicRegion, once per step."""
    tail = [helper.make_node("Cast", ["image"], ["f"], to=F32),
            helper.make_node("ReduceMean", ["f"], ["y"], keepdims=0)]
    model = _decoder("RGB", tail)
    session = tr_onnx.InferenceSession(model)
    for fmt in ("PNG", "BMP"):
        x = _encoded(fmt, 9, 4)
        (ours,) = session.run(None, {"x": x})
        (theirs,) = ReferenceEvaluator(model).run(None, {"x": x})
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_image_decoder_without_pillow_names_the_op_and_pillow(monkeypatch):
    x = _encoded("PNG")
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL.Image now raises ImportError
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(Exception, match="ImageDecoder needs Pillow"):
        tr_onnx.InferenceSession(_decoder("RGB")).run(None, {"x": x})
