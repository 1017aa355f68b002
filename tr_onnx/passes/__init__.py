"""Graph passes, in the order a plan's graph goes through them.

A model is imported once; a plan is then made per set of concrete input shapes by
``compiler.compile_plan``, which runs steps 2 to 7:

1. import (``importer.import_model``, once per model): load, ``onnx.checker``, opset
   conversion, shape inference, constant folding; every op must have a kernel.
2. specialise (``ImportedModel.specialize``): the input shapes (and the inputs a plan needs as
   constants, such as a Reshape's shape) are bound, constants folded again, static control
   flow resolved (``passes.control_flow``: If inlined, Loop/Scan unrolled, sequences made
   lists of tensors), the IR built.
3. dispatch (``passes.dispatch``): every node bound to its OpDef for the backend's kernels,
   attribute defaults filled from the schema; one error lists every node without a kernel.
4. train pass, training plans only (``training.pipeline.build_training_step``, the
   ``transform`` of ``compile_plan``): untie shared parameters, train-mode BatchNorm/Dropout,
   labels and loss, the backward pass (``passes.autodiff``: each op's gradient rule emits IR
   nodes; fan-in summed there), GRAD accumulators, optimizer state and update, then half
   precision, loss scaling and the cuda step guard. ``TrainingSession``'s eval plans get
   ``to_inference_mode`` here instead.
5. layout (``passes.layout``): physical layouts from the ops' LayoutRules: channels-last
   feature maps with channels padded to the backend's multiple, OHWI conv weights, a Flatten
   folded into the next Gemm/MatMul's weight rows (not in training plans), and a counted
   ``LayoutTranspose`` where no rule can take a layout as it is.
6. kernels (``compiler.compile_graph``): each node's kernel factory bound to its tensors'
   layouts, asking for the workspace it needs.
7. MemoryPlan (``memory.plan_memory``): first/last use of every value, offsets in one arena,
   lifetimes reused, validated at ``finalize``; then the executor (NumPy or CUDA) is bound to
   it.
"""
