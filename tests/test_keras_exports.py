"""Keras models exported by tf2onnx the way users export them: NHWC inputs, BatchNorm folded or
kept, trained by tr_onnx against onnxruntime, Keras itself and TensorFlow's own training.

What the exports are (TensorFlow 2.21, tf2onnx 1.17, held below):

- The graph input stays NHWC (``[N, 16, 16, 3]``, N symbolic) and feeds one Transpose to NCHW.
- ``tf.keras`` is Keras 3, whose BatchNormalization is arithmetic (``tf.nn.batch_normalization``):
  grappler's constant folding, which tf2onnx runs on every export, multiplies its scale into the
  convolution's weights (after a depthwise convolution a Mul remains) and leaves its shift an Add
  (which tf2onnx's default optimizers move into the Conv bias), whatever ``optimizers=`` says. No
  export of a Keras 3 model has a BatchNormalization node.
- Legacy Keras 2 (the ``tf_keras`` package, ``TF_USE_LEGACY_KERAS=1``) emits FusedBatchNormV3:
  tf2onnx's default optimizers fold it into the convolutions; ``optimizers={}`` keeps it as
  BatchNormalization with ``epsilon`` 1e-3 and no ``momentum`` (so ONNX's 0.9, not Keras's 0.99).
  Its running variance takes the unbiased batch variance: set the node's ``momentum`` to the
  layer's and train with ``bn_running_var="unbiased"`` to keep Keras's running statistics.
- Constant folding drops additions of zeros: a freshly initialised model loses its (zero)
  biases, so the models here get random biases and statistics, as a trained model has.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import onnx
import pytest
from oracles import assert_close_relative, ort_run

import tr_onnx

SHAPE = (16, 16, 3)  # NHWC, as Keras has it
CLASSES = 5
LR = 0.01
STEPS = 3

EXPORTS = {  # id: (Keras flavour, with BatchNorm, tf2onnx optimizers, BatchNormalization nodes)
    "keras3-bn-default": ("keras3", True, None, 0),
    "keras3-bn-no_optimizers": ("keras3", True, {}, 0),
    "keras3-plain-default": ("keras3", False, None, 0),
    "tf_keras-bn-default": ("tf_keras", True, None, 0),
    "tf_keras-bn-no_optimizers": ("tf_keras", True, {}, 3),
}
# Exports whose parameters are the Keras model's own: TensorFlow's training is their oracle. (A
# folded BatchNorm trains conv weights times BN scale as one parameter: another function.)
SAME_PARAMETERS = ["keras3-plain-default", "tf_keras-bn-no_optimizers"]


def _tf():
    """TensorFlow, tf2onnx and legacy Keras, imported on first use (not at collection: the
    import takes seconds and starts TensorFlow's thread pools)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # oneDNN and CPU-feature banners
    import tensorflow as tf
    import tf2onnx
    import tf_keras

    return tf, tf2onnx, {"keras3": tf.keras, "tf_keras": tf_keras}


def build_cnn(keras, batch_norm: bool):
    """Conv-BN-ReLU, max pool, a depthwise-separable block (depthwise 3x3, pointwise 1x1, each
    with BN and ReLU), average pool, Flatten (NHWC order) and Dense."""
    layers = keras.layers

    def norm(x):
        return layers.ReLU()(layers.BatchNormalization()(x) if batch_norm else x)

    x = image = keras.Input(SHAPE, name="image")
    x = norm(layers.Conv2D(8, 3, padding="same", use_bias=not batch_norm)(x))
    x = layers.MaxPooling2D(2)(x)
    x = norm(layers.DepthwiseConv2D(3, padding="same", use_bias=not batch_norm)(x))
    x = norm(layers.Conv2D(16, 1, use_bias=not batch_norm)(x))
    x = layers.Flatten()(layers.AveragePooling2D(2)(x))
    return keras.Model(image, layers.Dense(CLASSES)(x))


def set_weights_like_trained(model, seed: int = 1) -> None:
    """Random kernels, non-zero biases and BatchNorm statistics (a fresh model's zeros would be
    folded away by the exporter)."""
    rng = np.random.default_rng(seed)
    for w in model.weights:
        name, shape = w.name.split("/")[-1], tuple(w.shape)
        if name.startswith(("bias", "beta", "moving_mean")):
            value = rng.normal(0.0, 0.1, shape)
        elif name.startswith(("gamma", "moving_variance")):
            value = rng.uniform(0.5, 1.5, shape)
        else:
            value = rng.uniform(-1.0, 1.0, shape) * np.sqrt(3.0 / np.prod(shape[:-1]))
        w.assign(value.astype(np.float32))


@functools.cache
def keras_model(flavour: str, batch_norm: bool, fresh: bool = False):
    _, _, keras = _tf()
    model = build_cnn(keras[flavour], batch_norm)
    if not fresh:
        set_weights_like_trained(model)
    return model


@functools.cache
def exported(case: str) -> onnx.ModelProto:
    flavour, batch_norm, optimizers, _ = EXPORTS[case]
    return export(keras_model(flavour, batch_norm), optimizers)


def export(model, optimizers) -> onnx.ModelProto:
    """tf2onnx's documented Keras call, batch dimension left open."""
    tf, tf2onnx, _ = _tf()
    spec = (tf.TensorSpec((None, *SHAPE), tf.float32, name="image"),)
    kwargs = {} if optimizers is None else {"optimizers": optimizers}
    proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=17, **kwargs)
    return proto


def batches(seed: int = 0, batch: int = 8):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, *SHAPE)).astype(np.float32),
             rng.integers(0, CLASSES, batch)) for _ in range(STEPS)]


def eval_input(seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((4, *SHAPE)).astype(np.float32)


def session_for(proto: onnx.ModelProto, **options) -> tr_onnx.TrainingSession:
    return tr_onnx.TrainingSession(proto, loss="cross_entropy", optimizer=tr_onnx.optim.SGD(lr=LR),
                                   backend="numpy", **options)


def batch_norm_nodes(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in proto.graph.node if n.op_type == "BatchNormalization"]


def with_keras_momentum(proto: onnx.ModelProto, momentum: float = 0.99) -> onnx.ModelProto:
    """The export with each BatchNormalization's ``momentum`` set to the Keras layer's (ONNX
    and Keras both mean ``running = momentum * running + (1 - momentum) * batch``)."""
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    for node in batch_norm_nodes(proto):
        node.attribute.append(onnx.helper.make_attribute("momentum", momentum))
    return proto


def tensorflow_training(flavour: str, model, data):
    """TensorFlow's own SGD steps on a copy of ``model`` (``training=True``: batch statistics,
    moving averages updated): per-step losses and the trained copy."""
    tf, _, keras = _tf()
    keras = keras[flavour]
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    optimizer = keras.optimizers.SGD(learning_rate=LR)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = []
    for x, y in data:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, copy(x, training=True))
        grads = tape.gradient(loss, copy.trainable_variables)
        optimizer.apply_gradients(zip(grads, copy.trainable_variables))
        losses.append(float(loss))
    return np.array(losses, np.float32), copy


@pytest.mark.parametrize("case", EXPORTS)
def test_the_input_stays_nhwc_and_feeds_one_transpose(case):
    proto = exported(case)
    (inp,) = proto.graph.input
    dims = [d.dim_value or d.dim_param for d in inp.type.tensor_type.shape.dim]
    assert isinstance(dims[0], str) and dims[1:] == list(SHAPE), dims
    (consumer,) = [n for n in proto.graph.node if inp.name in n.input]
    assert consumer.op_type == "Transpose"
    assert list(onnx.helper.get_attribute_value(consumer.attribute[0])) == [0, 3, 1, 2]


@pytest.mark.parametrize("case", EXPORTS)
def test_batch_norm_is_folded_unless_legacy_keras_without_optimizers(case):
    nodes = batch_norm_nodes(exported(case))
    assert len(nodes) == EXPORTS[case][3]
    for node in nodes:  # Keras's epsilon carried over; its momentum is not
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"epsilon": pytest.approx(1e-3)}, attrs


@pytest.mark.parametrize("align", [1, 8], ids=["align1", "align8"])
@pytest.mark.parametrize("case", EXPORTS)
def test_forward_matches_onnxruntime_and_keras(case, align):
    proto, x = exported(case), eval_input()
    flavour, batch_norm, _, _ = EXPORTS[case]
    (ours,) = session_for(proto, channel_align=align).run(None, {"image": x})
    assert_close_relative(ours, ort_run(proto, {"image": x})[0])
    assert_close_relative(ours, keras_model(flavour, batch_norm)(x, training=False).numpy())


@pytest.mark.parametrize("case", SAME_PARAMETERS)
def test_three_sgd_steps_match_tensorflow_training(case):
    """Same losses step by step (batch statistics in both); after training, the same eval
    outputs and, with the node's momentum set to Keras's 0.99 and the unbiased running variance
    tf_keras's fused BatchNorm keeps, the same running statistics. Tolerance 1e-5 relative:
    float32 sums in another order (NHWC, im2col) over 3 small steps; observed <= 3e-7."""
    flavour, batch_norm, _, _ = EXPORTS[case]
    model, data = keras_model(flavour, batch_norm), batches()
    session = session_for(with_keras_momentum(exported(case)), bn_running_var="unbiased")
    ours = np.array([session.train_step({"image": x}, y) for x, y in data], np.float32)
    theirs, trained = tensorflow_training(flavour, model, data)
    assert_close_relative(ours, theirs)
    x = eval_input()
    assert_close_relative(session.run(None, {"image": x})[0], trained(x, training=False).numpy())
    params = session.parameters()
    keras_norms = [layer for layer in trained.layers if "batch_normalization" in layer.name]
    assert len(keras_norms) == len(batch_norm_nodes(exported(case)))
    for node, layer in zip(batch_norm_nodes(exported(case)), keras_norms):
        assert_close_relative(params[node.input[3]], layer.moving_mean.numpy())
        assert_close_relative(params[node.input[4]], layer.moving_variance.numpy())


def test_running_statistics_follow_onnx_momentum_unless_the_node_says_otherwise():
    """As exported (no ``momentum`` attribute), a step moves the running statistics by ONNX's
    0.9 with the biased batch variance: Keras's 0.99 is not in the file."""
    model = keras_model("tf_keras", True)
    proto = exported("tf_keras-bn-no_optimizers")
    x, y = batches()[0]
    session = session_for(proto)
    session.train_step({"image": x}, y)
    node = batch_norm_nodes(proto)[0]
    layer = next(layer for layer in model.layers if "batch_normalization" in layer.name)
    keras = _tf()[2]["tf_keras"]
    pre = keras.Model(model.inputs, layer.input)(x, training=True).numpy()  # the conv output
    mean0, var0 = layer.moving_mean.numpy(), layer.moving_variance.numpy()
    params = session.parameters()
    assert_close_relative(params[node.input[3]], 0.9 * mean0 + 0.1 * pre.mean(axis=(0, 1, 2)))
    assert_close_relative(params[node.input[4]], 0.9 * var0 + 0.1 * pre.var(axis=(0, 1, 2)))


@pytest.mark.parametrize("case", EXPORTS)
def test_trained_export_runs_in_onnxruntime_as_in_tr_onnx(case, tmp_path):
    session = session_for(exported(case))
    for x, y in batches(seed=3):
        session.train_step({"image": x}, y)
    path = session.export(tmp_path / "trained.onnx")
    x = eval_input()
    (ours,) = session.run(None, {"image": x})
    assert_close_relative(ours, ort_run(str(path), {"image": x})[0])
    assert not np.allclose(ours, ort_run(exported(case), {"image": x})[0], atol=1e-4)


def test_a_fresh_keras_model_loses_its_zero_biases_in_the_export():
    """Grappler's constant folding removes ``x + 0``: nothing is left for tr_onnx to train."""
    proto = export(keras_model("keras3", False, fresh=True), None)
    assert all(len(n.input) == 2 for n in proto.graph.node if n.op_type == "Conv")
    assert not [n for n in proto.graph.node if n.op_type in ("Add", "Sum", "BiasAdd")]
