"""Inference-only rewrites of a dispatched graph whose parameters never change (an
``InferenceSession``; never a training session's plans, whose weights train).

``fold_batchnorm``: a Conv whose only consumer is an inference BatchNormalization with constant
statistics becomes one Conv with per-output-channel scaled weights and a bias, as onnxruntime
and PyTorch's ``fuse_conv_bn_eval`` fold it: ``w' = w * s``, ``b' = (b - mean) * s + beta``
with ``s = gamma / sqrt(var + eps)``, computed in float64 and rounded once to the weights'
dtype. One kernel and one pass over the feature map fewer per pair.

``freeze_parameters``: every parameter becomes a constant, so a kernel may prepare it once at
plan time (``KernelContext.const``): conv_onednn reorders Conv weights into oneDNN's blocked
layout once instead of on every run.
"""

from __future__ import annotations

import numpy as np

from .. import ir


def _constant(v: ir.Value | None) -> bool:
    return v is not None and v.is_constant and v.data is not None


def fold_batchnorm(graph: ir.Graph) -> int:
    """Fold every eligible Conv -> BatchNormalization pair; returns how many were folded."""
    folded = 0
    for bn in list(graph.nodes):
        if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx") \
                or int(bn.attrs.get("training_mode", 0)) \
                or any(o is not None and o.consumers for o in bn.outputs[1:]) \
                or any(o in graph.outputs for o in bn.outputs[1:]):
            continue
        y = bn.inputs[0]
        conv = y.producer
        if conv is None or conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") \
                or y.consumers != [bn] or y in graph.outputs:
            continue
        w = conv.inputs[1]
        b = conv.inputs[2] if len(conv.inputs) > 2 else None
        stats = bn.inputs[1:5]
        if not all(_constant(v) for v in (w, *stats)) or (b is not None and not _constant(b)) \
                or not np.issubdtype(w.dtype, np.floating) or w.rank < 3:
            continue
        per_channel = (w.shape[0],)
        if any(np.shape(v.data) != per_channel for v in stats) \
                or (b is not None and np.shape(b.data) != per_channel) \
                or len(y.shape) < 2 or y.shape[1] != w.shape[0]:
            continue  # a malformed model: the kernels' shape checks name what is wrong
        gamma, beta, mean, var = (np.asarray(v.data, np.float64) for v in stats)
        s = gamma / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
        w_data = np.asarray(w.data, np.float64) * s.reshape(-1, *([1] * (w.rank - 1)))
        b_data = (0.0 if b is None else np.asarray(b.data, np.float64)) - mean
        new_w = ir.Value(graph.unique_name(f"{w.name}.bn_folded"), w.shape, w.dtype, ir.CONST,
                         data=w_data.astype(w.dtype))
        graph.values[new_w.name] = new_w
        new_b = ir.Value(graph.unique_name(f"{conv.name}.bias.bn_folded"), (w.shape[0],),
                         w.dtype, ir.CONST, data=(b_data * s + beta).astype(w.dtype))
        graph.values[new_b.name] = new_b
        graph.replace_input(conv, 1, new_w)
        if b is None:
            conv.inputs.append(None)
        graph.replace_input(conv, 2, new_b)
        out = bn.outputs[0]
        graph.remove_node(bn)
        conv.outputs[0] = out
        out.producer = conv
        del graph.values[y.name]
        for v in (w, b, *stats):  # parameters nothing reads any more hold no arena memory
            if v is not None and not v.consumers and v not in graph.outputs \
                    and v not in graph.inputs and graph.values.get(v.name) is v:
                del graph.values[v.name]
        folded += 1
    return folded


def freeze_parameters(graph: ir.Graph) -> int:
    """Make every parameter (a float initializer) a constant; returns how many. Their values
    stay where they were (the plan's CONST region instead of PARAM): nothing in an inference
    plan writes either."""
    frozen = 0
    for v in graph.values.values():
        if v.kind == ir.PARAM:
            v.kind = ir.CONST
            frozen += 1
    return frozen
