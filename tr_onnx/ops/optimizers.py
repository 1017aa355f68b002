"""Optimizer and bookkeeping ops of the training step, and the ONNX training-preview ops.

The ``ai.tr_onnx`` update ops work in place on flat spans: the trainable parameters, their
gradient accumulators and each optimizer moment sit in their regions in the same order with
the same slot sizes, so one elementwise pass over the spans updates every parameter (padded
lanes and alignment gaps are zero in all of them and stay zero). Their arithmetic follows
``torch.optim`` step for step (same formula order), so loss curves match PyTorch's.
``ai.onnx.preview.training`` Adam/Momentum/Adagrad are the ONNX ops, functional as specified.
"""

from __future__ import annotations

import math

import numpy as np

from ..hookspecs import hookimpl
from ..opdef import STRIDED_TO_PLAIN, LayoutRule, OpDef

IN_PLACE = LayoutRule(outputs="plain")
PREVIEW = "ai.onnx.preview.training"


def _scalar(a: np.ndarray):
    return a.reshape(()).item()


# ---- bookkeeping ---------------------------------------------------------------------------

def accumulate_numpy(ctx):
    """acc += g (a gradient accumulator; logical views, any strided layout)."""

    def run(ins, outs, ws):
        np.add(ins[0], ins[1], out=ins[0])

    return run


def assign_numpy(ctx):
    """target[...] = value (BatchNorm running statistics after a good step)."""

    def run(ins, outs, ws):
        np.copyto(ins[0], ins[1])

    return run


def zero_fill_numpy(ctx):
    def run(ins, outs, ws):
        ins[0].fill(0)

    return run


def scale_clip_grad_numpy(ctx):
    """g *= scale (1/k for k accumulated micro-batches); then, if ``max_norm`` > 0, scale g to
    global norm ``max_norm`` as torch.nn.utils.clip_grad_norm_ does. Output: the norm before
    clipping (float32 scalar)."""
    max_norm = float(ctx.attrs.get("max_norm", 0.0))
    dtype = ctx.inputs[0].dtype

    def run(ins, outs, ws):
        g = ins[0]
        scale = _scalar(ins[1])
        if scale != 1.0:
            np.multiply(g, dtype.type(scale), out=g)
        norm = math.sqrt(float(np.dot(g, g)))
        outs[0][...] = norm
        if max_norm > 0.0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                np.multiply(g, dtype.type(coef), out=g)

    return run


# ---- torch.optim semantics over flat spans -------------------------------------------------

def sgd_update_numpy(ctx):
    """torch.optim.SGD: d = g + wd*p; buf = d (first step) or momentum*buf + (1-dampening)*d;
    d = d + momentum*buf (nesterov) or buf; p -= lr*d."""
    a = ctx.attrs
    momentum, dampening = float(a["momentum"]), float(a["dampening"])
    nesterov, wd = bool(a["nesterov"]), float(a["weight_decay"])
    dtype = ctx.inputs[0].dtype
    d_k = ctx.workspace(ctx.inputs[0].shape, dtype)
    t = dtype.type

    def run(ins, outs, ws):
        p, g, buf = ins[0], ins[1], ins[2]
        lr, step = _scalar(ins[3]), _scalar(ins[4])
        d = ws[d_k]
        if wd:
            np.multiply(p, t(wd), out=d)
            np.add(g, d, out=d)
        else:
            np.copyto(d, g)
        if momentum:
            if step == 1:
                np.copyto(buf, d)
            else:
                np.multiply(buf, t(momentum), out=buf)
                buf += t(1 - dampening) * d if dampening else d
            if nesterov:
                d += t(momentum) * buf
            else:
                np.copyto(d, buf)
        np.multiply(d, t(-lr), out=d)
        np.add(p, d, out=p)

    return run


def adam_update_numpy(ctx):
    """torch.optim.Adam / AdamW (``decoupled``=1): the same arithmetic, in the same order, as
    torch's single-tensor implementation."""
    a = ctx.attrs
    beta1, beta2, eps = float(a["beta1"]), float(a["beta2"]), float(a["epsilon"])
    wd, decoupled = float(a["weight_decay"]), bool(a["decoupled"])
    dtype = ctx.inputs[0].dtype
    t = dtype.type
    g_k = ctx.workspace(ctx.inputs[0].shape, dtype)
    d_k = ctx.workspace(ctx.inputs[0].shape, dtype)

    def run(ins, outs, ws):
        p, grad, m, v = ins[0], ins[1], ins[2], ins[3]
        lr, step = _scalar(ins[4]), _scalar(ins[5])
        g, denom = ws[g_k], ws[d_k]
        if wd and decoupled:
            np.multiply(p, t(1 - lr * wd), out=p)
        if wd and not decoupled:
            np.multiply(p, t(wd), out=g)
            np.add(grad, g, out=g)
        else:
            np.copyto(g, grad)
        # m.lerp_(g, 1 - beta1): m + (1 - beta1) * (g - m)
        np.subtract(g, m, out=denom)
        denom *= t(1 - beta1)
        m += denom
        # v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        v *= t(beta2)
        np.multiply(g, g, out=denom)
        denom *= t(1 - beta2)
        v += denom
        bias1 = 1 - beta1 ** step
        bias2_sqrt = math.sqrt(1 - beta2 ** step)
        np.sqrt(v, out=denom)
        denom /= t(bias2_sqrt)
        denom += t(eps)
        np.divide(m, denom, out=denom)
        denom *= t(-(lr / bias1))
        p += denom

    return run


def adagrad_update_numpy(ctx):
    """torch.optim.Adagrad: g += wd*p; clr = lr / (1 + (step-1)*lr_decay); sum += g*g;
    p -= clr * g / (sqrt(sum) + eps)."""
    a = ctx.attrs
    lr_decay, wd, eps = float(a["lr_decay"]), float(a["weight_decay"]), float(a["epsilon"])
    dtype = ctx.inputs[0].dtype
    t = dtype.type
    g_k = ctx.workspace(ctx.inputs[0].shape, dtype)
    s_k = ctx.workspace(ctx.inputs[0].shape, dtype)

    def run(ins, outs, ws):
        p, grad, acc = ins[0], ins[1], ins[2]
        lr, step = _scalar(ins[3]), _scalar(ins[4])
        g, std = ws[g_k], ws[s_k]
        if wd:
            np.multiply(p, t(wd), out=g)
            np.add(grad, g, out=g)
        else:
            np.copyto(g, grad)
        clr = lr / (1 + (step - 1) * lr_decay)
        np.multiply(g, g, out=std)
        acc += std
        np.sqrt(acc, out=std)
        std += t(eps)
        np.divide(g, std, out=std)
        std *= t(-clr)
        p += std

    return run


# ---- ai.onnx.preview.training (functional, as the ONNX spec and its reference) ------------

def _groups(ctx, per: int):
    n = (len(ctx.inputs) - 2) // per
    return n


def preview_adam_numpy(ctx):
    a = ctx.attrs
    alpha, beta, eps = float(a["alpha"]), float(a["beta"]), float(a["epsilon"])
    norm_coef, decay = float(a["norm_coefficient"]), float(a["norm_coefficient_post"])
    n = _groups(ctx, 4)

    def run(ins, outs, ws):
        r, t = _scalar(ins[0]), _scalar(ins[1])
        for i in range(n):
            x, g, v, h = ins[2 + i], ins[2 + n + i], ins[2 + 2 * n + i], ins[2 + 3 * n + i]
            g_reg = norm_coef * x + g
            v_new = alpha * v + (1 - alpha) * g_reg
            h_new = beta * h + (1 - beta) * g_reg * g_reg
            h_sqrt = np.sqrt(h_new) + eps
            r_adj = r * math.sqrt(1 - beta ** t) / (1 - alpha ** t) if t > 0 else r
            x_new = x - r_adj * (v_new / h_sqrt)
            x_final = (1 - decay) * x_new
            # these small temporaries follow the spec's formula literally; the op exists for
            # interoperability, the training step uses the in-place span ops above
            np.copyto(outs[i], x_final, casting="same_kind")
            np.copyto(outs[n + i], v_new, casting="same_kind")
            np.copyto(outs[2 * n + i], h_new, casting="same_kind")

    return run


def preview_momentum_numpy(ctx):
    a = ctx.attrs
    alpha, beta, norm_coef = float(a["alpha"]), float(a["beta"]), float(a["norm_coefficient"])
    mode = a["mode"]
    n = _groups(ctx, 3)

    def run(ins, outs, ws):
        r, t = _scalar(ins[0]), _scalar(ins[1])
        for i in range(n):
            x, g, v = ins[2 + i], ins[2 + n + i], ins[2 + 2 * n + i]
            g_reg = norm_coef * x + g
            beta_adj = beta if t > 0 else 1.0
            v_new = alpha * v + beta_adj * g_reg
            x_new = x - r * (g_reg + alpha * v_new) if mode == "nesterov" else x - r * v_new
            np.copyto(outs[i], x_new, casting="same_kind")
            np.copyto(outs[n + i], v_new, casting="same_kind")

    return run


def preview_adagrad_numpy(ctx):
    a = ctx.attrs
    decay, eps, norm_coef = float(a["decay_factor"]), float(a["epsilon"]), \
        float(a["norm_coefficient"])
    n = _groups(ctx, 3)

    def run(ins, outs, ws):
        r, t = _scalar(ins[0]), _scalar(ins[1])
        r_t = r / (1 + t * decay)
        for i in range(n):
            x, g, h = ins[2 + i], ins[2 + n + i], ins[2 + 2 * n + i]
            g_reg = norm_coef * x + g
            h_new = h + g_reg * g_reg
            x_new = x - r_t * g_reg / (np.sqrt(h_new) + eps)
            np.copyto(outs[i], x_new, casting="same_kind")
            np.copyto(outs[n + i], h_new, casting="same_kind")

    return run


@hookimpl
def tr_onnx_op_definitions():
    internal = dict(domain="ai.tr_onnx", layout=IN_PLACE, differentiable=False)
    return [
        OpDef("Accumulate", (1,), {"numpy": accumulate_numpy}, updates_inputs=(0,), **internal),
        OpDef("Assign", (1,), {"numpy": assign_numpy}, updates_inputs=(0,), **internal),
        OpDef("ZeroFill", (1,), {"numpy": zero_fill_numpy}, updates_inputs=(0,), **internal),
        OpDef("ScaleClipGrad", (1,), {"numpy": scale_clip_grad_numpy}, updates_inputs=(0,),
              **internal),
        OpDef("SGDUpdate", (1,), {"numpy": sgd_update_numpy}, updates_inputs=(0, 2), **internal),
        OpDef("AdamUpdate", (1,), {"numpy": adam_update_numpy}, updates_inputs=(0, 2, 3),
              **internal),
        OpDef("AdagradUpdate", (1,), {"numpy": adagrad_update_numpy}, updates_inputs=(0, 2),
              **internal),
        OpDef("Adam", (1,), {"numpy": preview_adam_numpy}, domain=PREVIEW,
              layout=STRIDED_TO_PLAIN, differentiable=False),
        OpDef("Momentum", (1,), {"numpy": preview_momentum_numpy}, domain=PREVIEW,
              layout=STRIDED_TO_PLAIN, differentiable=False),
        OpDef("Adagrad", (1,), {"numpy": preview_adagrad_numpy}, domain=PREVIEW,
              layout=STRIDED_TO_PLAIN, differentiable=False),
    ]
