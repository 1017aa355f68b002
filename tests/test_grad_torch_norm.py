"""Normalisation gradients against PyTorch autograd (float64), and the finite-difference cases
of grad_cases_norm_reduce.py whose outputs ONNX shape inference cannot type."""

from __future__ import annotations

import gradcheck
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from grad_cases_norm_reduce import TYPED_OUTPUT_CASES
from onnx import helper, numpy_helper

import tr_onnx
from tr_onnx.training.gradients import vjp

pytestmark = pytest.mark.internal_ops  # models of its internal ops, to test their kernels

F64 = 11  # onnx TensorProto.DOUBLE
# float64 throughout; gradients of normalisations cancel terms of size ~|gy| (1e-12 abs)
RTOL, ATOL = 1e-9, 1e-11
# ONNX float attributes are float32: momentum 0.9 is 0.89999998, so the running statistics
# differ from PyTorch's float64 0.1 blend at ~1e-8 of the batch statistic
MOMENTUM_RTOL = 1e-6


def _typed_builder(shapes):
    """gradcheck.build_model's single-node model, with the outputs typed from ``shapes``."""

    def build_typed(case):
        ins, inits, names = [], [], []
        for i, x in enumerate(case.inputs):
            name = gradcheck._name(i) if x is not None else ""
            names.append(name)
            if isinstance(x, gradcheck.Const):
                inits.append(numpy_helper.from_array(np.asarray(x.value), name))
            elif x is not None:
                ins.append(helper.make_tensor_value_info(name, F64, np.shape(x)))
        outs = [f"y{k}" for k in range(case.n_outputs)]
        node = helper.make_node(case.op, names, outs, domain=case.domain, **case.attrs)
        opsets = [helper.make_opsetid("", case.opset)]
        if case.domain:
            opsets.append(helper.make_opsetid(case.domain, case.domain_version))
        graph = helper.make_graph(
            [node], case.id, ins,
            [helper.make_tensor_value_info(o, F64, list(s)) for o, s in zip(outs, shapes)],
            inits)
        return helper.make_model(graph, opset_imports=opsets)

    return build_typed


@pytest.mark.parametrize("align", [1, 8], ids=["align1", "align8"])
@pytest.mark.parametrize("case, shapes", TYPED_OUTPUT_CASES,
                         ids=[c.id for c, _ in TYPED_OUTPUT_CASES])
def test_typed_output_cases_match_finite_differences(case, shapes, align, monkeypatch):
    monkeypatch.setattr(gradcheck, "build_model", _typed_builder(shapes))
    gradcheck.check_case(case, channel_align=align)


def _model(op, inputs: dict, outputs: dict, attrs=None, domain="", opset=17, inits=()):
    """One node; ``outputs``: {name: shape} (all float64); ``inits``: initializer names."""
    node = helper.make_node(op, list(inputs), list(outputs), domain=domain, **(attrs or {}))
    graph = helper.make_graph(
        [node], op,
        [helper.make_tensor_value_info(k, F64, v.shape) for k, v in inputs.items()
         if k not in inits],
        [helper.make_tensor_value_info(k, F64, list(s)) for k, s in outputs.items()],
        [numpy_helper.from_array(inputs[k], k) for k in inits])
    opsets = [helper.make_opsetid("", opset)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=opsets)


def _t(a, grad=False):
    return torch.tensor(a, dtype=torch.float64, requires_grad=grad)


@pytest.mark.parametrize("shape", [(8, 3), (4, 5, 3, 2), (2, 3, 2, 3, 4)],
                         ids=["2d", "4d", "5d"])
@pytest.mark.parametrize("align", [1, 8], ids=["align1", "align8"])
def test_batch_norm_training_matches_torch(shape, align):
    rng = np.random.default_rng(len(shape))
    c = shape[1]
    x, scale, bias = rng.standard_normal(shape) * 2 + 1, rng.standard_normal(c), \
        rng.standard_normal(c)
    rmean, rvar = rng.standard_normal(c), rng.uniform(0.5, 1.5, c)
    cot = rng.standard_normal(shape)
    eps = 1e-5
    model = _model("BatchNormTraining",
                   {"x": x, "scale": scale, "bias": bias, "rmean": rmean, "rvar": rvar},
                   {"y": shape, "smean": (c,), "sinv": (c,), "new_rmean": (c,),
                    "new_rvar": (c,)},
                   {"epsilon": eps, "momentum": 0.9, "unbiased_running_var": 1},
                   domain="ai.tr_onnx", inits=("rmean", "rvar"))
    feed = {"x": x, "scale": scale, "bias": bias}
    y, grads = vjp(model, feed, ["x", "scale", "bias"], cot, output="y", channel_align=align)
    sess = tr_onnx.InferenceSession(model, channel_align=align)
    _, smean, sinv, new_rmean, new_rvar = sess.run(None, feed)

    tx, ts, tb = _t(x, True), _t(scale, True), _t(bias, True)
    t_rmean, t_rvar = _t(rmean), _t(rvar)
    ty = F.batch_norm(tx, t_rmean, t_rvar, ts, tb, training=True, momentum=0.1, eps=eps)
    ty.backward(_t(cot))
    axes = tuple(i for i in range(len(shape)) if i != 1)
    np.testing.assert_allclose(y, ty.detach().numpy(), RTOL, ATOL)
    np.testing.assert_allclose(new_rmean, t_rmean.numpy(), MOMENTUM_RTOL)
    np.testing.assert_allclose(new_rvar, t_rvar.numpy(), MOMENTUM_RTOL)
    np.testing.assert_allclose(smean, x.mean(axis=axes), RTOL, ATOL)
    np.testing.assert_allclose(sinv, 1 / np.sqrt(x.var(axis=axes) + eps), RTOL, ATOL)
    for name, t in (("x", tx), ("scale", ts), ("bias", tb)):
        np.testing.assert_allclose(grads[name], t.grad.numpy(), RTOL, ATOL, err_msg=name)


@pytest.mark.parametrize("training", [0, 1], ids=["fixed_stats", "batch_stats"])
def test_batch_norm_grad_op_matches_torch(training):
    """The named backward op alone, both modes, on a channels-last (align 8) feature map."""
    rng = np.random.default_rng(3)
    shape, c, eps = (3, 5, 4, 2), 5, 1e-3
    x, scale, gy = rng.standard_normal(shape), rng.standard_normal(c), rng.standard_normal(shape)
    rmean, rvar = rng.standard_normal(c), rng.uniform(0.5, 1.5, c)
    axes = (0, 2, 3)
    mean, var = (x.mean(axis=axes), x.var(axis=axes)) if training else (rmean, rvar)
    inv = 1 / np.sqrt(var + eps)
    model = _model("BatchNormGrad", {"gy": gy, "x": x, "scale": scale, "mean": mean, "inv": inv},
                   {"gx": shape, "gscale": (c,), "gbias": (c,)}, {"training": training},
                   domain="ai.tr_onnx")
    gx, gscale, gbias = tr_onnx.InferenceSession(model, channel_align=8).run(
        None, {"gy": gy, "x": x, "scale": scale, "mean": mean, "inv": inv})
    tx, ts, tb = _t(x, True), _t(scale, True), _t(np.zeros(c), True)
    ty = F.batch_norm(tx, _t(rmean), _t(rvar), ts, tb, training=bool(training), eps=eps)
    ty.backward(_t(gy))
    np.testing.assert_allclose(gx, tx.grad.numpy(), RTOL, ATOL)
    np.testing.assert_allclose(gscale, ts.grad.numpy(), RTOL, ATOL)
    np.testing.assert_allclose(gbias, tb.grad.numpy(), RTOL, ATOL)


@pytest.mark.parametrize("shape, axis", [((4, 7), -1), ((2, 3, 4, 5), 1), ((3, 4, 6), 2)],
                         ids=["2d", "4d_axis1", "3d_last"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_layer_norm_matches_torch(shape, axis, bias):
    rng = np.random.default_rng(5)
    norm_shape = shape[axis % len(shape):]
    x, w, b = rng.standard_normal(shape), rng.standard_normal(norm_shape), \
        rng.standard_normal(norm_shape)
    cot = rng.standard_normal(shape)
    inputs = {"x": x, "w": w, **({"b": b} if bias else {})}
    model = _model("LayerNormalization", inputs, {"y": shape}, {"axis": axis, "epsilon": 1e-4})
    y, grads = vjp(model, inputs, list(inputs), cot)
    tx, tw, tb = _t(x, True), _t(w, True), _t(b, True)
    ty = F.layer_norm(tx, norm_shape, tw, tb if bias else None, eps=1e-4)
    ty.backward(_t(cot))
    np.testing.assert_allclose(y, ty.detach().numpy(), RTOL, ATOL)
    for name, t in (("x", tx), ("w", tw), ("b", tb)):
        if name in grads:
            np.testing.assert_allclose(grads[name], t.grad.numpy(), RTOL, ATOL, err_msg=name)


@pytest.mark.parametrize("per_group", [0, 1], ids=["per_channel", "per_group"])
def test_group_norm_grad_op_matches_torch(per_group):
    """GroupNormGrad in both parameter modes (per-group: GroupNormalization-18, which no model
    can use since onnx.checker rejects the deprecated schema)."""
    rng = np.random.default_rng(9)
    shape, groups, eps = (2, 6, 3, 4), 3, 1e-4
    x, gy = rng.standard_normal(shape), rng.standard_normal(shape)
    scale = rng.standard_normal(groups if per_group else 6)
    model = _model("GroupNormGrad", {"gy": gy, "x": x, "scale": scale},
                   {"gx": shape, "gscale": scale.shape, "gbias": scale.shape},
                   {"num_groups": groups, "epsilon": eps, "per_group_params": per_group},
                   domain="ai.tr_onnx")
    gx, gscale, gbias = tr_onnx.InferenceSession(model, channel_align=8).run(
        None, {"gy": gy, "x": x, "scale": scale})
    tx, ts, tb = _t(x, True), _t(scale, True), _t(np.zeros(scale.shape), True)
    expand = (lambda t: t.repeat_interleave(6 // groups)) if per_group else (lambda t: t)
    ty = F.group_norm(tx, groups, expand(ts), expand(tb), eps=eps)
    ty.backward(_t(gy))
    np.testing.assert_allclose(gx, tx.grad.numpy(), RTOL, ATOL)
    np.testing.assert_allclose(gscale, ts.grad.numpy(), RTOL, ATOL)
    np.testing.assert_allclose(gbias, tb.grad.numpy(), RTOL, ATOL)
