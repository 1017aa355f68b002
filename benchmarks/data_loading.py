"""Data loading against the training step, for the zoo models (numpy backend).

Per model and data source: the ms to make one training batch as the Trainer does (a shuffled
``labels[idx]`` and ``arrays[k][idx]``) from an .npz loaded into memory, from a memory-mapped
.npy folder (float64 files, cast per batch), from a CSV read by the table source (the MLP only:
a table feeds one ``[N, F]`` input) and, for the image models, from a ``Rows`` of PNG images
decoded with Pillow per batch (an image folder's cost, without the disk); the median train
step; and, training one epoch with ``Trainer.fit``, how long the training loop waited for
batches: as the Trainer reads them (``prefetch = 2``: a background thread where the epoch's
first batch took 1 ms or more to read, ``tr_onnx.data.prefetch``; the "reads in" column says
which it chose) and, for comparison, all in the training thread (``prefetch = 0``, where the
whole read is waiting). The first batch of an epoch is always waited for (there is no step
before it to overlap with): its wait is shown apart; then the median and the mean wait per
later step (a mean well above the median: a few long waits, the thread not scheduled in time
on a busy machine).

The files are written just before they are read, so the .npy reads hit the page cache, not the
disk. Like profile_step.py, the numbers are taken once per OpenBLAS setting (``--blas-env``).

    python benchmarks/data_loading.py [--models mlp,lenet,mobilenet,resnet] [--samples 2048]
        [--batch 32] [--threads 2] [--steps 20] [--blas-env both]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import peer_common
from peer_common import ZOO, ZOO_SHAPES, median

CLASSES = 10
ZOO_MODELS = ("mlp", "lenet", "mobilenet", "resnet")  # the digits-sized ones and the CNNs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(ZOO_MODELS),
                   help=f"comma-separated zoo models (default {','.join(ZOO_MODELS)})")
    p.add_argument("--samples", type=int, default=2048, help="samples per data set")
    p.add_argument("--batch", type=int, default=peer_common.ZOO_BATCH)
    p.add_argument("--threads", type=int, default=2, help="BLAS threads")
    p.add_argument("--steps", type=int, default=20, help="timed steps and batch reads")
    p.add_argument("--blas-env", choices=peer_common.BLAS_MODES, default="both",
                   help="OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE as given, unset, or both runs")
    p.add_argument("--blas-setting", help=argparse.SUPPRESS)
    p.add_argument("--bench-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    unknown = [m for m in args.models if m not in ZOO_SHAPES]
    if unknown:
        p.error(f"unknown model(s) {unknown}; valid: {', '.join(ZOO_SHAPES)}")
    return args


def write_sources(model: str, n: int, folder: Path) -> dict[str, Path]:
    """The same random data set as each source the model can read: name -> path."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, *ZOO_SHAPES[model]))  # float64, as files often are
    labels = rng.integers(0, CLASSES, n)
    paths = {"npz in memory": folder / f"{model}.npz", "npy memmap": folder / f"{model}_npy"}
    np.savez(paths["npz in memory"], input=x.astype(np.float32), labels=labels)
    paths["npy memmap"].mkdir()
    np.save(paths["npy memmap"] / "input.npy", x)
    np.save(paths["npy memmap"] / "labels.npy", labels)
    if x.ndim == 2:
        import pyarrow as pa
        import pyarrow.csv

        paths["CSV loaded"] = folder / f"{model}.csv"
        columns = {f"f{j}": x[:, j] for j in range(x.shape[1])}
        pyarrow.csv.write_csv(pa.table({**columns, "label": labels}), paths["CSV loaded"])
    return paths


class DecodedPNG:
    """A ``Rows`` of images stored as PNG files' bytes, decoded with Pillow when a batch is
    indexed (what an image folder's reads cost, without the disk)."""

    def __init__(self, pngs: list[bytes], shape: tuple[int, ...]):
        import numpy as np

        self.pngs, self.shape, self.dtype = pngs, (len(pngs), *shape), np.dtype(np.float32)

    def __len__(self) -> int:
        return len(self.pngs)

    def __getitem__(self, idx):
        import io

        import numpy as np
        from PIL import Image

        rows = np.arange(len(self))[idx]
        images = [np.asarray(Image.open(io.BytesIO(self.pngs[i])).convert(
            "RGB" if self.shape[1] == 3 else "L"), np.float32) for i in rows]
        x = np.stack(images) / 255.0
        return (x[:, None] if self.shape[1] == 1 else x.transpose(0, 3, 1, 2)).astype(
            np.float32)

    def subset(self, idx):
        return DecodedPNG([self.pngs[i] for i in idx], self.shape[1:])

    def fingerprint(self) -> int:
        return len(self.pngs)


def decoded_png(model: str, n: int):
    """(arrays, labels) of ``n`` random images of the model's input shape, as PNG bytes."""
    import io

    import numpy as np
    from PIL import Image

    c, h, w = ZOO_SHAPES[model]
    rng = np.random.default_rng(0)
    pngs = []
    for _ in range(n):
        pixels = rng.integers(0, 256, (h, w, c), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels[..., 0] if c == 1 else pixels).save(out, "PNG")
        pngs.append(out.getvalue())
    return {"input": DecodedPNG(pngs, (c, h, w))}, rng.integers(0, CLASSES, n)


def batch_ms(data, batch: int, reads: int) -> float:
    """Median ms to make one batch as Trainer._run_epoch does."""
    import numpy as np

    arrays, labels = data
    order = np.random.default_rng(1).permutation(len(labels))
    times = []
    for b in range(reads):
        start = time.perf_counter()
        idx = order[(b * batch) % len(labels):][:batch]
        _ = labels[idx], {k: v[idx] for k, v in arrays.items()}
        times.append((time.perf_counter() - start) * 1e3)
    return median(times)


def epoch_waits(session, data, batch: int, prefetch: int):
    """(whether a thread read the batches, ms waited for the first batch, median and mean ms
    waited per later batch, % of the epoch spent waiting) of one epoch with
    ``Trainer.prefetch = prefetch``."""
    from tr_onnx.data import prefetch as prefetch_module
    from tr_onnx.training import trainer as trainer_module

    made: list = []

    class Recording(prefetch_module.Prefetcher):
        def __enter__(self):
            made.append(self)
            return super().__enter__()

    trainer = trainer_module.Trainer(session, data, None, batch_size=batch, epochs=1,
                                     log=None, progress=False)
    trainer.prefetch = prefetch
    trainer_module.Prefetcher = Recording
    try:
        start = time.perf_counter()
        trainer.fit()
        seconds = time.perf_counter() - start
    finally:
        trainer_module.Prefetcher = prefetch_module.Prefetcher
    (prefetcher,) = made
    waits = [w * 1e3 for w in prefetcher.waits]
    later = waits[1:] or [0.0]
    return (prefetcher.threaded, waits[0], median(later), sum(later) / len(later),
            100 * sum(waits) / seconds / 1e3)


def measure(args) -> None:
    """The table of one OpenBLAS setting (this process's environment)."""
    import numpy as np

    import tr_onnx
    from tr_onnx.data import load
    from tr_onnx.training.trainer import label_kind

    print(f"### {args.samples} samples, batch {args.batch}, {args.threads} BLAS threads; "
          f"BLAS: {peer_common.blas_kernels()}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print("| model | source | batch ms | step ms | batch / step | Trainer: reads in | first "
          "batch waited ms | later batches waited ms/step, median | mean | % of epoch waiting "
          "| reads in the training thread: waited ms/step, mean | % of epoch waiting |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        session = tr_onnx.TrainingSession(str(ZOO / f"{model}.onnx"), loss="cross_entropy",
                                          optimizer=tr_onnx.optim.SGD(lr=0.01),
                                          backend="numpy")
        kind, dtype = label_kind(session)
        rng = np.random.default_rng(2)
        feed = {"input": rng.standard_normal((args.batch, *ZOO_SHAPES[model]),
                                             dtype=np.float32)}
        y = rng.integers(0, CLASSES, args.batch)
        for _ in range(2):  # the plan is built and warmed
            session.train_step(feed, y)
        steps = []
        for _ in range(args.steps):
            start = time.perf_counter()
            session.train_step(feed, y)
            steps.append((time.perf_counter() - start) * 1e3)
        step = median(steps)
        with tempfile.TemporaryDirectory(prefix="tr_onnx_data_bench_") as tmp:
            sources = {name: load(path, session.imported.inputs, kind, dtype).data
                       for name, path in write_sources(model, args.samples, Path(tmp)).items()}
            if len(ZOO_SHAPES[model]) == 3:
                sources["PNG decoded"] = decoded_png(model, args.samples)
            for source, data in sources.items():
                one = batch_ms(data, args.batch, args.steps)
                epoch_waits(session, data, args.batch, 2)  # a warm-up epoch
                threaded, first, later, mean, share = epoch_waits(session, data, args.batch, 2)
                _, _, _, mean0, share0 = epoch_waits(session, data, args.batch, 0)
                shape = "x".join(map(str, ZOO_SHAPES[model]))
                where = "a thread" if threaded else "training thread"
                print(f"| {model} [{shape}] | {source} | {one:.3f} | {step:.2f} | "
                      f"{one / step:.3f} | {where} | {first:.3f} | {later:.3f} | {mean:.3f} | "
                      f"{share:.2f} | {mean0:.3f} | {share0:.2f} |", flush=True)
    print(flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    return peer_common.main_per_blas_setting(__file__, args, argv, [], measure)


if __name__ == "__main__":
    sys.exit(main())
