"""The cuda bindings of the builtin ops, one module per op family with the names of
``tr_onnx/ops/`` (``ops/conv.py`` holds Conv's NumPy kernel, shape, layout and gradient rules;
``backends/cuda/ops/conv.py`` its cuda binding; ``kernels/conv.cu`` what that launches).

Each module is an op set of the registry (``registry.BUILTIN_BACKEND_KERNELS``): its
``tr_onnx_op_definitions`` returns ``KernelDef``s for backend ``"cuda"``, loaded after the
NumPy op sets they extend. A binding is a kernel factory (``bind.binding``,
``bind.cudnn_binding``, or a factory that reserves its own scratch); see ``bind``. Importing
these modules needs no CuPy, driver or GPU.
"""
