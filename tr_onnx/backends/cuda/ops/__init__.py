"""The cuda bindings of the builtin ops, one module per op family with the names of
``tr_onnx/ops/`` (``ops/conv.py`` holds Conv's NumPy kernel, shape, layout and gradient rules;
``backends/cuda/ops/conv.py`` its cuda binding; ``kernels/conv.cu`` what that launches).

Each module is an op set of the registry (``registry.BUILTIN_BACKEND_KERNELS``): its
``tr_onnx_op_definitions`` returns ``KernelDef``s for backend ``"cuda"``, loaded after the
NumPy op sets they extend. A binding is a kernel factory (``bind.binding``, or a factory that
reserves its own scratch; see ``bind``) or a ``cudnn_graphs.CudnnGraph``: the family's cuDNN
graph (its description and frontend calls, in the family's module) and the binding around
it. Importing these modules needs no CuPy, driver or GPU.
"""
