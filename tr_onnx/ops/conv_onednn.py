"""Conv, ConvGradData and ConvGradFilter in float32 through oneDNN (``tr_onnx.onednn``), the
library PyTorch's CPU convolutions run on, where it is installed: the numpy backend's fast
path, with conv.py's NumPy kernels as the reference and the fallback.

Every operand stays where the plan put it (channels-last, padded lanes included: oneDNN reads
and writes through strided memory descriptors of the arena views). Only the weights move: each
step reorders w (OHWI) into the blocked layout oneDNN's kernel wants, and ConvGradFilter
reorders its blocked result back into gw; both buffers and every scratchpad are arena
workspaces; constant weights (an inference plan's) are reordered once, when the kernel is
made. A window oneDNN cannot express (a negative right pad, more than 3 spatial axes)
or a primitive it refuses returns None here, and the caller runs NumPy.
"""

from __future__ import annotations

import numpy as np

from .. import host_blas, onednn
from .conv_window import Window


def strided(info) -> onednn.MemoryDesc:
    """The tensor's logical [N, C, spatial...] view as the plan lays it out."""
    return onednn.MemoryDesc.strided(info.shape, info.layout.view_strides(4))


def _weights(shape, group: int, byte_strides=None) -> onednn.MemoryDesc:
    """w [O, Cg, *K] as oneDNN wants it: [G, O/G, Cg, *K] when grouped; over memory with these
    byte strides (the plan's layout, or a constant's own), or ANY (oneDNN's choice) without."""
    shape = list(shape)
    strides = None if byte_strides is None else list(byte_strides)
    if group > 1:
        shape = [group, shape[0] // group, *shape[1:]]
        if strides is not None:
            strides = [strides[0] * shape[1], *strides]
    if strides is not None:
        return onednn.MemoryDesc.strided(shape, strides)
    return onednn.MemoryDesc.any(shape)


def _user_weights(info, group: int) -> onednn.MemoryDesc:
    return _weights(info.shape, group, info.layout.view_strides(4))


def _packed(const: np.ndarray, group: int, blocked: onednn.MemoryDesc) -> np.ndarray:
    """Constant weights (every weight of an inference plan: ``freeze_parameters``) reordered
    once into oneDNN's blocked layout. The kernel holds them: weight-sized host memory beside
    the arena, as onnxruntime's prepacked weights, for a reorder per run saved (~20-40 us
    each on the zoo models, 2026-12-02)."""
    w = np.ascontiguousarray(const, np.float32)
    packed = np.empty(-(-blocked.nbytes // 4), np.float32)
    user = _weights(w.shape, group, w.strides)
    onednn.execute_once(onednn.reorder(user, blocked), [("src", user, w), ("dst", blocked, packed)])
    return packed


def geometry(win: Window):
    """(strides, dilations, pad_l, pad_r) for oneDNN, whose output size is
    ``(in + pad_l + pad_r - span) // stride + 1`` like ONNX's: the node's own end pads when
    that formula gives the node's output, else the smallest right pad that does; None if no
    right pad >= 0 does."""
    pad_r = []
    for o, st, k, d, s, b, e in zip(win.out_shape, win.strides, win.kernel, win.dilations,
                                    win.in_shape, win.pads_begin, win.pads_end):
        span = (k - 1) * d + 1
        if (s + b + e - span) // st + 1 != o:
            e = (o - 1) * st + span - s - b
        if e < 0:
            return None
        pad_r.append(e)
    return win.strides, win.dilations, win.pads_begin, pad_r


def usable(win: Window, dtype) -> bool:
    return (np.dtype(dtype) == np.float32 and 1 <= win.ndim <= 3 and onednn.available()
            and geometry(win) is not None)


# On AVX-512 machines oneDNN's convolutions of windows wider than 1x1 won while the weights
# were up to ~20x the map they make (ResNet-18 at 64x64, batch 8, training, per node, 2 threads,
# AMD EPYC with AVX-512, 2026-12-02: 128x128x3x3 on 8x8 forward 1.20 vs 0.38 ms, weight
# gradient 0.86 vs 0.37; 256x256x3x3 on 4x4, 18x, 1.15 vs 0.63 and 0.84 vs 0.51; stride-2
# data gradients 0.59 vs 0.24 and 0.57 vs 0.29) and lost past ~70x (512x512x3x3 on 2x2, 144x:
# 1.15 vs 1.38 forward; 256 -> 512 3x3 stride 2, 72x: 0.59 vs 0.86, weight gradient 0.56 vs
# 0.75, data gradient 0.71 vs 0.86). 1x1 windows keep the rule below (one GEMM in NumPy:
# ResNet-18's 1x1 downsample weight gradient 0.07 vs 0.19 ms).
AVX512_WEIGHTS_PER_MAP = 32


def preferred(name: str, ctx, win: Window, group: int) -> bool:
    """Whether oneDNN's kernel ``name`` should run this node rather than conv.py's NumPy one,
    by the shapes where each won, measured kernel by kernel on ResNet-18 and MobileNetV2 at
    64x64, batch 8 (2 threads, 2026-12-01, an AVX2 machine):

    - grouped convolutions: oneDNN (NumPy loops over groups: depthwise 3x3 3.0-3.5 ms vs 0.2-0.3);
    - forward and weight gradient: oneDNN while the weights are smaller than the output map
      (forward with constant weights: always, below).
      Past that, its per-step weight reorder and small-map kernels lose to one im2col GEMM
      (512x512x3x3 on 8x2x2: 6.0 vs 2.5 ms forward; 256x256x3x3 on 8x4x4: 3.0-4.8 vs 1.7-2.4
      ms weight gradient); below it oneDNN wins or ties (ResNet-18's stem: 2.6 vs 3.7 ms);
    - data gradient: oneDNN for stride-1 windows wider than 1x1 (512x512x3x3 on 2x2: 6 vs
      19 ms), NumPy for 1x1 (one GEMM: 0.2 vs 0.4 ms) and strided windows (its strided
      scatter: 512x256x3x3 stride 2: 1.4 vs 4.3 ms).

    Where oneDNN runs AVX-512, windows wider than 1x1 take it up to weights
    ``AVX512_WEIGHTS_PER_MAP`` times the map, strided data gradients included.
    """
    if group > 1:
        return True
    if name == "conv_onednn" and ctx.const(1) is not None:
        # weights reordered once (``_packed``): without the per-run reorder oneDNN won on every
        # ResNet-18 inference layer but the 1x1 ones (a tie), 512x512x3x3 on 8x2x2 included
        # (1.2-1.8 vs 2.1-2.8 ms), 2026-12-02
        return True
    wide = any(k > 1 for k in win.kernel)
    per_map = AVX512_WEIGHTS_PER_MAP if wide and onednn.avx512() else 1
    if name == "conv_grad_data_onednn":
        if not wide or (per_map == 1 and any(s != 1 for s in win.strides)):
            return False
        if all(s == 1 for s in win.strides):
            return True
        weights, out_map = ctx.inputs[1], ctx.inputs[0]  # (gy, w): gy is the map it reads
    else:
        weights = ctx.outputs[0] if name == "conv_grad_filter_onednn" else ctx.inputs[1]
        out_map = ctx.outputs[0] if name == "conv_onednn" else ctx.inputs[1]
    return int(np.prod(weights.shape)) < per_map * int(np.prod(out_map.shape))


def _primitives(kind, src_info, w_info, dst_info, win, group, with_bias=False, post_ops=None):
    """(forward hint, primitive) for ``kind``; raises OneDnnError if oneDNN refuses, or
    offers only its reference loop (e.g. for channels padded past the logical count, as a
    3-channel image aligned to 8: ResNet-18's stem took 600 ms there, NumPy 3 ms)."""
    window = geometry(win)
    src, dst = strided(src_info), strided(dst_info)
    bias = onednn.MemoryDesc.strided((w_info.shape[0],), (4,)) if with_bias else None
    forward = onednn.convolution(onednn.FORWARD_TRAINING, src, _weights(w_info.shape, group),
                                 bias, dst, *window, post_ops=post_ops)
    primitive = forward if kind == onednn.FORWARD_TRAINING else onednn.convolution(
        kind, src, _weights(w_info.shape, group), None, dst, *window, hint=forward)
    if primitive.implementation.startswith("ref"):
        raise onednn.OneDnnError(f"only oneDNN's reference loop ({primitive.implementation})")
    return forward, primitive


def _reading_weights(ctx, kind, src_info, w_info, dst_info, win, group, conv_args,
                     with_bias=False, post_ops=None):
    """A kernel whose convolution reads w (Conv, ConvGradData): each step reorders w from the
    plan's layout into oneDNN's blocked one, then runs the convolution, whose other arguments
    ``conv_args(ins, outs)`` names; constant weights are reordered once, here (``_packed``).
    None where oneDNN declines."""
    const = ctx.const(1)
    try:
        _, conv = _primitives(kind, src_info, w_info, dst_info, win, group, with_bias,
                              post_ops)
        blocked = conv.md("weights")
        if const is not None:
            packed = _packed(const, group, blocked)
        else:
            user_w = _user_weights(w_info, group)
            to_blocked = onednn.reorder(user_w, blocked)
    except onednn.OneDnnError:
        return None
    scratch = onednn.scratchpad(ctx, conv)
    if const is not None:
        return host_blas.prepared_step(lambda ins, outs, ws: [onednn.bind(
            conv, [*conv_args(ins, outs), ("weights", blocked, packed)], scratch, ws)])
    w_k = ctx.workspace((-(-blocked.nbytes // 4),), np.float32)
    reorder_scratch = onednn.scratchpad(ctx, to_blocked)

    def make(ins, outs, ws):
        return [onednn.bind(to_blocked, [("src", user_w, ins[1]), ("dst", blocked, ws[w_k])],
                            reorder_scratch, ws),
                onednn.bind(conv, [*conv_args(ins, outs), ("weights", blocked, ws[w_k])],
                            scratch, ws)]

    return host_blas.prepared_step(make)


def conv_onednn(ctx, win: Window, group: int, add: bool = False,
                clip: tuple[float, float] | None = None):
    """Conv forward: y = conv(x, reorder(w)) + b; FusedConv's (ops/fused_conv.py) also adds
    input 3 (``add``) and clips to ``clip`` as post-ops (``onednn.PostOps``)."""
    x_info, w_info, y_info = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    has_bias = ctx.has_input(2)
    if has_bias and tuple(ctx.inputs[2].layout.view_strides(4)) != (4,):
        return None
    x_md, y_md = strided(x_info), strided(y_info)
    b_md = onednn.MemoryDesc.strided((w_info.shape[0],), (4,)) if has_bias else None
    z_md = strided(ctx.inputs[3]) if add else None
    post_ops = onednn.PostOps(z_md, clip) if add or clip else None

    def conv_args(ins, outs):
        args = [("src", x_md, ins[0]), ("dst", y_md, outs[0])]
        if has_bias:
            args.append(("bias", b_md, ins[2]))
        return [*args, ("post_op_0_src_1", z_md, ins[3])] if add else args

    return _reading_weights(ctx, onednn.FORWARD_TRAINING, x_info, w_info, y_info, win, group,
                            conv_args, has_bias, post_ops)


def conv_grad_data_onednn(ctx, win: Window, group: int):
    """gx = conv backward data(gy, reorder(w))."""
    gy_info, w_info, gx_info = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    gy_md, gx_md = strided(gy_info), strided(gx_info)
    return _reading_weights(
        ctx, onednn.BACKWARD_DATA, gx_info, w_info, gy_info, win, group,
        lambda ins, outs: [("diff_dst", gy_md, ins[0]), ("diff_src", gx_md, outs[0])])


def conv_grad_filter_onednn(ctx, win: Window, group: int):
    """gw = reorder(conv backward weights(x, gy)) into gw's OHWI layout."""
    x_info, gy_info, gw_info = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    try:
        _, conv = _primitives(onednn.BACKWARD_WEIGHTS, x_info, gw_info, gy_info, win,
                              group)
        if "gemm" in conv.implementation or "1x1" in conv.implementation:
            # oneDNN's im2col + GEMM (it picks it for small maps with many channels, e.g. a
            # 512x512x3x3 layer on 2x2): 15 ms where conv.py's im2col + direct-output GEMM
            # takes ~2 ms, without the reorder of gw back from oneDNN's layout. Its 1x1
            # kernel (jit_1x1) waits for its threads in a barrier that, with the passive
            # OpenMP threads the library is loaded with (onednn.py), costs a scheduler tick:
            # ~4 ms per call whatever the size (MobileNetV2's 24x144 on 8x16x16: 4.0 ms;
            # 41 us with spinning threads); NumPy's one GEMM takes ~0.1 ms
            return None
        user_w = _user_weights(gw_info, group)
        blocked = conv.md("diff_weights")
        from_blocked = onednn.reorder(blocked, user_w)
    except onednn.OneDnnError:
        return None
    w_k = ctx.workspace((-(-blocked.nbytes // 4),), np.float32)
    scratch, reorder_scratch = onednn.scratchpad(ctx, conv), onednn.scratchpad(ctx, from_blocked)
    x_md, gy_md = strided(x_info), strided(gy_info)

    def make(ins, outs, ws):
        return [onednn.bind(conv, [("src", x_md, ins[0]), ("diff_dst", gy_md, ins[1]),
                                   ("diff_weights", blocked, ws[w_k])], scratch, ws),
                onednn.bind(from_blocked, [("src", blocked, ws[w_k]), ("dst", user_w, outs[0])],
                            reorder_scratch, ws)]

    return host_blas.prepared_step(make)
