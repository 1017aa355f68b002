"""Image folders (issue 32): ``root/<class>/*.png|jpg`` trains a PyTorch CNN exported by the test
end to end through ``tr-onnx train``, NCHW and NHWC, and the trained model runs in onnxruntime.

Oracles: the preprocessing equals torchvision's ``Resize(S)`` + ``CenterCrop(S)`` + ``ToTensor``
+ ``Normalize`` written out with the same PIL operations torchvision calls (torchvision itself
is not installed here); onnxruntime runs the trained export; the augmentation is checked
against itself (a pure function of seed, epoch and sample) and against a resumed run.
"""

from __future__ import annotations

import json
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from tests.oracles import ort_run
from tr_onnx.cli import main
from tr_onnx.data import load
from tr_onnx.data.images import IMAGENET_MEAN, IMAGENET_STD
from tr_onnx.errors import InputError
from tr_onnx.importer import InputSpec

S = 12  # the models' H = W
CLASSES = ("blue", "green", "red")  # sorted: the class indices 0, 1, 2
PER_CLASS = 10
SIZES = ((20, 14), (14, 20), (16, 16), (13, 12))  # (width, height): both orientations


def write_folder(root: Path, per_class: int = PER_CLASS) -> Path:
    """Three classes, each a dominant colour with a random pattern on it; PNG and JPEG files
    of several sizes."""
    rng = np.random.default_rng(0)
    for k, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        channel = {"red": 0, "green": 1, "blue": 2}[name]
        for i in range(per_class):
            w, h = SIZES[i % len(SIZES)]
            x = rng.integers(0, 90, (h, w, 3))
            x[..., channel] += 150
            x[rng.random((h, w)) < 0.2] = 255 * (k % 2)  # speckles
            image = Image.fromarray(x.astype(np.uint8), "RGB")
            suffix = ".jpg" if i % 3 == 0 else ".png"
            image.save(root / name / f"img{i:02d}{suffix}")
    return root


class Cnn(torch.nn.Module):
    def __init__(self, nhwc: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.nhwc = nhwc
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.fc = torch.nn.Linear(6, len(CLASSES))

    def forward(self, x):
        if self.nhwc:  # a Keras-like model: NHWC in, a Transpose at the input
            x = x.permute(0, 3, 1, 2)
        x = torch.relu(self.conv(x))
        return self.fc(x.mean(dim=(2, 3)))


def export_cnn(path: Path, nhwc: bool = False) -> Path:
    shape = (2, S, S, 3) if nhwc else (2, 3, S, S)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Cnn(nhwc), (torch.zeros(shape),), str(path), dynamo=False,
                          input_names=["x"], output_names=["logits"], opset_version=17,
                          dynamic_axes={"x": {0: "n"}, "logits": {0: "n"}})
    return path


def spec(layout: str = "NCHW", size=(S, S)) -> InputSpec:
    h, w = size
    shape = ("n", 3, h, w) if layout == "NCHW" else ("n", h, w, 3)
    return InputSpec("x", shape, np.dtype(np.float32))


def torchvision_reference(path: Path, size: int, mean, std) -> np.ndarray:
    """Resize(size) + CenterCrop(size) + ToTensor() + Normalize(mean, std) as torchvision
    computes them on a PIL image (torchvision/transforms/functional.py: the shorter side to
    ``size``, the longer ``int(size * long / short)``, bilinear; crop offsets
    ``int(round((h - size) / 2.0))``; ``/ 255`` and ``(x - mean) / std`` in float32)."""
    image = Image.open(path).convert("RGB")
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    image = image.resize((new_w, new_h), Image.BILINEAR)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    image = image.crop((left, top, left + size, top + size))
    x = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float().div(255)
    m = torch.tensor(mean, dtype=torch.float32)[:, None, None]
    s = torch.tensor(std, dtype=torch.float32)[:, None, None]
    return ((x - m) / s).numpy()


def files(root: Path) -> list[Path]:
    return [f for name in CLASSES for f in sorted((root / name).iterdir())]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_images_are_preprocessed_as_torchvision_resize_center_crop_normalize(tmp_path, layout):
    root = write_folder(tmp_path / "images")
    loaded = load(root, [spec(layout)])
    (x,), labels = list(loaded.data[0].values()), loaded.data[1]
    assert loaded.source == "images" and loaded.meta["classes"] == list(CLASSES)
    assert labels.tolist() == [k for k in range(3) for _ in range(PER_CLASS)]
    batch = x[np.arange(len(x))]
    assert batch.shape == ((len(x), 3, S, S) if layout == "NCHW" else (len(x), S, S, 3))
    for i, f in enumerate(files(root)):
        want = torchvision_reference(f, S, IMAGENET_MEAN, IMAGENET_STD)
        got = batch[i] if layout == "NCHW" else batch[i].transpose(2, 0, 1)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=str(f))


def test_mean_and_std_flags_and_spec_keys_reach_the_preprocessing(tmp_path):
    root = write_folder(tmp_path / "images", per_class=2)
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    x = load(root, [spec()], options={"images": {"mean": mean, "std": std}}).data[0]["x"]
    want = torchvision_reference(files(root)[0], S, mean, std)
    np.testing.assert_allclose(x[0], want, rtol=0, atol=1e-6)


def test_a_free_height_and_width_take_the_spec_size(tmp_path):
    root = write_folder(tmp_path / "images", per_class=2)
    free = InputSpec("x", ("n", 3, "h", "w"), np.dtype(np.float32))
    with pytest.raises(InputError, match=r"free H, W.*\[images\] size"):
        load(root, [free])
    x = load(root, [free], options={"images": {"size": [8, 8]}}).data[0]["x"]
    np.testing.assert_allclose(x[0], torchvision_reference(files(root)[0], 8, IMAGENET_MEAN,
                                                           IMAGENET_STD), rtol=0, atol=1e-6)


def test_augmentation_is_a_function_of_seed_epoch_and_sample(tmp_path):
    root = write_folder(tmp_path / "images")
    rows = load(root, [spec()]).data[0]["x"]
    idx = np.array([3, 0, 17, 25, 9])
    a = rows.for_epoch(7, 1)[idx]
    np.testing.assert_array_equal(rows.for_epoch(7, 1)[idx[::-1]], a[::-1])
    with ThreadPoolExecutor(4) as pool:  # any thread, any order, one sample at a time
        one_by_one = list(pool.map(lambda i: rows.for_epoch(7, 1)[[i]][0], idx))
    np.testing.assert_array_equal(np.stack(one_by_one), a)
    np.testing.assert_array_equal(rows.for_epoch(7, 1).subset(idx)[:], a)  # a split's sample
    assert not np.array_equal(rows.for_epoch(7, 2)[idx], a)  # another epoch, other draws
    assert not np.array_equal(rows.for_epoch(8, 1)[idx], a)
    center = rows[idx]
    assert not np.array_equal(a, center)
    off = load(root, [spec()], options={"images": {"augment": False}}).data[0]["x"]
    np.testing.assert_array_equal(off.for_epoch(7, 1)[idx], center)


def test_flips_and_crops_are_drawn(tmp_path):
    """A square image of the target size is only flipped or shifted by the crop: its augmented
    forms are its center crop of a rescaled copy, mirrored in about half of the epochs."""
    root = tmp_path / "images"
    (root / "a").mkdir(parents=True)
    x = np.zeros((S, S, 3), np.uint8)
    x[:, : S // 2] = 255  # left half white: a flip moves it right
    Image.fromarray(x).save(root / "a" / "half.png")
    rows = load(root, [spec()]).data[0]["x"]
    left_brighter = [rows.for_epoch(0, e)[0][:, :, : S // 2].mean()
                     > rows.for_epoch(0, e)[0][:, :, S // 2:].mean() for e in range(40)]
    assert 8 <= sum(left_brighter) <= 32  # flipped with probability 1/2


def test_the_validation_split_is_not_augmented(tmp_path):
    """Only the Trainer's training epoch passes data through ``for_epoch``: a split's
    validation rows decode the center crop."""
    from tr_onnx.data import split

    root = write_folder(tmp_path / "images")
    arrays, labels = load(root, [spec()]).data
    (train, _), (val, _) = split(arrays, labels, 0.25, seed=0)
    val_rows = val["x"]
    for j, sample in enumerate(val_rows.samples):
        want = torchvision_reference(files(root)[sample], S, IMAGENET_MEAN, IMAGENET_STD)
        np.testing.assert_allclose(val_rows[j], want, rtol=0, atol=1e-6)


def train(model: Path, root: Path, out: Path, *extra: str) -> int:
    return main(["train", str(model), "--data", str(root), "--out", str(out), "--epochs", "8",
                 "--batch-size", "6", "--lr", "0.03", "--no-progress", "--seed", "1",
                 "--backend", "numpy", *extra])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_an_image_folder_trains_a_torch_cnn_that_runs_in_onnxruntime(tmp_path, layout, capsys):
    root = write_folder(tmp_path / "images")
    model = export_cnn(tmp_path / "cnn.onnx", nhwc=layout == "NHWC")
    out = tmp_path / "trained.onnx"
    assert train(model, root, out) == 0, capsys.readouterr().err
    meta = json.loads(out.with_suffix(".data.json").read_text())
    assert meta["classes"] == list(CLASSES) and meta["layout"] == layout
    arrays, labels = load(root, [spec(layout)]).data
    x = arrays["x"][:]
    before = ort_run(onnx.load(model), {"x": x})[0].argmax(1)
    after = ort_run(onnx.load(out), {"x": x})[0].argmax(1)
    assert (after == labels).mean() >= 0.9 > (before == labels).mean()


def test_a_resumed_run_draws_the_same_augmentation(tmp_path, capsys):
    root = write_folder(tmp_path / "images")
    model = export_cnn(tmp_path / "cnn.onnx")
    whole, resumed = tmp_path / "whole.onnx", tmp_path / "resumed.onnx"
    common = ["--epochs", "2", "--checkpoint-dir"]
    assert train(model, root, whole, *common, str(tmp_path / "a")) == 0
    assert train(model, root, tmp_path / "half.onnx", "--epochs", "1", "--checkpoint-dir",
                 str(tmp_path / "b")) == 0
    assert train(model, root, resumed, *common, str(tmp_path / "b"), "--resume") == 0, \
        capsys.readouterr().err
    for a, b in zip(onnx.load(whole).graph.initializer, onnx.load(resumed).graph.initializer,
                    strict=True):
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(a),
                                      onnx.numpy_helper.to_array(b))


def test_a_corrupt_image_names_the_file(tmp_path, capsys):
    root = write_folder(tmp_path / "images", per_class=4)
    bad = root / "green" / "img01.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    rows = load(root, [spec()]).data[0]["x"]
    with pytest.raises(InputError, match=f"{bad}: not a readable image"):
        rows[np.arange(len(rows))]
    model = export_cnn(tmp_path / "cnn.onnx")
    assert train(model, root, tmp_path / "t.onnx") == 2
    assert str(bad) in capsys.readouterr().err


def test_an_empty_class_folder_or_no_class_folders_is_an_error(tmp_path):
    root = write_folder(tmp_path / "images", per_class=2)
    (root / "zebra").mkdir()
    with pytest.raises(InputError, match=r"zebra.*holds no images"):
        load(root, [spec()])
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (4, 4)).save(flat / "a.png")
    with pytest.raises(InputError, match="not a kind of data"):
        load(flat, [spec()])
    with pytest.raises(InputError, match="no class folders"):
        load(flat, [spec()], options={"kind": "images"})


def test_a_model_input_that_is_not_an_image_is_refused(tmp_path):
    root = write_folder(tmp_path / "images", per_class=2)
    with pytest.raises(InputError, match="5 channels"):
        load(root, [InputSpec("x", ("n", 5, S, S), np.dtype(np.float32))],
             options={"images": {"layout": "NCHW"}})
    with pytest.raises(InputError, match=r"\[N, C, H, W\]"):
        load(root, [InputSpec("x", ("n", 64), np.dtype(np.float32))])


def test_the_trainer_feeds_each_epoch_its_augmentation_and_validates_on_center_crops(tmp_path):
    """The Trainer's epoch e visits ``default_rng(seed + e).permutation(n)`` in batches (its
    documented order): batch b's images are ``for_epoch(seed, e)`` of those samples; the
    validation data is decoded without augmentation."""
    from tr_onnx.data import split
    from tr_onnx.training.session import TrainingSession
    from tr_onnx.training.trainer import Trainer

    root = write_folder(tmp_path / "images", per_class=4)
    arrays, labels = load(root, [spec()]).data
    train_data, val_data = split(arrays, labels, 0.25, seed=0)
    session = TrainingSession(str(export_cnn(tmp_path / "cnn.onnx")), backend="numpy")
    trained, validated = [], []
    train_step, run_loss = session.train_step, session.run_loss
    session.train_step = lambda feed, y, **kw: (trained.append(feed["x"].copy()),
                                                train_step(feed, y, **kw))[1]
    session.run_loss = lambda feed, y: (validated.append(feed["x"].copy()),
                                        run_loss(feed, y))[1]
    seed, batch = 5, 4
    Trainer(session, train_data, val_data, batch_size=batch, epochs=2, seed=seed,
            progress=False, log=None).fit()
    rows, n = train_data[0]["x"], len(train_data[1])
    nb = -(-n // batch)  # the last batch partial
    assert len(trained) == 2 * nb
    for epoch in range(2):
        order = np.random.default_rng(seed + epoch).permutation(n)
        for b in range(nb):
            want = rows.for_epoch(seed, epoch)[order[b * batch:(b + 1) * batch]]
            np.testing.assert_array_equal(trained[epoch * nb + b], want)
    np.testing.assert_array_equal(np.concatenate(validated[:1]), val_data[0]["x"][:])


def test_a_model_with_free_height_and_width_trains_with_the_spec_size(tmp_path, capsys):
    root = write_folder(tmp_path / "images", per_class=4)
    model = tmp_path / "free.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Cnn(), (torch.zeros(2, 3, S, S),), str(model), dynamo=False,
                          input_names=["x"], output_names=["logits"], opset_version=17,
                          dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}, "logits": {0: "n"}})
    data_spec = tmp_path / "images.toml"
    data_spec.write_text('kind = "images"\n[images]\nsize = [10, 14]\naugment = false\n')
    out = tmp_path / "t.onnx"
    assert train(model, root, out, "--epochs", "1", "--data-spec", str(data_spec),
                 "--image-mean", "0.5", "--image-std", "0.25") == 0, capsys.readouterr().err
    meta = json.loads(out.with_suffix(".data.json").read_text())
    assert meta["image_size"] == [10, 14] and meta["mean"] == [0.5] * 3
    assert meta["std"] == [0.25] * 3
    data_spec.write_text('[images]\nsize = [10, 14]\nzoom = 2\n')
    assert train(model, root, out, "--data-spec", str(data_spec)) == 2
    assert "[images] has no key 'zoom'" in capsys.readouterr().err


def test_a_one_channel_model_gets_grayscale_with_the_averaged_imagenet_statistics(tmp_path):
    root = write_folder(tmp_path / "images", per_class=2)
    gray = InputSpec("x", ("n", 1, S, S), np.dtype(np.float32))
    loaded = load(root, [gray])
    assert loaded.meta["mean"] == [pytest.approx(0.449)]
    assert loaded.meta["std"] == [pytest.approx(0.226)]
    x = loaded.data[0]["x"][:]
    for i, f in enumerate(files(root)):
        image = Image.open(f).convert("L")  # torchvision's Grayscale: PIL's convert("L")
        w, h = image.size
        short, long = min(w, h), max(w, h)
        size = (S, int(S * long / short)) if w <= h else (int(S * long / short), S)
        image = image.resize(size, Image.BILINEAR)
        top, left = int(round((size[1] - S) / 2.0)), int(round((size[0] - S) / 2.0))
        ref = np.asarray(image.crop((left, top, left + S, top + S)), np.float32) / 255
        want = (ref - np.float32(np.mean(IMAGENET_MEAN))) / np.float32(np.mean(IMAGENET_STD))
        np.testing.assert_allclose(x[i, 0], want, rtol=0, atol=1e-6)
