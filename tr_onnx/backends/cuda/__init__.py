"""The cuda backend: CuPy arena, cuDNN frontend graphs and tr_onnx's own kernels.

Nothing here is imported by ``import tr_onnx``; CuPy is imported only inside the functions that
need it, so this package imports on any machine. ``sources`` holds the registry of kernel
sources (``kernels/*.cu`` and their headers) with their NVRTC options.
"""
