"""Fuzzing the importer (issue 12): mutated model-zoo models end in a run or a ``TrOnnxError``,
never another exception, a hang, or an allocation past the bound.

The campaign (``fuzz_models.run_campaign``) runs ``TR_ONNX_FUZZ_CASES`` seeded cases (default
4000, about 30 s on two cores) of seed ``TR_ONNX_FUZZ_SEED`` (default 12, fixed so CI is
deterministic) in two worker processes, each under a 2 GiB address-space bound and a 10 s
alarm per case; a failure prints the command that reproduces its case. Then one test per bug
the fuzzer found, on a minimal model, and the harness's own tests: it reports each way a case
can fail, so the campaign can fail.

    TR_ONNX_FUZZ_CASES=20000 TR_ONNX_FUZZ_SEED=7 python3 -m pytest tests/test_fuzz_import.py
    python tests/fuzz_models.py --seed 7 --campaign 20000     # the same, as a report
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import fuzz_models
import numpy as np
import onnx
import pytest
from fuzz_models import FAILURES
from onnx import TensorProto, helper, numpy_helper

import tr_onnx
from tr_onnx.optim import SGD

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
SEED = int(os.environ.get("TR_ONNX_FUZZ_SEED", "12"))
CASES = int(os.environ.get("TR_ONNX_FUZZ_CASES", "4000"))
CASE_TIMEOUT_S = 10.0
MEMORY_GIB = 2.0


@pytest.fixture(scope="module")
def campaign() -> list[dict]:
    return fuzz_models.run_campaign(SEED, CASES, workers=2, case_timeout=CASE_TIMEOUT_S,
                                    memory_gib=MEMORY_GIB)


@pytest.mark.parametrize("failure", FAILURES, ids=[
    "leaked_exception", "internal_error", "allocation_past_2GiB", "past_10s", "changed_proto",
    "differs_from_onnxruntime", "worker_crash", "worker_hang"])
def test_no_fuzzed_model_ends_in(campaign, failure):
    failed = [r for r in campaign if r.get("failure") == failure]
    assert not failed, f"{len(failed)} of {len(campaign)} cases (seed {SEED}):\n" + \
        fuzz_models.summary(failed, SEED)


def test_the_campaign_runs_every_case_and_reaches_every_stage(campaign):
    """The fuzzer is not vacuous: every case ran, and mutants get past the parser, the checker,
    inference and planning into runs, training steps and onnxruntime comparisons."""
    assert [r["case"] for r in campaign] == list(range(CASES))
    count = {}
    for r in campaign:
        key = r["outcome"] if r["outcome"] != "error" else r["error"]
        count[key] = count.get(key, 0) + 1
    kinds = {k: sum(r["kind"] == k for r in campaign) for k in ("bytes", "proto")}
    assert kinds["bytes"] > 0.4 * CASES and kinds["proto"] > 0.3 * CASES, kinds
    ran = sum(n for k, n in count.items() if k.startswith("ran"))
    assert ran > 0.05 * CASES, count
    assert count.get("trained", 0) > 0.003 * CASES, count
    assert count.get("ran, equal to onnxruntime", 0) > 0.003 * CASES, count
    for error in ("ModelLoadError", "ShapeError", "UnsupportedModelError", "KernelError"):
        assert count.get(error, 0) > 0.001 * CASES, (error, count)


def test_a_case_is_a_function_of_seed_and_index():
    def serialized(seed, case):
        c = fuzz_models.make_case(seed, case)
        data = c.mutant if isinstance(c.mutant, bytes) else c.mutant.SerializeToString()
        return c.model, c.kind, c.mutations, data

    cases = range(40)
    assert [serialized(SEED, k) for k in cases] == [serialized(SEED, k) for k in cases]
    assert [serialized(SEED, k) for k in cases] != [serialized(SEED + 1, k) for k in cases]


# ---- the harness can fail: each way a case fails is reported as such --------------------------

def _raises(exc):
    def run_case(*args, **kwargs):
        raise exc

    return run_case


def _kernel_out_of_memory(*args, **kwargs):
    try:
        raise MemoryError("Unable to allocate 40.0 TiB")
    except MemoryError as exc:
        raise tr_onnx.errors.TrOnnxError("node 'n' failed: MemoryError") from exc


def _sleeps(*args, **kwargs):
    time.sleep(30)


@pytest.mark.parametrize("run_case, outcome, failure", [
    (_raises(IndexError("index 72 is out of bounds")), "failure", fuzz_models.LEAKED),
    (_raises(onnx.checker.ValidationError("B has inconsistent type")), "failure",
     fuzz_models.LEAKED),
    (_raises(tr_onnx.PlanError("tensor does not fit its slot")), "failure",
     fuzz_models.INTERNAL),
    (_raises(MemoryError()), "failure", fuzz_models.MEMORY),
    (_kernel_out_of_memory, "failure", fuzz_models.MEMORY),
    (_sleeps, "failure", fuzz_models.TIMEOUT),
    (_raises(fuzz_models.ChangedModel("changed")), "failure", fuzz_models.CHANGED),
    (_raises(fuzz_models.WrongResult("differs")), "failure", fuzz_models.WRONG),
    (_raises(tr_onnx.ShapeError("node 'n': inputs do not fit")), "error", None),
    (lambda *args, **kwargs: "ran", "ran", None),
], ids=["IndexError", "onnx_ValidationError", "PlanError", "MemoryError", "kernel_MemoryError",
        "slow", "changed_proto", "wrong_result", "ShapeError_is_clean", "run_is_clean"])
def test_the_worker_reports_each_way_a_case_can_fail(monkeypatch, run_case, outcome, failure):
    monkeypatch.setattr(fuzz_models, "run_case", run_case)
    out = io.StringIO()
    fuzz_models.run_cases(SEED, [5], case_timeout=0.5, out=out)
    start, record = [json.loads(line) for line in out.getvalue().splitlines()]
    assert start == {"case": 5, "start": True}
    assert (record["outcome"], record.get("failure")) == (outcome, failure), record
    assert record["seconds"] < 5


def test_a_worker_that_dies_or_hangs_fails_its_case_and_the_rest_still_run():
    records = fuzz_models.run_campaign(SEED, 4, workers=1, case_timeout=1.0, stall=4.0,
                                       env={fuzz_models.SABOTAGE: "crash:1"})
    assert [r["case"] for r in records] == [0, 1, 2, 3]
    assert records[1]["failure"] == fuzz_models.CRASH
    assert "exit status 3" in records[1]["message"]
    assert all("failure" not in records[k] for k in (0, 2, 3))
    hung = fuzz_models.run_campaign(SEED, 3, workers=1, case_timeout=1.0, stall=4.0,
                                    env={fuzz_models.SABOTAGE: "hang:0"})
    assert [r.get("failure") for r in hung] == [fuzz_models.HANG, None, None]


def test_the_memory_bound_fails_an_allocation_past_it():
    code = ("import sys; sys.path.insert(0, 'tests'); import fuzz_models, numpy as np\n"
            "fuzz_models.limit_memory(0.5)\n"
            "np.ones(1 << 26, np.uint8)\n"  # 64 MiB: under the bound
            "try:\n    np.ones(1 << 30, np.uint8)\nexcept MemoryError:\n    print('bounded')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ZOO.parent, timeout=120)
    assert done.stdout.strip() == "bounded", done.stderr[-2000:]


# ---- the bugs the fuzzer found, each on a minimal model ----------------------------------------

def _zoo(name: str) -> onnx.ModelProto:
    return onnx.load(ZOO / name)


def _initializer(m: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in m.graph.initializer if t.name == name)


def _raw_data_long():
    """The checker rejects raw_data that is too short, not too long."""
    m = _zoo("mlp.onnx")
    t = _initializer(m, "0.weight")
    t.raw_data = t.raw_data + b"\0" * 4
    return m


def _unknown_data_type():
    m = _zoo("mlp.onnx")
    _initializer(m, "0.bias").data_type = 999
    return m


def _segment():
    m = _zoo("mlp.onnx")
    t = _initializer(m, "0.bias")
    t.segment.begin, t.segment.end = 0, 1
    return m


def _small(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _x(shape=("N", 3)):
    return helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))


def _y(shape=("N", 3)):
    return helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))


def _constant_value_long():
    value = numpy_helper.from_array(np.ones(3, np.float32), "c")
    value.raw_data = value.raw_data + b"\0" * 4  # 4 floats for dims [3]
    return _small([helper.make_node("Constant", [], ["c"], value=value),
                   helper.make_node("Add", ["x", "c"], ["y"])], [_x()], [_y()])


def _sequence_input():
    m = _zoo("mlp.onnx")
    m.graph.input[0].type.CopyFrom(helper.make_sequence_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, None)))
    return m


def _input_elem_type_999():
    m = _zoo("mlp.onnx")
    m.graph.input[0].type.tensor_type.elem_type = 999
    return m


def _non_utf8_name():
    """A node reading a value nothing defines, whose name is not UTF-8: the checker's message
    quotes it (the bytes are patched in: protobuf takes str names only)."""
    m = _small([helper.make_node("Add", ["x", "QQQQ"], ["y"])], [_x()], [_y()])
    return m.SerializeToString().replace(b"QQQQ", b"Q\xff\xfeQ")


def _conv_weight_rank_1(**attrs):
    """ONNX's Conv rule reads the weight's spatial dims only without ``kernel_shape``."""
    def build():
        return _small([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)],
                      [_x(("N", 3, 4, 4))], [_y(("N", 1, 4, 4))],
                      [numpy_helper.from_array(np.ones(1, np.float32), "w")])

    return build


def _maxpool_without_strides():
    """LeNet (opset 9) with its first MaxPool's strides dropped: the flattened features no
    longer match the first Gemm's weight, which ONNX's Gemm rule checks only from opset 13."""
    m = _zoo("lenet_opset9.onnx")
    pool = next(n for n in m.graph.node if n.op_type == "MaxPool")
    keep = [a for a in pool.attribute if a.name != "strides"]
    del pool.attribute[:]
    pool.attribute.extend(keep)
    return m


def _clip_bound_empty():
    """A Constant bound is read when the plan is made (a float initializer, when it runs)."""
    return _small([helper.make_node("Constant", [], ["lo"], value=numpy_helper.from_array(
                       np.zeros(0, np.float32))),
                   helper.make_node("Clip", ["x", "lo"], ["y"])], [_x()], [_y()])


def _reshape_loses_elements():
    """ONNX's Reshape rule does not count elements: [N, 4] to [2, 3] passes inference."""
    return _small([helper.make_node("Reshape", ["x", "shape"], ["r"]),
                   helper.make_node("Relu", ["r"], ["y"])], [_x(("N", 4))], [_y((2, 3))],
                  [numpy_helper.from_array(np.array([2, 3], np.int64), "shape")])


def _output_declared_huge():
    m = _zoo("mlp.onnx")
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 2 ** 40
    return m


def _float_gemm_int64_bias():
    """A float Gemm whose bias is an int64 product: a type error ONNX's rules catch."""
    m = _zoo("mlp.onnx")
    m.graph.initializer.append(numpy_helper.from_array(np.arange(1, 129), "k"))
    gemm = m.graph.node[0]
    m.graph.node.insert(0, helper.make_node("Mul", [gemm.input[2], "k"], ["scaled_bias"]))
    m.graph.node[1].input[2] = "scaled_bias"
    return m


def _input_as_output_declared_negative():
    """The input listed among the outputs too, its batch declared -1 there: lenient inference
    took that size for every value downstream (negative byte counts in the plan)."""
    m = _zoo("mlp.onnx")
    m.graph.output.add().CopyFrom(m.graph.input[0])
    m.graph.output[1].type.tensor_type.shape.dim[0].dim_value = -1
    return m


def _cast_to_no_type():
    return _small([helper.make_node("Cast", ["x"], ["c"], to=-2 ** 63),
                   helper.make_node("Relu", ["c"], ["y"])], [_x()], [_y()])


def _batch_norm_scalar_scale():
    """Inference broadcasts a scalar BatchNormalization scale (ONNX checks its shape only from
    opset 15); training keeps one statistic per channel."""
    stats = [numpy_helper.from_array(np.array(1.0, np.float32), "s")] + [
        numpy_helper.from_array(np.ones(3, np.float32), n) for n in ("b", "m", "v")]
    return _small([helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["n"]),
                   helper.make_node("GlobalAveragePool", ["n"], ["p"]),
                   helper.make_node("Flatten", ["p"], ["f"]),
                   helper.make_node("MatMul", ["f", "fc"], ["y"])],
                  [_x(("N", 3, 4, 4))], [_y(("N", 5))],
                  [*stats, numpy_helper.from_array(np.ones((3, 5), np.float32), "fc")], 13)


def _run(model):
    session = tr_onnx.InferenceSession(model)
    feed = {s.name: np.ones([d if isinstance(d, int) else 2 for d in s.shape], s.dtype)
            for s in session.imported.inputs}
    return session.run(None, feed)


def _train(model):
    session = tr_onnx.TrainingSession(model, optimizer=SGD(lr=0.1), backend="numpy")
    feed = {s.name: np.ones([d if isinstance(d, int) else 2 for d in s.shape], s.dtype)
            for s in session.imported.inputs}
    return session.train_step(feed, np.zeros(2, np.int64))


@pytest.mark.parametrize("build, call, error, message", [
    (_raw_data_long, _run, tr_onnx.ModelLoadError,
     r"<ModelProto>: initializer '0.weight' \(FLOAT, dims \[128, 64\]\) does not hold data of "
     r"its dims and type"),
    (_unknown_data_type, _run, tr_onnx.ModelLoadError,
     r"initializer '0.bias' \(999 \(not an ONNX element type\), dims \[128\]\) does not hold"),
    (_segment, _run, tr_onnx.ModelLoadError, r"initializer '0.bias' .* segments"),
    (_constant_value_long, _run, tr_onnx.ModelLoadError,
     r"node 'Constant' \(Constant\) attribute 'value' \(FLOAT, dims \[3\]\) does not hold data"),
    (_sequence_input, _run, tr_onnx.UnsupportedModelError,
     r"values with element types tr_onnx cannot hold: 'input' \(sequence_type, not a tensor\)"),
    (_input_elem_type_999, _run, tr_onnx.UnsupportedModelError,
     r"cannot hold: 'input' \(999 \(not an ONNX element type\)\)"),
    (_non_utf8_name, _run, tr_onnx.ModelLoadError,
     r"<bytes>: fails onnx.checker, on a name or string that is not valid UTF-8"),
    (_conv_weight_rank_1(), _run, tr_onnx.ShapeError,
     r"node 'Conv_0' \(Conv\): its inputs do not fit the op .* spatial dimensions in the "
     r"weight tensor \(0\)"),
    (_conv_weight_rank_1(kernel_shape=[1, 1]), _run, tr_onnx.UnsupportedModelError,
     r"node 'Conv_0' \(Conv, ai.onnx v11\): weight \[1\] does not fit input \[2, 3, 4, 4\]"),
    (_maxpool_without_strides, _run, tr_onnx.UnsupportedModelError,
     r"node '/classifier/classifier.0/Gemm' \(Gemm, ai.onnx v9\): A \[2, 144\] \(transA=0\) "
     r"and B \[120, 64\] \(transB=1\) are not matrices whose product is defined"),
    (_clip_bound_empty, _run, tr_onnx.UnsupportedModelError,
     r"node 'Clip_0' \(Clip, ai.onnx v13\): bound 1 \(min\) has shape \[0\]; a Clip bound is "
     r"a scalar"),
    (_reshape_loses_elements, _run, tr_onnx.ShapeError,
     r"node 'Reshape_0' \(Reshape, ai.onnx v14\): output 'r' \[2, 3\] float32 is not input "
     r"'x' \[2, 4\] float32 regrouped"),
    (_output_declared_huge, _run, tr_onnx.ShapeError,
     r"output 'logits' is declared with shape \[1099511627776, 10\], but the model gives it "
     r"\[2, 10\]"),
    (_float_gemm_int64_bias, _train, tr_onnx.ShapeError,
     r"node 'Mul_0' \(Mul\): input 0 \('0.bias'\) is FLOAT but input 1 \('k'\) is INT64; the "
     r"op takes one type for both \(T\)"),
    (_input_as_output_declared_negative, _run, tr_onnx.ShapeError,
     r"output 'input' is declared with shape \[-1, 64\], but the model gives it \[2, 64\]"),
    (_cast_to_no_type, _run, tr_onnx.ModelLoadError,
     r"node 'Cast_0' \(Cast\): attribute 'to' is -9223372036854775808, which is no ONNX "
     r"element type"),
    (_batch_norm_scalar_scale, _train, tr_onnx.UnsupportedModelError,
     r"node 'BatchNormalization_0' \(BatchNormalization, ai.onnx v9\): training needs scale, "
     r"bias, mean and var of one value per channel of x \[2, 3, 4, 4\]; they are \[\[\], "
     r"\[3\], \[3\], \[3\]\]"),
], ids=["raw_data_long", "unknown_data_type", "segment", "constant_value_long",
        "sequence_input", "input_elem_type_999", "non_utf8_name", "conv_weight_rank_1",
        "conv_weight_rank_1_with_kernel_shape", "gemm_k_mismatch_opset9", "clip_bound_empty",
        "reshape_loses_elements", "output_declared_huge", "float_gemm_int64_bias",
        "input_as_output_declared_negative", "cast_to_no_type", "batch_norm_scalar_scale"])
def test_a_bad_model_the_fuzzer_found_is_a_named_error(build, call, error, message):
    with pytest.raises(error, match=message):
        call(build())


def test_external_data_of_a_model_given_as_bytes_is_never_read_from_the_working_folder(
        tmp_path, monkeypatch):
    """The model's bytes have no folder: a file of that name where the process happens to run
    is not its data (nor any other file it names)."""
    w = np.full((3,), 7.0, np.float32)
    (tmp_path / "weights.bin").write_bytes(w.tobytes())
    t = numpy_helper.from_array(np.zeros(3, np.float32), "w")
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value="weights.bin")
    m = _small([helper.make_node("Add", ["x", "w"], ["y"])], [_x()], [_y()], [t])
    monkeypatch.chdir(tmp_path)
    for given in (m.SerializeToString(), m):
        with pytest.raises(tr_onnx.ModelLoadError, match=r"tensor 'w' keeps its data in an "
                                                         r"external file .*a model given as "
                                                         r"bytes or a ModelProto has no folder"):
            tr_onnx.InferenceSession(given)
    path = tmp_path / "model.onnx"  # from its path, the file beside it is its data
    path.write_bytes(m.SerializeToString())
    (y,) = tr_onnx.InferenceSession(path).run(None, {"x": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(y, np.ones((2, 3), np.float32) + w)


def test_importing_a_model_proto_leaves_it_as_it_was():
    """IR 3 lists the initializers among the graph inputs; the import drops them from a copy."""
    m = _zoo("resnet_opset9_ir3.onnx")
    before = m.SerializeToString()
    session = tr_onnx.InferenceSession(m)
    assert m.SerializeToString() == before
    assert [s.name for s in session.imported.inputs] == ["input"]


def test_a_stale_declared_output_shape_is_named_before_a_kernel_fails():
    """An export that fixed the batch of its output ([1, 10]) while the input's is symbolic."""
    m = _zoo("mlp.onnx")
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 1
    session = tr_onnx.InferenceSession(m)
    (y,) = session.run(None, {"input": np.ones((1, 64), np.float32)})
    assert y.shape == (1, 10)
    with pytest.raises(tr_onnx.ShapeError, match=r"output 'logits' is declared with shape "
                                                 r"\[1, 10\], but the model gives it \[2, 10\]"):
        session.run(None, {"input": np.ones((2, 64), np.float32)})


def test_global_average_pool_over_no_spatial_element_trains_as_a_bad_step():
    """A Slice leaves the pooled feature map without rows: the mean is NaN, so the step is not
    applied (a warning names it); its gradient rule no longer divides by zero."""
    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    fc = numpy_helper.from_array(np.ones((4, 5), np.float32), "fc")
    ints = [numpy_helper.from_array(np.array(v, np.int64), n)
            for v, n in (([0], "start"), ([0], "end"), ([2], "axis"))]
    m = _small([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                helper.make_node("Slice", ["c", "start", "end", "axis"], ["s"]),
                helper.make_node("GlobalAveragePool", ["s"], ["p"]),
                helper.make_node("Flatten", ["p"], ["f"]),
                helper.make_node("MatMul", ["f", "fc"], ["y"])],
               [_x(("N", 3, 4, 4))], [_y(("N", 5))], [w, fc, *ints])
    session = tr_onnx.TrainingSession(m, optimizer=SGD(lr=0.1), backend="numpy")
    before = session.parameters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = session.train_step({"x": np.ones((2, 3, 4, 4), np.float32)},
                                  np.zeros(2, np.int64))
    assert np.isnan(loss) and session.step == 0
    assert any("step 1: non-finite loss" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    after = session.parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_a_batch_whose_labels_are_all_ignored_is_a_bad_step_not_a_kernel_error():
    """Mean cross-entropy over no counted label is NaN (as PyTorch's); its gradient divided
    a Python float by zero. Found through an empty batch (a Tile by 0)."""
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", loss=tr_onnx.LossSpec(
        "cross_entropy", ignore_index=-100), optimizer=SGD(lr=0.1), backend="numpy")
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    before = session.parameters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = session.train_step({"input": x}, np.full(4, -100, np.int64))
    assert np.isnan(loss) and session.step == 0
    assert any("step 1: non-finite loss (nan)" in str(w.message) for w in caught)
    assert all(np.array_equal(v, session.parameters()[k]) for k, v in before.items())
    assert np.isfinite(session.train_step({"input": x}, np.array([1, -100, 2, 3])))
    assert session.step == 1
