"""Forward (inference) time of the model_zoo models: tr_onnx numpy backend vs onnxruntime CPU,
same model, same batch, same thread count. Prints a markdown table of median ms per run and
the ratio. Training benchmarks against PyTorch and ONNX Runtime training come with training.

    python benchmarks/forward.py [--batch 32] [--threads 2] [--repeat 50]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
SHAPES = {"mlp": (64,), "lenet": (1, 8, 8), "resnet": (3, 16, 16), "mobilenet": (3, 16, 16),
          "transformer": (8, 32)}


def median_ms(fn, repeat: int) -> float:
    import numpy as np

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    # BLAS threads must be fixed before numpy loads
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import numpy as np
    import onnxruntime as ort

    import tr_onnx

    print(f"batch {args.batch}, {args.threads} threads, median of {args.repeat} runs\n")
    print("| model | tr_onnx align 1 (ms) | tr_onnx align 8 (ms) | onnxruntime (ms) | "
          "tr_onnx / ORT |")
    print("|---|---|---|---|---|")
    for stem, shape in SHAPES.items():
        path = ZOO / f"{stem}.onnx"
        feed = {"input": np.random.default_rng(0).standard_normal(
            (args.batch, *shape)).astype(np.float32)}
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        ref = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        t_ort = median_ms(lambda ref=ref, feed=feed: ref.run(None, feed), args.repeat)
        ours = []
        for align in (1, 8):
            sess = tr_onnx.InferenceSession(path, channel_align=align)
            ours.append(median_ms(lambda sess=sess, feed=feed: sess.run(None, feed), args.repeat))
        print(f"| {stem} | {ours[0]:.3f} | {ours[1]:.3f} | {t_ort:.3f} | "
              f"{ours[0] / t_ort:.1f}x |")


if __name__ == "__main__":
    main()
