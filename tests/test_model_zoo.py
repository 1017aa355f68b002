"""The model_zoo models (exported from PyTorch by model_zoo/export_models.py) match onnxruntime,
NHWC inside, with channel_align 1 and 8."""

import filecmp
import json
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from oracles import assert_close_relative, ort_run

import tr_onnx
from tr_onnx.memory import pad_lanes_are_zero

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
MANIFEST = json.loads((ZOO / "MANIFEST.json").read_text())["files"]
# A training-mode export with an active Dropout draws random masks in any runtime: it is
# trained (test_training.py), not compared with onnxruntime here.
FILES = sorted(stem for stem in MANIFEST
               if not (stem.endswith("_train") and "Dropout" in MANIFEST[stem]["op_types"]))


def _feed(stem: str, batch: int) -> dict:
    spec = MANIFEST[stem]["inputs"][0]
    shape = [batch if isinstance(d, str) else d for d in spec["shape"]]
    rng = np.random.default_rng(zlib.crc32(f"{stem}/{batch}".encode()))  # stable across runs
    return {spec["name"]: rng.standard_normal(shape).astype(np.float32)}


@pytest.mark.parametrize("align", [1, 8], ids=["align1", "align8"])
@pytest.mark.parametrize("stem", FILES)
def test_zoo_model_matches_onnxruntime(stem, align):
    path = ZOO / MANIFEST[stem]["file"]
    sess = tr_onnx.InferenceSession(path, channel_align=align)
    for batch in (1, 3):
        feed = _feed(stem, batch)
        (got,) = sess.run(None, feed)
        (want,) = ort_run(str(path), feed)
        assert_close_relative(got, want, 1e-5)
        plan = sess.plan_for(feed)
        plan.executor.run(check_pads=True)  # every kernel's outputs keep zero padded lanes
        end = len(plan.graph.nodes)
        live_at_end = [t for t in plan.memory.tensors.values() if t.last_use == end]
        assert all(pad_lanes_are_zero(plan.executor.arena, t) for t in live_at_end)


@pytest.mark.parametrize("stem", ["lenet", "resnet", "mobilenet"])
def test_cnn_runs_channels_last_without_transposes(stem):
    sess = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", channel_align=8)
    plan = sess.plan_for(_feed(stem, 2))
    assert plan.layout.transposes == []
    assert plan.layout.absorbed_flattens  # the Flatten before the classifier costs nothing
    assert plan.layout.channels_last > 0
    convs = [n for n in plan.graph.nodes if n.op_type in ("Conv", "FusedConv")]
    assert convs and all(n.inputs[0].get_layout().is_channels_last for n in convs)
    assert all(n.inputs[1].get_layout().kind == "conv_weight" for n in convs)


def test_transformer_shape_subgraphs_fold_away():
    sess = tr_onnx.InferenceSession(ZOO / "transformer.onnx")
    assert any(n.op_type == "Shape" for n in sess.imported.proto.graph.node)  # symbolic batch
    plan = sess.plan_for(_feed("transformer", 2))
    assert not any(n.op_type in ("Shape", "Size") for n in plan.graph.nodes)
    assert not any(n.inputs and all(v is None or v.kind == "const" for v in n.inputs)
                   for n in plan.graph.nodes)  # nothing left that only computes shapes


def test_zoo_files_are_reproduced_by_the_export_script(tmp_path):
    """Byte for byte, but for the last bits of values PyTorch computed while exporting: the
    training-mode exports' BatchNorm running statistics come from a forward pass, whose
    convolutions sum in another order on another CPU (AVX-512 vs AVX2: up to 3e-8 apart, about
    1 ulp, in resnet_train.onnx). Everything else (graph, names, metadata, every other value)
    must be identical."""
    from model_zoo.export_models import export_all

    paths = export_all(tmp_path)
    assert set(p.name for p in paths.values()) == {v["file"] for v in MANIFEST.values()}
    for p in paths.values():
        if filecmp.cmp(p, ZOO / p.name, shallow=False):
            continue
        got, want = onnx.load(p), onnx.load(ZOO / p.name)
        got_values, want_values = (
            {i.name: numpy_helper.to_array(i) for i in m.graph.initializer} for m in (got, want))
        assert got_values.keys() == want_values.keys(), p.name
        moved = [k for k in got_values if k.endswith((".running_mean", ".running_var"))]
        for name, value in got_values.items():
            if name in moved:
                np.testing.assert_allclose(value, want_values[name], rtol=1e-6, atol=1e-7,
                                           err_msg=f"{p.name}: {name}")
            else:
                assert value.tobytes() == want_values[name].tobytes(), f"{p.name}: {name}"
        for m in (got, want):
            del m.graph.initializer[:]
        assert got.SerializeToString() == want.SerializeToString(), \
            f"{p.name} differs from model_zoo/ beyond its BatchNorm running statistics"
