"""The cuda backend: CuPy arena, cuDNN frontend graphs and tr_onnx's own kernels.

Nothing here is imported by ``import tr_onnx``; CuPy and the cuDNN frontend are imported only
inside the functions that need them, so this package imports on any machine (the registry
loads the bindings of ``ops/`` with every op set). The modules, in the order a plan meets
them: ``ops/<family>.py`` (the bindings, with each family's kernel table; the CUDA C++ in
``kernels/``), ``bind`` (what a binding may use and what it returns), ``cudnn_graphs`` (cuDNN
graphs described from the MemoryPlan), ``executor`` (binding and running a plan), ``capture``
(the device protocol and the eager -> captured -> replayed state machine), ``transfers`` (host
transfers), ``device`` (CuPy and cuDNN on a GPU), ``sources`` (NVRTC and the table helpers),
``deviceless`` (the real cuDNN checking every graph without a GPU).
"""
