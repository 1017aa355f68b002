"""Transformer ops of opsets 23-25: Attention, RMSNormalization, RotaryEmbedding and Swish, with
the backward ops AttentionGrad, RMSNormalizationGrad and RotaryEmbeddingGrad.

They are one family because a decoder block exported at opset 23 (torch's dynamo exporter for
Llama- and Qwen2-shaped models) is made of them: RMSNormalization before attention and MLP,
RotaryEmbedding on the queries and keys, Attention with grouped key/value heads, and SiLU
(Swish with alpha 1) in the MLP.

Attention follows ``onnx.reference``'s ``op_attention.py`` (the definition the node suite's
expected values come from): scores ``Q K^T * scale``, softcap, an additive bias (float mask,
boolean mask as -inf, causal and window frontiers offset by the past length or per batch by
``nonpad_kv_seqlen - q_len``, padding past ``nonpad_kv_seqlen``), softmax, and a query row whose
bias is -inf everywhere gives zeros. Kernels work on ``[batch, heads, seq, size]`` arrays in
the accumulation precision (float32 for 16-bit inputs, else the input's); grouped key/value
heads are never repeated: queries are viewed ``[batch, kv_heads, group, seq, size]`` and
matmul broadcasts the keys over the group axis. The softmax runs in the wider of
``softmax_precision`` and that precision. One departure from the reference: the mode-0
qk_matmul_output is the scores before softcap, as the schema says and onnxruntime computes
(the reference returns them softcapped; no node-suite case has both).

The gradient of Attention is one named op, AttentionGrad, which recomputes the probabilities
from the forward inputs (nothing of the forward is saved but its inputs) and writes the
gradients of Q, K, V, the past key/value and a float mask, from the gradients of Y, the
present key/value and qk_matmul_output. RotaryEmbedding's gradient is the
inverse rotation (RotaryEmbeddingGrad: the same kernel with the sine negated; the cos/sin
caches get none). Swish's is built from standard ops.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import numpy as np
from onnx import helper

from ..domains import INTERNAL_DOMAIN
from ..hookspecs import hookimpl
from ..opdef import NORMALIZATION, PLAIN_ONLY, OpDef
from .elementwise import const_like
from .normalization import _stash_dtype
from .tensor import _split_axes, positive_axis, zeros_like
from .unary import _sigmoid


def _at(seq, i: int):
    """``seq[i]``, None past the end (trailing optional inputs/outputs may be left off)."""
    return seq[i] if i < len(seq) else None


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    """Accumulation precision: float32 for 16-bit floats, else the dtype itself."""
    return np.promote_types(np.dtype(dtype), np.float32)


# ---- Attention: shapes and views ------------------------------------------------------------


class AttentionForm(NamedTuple):
    """What an Attention node computes, from its attributes and input shapes."""

    rank3: bool
    b: int
    hq: int
    hkv: int
    sq: int
    past: int  # past_sequence_length (0 without a cache input)
    t: int  # total key length: past + kv_sequence_length
    d: int
    dv: int
    scale: float
    softcap: float
    causal: bool
    left: int  # window sizes (-1: unbounded; opset 25)
    right: int
    mode: int  # qk_matmul_output_mode
    acc: np.dtype
    soft: np.dtype  # softmax precision


def attention_form(attrs, shapes, dtype, error) -> AttentionForm:
    """``shapes``: Q, K, V, attn_mask, past_key (None where absent)."""
    q, k, v, _, past_key = shapes
    rank3 = len(q) == 3
    if rank3:
        hq, hkv = attrs.get("q_num_heads"), attrs.get("kv_num_heads")
        if not hq or not hkv:
            raise error("3-D Q, K, V need the q_num_heads and kv_num_heads attributes")
        if q[2] % hq or k[2] % hkv or v[2] % hkv:
            raise error(f"hidden sizes {q[2]}, {k[2]}, {v[2]} do not split into {hq} query and "
                        f"{hkv} key/value heads")
        b, sq, d, skv, dv = q[0], q[1], q[2] // hq, k[1], v[2] // hkv
    else:
        b, hq, sq, d = q
        hkv, skv, dv = k[1], k[2], v[3]
    if hq % hkv:
        raise error(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    past = past_key[2] if past_key is not None else 0
    acc = _acc_dtype(dtype)
    precision = attrs.get("softmax_precision")
    soft = acc if precision is None else np.promote_types(
        acc, helper.tensor_dtype_to_np_dtype(int(precision)))
    scale = attrs.get("scale")
    # Q and K are each scaled by sqrt(scale); the definition takes that root of the float
    # attribute in float32 (the reference's and the function body's Sqrt), so its square is
    # the scale the scores get, not the attribute itself (they differ by ~1e-7 relative).
    root = float(np.sqrt(np.float32(scale))) if scale is not None else float(d) ** -0.25
    return AttentionForm(rank3, b, hq, hkv, sq, past, past + skv, d, dv, root * root,
                 float(attrs.get("softcap", 0.0)), bool(attrs.get("is_causal", 0)),
                 int(attrs.get("left_window_size", -1)), int(attrs.get("right_window_size", -1)),
                 int(attrs.get("qk_matmul_output_mode", 0)), acc, soft)


def _heads(x: np.ndarray, rank3: bool, heads: int) -> np.ndarray:
    """``[batch, heads, seq, size]`` view of a 4-D array, or of a 3-D ``[batch, seq, heads *
    size]`` one (split, then transposed: a view, so writes reach ``x``)."""
    if not rank3:
        return x
    return _split_axes(x, {2: (heads, x.shape[2] // heads)}).transpose(0, 2, 1, 3)


def _grouped(x: np.ndarray, sp: AttentionForm) -> np.ndarray:
    """``[batch, q_heads, ...]`` as ``[batch, kv_heads, group, ...]`` (a view)."""
    return _split_axes(x, {1: (sp.hkv, sp.hq // sp.hkv)})


def _frontier(sp: AttentionForm, nonpad: bool) -> np.ndarray | None:
    """``key - query`` index differences [q, total] when a causal or window frontier applies."""
    if not (sp.causal or sp.left >= 0 or sp.right >= 0 or nonpad):
        return None
    return np.arange(sp.t)[None, :] - np.arange(sp.sq)[:, None]


def _blocked(dj: np.ndarray, offset, sp: AttentionForm, out: np.ndarray, tmp: np.ndarray) -> None:
    """``out`` = keys the causal/window frontiers hide from each query, for a query block whose
    first query sits at ``offset`` (a scalar, or [batch, 1, 1, 1] per batch): query i attends
    key j iff ``j - i <= offset`` (causal), ``j - i >= offset - left``, ``j - i <= offset +
    right`` (the reference's ``_apply_causal`` and ``_apply_sliding_window``)."""
    out.fill(False)
    if sp.causal:
        np.greater(dj, offset, out=tmp)
        out |= tmp
    if sp.left >= 0:
        np.less(dj, np.subtract(offset, sp.left), out=tmp)
        out |= tmp
    if sp.right >= 0:
        np.greater(dj, np.add(offset, sp.right), out=tmp)
        out |= tmp


class _Scores:
    """The forward up to the probabilities, shared by Attention and AttentionGrad.

    Reserves its workspaces at plan time; ``load`` fills Q, K and V ([batch, heads, seq,
    size], accumulation precision, past and new keys joined) and ``probabilities`` the scores
    buffer ``s`` with the softmax (and ``th`` with tanh of the scaled scores when softcap is
    set, for the gradient)."""

    def __init__(self, ctx, sp: AttentionForm, first: int, keep_tanh: bool):
        self.sp, self.first = sp, first  # index of Q among the kernel's inputs
        acc = sp.acc
        q_shape, s_shape = (sp.b, sp.hq, sp.sq, sp.d), (sp.b, sp.hq, sp.sq, sp.t)
        self.q = ctx.workspace(q_shape, acc)
        self.k = ctx.workspace((sp.b, sp.hkv, sp.t, sp.d), acc)
        self.v = ctx.workspace((sp.b, sp.hkv, sp.t, sp.dv), acc)
        self.s = ctx.workspace(s_shape, acc)
        self.th = ctx.workspace(s_shape, acc) if keep_tanh and sp.softcap > 0 else None
        self.row = ctx.workspace(s_shape[:3] + (1,), sp.soft)
        self.flag = ctx.workspace(s_shape[:3] + (1,), np.bool_)
        self.dead = ctx.workspace(s_shape[:3] + (1,), np.bool_)
        self.soft = ctx.workspace(s_shape, sp.soft) if sp.soft != acc else None
        mask = _at(ctx.inputs, first + 3)
        nonpad = ctx.has_input(first + 6)
        if nonpad and ctx.has_input(first + 4):
            raise ctx.error("nonpad_kv_seqlen cannot be combined with past_key/past_value")
        self.nonpad = nonpad
        self.dj = _frontier(sp, nonpad)
        self.fixed = None  # the frontier, when it does not depend on nonpad_kv_seqlen
        if self.dj is not None and not nonpad:
            self.fixed = np.zeros((sp.sq, sp.t), np.bool_)
            _blocked(self.dj, sp.past, sp, self.fixed, np.zeros_like(self.fixed))
        if mask is not None or self.dj is not None:
            self.bias = ctx.workspace(s_shape, acc)
            self.bias_row = ctx.workspace(s_shape[:3] + (1,), acc)
            if mask is not None:
                if len(mask.shape) > 4 or mask.shape[-1] > sp.t:
                    raise ctx.error(f"attn_mask of shape {list(mask.shape)} does not "
                                    f"broadcast to {list(s_shape)}")
                self.not_mask = ctx.workspace(mask.shape, np.bool_) \
                    if mask.dtype == np.bool_ else None
            if nonpad:
                self.key = np.arange(sp.t)  # key positions, against each batch's valid length
                self.hidden = ctx.workspace((sp.b, 1, sp.sq, sp.t), np.bool_)
                self.hidden_tmp = ctx.workspace((sp.b, 1, sp.sq, sp.t), np.bool_)
        else:
            self.bias = None

    def load(self, ins, ws) -> None:
        sp, f = self.sp, self.first
        q, k, v = ws[self.q], ws[self.k], ws[self.v]
        np.copyto(q, _heads(ins[f], sp.rank3, sp.hq))
        new = slice(sp.past, None)
        np.copyto(k[:, :, new], _heads(ins[f + 1], sp.rank3, sp.hkv))
        np.copyto(v[:, :, new], _heads(ins[f + 2], sp.rank3, sp.hkv))
        if sp.past:
            np.copyto(k[:, :, :sp.past], ins[f + 4])
            np.copyto(v[:, :, :sp.past], ins[f + 5])

    def _fill_bias(self, ins, ws) -> np.ndarray:
        """The additive bias [batch, q_heads, q, total]: the mask, -inf where a frontier or
        the padding hides a key. With nonpad_kv_seqlen the per-batch offsets are computed
        each step ([batch]-sized temporaries: the lengths are an input)."""
        sp, f = self.sp, self.first
        bias = ws[self.bias]
        bias.fill(0)
        mask = _at(ins, f + 3)
        if mask is not None:
            n = mask.shape[-1]  # a shorter mask hides the keys past its end
            head = bias[..., :n]
            if mask.dtype == np.bool_:
                np.logical_not(mask, out=ws[self.not_mask])
                np.copyto(head, -np.inf, where=ws[self.not_mask])
            else:
                np.add(head, mask, out=head, casting="unsafe")
            bias[..., n:] = -np.inf
        if self.fixed is not None:
            np.copyto(bias, -np.inf, where=self.fixed)
        if self.nonpad:
            lengths = _at(ins, f + 6).reshape(sp.b, 1, 1, 1)
            hidden, tmp = ws[self.hidden], ws[self.hidden_tmp]
            _blocked(self.dj, lengths - sp.sq, sp, hidden, tmp)
            np.greater_equal(self.key, lengths, out=tmp)
            hidden |= tmp  # padding: keys at or past the valid length
            np.copyto(bias, -np.inf, where=hidden)
        return bias

    def probabilities(self, ins, ws, qk: np.ndarray | None = None) -> np.ndarray:
        """``ws[s]`` = the attention probabilities [batch, q_heads, q, total]; ``qk``: where
        the qk_matmul_output (mode ``sp.mode``) goes, if asked for."""
        sp = self.sp
        s = ws[self.s]
        k5 = ws[self.k][:, :, None]
        np.matmul(_grouped(ws[self.q], sp), k5.swapaxes(-1, -2), out=_grouped(s, sp))
        s *= sp.scale
        if qk is not None and sp.mode == 0:
            np.copyto(qk, s, casting="same_kind")
        if sp.softcap > 0:
            s /= sp.softcap
            np.tanh(s, out=s)
            if self.th is not None:
                np.copyto(ws[self.th], s)
            s *= sp.softcap
        if qk is not None and sp.mode == 1:
            np.copyto(qk, s, casting="same_kind")
        row, dead = ws[self.row], ws[self.dead]
        if self.bias is not None:
            bias = self._fill_bias(ins, ws)
            s += bias
            # a row every key is hidden from gives zeros (decided on the bias, not the scores)
            np.max(bias, axis=-1, keepdims=True, out=ws[self.bias_row])
            np.isneginf(ws[self.bias_row], out=dead)
        if qk is not None and sp.mode == 2:
            np.copyto(qk, s, casting="same_kind")
        p = s if self.soft is None else ws[self.soft]
        if p is not s:
            np.copyto(p, s, casting="same_kind")
        _softmax_last(p, row, ws[self.flag])
        if self.bias is not None:
            np.copyto(p, 0, where=dead)
        if p is not s:
            np.copyto(s, p, casting="same_kind")
        if qk is not None and sp.mode == 3:
            np.copyto(qk, s, casting="same_kind")
        return s


def _softmax_last(p: np.ndarray, row: np.ndarray, flag: np.ndarray) -> None:
    """Softmax over the last axis in place; an all -inf row gives zeros, not NaN. ``row``:
    [..., 1] scratch of p's dtype, ``flag`` the same in bool."""
    np.max(p, axis=-1, keepdims=True, out=row)
    np.copyto(row, 0, where=np.isneginf(row, out=flag))
    p -= row
    np.exp(p, out=p)
    np.sum(p, axis=-1, keepdims=True, out=row)
    np.copyto(row, 1, where=np.equal(row, 0, out=flag))
    p /= row


def attention_spec(ctx, first: int) -> AttentionForm:
    shapes = [ctx.inputs[first + i].shape if ctx.has_input(first + i) else None
              for i in range(5)]
    return attention_form(ctx.attrs, shapes, ctx.inputs[first].dtype, ctx.error)


def attention_numpy(ctx):
    """Attention(Q, K, V[, attn_mask, past_key, past_value, nonpad_kv_seqlen]) -> (Y[,
    present_key, present_value, qk_matmul_output]); Y = P V with P from ``_Scores``."""
    sp = attention_spec(ctx, 0)
    scores = _Scores(ctx, sp, 0, keep_tanh=False)
    y_ws = ctx.workspace((sp.b, sp.hq, sp.sq, sp.dv), sp.acc)

    def run(ins, outs, ws):
        scores.load(ins, ws)
        p = scores.probabilities(ins, ws, _at(outs, 3))
        y, v5 = ws[y_ws], ws[scores.v][:, :, None]
        np.matmul(_grouped(p, sp), v5, out=_grouped(y, sp))
        np.copyto(_heads(outs[0], sp.rank3, sp.hq), y, casting="same_kind")
        for i, src in ((1, scores.k), (2, scores.v)):
            if _at(outs, i) is not None:
                np.copyto(outs[i], ws[src], casting="same_kind")

    return run


def attention_grad_numpy(ctx):
    """ai.tr_onnx AttentionGrad(gY, Q, K, V, attn_mask, past_key, past_value,
    nonpad_kv_seqlen, g_present_key, g_present_value, g_qk_matmul_output) -> (gQ, gK, gV[,
    g_past_key, g_past_value][, g_attn_mask]) (attributes ``past`` and ``mask_grad`` say which
    optional outputs exist). With P the probabilities and Z the biased scores: gV = P^T gY,
    gP = gY V^T, gZ = P (gP - rowsum(gP P)), the softcap's tanh t gives gS = gZ (1 - t^2), and
    gQ = scale gS K, gK = scale gS^T Q, summed over each key/value head's query group. The
    qk_matmul_output's gradient joins at the stage its mode taps (P, Z, the softcapped or the
    raw scores)."""
    sp = attention_spec(ctx, 1)
    scores = _Scores(ctx, sp, 1, keep_tanh=True)
    acc = sp.acc
    g = sp.hq // sp.hkv
    gy_ws = ctx.workspace((sp.b, sp.hq, sp.sq, sp.dv), acc)
    gp_ws = ctx.workspace((sp.b, sp.hq, sp.sq, sp.t), acc)
    gq_ws = ctx.workspace((sp.b, sp.hq, sp.sq, sp.d), acc)
    per_q = ctx.workspace((sp.b, sp.hkv, g, sp.t, max(sp.d, sp.dv)), acc)
    dot_ws = ctx.workspace((sp.b, sp.hq, sp.sq, 1), acc)
    gk_ws = ctx.workspace((sp.b, sp.hkv, sp.t, sp.d), acc)
    gv_ws = ctx.workspace((sp.b, sp.hkv, sp.t, sp.dv), acc)
    past = bool(ctx.attrs.get("past", 0))
    mask_out = 5 if past else 3
    mask_grad = bool(ctx.attrs.get("mask_grad", 0))
    if mask_grad:
        mshape = ctx.inputs[4].shape
        lead = 4 - len(mshape)
        full = (1,) * lead + tuple(mshape)
        s_shape = (sp.b, sp.hq, sp.sq, mshape[-1])
        mask_axes = tuple(i for i in range(4) if full[i] == 1 and s_shape[i] != 1)
        gm_ws = ctx.workspace(tuple(1 if i in mask_axes else s_shape[i] for i in range(4)), acc)

    def run(ins, outs, ws):
        scores.load(ins, ws)
        p = scores.probabilities(ins, ws)
        gy, gp = ws[gy_ws], ws[gp_ws]
        np.copyto(gy, _heads(ins[0], sp.rank3, sp.hq))
        q, k, v = ws[scores.q], ws[scores.k], ws[scores.v]
        p5, gy5, gp5 = _grouped(p, sp), _grouped(gy, sp), _grouped(gp, sp)
        tmp_v = ws[per_q][..., :sp.dv]
        np.matmul(p5.swapaxes(-1, -2), gy5, out=tmp_v)
        np.sum(tmp_v, axis=2, out=ws[gv_ws])
        np.matmul(gy5, v[:, :, None].swapaxes(-1, -2), out=gp5)
        g_qk = _at(ins, 10)
        if g_qk is not None and sp.mode == 3:
            gp += g_qk
        dot = ws[dot_ws]
        np.einsum("...i,...i->...", gp, p, out=dot[..., 0])
        gp -= dot
        gp *= p  # gZ
        if g_qk is not None and sp.mode == 2:
            gp += g_qk
        if mask_grad:
            n = ins[4].shape[-1]
            np.sum(gp[..., :n], axis=mask_axes, keepdims=True, out=ws[gm_ws])
            np.copyto(outs[mask_out], ws[gm_ws].reshape(outs[mask_out].shape),
                      casting="same_kind")
        if g_qk is not None and sp.mode == 1:
            gp += g_qk
        if scores.th is not None:
            th = ws[scores.th]
            np.multiply(th, th, out=th)
            np.subtract(1, th, out=th)
            gp *= th
        if g_qk is not None and sp.mode == 0:
            gp += g_qk
        gp *= sp.scale
        np.matmul(gp5, k[:, :, None], out=_grouped(ws[gq_ws], sp))
        np.copyto(_heads(outs[0], sp.rank3, sp.hq), ws[gq_ws], casting="same_kind")
        tmp_k = ws[per_q][..., :sp.d]
        np.matmul(gp5.swapaxes(-1, -2), _grouped(q, sp), out=tmp_k)
        np.sum(tmp_k, axis=2, out=ws[gk_ws])
        for i, total, g_present, g_past in ((1, ws[gk_ws], _at(ins, 8), 3),
                                            (2, ws[gv_ws], _at(ins, 9), 4)):
            if g_present is not None:
                total += g_present
            np.copyto(_heads(outs[i], sp.rank3, sp.hkv), total[:, :, sp.past:],
                      casting="same_kind")
            if past:
                np.copyto(outs[g_past], total[:, :, :sp.past], casting="same_kind")

    return run


_ATTENTION_ATTRS = ("scale", "softcap", "is_causal", "q_num_heads", "kv_num_heads",
                    "softmax_precision", "qk_matmul_output_mode", "left_window_size",
                    "right_window_size")


def attention_vjp(b, node, gys, needed):
    """One AttentionGrad node for Q, K, V, past key/value and a float mask (from the
    gradients of all four outputs); a boolean mask and nonpad_kv_seqlen get none."""
    ins = list(node.inputs) + [None] * (7 - len(node.inputs))
    q, k, v, mask, past_key, past_value = ins[:6]
    past = past_key is not None and past_value is not None
    mask_grad = mask is not None and needed[3]
    attrs = {a: node.attrs[a] for a in _ATTENTION_ATTRS if node.attrs.get(a) is not None}
    attrs.update(past=int(past), mask_grad=int(mask_grad))
    gy = gys[0] if gys[0] is not None else zeros_like(b, node.outputs[0])
    g_outs = [gys[i] if len(gys) > i else None for i in (1, 2, 3)]  # present k/v, qk
    likes = [q, k, v] + ([past_key, past_value] if past else []) + ([mask] if mask_grad else [])
    outs = b.op("AttentionGrad", [gy, q, k, v, mask, past_key, past_value, ins[6], *g_outs],
                attrs, domain=INTERNAL_DOMAIN, like=likes)
    grads = [outs[0], outs[1], outs[2], None, None, None, None]
    if past:
        grads[4], grads[5] = outs[3], outs[4]
    if mask_grad:
        grads[3] = outs[-1]
    return [gx if need else None for gx, need in zip(grads, needed)]


# ---- RMSNormalization -----------------------------------------------------------------------


def _rms_layout(ctx, x_index: int) -> tuple[tuple, int, int, int]:
    """(x's shape, first normalised axis, rows, elements per row)."""
    shape = tuple(ctx.inputs[x_index].shape)
    rank = len(shape)
    axis = int(ctx.attrs["axis"])
    if not -rank <= axis < rank:
        raise ctx.error(f"axis {axis} is out of range for a rank-{rank} input")
    axis = positive_axis(axis, rank)
    return shape, axis, int(np.prod(shape[:axis], dtype=np.int64)), \
        int(np.prod(shape[axis:], dtype=np.int64))


def _inv_rms(xh: np.ndarray, r: np.ndarray, inner: int, eps: float) -> None:
    """``r`` = 1 / sqrt(mean(x^2) + eps) per row of ``xh`` [rows, inner]; then ``xh *= r``."""
    np.einsum("ij,ij->i", xh, xh, out=r[:, 0])
    r /= inner
    r += eps
    np.sqrt(r, out=r)
    np.reciprocal(r, out=r)
    xh *= r


def rms_norm_numpy(ctx):
    """Normalised in ``stash_type`` precision (or x's, if wider), cast to the output's dtype,
    then scaled (the schema's stage two)."""
    shape, _, outer, inner = _rms_layout(ctx, 0)
    acc = _stash_dtype(ctx, ctx.inputs[0].dtype)
    eps = float(ctx.attrs["epsilon"])
    xh_ws, r_ws = ctx.workspace((outer, inner), acc), ctx.workspace((outer, 1), acc)

    def run(ins, outs, ws):
        xh = ws[xh_ws]
        np.copyto(xh.reshape(shape), ins[0])  # contiguous workspace: the reshape is a view
        _inv_rms(xh, ws[r_ws], inner, eps)
        np.copyto(outs[0], xh.reshape(shape), casting="same_kind")
        np.multiply(outs[0], ins[1], out=outs[0])

    return run


def rms_norm_grad_numpy(ctx):
    """ai.tr_onnx RMSNormalizationGrad(gy, x, scale) -> (gx, gscale). Per row of M elements,
    r = 1/sqrt(mean(x^2) + eps), xhat = x r, g = gy scale: gx = r (g - xhat mean(g xhat));
    gscale = gy xhat summed over the axes the scale is broadcast along."""
    shape, _, outer, inner = _rms_layout(ctx, 1)
    acc = _acc_dtype(ctx.outputs[0].dtype)
    eps = float(ctx.attrs["epsilon"])
    rank = len(shape)
    s_shape = tuple(ctx.inputs[2].shape)
    full = (1,) * (rank - len(s_shape)) + s_shape
    axes = tuple(i for i in range(rank) if full[i] == 1 and shape[i] != 1)
    xh_ws, g_ws = ctx.workspace((outer, inner), acc), ctx.workspace((outer, inner), acc)
    r_ws, m_ws = ctx.workspace((outer, 1), acc), ctx.workspace((outer, 1), acc)
    gs_ws = ctx.workspace(full, acc)

    def run(ins, outs, ws):
        xh, g, r, m = ws[xh_ws], ws[g_ws], ws[r_ws], ws[m_ws]
        xh_full, g_full = xh.reshape(shape), g.reshape(shape)
        np.copyto(xh_full, ins[1])
        _inv_rms(xh, r, inner, eps)
        if _at(outs, 1) is not None:
            np.multiply(ins[0], xh_full, out=g_full)
            np.sum(g_full, axis=axes, keepdims=True, out=ws[gs_ws])
            np.copyto(outs[1], ws[gs_ws].reshape(s_shape), casting="same_kind")
        if outs[0] is None:
            return
        np.multiply(ins[0], ins[2], out=g_full)
        np.einsum("ij,ij->i", g, xh, out=m[:, 0])
        m /= inner
        xh *= m
        g -= xh
        g *= r
        np.copyto(outs[0], g_full, casting="same_kind")

    return run


def rms_norm_vjp(b, node, gys, needed):
    """One RMSNormalizationGrad node for x and the scale (summed to the scale's shape)."""
    x, scale = node.inputs[0], node.inputs[1]
    gx, gscale = b.op("RMSNormalizationGrad", [gys[0], x, scale],
                      {"axis": int(node.attrs["axis"]), "epsilon": float(node.attrs["epsilon"])},
                      domain=INTERNAL_DOMAIN, like=[x, scale])
    return [gx if needed[0] else None, gscale if needed[1] else None]


# ---- RotaryEmbedding ------------------------------------------------------------------------


def rotary_numpy(ctx, inverse: bool = False):
    """Rotates pairs (halves, or even/odd lanes when interleaved) of the first
    ``rotary_embedding_dim`` lanes of each head by the cached angle of the token's position;
    ``inverse``: by minus that angle (RotaryEmbeddingGrad: the transpose of the rotation)."""
    shape = tuple(ctx.inputs[0].shape)
    rank3 = len(shape) == 3
    heads = int(ctx.attrs.get("num_heads", 0) or 0)
    if rank3 and (not heads or shape[2] % heads):
        raise ctx.error(f"a 3-D input of hidden size {shape[2]} needs num_heads dividing it")
    d = shape[2] // heads if rank3 else shape[3]
    rot = int(ctx.attrs.get("rotary_embedding_dim", 0) or 0) or d
    half = rot // 2
    if rot % 2 or rot > d:
        raise ctx.error(f"rotary_embedding_dim {rot} must be even and at most the head size {d}")
    if ctx.inputs[1].shape[-1] != half:
        raise ctx.error(f"cos_cache's last axis {ctx.inputs[1].shape[-1]} is not "
                        f"rotary_embedding_dim / 2 = {half}")
    b, s = shape[0], shape[1] if rank3 else shape[2]
    n_heads = heads if rank3 else shape[1]
    dtype = ctx.outputs[0].dtype
    has_pos = ctx.has_input(3)
    cache_ws = [ctx.workspace((b, s, half), dtype) for _ in range(2)] if has_pos else None
    t_ws = ctx.workspace((b, s, n_heads, half), dtype)
    first, second = (slice(0, rot, 2), slice(1, rot, 2)) if ctx.attrs.get("interleaved") \
        else (slice(0, half), slice(half, rot))

    def bshd(a):  # [batch, seq, heads, head_size] view
        return _split_axes(a, {2: (heads, d)}) if rank3 else a.transpose(0, 2, 1, 3)

    def run(ins, outs, ws):
        x, y, t = bshd(ins[0]), bshd(outs[0]), ws[t_ws]
        if has_pos:
            cos, sin = ws[cache_ws[0]], ws[cache_ws[1]]
            np.take(ins[1], ins[3], axis=0, out=cos)
            np.take(ins[2], ins[3], axis=0, out=sin)
        else:
            cos, sin = ins[1], ins[2]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        x1, x2, y1, y2 = x[..., first], x[..., second], y[..., first], y[..., second]
        np.multiply(cos, x1, out=y1)
        np.multiply(sin, x2, out=t)
        np.add(y1, t, out=y1) if inverse else np.subtract(y1, t, out=y1)
        np.multiply(cos, x2, out=y2)
        np.multiply(sin, x1, out=t)
        np.subtract(y2, t, out=y2) if inverse else np.add(y2, t, out=y2)
        if rot < d:
            np.copyto(y[..., rot:], x[..., rot:])

    return run


def rotary_vjp(b, node, gys, needed):
    """The inverse rotation of gy, with the same caches and positions."""
    attrs = {a: int(node.attrs[a]) for a in ("interleaved", "rotary_embedding_dim", "num_heads")
             if node.attrs.get(a) is not None}
    x = node.inputs[0]
    gx = b.op("RotaryEmbeddingGrad", [gys[0], *node.inputs[1:]], attrs, domain=INTERNAL_DOMAIN,
              like=x)
    return [gx] + [None] * (len(node.inputs) - 1)


# ---- Swish ----------------------------------------------------------------------------------


def swish_numpy(ctx):
    """x * sigmoid(alpha x), with ops/unary.py's overflow-free sigmoid."""
    shape, dtype = ctx.outputs[0].shape, ctx.outputs[0].dtype
    alpha = dtype.type(ctx.attrs["alpha"])
    ax, e, neg = (ctx.workspace(shape, dt) for dt in (dtype, dtype, np.bool_))

    def run(ins, outs, ws):
        np.multiply(ins[0], alpha, out=ws[ax])
        _sigmoid(ws[ax], outs[0], (ws[e], ws[neg]), None)
        np.multiply(outs[0], ins[0], out=outs[0])

    return run


def swish_vjp(b, node, gys, needed):
    """gy * s (1 + alpha x (1 - s)), s = sigmoid(alpha x)."""
    x = node.inputs[0]
    ax = b.mul(x, b.scalar_like(float(node.attrs["alpha"]), x))
    s = b.op("Sigmoid", [ax])
    one = const_like(b, 1.0, x)
    d = b.mul(s, b.add(one, b.mul(ax, b.sub(one, s))))
    return [b.mul(gys[0], d)]


# ---- registration ---------------------------------------------------------------------------


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("Attention", (23, 24, 25), {"numpy": attention_numpy}, layout=PLAIN_ONLY,
              differentiable=True, gradient=attention_vjp, grad_inputs=(0, 1, 2, 3, 4, 5),
              doc="scaled dot-product attention: 3-D or 4-D Q/K/V, grouped key/value heads, "
                  "float or boolean masks, causal (offset by the past or per batch by "
                  "nonpad_kv_seqlen), softcap, past/present key and value, qk_matmul_output "
                  "modes 0-3, windows (v25). Gradients for Q, K, V, past key/value and a "
                  "float mask, from every output"),
        OpDef("RMSNormalization", (23,), {"numpy": rms_norm_numpy}, layout=PLAIN_ONLY,
              differentiable=True, gradient=rms_norm_vjp, grad_inputs=(0, 1), param_inputs=(1,),
              traits=frozenset({NORMALIZATION})),
        OpDef("RotaryEmbedding", (23,), {"numpy": rotary_numpy}, layout=PLAIN_ONLY,
              differentiable=True, gradient=rotary_vjp, grad_inputs=(0,),
              doc="rotary position embedding; gradient for the input (caches frozen)"),
        OpDef("Swish", (24,), {"numpy": swish_numpy}, differentiable=True, gradient=swish_vjp),
        # backward-only ops of the rules above
        OpDef("AttentionGrad", (1,), {"numpy": attention_grad_numpy}, domain=INTERNAL_DOMAIN,
              layout=PLAIN_ONLY, doc="gradient of Attention, recomputing the probabilities"),
        OpDef("RMSNormalizationGrad", (1,), {"numpy": rms_norm_grad_numpy}, domain=INTERNAL_DOMAIN,
              layout=PLAIN_ONLY, doc="gradient of RMSNormalization for x and scale"),
        OpDef("RotaryEmbeddingGrad", (1,), {"numpy": partial(rotary_numpy, inverse=True)},
              domain=INTERNAL_DOMAIN, layout=PLAIN_ONLY,
              doc="gradient of RotaryEmbedding: the inverse rotation"),
    ]
