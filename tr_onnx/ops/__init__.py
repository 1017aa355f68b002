"""Builtin op sets. One op (or a small family) per module: layout rule, kernels per backend and,
with training, the gradient rule side by side. Each module is a pluggy plugin implementing
``tr_onnx_op_definitions``; ``tr_onnx.registry.BUILTIN_OPSETS`` lists them."""
