"""ONNX Runtime training 1.19.2 peer of ``benchmarks/train.py``. Runs with the python of
``benchmarks/.venv-ort`` (made by ``setup_ort_training.sh``), never with the project's python.

    .venv-ort/bin/python benchmarks/peer_ort_training.py JOB.json   (job["phase"]: artifacts|train)
    .venv-ort/bin/python benchmarks/peer_ort_training.py --check    (prints the version)

Two processes per model, so artifact generation (onnx + the gradient builder) does not count in
the training process's peak memory:

* ``artifacts``: the zoo graph made trainable the way ``shared/PEERS.md`` describes, then
  ``generate_artifacts``. BatchNormalization gets ``training_mode=1`` with its two running-stat
  outputs (unconnected, as PyTorch's TRAINING export writes it) and the running statistics go to
  ``frozen_params`` (asking gradients for them fails). The AdamW node is switched to
  ``adam_mode=0`` (torch.optim.AdamW: eps before bias correction; the builder's default is the
  Hugging Face variant) with torch's betas, eps and weight decay. Every artifact's IR version is
  lowered to what ORT 1.19 loads (10; onnx >= 1.17 stamps newer ones).
* ``train``: ``CheckpointState``/``Module``/``Optimizer``, ``module(x, y)`` (forward and
  backward), ``optimizer.step()``, ``module.lazy_reset_grad()`` per step.
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import peer_common

MAX_IR_VERSION = 10  # the newest IR version ORT 1.19 loads


def import_ort_training():
    """(artifacts, api) of onnxruntime.training without importing torch.

    ``onnxruntime/training/__init__.py`` imports its ``optim`` subpackage (ORTModule's FP16
    optimizer wrappers), which imports torch; on-device training needs none of it, and torch
    would add its hundreds of MB to this peer's memory. A placeholder module stands in for it.
    """
    try:
        import torch  # noqa: F401  (present: let the package import normally)
    except ImportError:
        sys.modules.setdefault("onnxruntime.training.optim",
                               types.ModuleType("onnxruntime.training.optim"))
    from onnxruntime.training import api, artifacts

    return artifacts, api


def trainable_model(model):
    """Copy of ``model`` with every BatchNormalization in training mode; returns (model,
    running-statistic initializer names)."""
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    running = []
    for node in out.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        running += list(node.input[3:5])
        kept = [a for a in node.attribute if a.name != "training_mode"]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute("training_mode", 1)])
        while len(node.output) < 3:
            node.output.append(f"{node.output[0]}__running_{len(node.output)}")
    return out, running


def parameter_names(model, running: list[str]) -> list[str]:
    """Float initializers that some node reads, minus BN running statistics: the weights."""
    import onnx

    used = {name for node in model.graph.node for name in node.input}
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)
    return [init.name for init in model.graph.initializer
            if init.data_type in floats and init.name in used and init.name not in running]


# ops whose gradient builder ORT training 1.19.2 lacks (shared/PEERS.md); named in the error
NO_GRADIENT = {"InstanceNormalization", "GroupNormalization", "HardSigmoid", "HardSwish", "Elu",
               "Selu", "Softplus", "Mish", "PRelu", "GlobalMaxPool", "ReduceMax", "Einsum", "Sum",
               "Mean", "CumSum", "LRN", "Floor", "Round"}


def known_gaps(model) -> list[str]:
    """The ops of ``model`` that ORT training is known not to differentiate."""
    gaps = sorted({n.op_type for n in model.graph.node if n.op_type in NO_GRADIENT})
    if any(n.op_type == "LayerNormalization" and len(n.output) == 1 for n in model.graph.node):
        gaps.append("LayerNormalization with one output")
    return gaps


def fix_optimizer_model(path: Path, job: dict) -> None:
    """AdamW as torch.optim.AdamW (adam_mode 0, torch's betas/eps/weight decay)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path))
    want = {"adam_mode": 0, "alpha": 0.9, "beta": 0.999, "epsilon": 1e-8,
            "weight_decay": float(job["weight_decay"]), "correct_bias": 1}
    for node in model.graph.node:
        if node.op_type == "AdamWOptimizer":
            kept = [a for a in node.attribute if a.name not in want]
            del node.attribute[:]
            node.attribute.extend(kept + [helper.make_attribute(k, v) for k, v in want.items()])
    onnx.save(model, str(path))


def lower_ir_versions(directory: Path) -> None:
    import onnx

    for path in directory.glob("*.onnx"):
        model = onnx.load(str(path))
        if model.ir_version > MAX_IR_VERSION:
            model.ir_version = MAX_IR_VERSION
            onnx.save(model, str(path))


def make_artifacts(job: dict, result: dict) -> None:
    import onnx

    artifacts, _ = import_ort_training()
    model, running = trainable_model(onnx.load(job["model_path"]))
    params = parameter_names(model, running)
    loss = {"cross_entropy": artifacts.LossType.CrossEntropyLoss,
            "mse": artifacts.LossType.MSELoss}[job["loss"]]
    optim = {"sgd": artifacts.OptimType.SGD, "adamw": artifacts.OptimType.AdamW}[job["optimizer"]]
    out = Path(job["artifacts"])
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        artifacts.generate_artifacts(model, requires_grad=params, frozen_params=running,
                                     loss=loss, optimizer=optim, artifact_directory=str(out))
    except Exception as exc:
        gaps = known_gaps(model)
        if gaps:
            raise RuntimeError(f"known gradient gap ({', '.join(gaps)}): {exc}") from exc
        raise
    if job["optimizer"] == "adamw":
        fix_optimizer_model(out / "optimizer_model.onnx", job)
    lower_ir_versions(out)
    result["artifacts_s"] = time.perf_counter() - start
    result["params"], result["frozen"] = len(params), len(running)


def train(job: dict, result: dict) -> None:
    import numpy as np
    import onnxruntime as ort

    _, api = import_ort_training()
    result["rss_after_imports_mb"] = peer_common.rss_mb()
    result["version"] = ort.__version__
    xs, ys = peer_common.load_data(job)
    if job["loss"] == "cross_entropy":
        ys = ys.astype(np.int64)
    out = Path(job["artifacts"])
    options = ort.SessionOptions()
    options.intra_op_num_threads = job["threads"]
    options.inter_op_num_threads = 1
    start = time.perf_counter()
    state = api.CheckpointState.load_checkpoint(str(out / "checkpoint"))
    # no eval model: its BatchNormalization keeps 3 outputs and it fails to load
    module = api.Module(str(out / "training_model.onnx"), state, session_options=options)
    optimizer = api.Optimizer(str(out / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(job["lr"])
    module.train()
    result["setup_s"] = time.perf_counter() - start

    def step(x, y):
        loss = module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
        return loss

    result["ms"], result["losses"] = peer_common.timed_loop(step, xs, ys, job["warmup"])


def check() -> None:
    import_ort_training()
    import numpy
    import onnx
    import onnxruntime

    print(f"onnxruntime {onnxruntime.__version__}, onnx {onnx.__version__}, "
          f"numpy {numpy.__version__}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        check()
        sys.exit(0)
    job = peer_common.load_job()
    peer_common.pin_threads(job["threads"])
    peer_common.run_peer(job, make_artifacts if job["phase"] == "artifacts" else train)
