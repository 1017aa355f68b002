"""Attention ops that run forward only, in float64 and without a gradient rule:
LinearAttention (a recurrent state instead of a softmax over all keys) and ai.onnx.preview
FlexAttention without modifier subgraphs. The trainable transformer ops (Attention,
RMSNormalization, RotaryEmbedding, Swish) are ops/attention.py.
"""

from __future__ import annotations

import numpy as np

from ..hookspecs import hookimpl
from ..opdef import PLAIN_ONLY, OpDef

# ---- LinearAttention: a recurrent state instead of a softmax over all keys ------------------


def _split_heads_f64(x: np.ndarray, heads: int) -> np.ndarray:
    """[B, T, H*D] as a float64 [B, H, T, D] array."""
    b, t, hd = x.shape
    return x.reshape(b, t, heads, hd // heads).transpose(0, 2, 1, 3).astype(np.float64)


def linear_attention_numpy(ctx):
    """LinearAttention: per step t a state S [B, H_kv, d_k, d_v] is decayed by exp(decay_t)
    (``gated``), corrected towards v_t by beta_t (``delta``: ``v_t = beta_t (v_t - S^T k_t)``),
    updated ``S += k_t v_t^T``, and read by each query head of its group:
    ``y_t = scale q_t^T S``. In float64, one step at a time (small per-step temporaries)."""
    rule = ctx.attrs.get("update_rule", "gated_delta")
    if isinstance(rule, bytes):
        rule = rule.decode()
    if rule not in ("linear", "gated", "delta", "gated_delta"):
        raise ctx.error(f"update_rule {rule!r} is not linear, gated, delta or gated_delta")
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    q_heads, kv_heads = int(ctx.attrs["q_num_heads"]), int(ctx.attrs["kv_num_heads"])
    if q_heads % kv_heads:
        raise ctx.error(f"q_num_heads {q_heads} is not a multiple of kv_num_heads {kv_heads}")
    for index, name, needed in ((4, "decay", gated), (5, "beta", delta)):
        if ctx.has_input(index) != needed:
            raise ctx.error(f"update_rule {rule!r} {'needs' if needed else 'forbids'} {name}")
    b, t, _ = ctx.inputs[0].shape
    d_k = ctx.inputs[0].shape[2] // q_heads
    d_v = ctx.inputs[2].shape[2] // kv_heads
    group = q_heads // kv_heads
    scale = float(ctx.attrs.get("scale", 0.0) or 0.0) or 1.0 / np.sqrt(d_k)
    has_past = ctx.has_input(3)

    def run(ins, outs, ws):
        q, k, v = (_split_heads_f64(ins[i], n) for i, n in
                   ((0, q_heads), (1, kv_heads), (2, kv_heads)))
        state = ins[3].astype(np.float64) if has_past else np.zeros((b, kv_heads, d_k, d_v))
        if gated:
            decay = ins[4]
            decay = (decay.reshape(b, t, kv_heads, 1).transpose(0, 2, 1, 3)
                     if decay.shape[-1] == kv_heads else _split_heads_f64(decay, kv_heads))
        if delta:
            beta = ins[5].reshape(b, t, ins[5].shape[-1], 1).transpose(0, 2, 1, 3)
        y = np.empty((b, q_heads, t, d_v))
        for i in range(t):
            if gated:
                state *= np.exp(decay[:, :, i, :].astype(np.float64))[..., None]
            v_i = v[:, :, i, :]
            if delta:
                v_i = beta[:, :, i, :] * (v_i - np.einsum("bhkv,bhk->bhv", state, k[:, :, i]))
            state += k[:, :, i, :, None] * v_i[..., None, :]
            grouped_q = q[:, :, i].reshape(b, kv_heads, group, d_k)
            y[:, :, i] = scale * np.einsum("bhgk,bhkv->bhgv", grouped_q, state).reshape(
                b, q_heads, d_v)
        np.copyto(outs[0], y.transpose(0, 2, 1, 3).reshape(b, t, q_heads * d_v))
        if len(outs) > 1 and outs[1] is not None:
            np.copyto(outs[1], state)

    return run


def flex_attention_numpy(ctx):
    """ai.onnx.preview FlexAttention without modifier subgraphs: ``softmax(Q K^T scale) V``,
    each query head reading K/V head ``h // group``; in float64 (at least any
    ``softmax_precision``), rounded once. A node with a ``score_mod`` / ``prob_mod`` subgraph
    runs as its ONNX function body instead (``importer._inline_subgraph_ops``)."""
    for name in ("score_mod", "prob_mod"):
        if ctx.attrs.get(name) is not None:  # import could not inline it
            raise ctx.error(f"{name} subgraphs run only as the op's ONNX function body, which "
                            "onnx could not build for this node (input types unknown?)")
    b, q_heads, q_len, d = ctx.inputs[0].shape
    kv_heads = ctx.inputs[1].shape[1]
    if q_heads % kv_heads:
        raise ctx.error(f"{q_heads} query heads are not a multiple of {kv_heads} K/V heads")
    group = q_heads // kv_heads
    scale = ctx.attrs.get("scale")
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)

    def run(ins, outs, ws):
        q = ins[0].astype(np.float64).reshape(b, kv_heads, group, q_len, d)
        k, v = ins[1].astype(np.float64), ins[2].astype(np.float64)
        scores = np.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        y = np.einsum("bhgqk,bhkv->bhgqv", scores, v)
        np.copyto(outs[0], y.reshape(outs[0].shape))

    return run


# ---- registration ---------------------------------------------------------------------------


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("FlexAttention", (1,), {"numpy": flex_attention_numpy}, domain="ai.onnx.preview",
              layout=PLAIN_ONLY, differentiable=False),
        OpDef("LinearAttention", (27,), {"numpy": linear_attention_numpy}, layout=PLAIN_ONLY,
              differentiable=False),
    ]
