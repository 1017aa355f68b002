"""A test double of an op family, laid out as a builtin family is, to document how to add one.

``ai.tr_onnx.test`` ScaledSquare(x) -> y = alpha * x * x (attribute ``alpha``, default 1.0) and
its named backward op ScaledSquareGrad(gy, x) -> gx = 2 * alpha * x * gy, in three files that
mirror a builtin family's:

* ``ops.py`` (like ``tr_onnx/ops/<family>.py``): both OpDefs -- shape and layout rules, the
  NumPy kernels, the gradient rule (which emits ScaledSquareGrad);
* ``cuda.py`` (like ``tr_onnx/backends/cuda/ops/<family>.py``): a ``KernelDef`` per op whose
  binding factory reserves its own scratch and launches the family's kernels;
* ``scaled_square.cu`` (like ``tr_onnx/backends/cuda/kernels/<family>.cu``): those kernels,
  over ``elementwise.cuh``'s helpers, named in ``cuda.SOURCE``.

Nothing else: a session takes the two op sets as ``plugins=[ops, cuda]`` (op sets load in
order, so the OpDefs exist when the KernelDefs are merged into them). A builtin family is
instead loaded by name from ``tr_onnx.registry``'s ``BUILTIN_OPSETS`` and
``BUILTIN_BACKEND_KERNELS`` (its kernel table, ``KERNELS`` in its bindings' module, is found
from the latter); this one passes its own ``KernelSource`` to ``b.launch(..., family=...)``,
which the host emulator builds for the CPU and ``CupyDevice`` compiles with the builtin
families' NVRTC options.
"""
