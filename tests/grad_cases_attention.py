"""Gradient cases of the transformer ops (ops/attention.py): Attention (masks, causal, grouped
heads, softcap, past key/value, nonpad_kv_seqlen, windows), RMSNormalization,
RotaryEmbedding and Swish, in float64 against finite differences of onnx.reference.

RotaryEmbedding's schema allows float, float16 and bfloat16 only; neither the checker nor
shape inference enforces it and both onnx.reference and our kernels compute in float64, so
its cases use float64 as the others do (float32 finite differences would need a tolerance
1e6 times looser)."""

import numpy as np
from gradcheck import Const, GradCase

_rng = np.random.default_rng(23)


def _x(*shape):
    return _rng.standard_normal(shape)


def _bool(*shape, p=0.7):
    m = _rng.random(shape) < p
    m[..., 0] = True  # every query row keeps a key (a fully hidden row is a constant zero)
    return m


def _attention(id, inputs, opset=23, **attrs):
    return GradCase(id, "Attention", inputs, attrs, opset=opset)


_CAUSAL_MASK_ROW = np.array([[True, True, False], [True, False, True]])

CASES = [
    _attention("attention_4d", [_x(2, 2, 3, 4), _x(2, 2, 5, 4), _x(2, 2, 5, 3)]),
    _attention("attention_4d_gqa_causal", [_x(1, 4, 3, 4), _x(1, 2, 3, 4), _x(1, 2, 3, 4)],
               is_causal=1),
    _attention("attention_4d_mqa_scaled_softcap", [_x(2, 3, 2, 4), _x(2, 1, 4, 4),
                                                    _x(2, 1, 4, 2)],
               scale=0.7, softcap=2.0),
    # float mask: differentiated too (broadcast over batch and heads, summed back)
    _attention("attention_3d_gqa_float_mask", [_x(2, 3, 8), _x(2, 4, 4), _x(2, 4, 6),
                                               _x(3, 4)],
               q_num_heads=4, kv_num_heads=2),
    _attention("attention_4d_bool_mask_softcap", [_x(2, 2, 3, 4), _x(2, 2, 5, 4),
                                                  _x(2, 2, 5, 4), _bool(2, 1, 3, 5)],
               softcap=1.5),
    _attention("attention_4d_bool_mask_causal", [_x(1, 2, 2, 4), _x(1, 2, 3, 4),
                                                 _x(1, 2, 3, 4), Const(_CAUSAL_MASK_ROW)],
               is_causal=1),
    # past key/value: present = concat(past, new); causal offset by the past length
    _attention("attention_4d_past_causal", [_x(1, 2, 2, 4), _x(1, 2, 2, 4), _x(1, 2, 2, 3),
                                            None, _x(1, 2, 3, 4), _x(1, 2, 3, 3)],
               is_causal=1),
    GradCase("attention_3d_past_present_key", "Attention",
             [_x(1, 2, 4), _x(1, 2, 4), _x(1, 2, 4), _x(2, 5), _x(1, 2, 3, 2), _x(1, 2, 3, 2)],
             {"q_num_heads": 2, "kv_num_heads": 2}, opset=23, output=1, n_outputs=3),
    GradCase("attention_4d_past_present_value_gqa", "Attention",
             [_x(1, 4, 2, 4), _x(1, 2, 2, 4), _x(1, 2, 2, 3), None, _x(1, 2, 1, 4),
              _x(1, 2, 1, 3)], {"is_causal": 1}, opset=23, output=2, n_outputs=3),
    # nonpad_kv_seqlen (opset 24): padding and a per-batch causal offset
    _attention("attention_4d_causal_nonpad", [_x(2, 2, 2, 4), _x(2, 2, 5, 4), _x(2, 2, 5, 4),
                                              None, None, None,
                                              Const(np.array([5, 3], np.int64))],
               opset=24, is_causal=1),
    _attention("attention_4d_local_window", [_x(1, 2, 4, 4), _x(1, 2, 4, 4), _x(1, 2, 4, 4)],
               opset=25, is_causal=1, left_window_size=1),
    # qk_matmul_output's gradient at each mode's stage (mode 0 without softcap: with one,
    # onnx.reference softcaps the mode-0 output, against the schema and onnxruntime)
    *(GradCase(f"attention_qk_output_mode{mode}", "Attention",
               [_x(1, 2, 3, 4), _x(1, 2, 4, 4), _x(1, 2, 4, 3), _x(3, 4)],
               {"qk_matmul_output_mode": mode, "softcap": softcap}, opset=23, output=3,
               n_outputs=4, output_shapes=[(1, 2, 3, 3), (1, 2, 4, 4), (1, 2, 4, 3),
                                           (1, 2, 3, 4)])
      for mode, softcap in ((0, 0.0), (1, 2.0), (2, 2.0), (3, 2.0))),
    GradCase("rms_norm_last_axis", "RMSNormalization", [_x(2, 3, 4), _x(4)], opset=23),
    GradCase("rms_norm_axis1_eps", "RMSNormalization", [_x(2, 3, 4), _x(3, 4)],
             {"axis": 1, "epsilon": 0.1}, opset=23),
    GradCase("rms_norm_broadcast_scale", "RMSNormalization", [_x(2, 3, 4), _x(1, 4)],
             {"axis": -2}, opset=23),
    GradCase("rotary_4d", "RotaryEmbedding",
             [_x(2, 2, 3, 4), Const(_x(2, 3, 2)), Const(_x(2, 3, 2))], opset=23),
    GradCase("rotary_3d_positions", "RotaryEmbedding",
             [_x(2, 3, 8), Const(_x(6, 2)), Const(_x(6, 2)),
              Const(np.array([[0, 1, 2], [3, 5, 4]], np.int64))], {"num_heads": 2}, opset=23),
    GradCase("rotary_interleaved_partial", "RotaryEmbedding",
             [_x(1, 2, 3, 6), Const(_x(4, 2)), Const(_x(4, 2)),
              Const(np.array([[3, 0, 1]], np.int64))],
             {"interleaved": 1, "rotary_embedding_dim": 4}, opset=23),
    GradCase("swish", "Swish", [_x(3, 4)], opset=24),
    GradCase("swish_alpha", "Swish", [_x(3, 4) * 3], {"alpha": 0.7}, opset=24),
]
