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

from ..distributed import lookup
from ..domains import INTERNAL_DOMAIN
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


def _flag_set(ins, k: int | None) -> bool:
    """Whether optional flag input ``k`` (a float32 scalar) is present and non-zero."""
    return k is not None and ins[k] is not None and _scalar(ins[k]) != 0.0


def assign_numpy(ctx):
    """target[...] = value (BatchNorm running statistics after a good step), unless the
    optional third input, a float32 flag, is set (the step guard's bad batch)."""
    skip = 2 if ctx.has_input(2) else None

    def run(ins, outs, ws):
        if not _flag_set(ins, skip):
            np.copyto(ins[0], ins[1])

    return run


def zero_fill_numpy(ctx):
    """x = 0; with the optional second input, a float32 flag, only when it is set (the step
    guard drops a bad batch's gradients)."""
    flag = 1 if ctx.has_input(1) else None

    def run(ins, outs, ws):
        if flag is None or _flag_set(ins, flag):
            ins[0].fill(0)

    return run


def _any_non_finite(x: np.ndarray) -> bool:
    return not np.isfinite(np.dot(x.reshape(-1), x.reshape(-1)))


def scale_clip_grad_numpy(ctx):
    """g *= scale (1/k for k accumulated micro-batches); then, if ``max_norm`` > 0, scale g to
    global norm ``max_norm`` as torch.nn.utils.clip_grad_norm_ does. Output: the norm before
    clipping (float32 scalar). Dynamic loss scaling declares two more inputs, ``inv_scale``
    and ``found_inf`` (float32 scalars): first found_inf is set when g has a non-finite
    element (never cleared here: the step guard or a ZeroFill before clears it) and g *=
    inv_scale, as GradScaler's unscale."""
    max_norm = float(ctx.attrs.get("max_norm", 0.0))
    dtype = ctx.inputs[0].dtype
    unscale = ctx.has_input(2) and ctx.has_input(3)

    def run(ins, outs, ws):
        g = ins[0]
        if unscale:
            if _any_non_finite(g):
                ins[3][...] = 1.0
            inv = _scalar(ins[2])
            if inv != 1.0:
                np.multiply(g, dtype.type(inv), out=g)
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


# ---- the training step's guard and loss scaling --------------------------------------------

REPORT_FIELDS = ("loss", "bad", "overflow", "grad_norm", "rejected")
"""What ``StepReport`` writes, in order (float32 each; the report tensor holds 8)."""


def step_check_numpy(ctx):
    """StepCheck(bad, reject, loss, step, applied[, grads][, found_inf]), in place: bad = the
    loss (or, with ``grads``, a gradient) is not finite; reject = the step was launched with a
    step number that assumed an earlier step applied which did not (step != applied + 1), and
    a rejected step is a bad one; ``found_inf`` (loss scaling's overflow flag) starts the step
    as bad, so the update skips itself and the scale backs off. With attribute ``world`` (data
    parallelism) the batch is bad on every rank when it is on any: ranks that decided alone
    would drop different micro-batches, then one would reduce its gradients while another
    accumulated -- collectives out of step, a hang."""
    grads = 5 if ctx.has_input(5) else None
    found = 6 if ctx.has_input(6) else None
    world = lookup(int(ctx.attrs["world"])) if "world" in ctx.attrs else None

    def run(ins, outs, ws):
        bad, reject, loss, step, applied = ins[:5]
        is_bad = not np.isfinite(_scalar(loss)) or (grads is not None
                                                     and _any_non_finite(ins[grads]))
        rejected = _scalar(step) != _scalar(applied) + 1
        reject[...] = float(rejected)
        bad[...] = float(is_bad or rejected)
        if world is not None:
            world.allreduce_max_(bad.reshape(-1))
        if found is not None:
            ins[found][...] = bad

    return run


def step_advance_numpy(ctx):
    """StepAdvance(applied, skip): the count of applied optimizer steps += 1 unless ``skip``
    (a float32 flag) is set."""

    def run(ins, outs, ws):
        if not _flag_set(ins, 1):
            ins[0][...] += 1

    return run


def loss_scale_update_numpy(ctx):
    """LossScaleUpdate(scale, inv_scale, growth_tracker, found_inf[, reject]), in place, as
    torch.amp.GradScaler's update: back off on found_inf, grow after ``growth_interval`` good
    steps (when the grown scale is finite), inv_scale = 1/scale in double; a rejected step
    (``reject`` set) changes nothing."""
    a = ctx.attrs
    growth, backoff = float(a["growth_factor"]), float(a["backoff_factor"])
    interval = int(a["growth_interval"])
    reject = 4 if ctx.has_input(4) else None

    def run(ins, outs, ws):
        scale, inv, tracker, found = ins[:4]
        if _flag_set(ins, reject):
            return
        if _scalar(found) != 0.0:
            scale[...] = np.float32(_scalar(scale) * backoff)
            tracker[...] = 0
        elif _scalar(tracker) + 1 == interval:
            grown = np.float32(_scalar(scale) * growth)
            if np.isfinite(grown):
                scale[...] = grown
            tracker[...] = 0
        else:
            tracker[...] += 1
        inv[...] = np.float32(1.0 / float(_scalar(scale)))

    return run


def step_report_numpy(ctx):
    """StepReport(report, loss, bad, found_inf, grad_norm, reject), in place: ``report``'s
    first fields are ``REPORT_FIELDS`` (an absent input reads 0), the one small tensor the
    host reads back after a step run as one graph."""

    def run(ins, outs, ws):
        report = ins[0].reshape(-1)
        for i, v in enumerate(ins[1:]):
            report[i] = 0.0 if v is None else _scalar(v)

    return run


# ---- torch.optim semantics over flat spans -------------------------------------------------

UPDATE_STATES = {"SGDUpdate": 1, "AdamUpdate": 2, "AdagradUpdate": 1}
"""The moments each update op reads after (params, grads): its optional ``skip`` and
``weight_copy`` inputs follow (params, grads, moments..., lr, step)."""


def with_skip_and_copy(update, states: int):
    """The kernel factory of an update op with the optional trailing inputs every one
    declares after (params, grads, ``states`` moments, lr, step): ``skip``, a float32 flag --
    when set the update does nothing (loss scaling's overflow, the step guard's bad batch) --
    and ``weight_copy``, the half-precision copy of the parameters the compute phase reads,
    rounded from the updated float32 master weights."""
    k_skip, k_copy = states + 4, states + 5

    def factory(ctx):
        run = update(ctx)
        skip = k_skip if ctx.has_input(k_skip) else None
        copy = k_copy if ctx.has_input(k_copy) else None
        if skip is None and copy is None:
            return run

        def guarded(ins, outs, ws):
            if _flag_set(ins, skip):
                return
            run(ins, outs, ws)
            if copy is not None:
                np.copyto(ins[copy], ins[0], casting="unsafe")

        return guarded

    factory.__name__ = update.__name__
    return factory



# The updates are a dozen elementwise passes over spans of tens of MB: run pass after pass
# over the whole span and each one streams every operand from main memory again. They run
# block by block instead, all the passes of one block while it sits in the cache; every
# element sees the same operations in the same order, so the results are the same bits.
# 256 KiB of each operand: Adam's five (1.25 MiB a block) stay in cache, and ResNet-18's 45 MB
# are 170 blocks; much smaller blocks cost more in calls than they save (measured: AdamW over
# 11.2M parameters 183 ms unblocked, 98 ms at 256 KiB, 139 ms at 64 KiB, loaded machine).
BLOCK_BYTES = 1 << 18


def _blocks(ctx) -> tuple[list[slice], tuple[int, ...]]:
    """Row ranges of the update's operands (the spans: 1-D) of about ``BLOCK_BYTES`` each, and
    the shape of a block's scratch buffer (the workspaces are one block, not one span)."""
    shape, itemsize = tuple(ctx.inputs[0].shape), ctx.inputs[0].dtype.itemsize
    rows = max(1, BLOCK_BYTES // max(1, math.prod(shape[1:]) * itemsize))
    blocks = [slice(i, min(i + rows, shape[0])) for i in range(0, shape[0], rows)]
    return blocks, (min(rows, shape[0]), *shape[1:])


def sgd_update_numpy(ctx):
    """torch.optim.SGD: d = g + wd*p; buf = d (first step) or momentum*buf + (1-dampening)*d;
    d = d + momentum*buf (nesterov) or buf; p -= lr*d. Each product and sum is torch's, in its
    order; the passes read the gradient (or buf) where it lies instead of copying it first."""
    a = ctx.attrs
    momentum, dampening = float(a["momentum"]), float(a["dampening"])
    nesterov, wd = bool(a["nesterov"]), float(a["weight_decay"])
    dtype = ctx.inputs[0].dtype
    blocks, block = _blocks(ctx)
    d_k = ctx.workspace(block, dtype)
    # a second buffer where d already holds g + wd*p (nesterov) or for (1-dampening)*d
    e_k = (ctx.workspace(block, dtype)
           if momentum and ((nesterov and wd) or dampening) else None)
    t = dtype.type
    c_wd, c_m, c_damp = t(wd), t(momentum), t(1 - dampening)

    def update(p, g, buf, d, e, neg_lr, first):
        if wd:
            np.multiply(p, c_wd, out=d)
            np.add(g, d, out=d)
            g = d
        if momentum:
            if first:
                np.copyto(buf, g)
            else:
                np.multiply(buf, c_m, out=buf)
                if dampening:
                    buf += np.multiply(g, c_damp, out=e)
                else:
                    buf += g
            if nesterov:  # g + momentum*buf
                m_buf = np.multiply(buf, c_m, out=e if g is d else d)
                g = np.add(g, m_buf, out=d)
            else:
                g = buf
        np.multiply(g, neg_lr, out=d)
        np.add(p, d, out=p)

    def run(ins, outs, ws):
        p, g, buf = ins[0], ins[1], ins[2]
        neg_lr, first = t(-_scalar(ins[3])), _scalar(ins[4]) == 1
        d, e = ws[d_k], ws[e_k] if e_k is not None else None
        for r in blocks:
            n = r.stop - r.start
            update(p[r], g[r], buf[r], d[:n], e[:n] if e is not None else None, neg_lr, first)

    return run


def adam_update_numpy(ctx):
    """torch.optim.Adam / AdamW (``decoupled``=1): the same arithmetic, in the same order, as
    torch's single-tensor implementation."""
    a = ctx.attrs
    beta1, beta2, eps = float(a["beta1"]), float(a["beta2"]), float(a["epsilon"])
    wd, decoupled = float(a["weight_decay"]), bool(a["decoupled"])
    dtype = ctx.inputs[0].dtype
    t = dtype.type
    blocks, block = _blocks(ctx)
    # g + wd*p (L2 weight decay); otherwise the gradient is read where it lies
    g_k = ctx.workspace(block, dtype) if wd and not decoupled else None
    d_k = ctx.workspace(block, dtype)
    c_wd, c_b1, c_b2 = t(wd), t(1 - beta1), t(1 - beta2)
    beta2_t, eps_t = t(beta2), t(eps)

    def update(p, grad, m, v, g, denom, decay, bias2_sqrt, neg_step):
        if decay is not None:
            np.multiply(p, decay, out=p)
        if g is not None:
            np.multiply(p, c_wd, out=g)
            np.add(grad, g, out=g)
        else:
            g = grad
        # m.lerp_(g, 1 - beta1): m + (1 - beta1) * (g - m)
        np.subtract(g, m, out=denom)
        denom *= c_b1
        m += denom
        # v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        v *= beta2_t
        np.multiply(g, g, out=denom)
        denom *= c_b2
        v += denom
        np.sqrt(v, out=denom)
        denom /= bias2_sqrt
        denom += eps_t
        np.divide(m, denom, out=denom)
        denom *= neg_step
        p += denom

    def run(ins, outs, ws):
        p, grad, m, v = ins[0], ins[1], ins[2], ins[3]
        lr, step = _scalar(ins[4]), _scalar(ins[5])
        decay = t(1 - lr * wd) if wd and decoupled else None
        bias1 = 1 - beta1 ** step
        bias2_sqrt = t(math.sqrt(1 - beta2 ** step))
        neg_step = t(-(lr / bias1))
        g, denom = ws[g_k] if g_k is not None else None, ws[d_k]
        for r in blocks:
            n = r.stop - r.start
            update(p[r], grad[r], m[r], v[r], g[:n] if g is not None else None, denom[:n],
                   decay, bias2_sqrt, neg_step)

    return run


def adagrad_update_numpy(ctx):
    """torch.optim.Adagrad: g += wd*p; clr = lr / (1 + (step-1)*lr_decay); sum += g*g;
    p -= clr * g / (sqrt(sum) + eps)."""
    a = ctx.attrs
    lr_decay, wd, eps = float(a["lr_decay"]), float(a["weight_decay"]), float(a["epsilon"])
    dtype = ctx.inputs[0].dtype
    t = dtype.type
    blocks, block = _blocks(ctx)
    g_k = ctx.workspace(block, dtype) if wd else None  # g + wd*p
    s_k = ctx.workspace(block, dtype)
    c_wd, eps_t = t(wd), t(eps)

    def update(p, grad, acc, g, std, neg_clr):
        if g is not None:
            np.multiply(p, c_wd, out=g)
            np.add(grad, g, out=g)
        else:
            g = grad
        np.multiply(g, g, out=std)
        acc += std
        np.sqrt(acc, out=std)
        std += eps_t
        np.divide(g, std, out=std)
        std *= neg_clr
        p += std

    def run(ins, outs, ws):
        p, grad, acc = ins[0], ins[1], ins[2]
        lr, step = _scalar(ins[3]), _scalar(ins[4])
        neg_clr = t(-(lr / (1 + (step - 1) * lr_decay)))
        g, std = ws[g_k] if g_k is not None else None, ws[s_k]
        for r in blocks:
            n = r.stop - r.start
            update(p[r], grad[r], acc[r], g[:n] if g is not None else None, std[:n], neg_clr)

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
    internal = dict(domain=INTERNAL_DOMAIN, layout=IN_PLACE, differentiable=False)
    updates = {"SGDUpdate": sgd_update_numpy, "AdamUpdate": adam_update_numpy,
               "AdagradUpdate": adagrad_update_numpy}
    return [
        *(OpDef(op, (1,), {"numpy": with_skip_and_copy(fn, UPDATE_STATES[op])},
                # in place: params, moments and the weight copy
                updates_inputs=(0, *range(2, 2 + UPDATE_STATES[op]), UPDATE_STATES[op] + 5),
                **internal) for op, fn in updates.items()),
        OpDef("Accumulate", (1,), {"numpy": accumulate_numpy}, updates_inputs=(0,), **internal),
        OpDef("Assign", (1,), {"numpy": assign_numpy}, updates_inputs=(0,), **internal),
        OpDef("ZeroFill", (1,), {"numpy": zero_fill_numpy}, updates_inputs=(0,), **internal),
        OpDef("ScaleClipGrad", (1,), {"numpy": scale_clip_grad_numpy}, updates_inputs=(0, 3),
              **internal),
        OpDef("StepCheck", (1,), {"numpy": step_check_numpy}, updates_inputs=(0, 1, 6),
              **internal),
        OpDef("StepAdvance", (1,), {"numpy": step_advance_numpy}, updates_inputs=(0,),
              **internal),
        OpDef("LossScaleUpdate", (1,), {"numpy": loss_scale_update_numpy},
              updates_inputs=(0, 1, 2), **internal),
        OpDef("StepReport", (1,), {"numpy": step_report_numpy}, updates_inputs=(0,),
              **internal),
        OpDef("Adam", (1,), {"numpy": preview_adam_numpy}, domain=PREVIEW,
              layout=STRIDED_TO_PLAIN, differentiable=False),
        OpDef("Momentum", (1,), {"numpy": preview_momentum_numpy}, domain=PREVIEW,
              layout=STRIDED_TO_PLAIN, differentiable=False),
        OpDef("Adagrad", (1,), {"numpy": preview_adagrad_numpy}, domain=PREVIEW,
              layout=STRIDED_TO_PLAIN, differentiable=False),
    ]
