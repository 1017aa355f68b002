"""Random draws: RandomUniform, RandomNormal, their *Like forms and Bernoulli, from a
counter-based generator, and the training form ``ai.tr_onnx.RandomDraw`` the train pass puts
in their place (as it does for Dropout).

Every draw is Philox keyed by a seed and jumped by a counter: the numbers of a call depend on
(key, counter) only, never on what ran before, the output dtype or the layout (uniforms and
normals are drawn in float64 in the logical C order of the output, then converted). In a
training step the counter is the session's step counter and the key the session seed mixed
with the node's position (or the node's own ``seed`` attribute), so a run resumed from a
checkpoint draws the same numbers at the same steps. Outside training (``run``, the node
suite) the counter is the kernel's own call count and the key the ``seed`` attribute, else a
hash of the node's name: a plan draws the same sequence each time it is made.

No op here is differentiable: PyTorch's ``bernoulli`` and ``rand`` give no gradient either
(reparameterised samples are written as ``mean + scale * RandomNormalLike(...)`` in the graph,
and the gradient flows through that Add/Mul).
"""

from __future__ import annotations

import zlib

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..hookspecs import hookimpl
from ..opdef import OpDef, TrainingContext

RANDOM_OPS = ("RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike",
              "Bernoulli")
_VERSIONS = {"RandomUniform": (1, 22), "RandomNormal": (1, 22), "RandomUniformLike": (1, 22),
             "RandomNormalLike": (1, 22), "Bernoulli": (15, 22)}
_WITH_INPUT = ("RandomUniformLike", "RandomNormalLike", "Bernoulli")  # input 0: like / p


def seed_key(seed) -> int:
    """A Philox key from an ONNX ``seed`` (a float attribute) or an int session seed."""
    return int(np.float64(seed).view(np.uint64)) if isinstance(seed, float) else int(seed) % 2**64


def _sampler(ctx, op: str):
    """``sample(rng, ins, out, u)``: one draw of ``op`` into ``out`` using ``u`` (a float64
    workspace shaped like the output) for the uniforms or normals."""
    attrs = ctx.attrs
    if op in ("RandomUniform", "RandomUniformLike"):
        low, high = float(attrs.get("low", 0.0)), float(attrs.get("high", 1.0))

        def sample(rng, ins, out, u):
            rng.random(out=u.reshape(-1))
            u *= high - low
            u += low
            np.copyto(out, u, casting="unsafe")
    elif op in ("RandomNormal", "RandomNormalLike"):
        mean, scale = float(attrs.get("mean", 0.0)), float(attrs.get("scale", 1.0))

        def sample(rng, ins, out, u):
            rng.standard_normal(out=u.reshape(-1))
            u *= scale
            u += mean
            np.copyto(out, u, casting="unsafe")
    else:  # Bernoulli: 1 where a uniform falls below p

        def sample(rng, ins, out, u):
            p = ins[0]
            if not ((p >= 0) & (p <= 1)).all():  # nan fails both
                raise ValueError(f"Bernoulli probabilities outside [0, 1] (min {p.min()}, "
                                 f"max {p.max()})")
            rng.random(out=u.reshape(-1))
            np.copyto(out, u < p, casting="unsafe")
    return sample


def random_numpy(op: str):
    """The public op's kernel: keyed by its ``seed`` (else its name), counted per call."""

    def factory(ctx):
        seed = ctx.attrs.get("seed")
        key = seed_key(seed) if seed is not None else zlib.crc32(ctx.name.encode())
        stream = np.random.Philox(key=key)
        sample = _sampler(ctx, op)
        u = ctx.workspace(ctx.outputs[0].shape, np.float64)
        calls = [0]

        def run(ins, outs, ws):
            # jumped() leaves ``stream`` as it is: the Generator/Philox pair it makes per call
            # is a small unavoidable temporary (as in DropoutTraining)
            sample(np.random.Generator(stream.jumped(calls[0])), ins, outs[0], ws[u])
            calls[0] += 1

        return run

    return factory


def random_draw_numpy(ctx):
    """``ai.tr_onnx.RandomDraw(input?, step) -> y``: the op named by attribute ``op`` (its
    attributes alongside), keyed by attribute ``key`` and counted by the step input (last)."""
    if "op" not in ctx.attrs or "key" not in ctx.attrs:
        raise ctx.error("RandomDraw needs the attributes 'op' and 'key' (internal ops have no "
                        "defaults)")
    op = ctx.attrs["op"]
    stream = np.random.Philox(key=int(ctx.attrs["key"]) % 2**64)
    sample = _sampler(ctx, op)
    u = ctx.workspace(ctx.outputs[0].shape, np.float64)

    def run(ins, outs, ws):
        rng = np.random.Generator(stream.jumped(int(ins[-1].reshape(()))))
        sample(rng, ins, outs[0], ws[u])

    return run


def random_training_form(node, ctx: TrainingContext) -> bool:
    """In a training graph ``node`` becomes a RandomDraw counted by the step counter, so each
    step draws anew and a resumed run redraws the same numbers: its own ``seed`` keys it when
    it has one, else ``ctx.seed`` (session seed and position)."""
    attrs = {k: v for k, v in node.attrs.items() if k != "seed"}
    attrs["op"] = node.op_type
    seed = node.attrs.get("seed")
    attrs["key"] = seed_key(seed) if seed is not None else ctx.seed
    inputs = [node.inputs[0]] if node.op_type in _WITH_INPUT else []
    new = ctx.make_node("RandomDraw", node.name, inputs + [ctx.step_counter],
                        list(node.outputs), attrs)
    ctx.graph.replace_node(node, new)
    return True


@hookimpl
def tr_onnx_op_definitions():
    defs = [OpDef(op, _VERSIONS[op], {"numpy": random_numpy(op)}, differentiable=False,
                  training=random_training_form,
                  doc="counter-based Philox draws (see ops/random.py); in training the step "
                      "counter drives them, so a resumed run redraws the same numbers")
            for op in RANDOM_OPS]
    defs.append(OpDef("RandomDraw", (1,), {"numpy": random_draw_numpy}, domain=INTERNAL_DOMAIN,
                      differentiable=False,
                      doc="training form of a random op: inputs (like/p if any, step), "
                          "attributes op, key and the op's own"))
    return defs
