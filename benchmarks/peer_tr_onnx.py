"""tr_onnx peer of ``benchmarks/train.py``: ``TrainingSession.train_step`` on the zoo model.

    python benchmarks/peer_tr_onnx.py JOB.json
"""

from __future__ import annotations

import time

import peer_common


def body(job: dict, result: dict) -> None:
    import numpy as np

    import tr_onnx

    result["rss_after_imports_mb"] = peer_common.rss_mb()
    result["version"] = tr_onnx.__version__
    xs, ys = peer_common.load_data(job)
    if job["optimizer"] == "adamw":
        opt = tr_onnx.optim.AdamW(lr=job["lr"], weight_decay=job["weight_decay"])
    else:
        opt = tr_onnx.optim.SGD(lr=job["lr"])
    start = time.perf_counter()
    session = tr_onnx.TrainingSession(job["model_path"], loss=job["loss"], optimizer=opt)
    result["setup_s"] = time.perf_counter() - start
    labels = ys.astype(np.int64) if job["loss"] == "cross_entropy" else ys

    def step(x, y):
        return session.train_step({"input": x}, y)

    result["ms"], result["losses"] = peer_common.timed_loop(step, xs, labels, job["warmup"])


if __name__ == "__main__":
    job = peer_common.load_job()
    peer_common.pin_threads(job["threads"])
    peer_common.run_peer(job, body)
