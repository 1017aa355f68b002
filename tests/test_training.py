"""Training end to end against PyTorch: same initial weights, same batches, same optimizer.

PyTorch (CPU, float32) is the oracle for loss curves, optimizers, BatchNorm running statistics,
gradient accumulation and clipping. Also: export (onnxruntime reproduces the trained model),
checkpoints (bitwise resume, atomic writes) and bad input (nothing changes).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from oracles import assert_close_relative, mse_loss_model, ort_run

import tr_onnx
from model_zoo.export_models import build_torch_model
from tr_onnx.optim import SGD, Adagrad, Adam, AdamW
from tr_onnx.training.export import export_model

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
SHAPES = {"mlp": (64,), "lenet": (1, 8, 8), "resnet": (3, 16, 16), "mobilenet": (3, 16, 16),
          "transformer": (8, 32)}
TORCH_OPT = {SGD: torch.optim.SGD, Adam: torch.optim.Adam, AdamW: torch.optim.AdamW,
             Adagrad: torch.optim.Adagrad}


def batches(name: str, steps: int, batch: int = 8, seed: int = 0, classes: int = 10,
            distinct: int = 3):
    """``steps`` batches cycling over ``distinct`` fixed ones, so a model can fit them and the
    loss visibly falls."""
    rng = np.random.default_rng(seed)
    fixed = [(rng.standard_normal((batch, *SHAPES[name])).astype(np.float32),
              rng.integers(0, classes, batch)) for _ in range(min(distinct, steps))]
    return [fixed[i % len(fixed)] for i in range(steps)]


def torch_optimizer(opt, params):
    cfg = {k: v for k, v in opt.config().items() if k != "name"}
    return TORCH_OPT[type(opt)](params, **cfg)


def torch_curve(model, opt, data, loss="cross_entropy", clip=None, accumulate=1):
    model.train()
    optim = torch_optimizer(opt, model.parameters())
    losses = []
    for i, (x, y) in enumerate(data):
        out = model(torch.from_numpy(x))
        target = torch.from_numpy(y)
        value = (torch.nn.functional.cross_entropy(out, target) if loss == "cross_entropy"
                 else torch.nn.functional.mse_loss(out, target))
        (value / accumulate).backward()
        losses.append(value.item())
        if (i + 1) % accumulate == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optim.step()
            optim.zero_grad()
    return np.array(losses)


def ours_curve(session, data):
    return np.array([session.train_step({"input": x}, y) for x, y in data])


PARITY = [  # (zoo file, model, optimizer, steps, tolerance)
    ("mlp", "mlp", SGD(lr=0.1), 20, 1e-5),
    ("mlp_train", "mlp", SGD(lr=0.1), 20, 1e-5),
    ("mlp", "mlp", AdamW(lr=1e-3), 20, 1e-5),
    ("mlp_train", "mlp", AdamW(lr=1e-3), 20, 1e-5),
    ("lenet", "lenet", SGD(lr=0.1), 20, 1e-5),
    ("lenet_train", "lenet", SGD(lr=0.1), 20, 1e-5),
    ("resnet", "resnet", SGD(lr=0.01), 20, 1e-4),
    ("resnet_train", "resnet", SGD(lr=0.01), 20, 1e-4),
    ("resnet_opset9", "resnet", SGD(lr=0.01, momentum=0.9), 10, 1e-4),
]


@pytest.mark.parametrize("stem, name, opt, steps, tol", PARITY,
                         ids=[f"{p[0]}-{type(p[2]).__name__}" for p in PARITY])
def test_loss_curve_matches_pytorch(stem, name, opt, steps, tol):
    data = batches(name, steps)
    want = torch_curve(build_torch_model(name), copy.deepcopy(opt), data)
    session = tr_onnx.TrainingSession(ZOO / f"{stem}.onnx", optimizer=copy.deepcopy(opt),
                                      bn_running_var="unbiased")
    got = ours_curve(session, data)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    assert want[-3:].mean() < want[:3].mean()  # it learns, so the comparison means something


@pytest.mark.parametrize("opt", [SGD(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
                                 SGD(lr=0.05, momentum=0.9, nesterov=True), Adam(lr=1e-3,
                                 weight_decay=1e-2), Adagrad(lr=0.05, lr_decay=0.01,
                                                             initial_accumulator_value=0.1)],
                         ids=["sgd_momentum_dampening_wd", "sgd_nesterov", "adam_l2", "adagrad"])
def test_optimizers_match_torch_optim(opt):
    data = batches("mlp", 12)
    want = torch_curve(build_torch_model("mlp"), copy.deepcopy(opt), data)
    got = ours_curve(tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=copy.deepcopy(opt)),
                     data)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_batchnorm_running_stats_follow_pytorch_and_export():
    data = batches("resnet", 5)
    model = build_torch_model("resnet")
    torch_curve(model, SGD(lr=0.01), data)
    session = tr_onnx.TrainingSession(ZOO / "resnet.onnx", optimizer=SGD(lr=0.01),
                                      bn_running_var="unbiased")
    ours_curve(session, data)
    params = session.parameters()
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for key in [k for k in state if k.endswith(("running_mean", "running_var"))]:
        np.testing.assert_allclose(params[key], state[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # eval with the trained weights: onnxruntime on the exported file == session.run
    x = batches("resnet", 1, batch=4, seed=9)[0][0]
    exported = session.export_proto()
    assert [n.name for n in exported.graph.node] == [
        n.name for n in onnx.load(ZOO / "resnet.onnx").graph.node]
    assert_close_relative(ort_run(exported, {"input": x})[0], session.run(None, {"input": x})[0])
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(x)).numpy()
    assert_close_relative(session.run(None, {"input": x})[0], want, 1e-4)


def test_onnx_spec_running_variance_is_the_default():
    data = batches("resnet", 2)
    biased = tr_onnx.TrainingSession(ZOO / "resnet.onnx", optimizer=SGD(lr=0.01))
    unbiased = tr_onnx.TrainingSession(ZOO / "resnet.onnx", optimizer=SGD(lr=0.01),
                                       bn_running_var="unbiased")
    ours_curve(biased, data)
    ours_curve(unbiased, data)
    key = "stem.1.running_var"
    assert not np.allclose(biased.parameters()[key], unbiased.parameters()[key])


def test_shared_initializers_train_separately_unless_tied():
    data = batches("resnet", 10)
    fresh = build_torch_model("resnet", fresh=True)
    want = torch_curve(fresh, SGD(lr=0.01), data)
    session = tr_onnx.TrainingSession(ZOO / "resnet_fresh.onnx", optimizer=SGD(lr=0.01),
                                      bn_running_var="unbiased")
    np.testing.assert_allclose(ours_curve(session, data), want, rtol=0, atol=1e-4)
    plan = session._state.active
    assert len(plan.info.untied) >= 12  # BN weights/biases were Identity copies of stats
    assert len(plan.info.trainable) == len(list(fresh.parameters()))
    exported = session.export_proto()
    identity_of_init = [n for n in exported.graph.node if n.op_type == "Identity"
                        and n.input[0] in {i.name for i in exported.graph.initializer}]
    assert identity_of_init == []
    x = data[0][0]
    assert_close_relative(ort_run(exported, {"input": x})[0], session.run(None, {"input": x})[0])
    tied = tr_onnx.TrainingSession(ZOO / "resnet_fresh.onnx", optimizer=SGD(lr=0.01),
                                   tie_shared_initializers=True)
    ours_curve(tied, data[:1])
    assert len(tied._state.active.info.trainable) < len(plan.info.trainable)


def test_gradient_accumulation_equals_one_big_batch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    big = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1))
    big.train_step({"input": x}, y)
    acc = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1), grad_accumulation=2)
    acc.train_step({"input": x[:8]}, y[:8])
    assert acc.step == 0
    acc.train_step({"input": x[8:]}, y[8:])
    assert acc.step == 1
    for k, v in big.parameters().items():
        np.testing.assert_allclose(acc.parameters()[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_clipping_and_accumulation_match_torch():
    data = batches("mlp", 8)
    want = torch_curve(build_torch_model("mlp"), SGD(lr=0.5), data, clip=0.5, accumulate=2)
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.5),
                                      clip_grad_norm=0.5, grad_accumulation=2)
    np.testing.assert_allclose(ours_curve(session, data), want, rtol=0, atol=1e-5)
    assert session.last_grad_norm > 0.5  # clipping really engaged


def test_frozen_parameters_do_not_change():
    session = tr_onnx.TrainingSession(ZOO / "lenet.onnx", optimizer=SGD(lr=0.1),
                                      frozen=["features.*"])
    before = session.parameters()
    ours_curve(session, batches("lenet", 3))
    after = session.parameters()
    for k in before:
        same = np.array_equal(before[k], after[k])
        assert same == k.startswith("features."), k
    assert all(not n.startswith("features.") for n in session._state.active.info.trainable)


@pytest.mark.parametrize("schedule, torch_factory", [
    (tr_onnx.optim.StepLR(step_size=3, gamma=0.5),
     lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)),
    (tr_onnx.optim.Cosine(total_steps=8),
     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=8)),
], ids=["step", "cosine"])
def test_lr_schedules_match_torch(schedule, torch_factory):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = torch_factory(opt)
    want = []
    for _ in range(8):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    got = [0.1 * schedule.factor(step) for step in range(1, 9)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    warm = tr_onnx.optim.Warmup(warmup_steps=4)
    assert [warm.factor(s) for s in (1, 2, 4, 5)] == [0.25, 0.5, 1.0, 1.0]


def test_losses_match_torch():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    target = rng.standard_normal((6, 10)).astype(np.float32)
    probs = rng.uniform(0, 1, (6, 10)).astype(np.float32)
    model = build_torch_model("mlp")
    with torch.no_grad():
        out = model(torch.from_numpy(x))
    fn = torch.nn.functional
    cases = {
        "mse": (target, fn.mse_loss(out, torch.from_numpy(target))),
        "l1": (target, fn.l1_loss(out, torch.from_numpy(target))),
        "smooth_l1": (target, fn.smooth_l1_loss(out, torch.from_numpy(target))),
        "bce_with_logits": (probs, fn.binary_cross_entropy_with_logits(out,
                                                                      torch.from_numpy(probs))),
    }
    for name, (y, want) in cases.items():
        session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", loss=name, optimizer=SGD(lr=0.0))
        assert session.train_step({"input": x}, y) == pytest.approx(want.item(), rel=1e-5), name
    labels = rng.integers(0, 10, 6)
    labels[2] = -100
    spec = tr_onnx.LossSpec("cross_entropy", ignore_index=-100,
                            weights=tuple(np.linspace(0.5, 1.5, 10)))
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", loss=spec, optimizer=SGD(lr=0.0))
    want = fn.cross_entropy(out, torch.from_numpy(labels), ignore_index=-100,
                            weight=torch.tensor(spec.weights, dtype=torch.float32))
    assert session.train_step({"input": x}, labels) == pytest.approx(want.item(), rel=1e-5)


def test_user_onnx_loss_model_equals_builtin():
    loss_model = mse_loss_model()
    rng = np.random.default_rng(4)
    data = [(rng.standard_normal((8, 64)).astype(np.float32),
             rng.standard_normal((8, 10)).astype(np.float32)) for _ in range(4)]
    builtin = tr_onnx.TrainingSession(ZOO / "mlp.onnx", loss="mse", optimizer=SGD(lr=0.1))
    custom = tr_onnx.TrainingSession(ZOO / "mlp.onnx", loss=loss_model, optimizer=SGD(lr=0.1))
    np.testing.assert_allclose(ours_curve(custom, data), ours_curve(builtin, data), rtol=1e-6)


def masked_mse_loss_model(compress: bool) -> onnx.ModelProto:
    """Mean squared error over the labels that are not -1: with ``compress`` the kept squares
    are Compress'd out (a size decided by the labels' values: a data-dependent region), else
    the same mean as a weighted sum over static shapes."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Constant", [], ["skip"], value=helper.make_tensor(
                 "skip", TensorProto.FLOAT, [], [-1.0])),
             helper.make_node("Equal", ["target", "skip"], ["is_skip"]),
             helper.make_node("Not", ["is_skip"], ["keep"]),
             helper.make_node("Sub", ["out", "target"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["sq"])]
    if compress:
        nodes += [helper.make_node("Compress", ["sq", "keep"], ["kept"]),
                  helper.make_node("ReduceMean", ["kept"], ["loss"], keepdims=0)]
    else:
        nodes += [helper.make_node("Cast", ["keep"], ["w"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["sq", "w"], ["wsq"]),
                  helper.make_node("ReduceSum", ["wsq"], ["total"], keepdims=0),
                  helper.make_node("ReduceSum", ["w"], ["count"], keepdims=0),
                  helper.make_node("Div", ["total", "count"], ["loss"])]
    graph = helper.make_graph(nodes, "masked_mse", [
        helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 10]),
        helper.make_tensor_value_info("target", TensorProto.FLOAT, ["n", 10])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_user_loss_model_with_a_data_dependent_size_trains_as_its_static_form():
    """The loss model is cut into sub-plans as the main model is (a Compress over the labels
    would otherwise be a ShapeError)."""
    rng = np.random.default_rng(5)
    data = []
    for _ in range(4):
        y = rng.standard_normal((8, 10)).astype(np.float32)
        y[rng.random(y.shape) < 0.3] = -1.0
        data.append((rng.standard_normal((8, 64)).astype(np.float32), y))
    dynamic = tr_onnx.TrainingSession(ZOO / "mlp.onnx", loss=masked_mse_loss_model(True),
                                      optimizer=SGD(lr=0.1))
    static = tr_onnx.TrainingSession(ZOO / "mlp.onnx", loss=masked_mse_loss_model(False),
                                     optimizer=SGD(lr=0.1))
    (x, y), keep = data[0], data[0][1] != -1.0
    out = dynamic.run(None, {"input": x})[0]
    want = np.mean((out.astype(np.float64)[keep] - y[keep]) ** 2)
    curve = ours_curve(dynamic, data)
    assert curve[0] == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(curve, ours_curve(static, data), rtol=1e-5)


def test_dropout_trains_in_training_mode_and_is_identity_in_eval():
    # the eval export drops Dropout; the training-mode export keeps it
    session = tr_onnx.TrainingSession(ZOO / "mobilenet_train.onnx", optimizer=SGD(lr=0.0))
    x, y = batches("mobilenet", 1)[0]
    a = session.train_step({"input": x}, y)
    b = session.train_step({"input": x}, y)
    assert a != b  # a new mask each micro-batch (lr 0: nothing else changed)
    assert session._state.active.info.converted == {"BatchNormalization": 11, "Dropout": 1}
    r1, r2 = session.run(None, {"input": x})[0], session.run(None, {"input": x})[0]
    np.testing.assert_array_equal(r1, r2)


# ---- export and checkpoints -----------------------------------------------------------------

def test_export_runs_in_onnxruntime_and_keeps_names(tmp_path):
    session = tr_onnx.TrainingSession(ZOO / "lenet.onnx", optimizer=AdamW(lr=1e-2))
    ours_curve(session, batches("lenet", 5))
    path = session.export(tmp_path / "lenet_trained.onnx")
    model = onnx.load(path)
    onnx.checker.check_model(model)
    original = onnx.load(ZOO / "lenet.onnx")
    assert [n.name for n in model.graph.node] == [n.name for n in original.graph.node]
    assert [i.name for i in model.graph.input] == [i.name for i in original.graph.input]
    x = batches("lenet", 1, batch=5, seed=7)[0][0]
    assert_close_relative(ort_run(str(path), {"input": x})[0], session.run(None, {"input": x})[0])
    assert not np.allclose(ort_run(str(path), {"input": x})[0],
                           ort_run(str(ZOO / "lenet.onnx"), {"input": x})[0])


def test_checkpoint_resume_is_bitwise(tmp_path):
    data = batches("resnet", 6)
    straight = tr_onnx.TrainingSession(ZOO / "mobilenet.onnx", optimizer=AdamW(lr=1e-3),
                                       lr_schedule="cosine")
    ours_curve(straight, data)
    first = tr_onnx.TrainingSession(ZOO / "mobilenet.onnx", optimizer=AdamW(lr=1e-3),
                                    lr_schedule="cosine")
    ours_curve(first, data[:3])
    first.save_checkpoint(tmp_path / "ck.npz")
    resumed = tr_onnx.TrainingSession.from_checkpoint(tmp_path / "ck.npz")
    assert resumed.step == 3
    ours_curve(resumed, data[3:])
    a, b = straight.state_arrays(), resumed.state_arrays()
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1))
    ours_curve(session, batches("mlp", 1))
    path = session.save_checkpoint(tmp_path / "ck.npz")
    good = path.read_bytes()
    ours_curve(session, batches("mlp", 1, seed=5))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("tr_onnx.training.storage.os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        session.save_checkpoint(path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["ck.npz"]  # no temporary left behind


# ---- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("feed, labels, message", [
    ({"image": np.zeros((4, 64), np.float32)}, np.zeros(4, np.int64), "unknown \\['image'\\]"),
    ({"input": np.zeros((4, 63), np.float32)}, np.zeros(4, np.int64),
     r"input 'input': expected shape \['batch', 64\]"),
    ({"input": np.zeros((4, 64), np.float64)}, np.zeros(4, np.int64), "expected dtype float32"),
    ({"input": np.zeros((4, 64), np.float32)}, np.zeros(5, np.int64),
     r"labels 'labels': expected shape \[4\], got \[5\]"),
    ({"input": np.zeros((4, 64), np.float32)}, np.zeros((4, 10), np.float32),
     "labels 'labels': expected dtype int64"),
], ids=["name", "shape", "dtype", "label_shape", "label_dtype"])
def test_bad_batch_names_the_problem_and_changes_nothing(feed, labels, message):
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=AdamW(lr=1e-2))
    ours_curve(session, batches("mlp", 2))
    before, step = session.state_arrays(), session.step
    with pytest.raises(tr_onnx.InputError, match=message):
        session.train_step(feed, labels)
    after = session.state_arrays()
    assert session.step == step and all(np.array_equal(before[k], after[k]) for k in before)


def test_non_finite_batches_are_skipped_then_training_stops():
    session = tr_onnx.TrainingSession(ZOO / "resnet.onnx", optimizer=AdamW(lr=1e-2),
                                      max_bad_steps=3)
    ours_curve(session, batches("resnet", 2))
    before = session.state_arrays()
    x, y = batches("resnet", 1, seed=3)[0]
    x[1, 0, 2, 2] = np.nan
    with pytest.warns(RuntimeWarning, match="step 3: non-finite loss"):
        session.train_step({"input": x}, y)
    after = session.state_arrays()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # running stats too
    good = session.train_step({"input": batches("resnet", 1, seed=4)[0][0]}, y)
    assert np.isfinite(good) and session.step == 3
    for _ in range(2):
        with pytest.warns(RuntimeWarning):
            session.train_step({"input": x}, y)
    with pytest.raises(tr_onnx.TrainingDiverged, match="3 steps in a row"), \
            pytest.warns(RuntimeWarning):
        session.train_step({"input": x}, y)


@pytest.mark.parametrize("kwargs, message", [
    ({"loss": "hinge"}, "unknown loss 'hinge'; valid: cross_entropy, mse, l1"),
    ({"optimizer": "lamb"}, "unknown optimizer 'lamb'; valid: sgd, adam, adamw, adagrad"),
    ({"lr_schedule": "poly"}, "unknown lr schedule 'poly'; valid: constant, step"),
], ids=["loss", "optimizer", "schedule"])
def test_unknown_names_list_the_valid_ones(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tr_onnx.TrainingSession(ZOO / "mlp.onnx", **kwargs)


def test_a_training_step_allocates_only_numpy_buffers():
    import gc
    import tracemalloc

    session = tr_onnx.TrainingSession(ZOO / "resnet.onnx", optimizer=AdamW(lr=1e-3))
    data = batches("resnet", 14)
    ours_curve(session, data[:4])
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        ours_curve(session, data[4:])
        peak = tracemalloc.get_traced_memory()[1]
        gc.collect()
        current = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert peak - base < 512 * 1024  # the step's arena is ~20 MB
    assert current - base < 64 * 1024


@pytest.mark.parametrize("stem", ["resnet_train", "mobilenet_train"])
def test_training_mode_exports_come_back_in_inference_form(stem):
    session = tr_onnx.TrainingSession(ZOO / f"{stem}.onnx", optimizer=SGD(lr=0.01))
    ours_curve(session, batches("resnet", 3))
    exported = session.export_proto()
    bn = [n for n in exported.graph.node if n.op_type == "BatchNormalization"]
    assert all(len(n.output) == 1 for n in bn)
    x = batches("resnet", 1, batch=4, seed=11)[0][0]
    assert_close_relative(ort_run(exported, {"input": x})[0], session.run(None, {"input": x})[0])


def test_export_writes_a_copy_in_the_initializers_own_dtype_and_order():
    original = onnx.load(ZOO / "resnet_train.onnx")
    before = original.SerializeToString()
    names = [i.name for i in original.graph.initializer]
    w = onnx.numpy_helper.to_array(original.graph.initializer[0])
    params = {names[0]: np.full(w.shape, 0.5, np.float64)}  # float64 comes back as the file's
    exported = export_model(original, params, {})
    assert original.SerializeToString() == before
    assert [i.name for i in exported.graph.initializer] == names
    got = onnx.numpy_helper.to_array(exported.graph.initializer[0])
    assert got.dtype == w.dtype and np.all(got == 0.5)
    assert all(a.i == 0 for n in exported.graph.node for a in n.attribute
               if n.op_type == "BatchNormalization" and a.name == "training_mode")


def test_loaded_frozen_parameters_survive_a_new_batch_shape():
    session = tr_onnx.TrainingSession(ZOO / "lenet.onnx", optimizer=SGD(lr=0.1),
                                      frozen=["features.0.*"])
    ours_curve(session, batches("lenet", 1))
    new = np.full_like(session.parameters()["features.0.weight"], 0.25)
    session.load_parameters({"features.0.weight": new})
    ours_curve(session, batches("lenet", 1, batch=5))  # a new plan for batch 5
    np.testing.assert_array_equal(session.parameters()["features.0.weight"], new)


@pytest.mark.parametrize("name", ["__step", "__params"])
def test_a_model_value_with_a_name_training_reserves_is_refused_by_name(name):
    """A model's value named like a value the train pass adds (the step counter, the parameter
    span) would be read and written as that one: refused, naming it."""
    from onnx import helper, numpy_helper

    from tr_onnx.errors import UnsupportedModelError
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], [name]), helper.make_node("Relu", [name], ["y"])],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = tr_onnx.TrainingSession(model, loss="mse", optimizer=SGD(lr=0.1), backend="numpy")
    with pytest.raises(UnsupportedModelError, match=repr(name)):
        session.train_step({"x": np.ones((2, 4), np.float32)}, np.zeros((2, 3), np.float32))
