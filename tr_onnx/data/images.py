"""An image folder, ``root/<class name>/*.jpg|jpeg|png|bmp|webp`` (Pillow), for a model with one
image input.

Class indices are the class folder names in sorted order (torchvision's ``ImageFolder`` rule);
the names go beside the trained model. Images are decoded when a batch is indexed
(``ImageRows``), never the whole folder at once: converted to RGB (L for a model with one
channel), resized so that they cover the model's H x W (the shorter side to the target:
torchvision's ``Resize``) and center-cropped to it (``CenterCrop``), scaled to [0, 1] and
normalised with ``(x - mean) / std`` per channel (ImageNet's by default), in NCHW or NHWC as the
model's input shape says (channels, 1 or 3, on axis 1 or -1).

Training augmentation (the training split of a ``Trainer`` epoch only; ``[images] augment =
false`` turns it off): a random resized crop made light -- the image is resized with its
shorter side to the target times a factor drawn from [1, ``AUGMENT_SCALE``], and the H x W crop
is taken at a random position of it instead of the center -- then a horizontal flip with
probability 1/2. The draws of a sample are a function of the run's seed, the epoch and the
sample's position in the folder (``numpy.random.default_rng([seed, epoch, sample])``), so a
resumed run draws the same, whatever thread decodes the batch and in whatever order.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import InputError
from . import Loaded, section

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp"})
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
AUGMENT_SCALE = 1.25  # the largest resize factor the training crop draws
LAYOUTS = ("NCHW", "NHWC")
KEYS = {"size": list, "mean": list, "std": list, "augment": bool, "layout": str}


def claims(path: Path) -> bool:
    """A folder with a subfolder that holds an image file (by suffix)."""
    if not path.is_dir():
        return False
    return any(sub.is_dir() and any(_is_image(f) for f in sub.iterdir())
               for sub in path.iterdir())


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()


def add_arguments(group) -> None:
    group.add_argument("--image-mean", type=_floats, default=None, dest="images.mean",
                       metavar="M[,M,M]", help="image folders: the per-channel mean subtracted "
                       "after scaling pixels to [0, 1] (default ImageNet's "
                       f"{','.join(map(str, IMAGENET_MEAN))}; overrides [images] mean)")
    group.add_argument("--image-std", type=_floats, default=None, dest="images.std",
                       metavar="S[,S,S]", help="image folders: the per-channel standard "
                       f"deviation divided by (default ImageNet's "
                       f"{','.join(map(str, IMAGENET_STD))}; overrides [images] std)")


def _floats(text: str) -> list[float]:
    import argparse

    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") \
            from None


@dataclass(frozen=True)
class Preprocess:
    """How a decoded image becomes a model input sample. ``augment``: the training crop and
    flip are allowed; ``draw``: the (seed, epoch) they are drawn for (None: no augmentation,
    the center crop)."""

    size: tuple[int, int]  # H, W
    channels: int
    layout: str
    mean: np.ndarray  # float32 [C]
    std: np.ndarray
    augment: bool = True
    draw: tuple[int, int] | None = None

    def __call__(self, image, sample: int) -> np.ndarray:
        """``image`` (a PIL image) as a float32 [H, W, C] array."""
        from PIL import Image

        image = image.convert("L" if self.channels == 1 else "RGB")
        h, w = self.size
        rng = None
        if self.draw is not None:  # SeedSequence takes non-negative integers only
            seed, epoch = self.draw
            rng = np.random.default_rng([seed % 2**64, epoch, sample])
        scale = 1.0 if rng is None else rng.uniform(1.0, AUGMENT_SCALE)
        image = image.resize(cover_size(image.size, (round(h * scale), round(w * scale))),
                             Image.BILINEAR)
        iw, ih = image.size
        if rng is None:  # torchvision's center_crop offsets
            top, left = int(round((ih - h) / 2.0)), int(round((iw - w) / 2.0))
        else:
            top, left = int(rng.integers(0, ih - h + 1)), int(rng.integers(0, iw - w + 1))
        image = image.crop((left, top, left + w, top + h))
        if rng is not None and rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        x = np.asarray(image, dtype=np.float32).reshape(h, w, self.channels) / np.float32(255)
        return (x - self.mean) / self.std


def cover_size(image_wh: tuple[int, int], target_hw: tuple[int, int]) -> tuple[int, int]:
    """(width, height) that ``image_wh`` is resized to so that it covers ``target_hw``: the side
    that needs the larger scale becomes its target, the other keeps the aspect ratio (rounded
    down, as torchvision's ``Resize(size)`` sizes the longer side)."""
    (iw, ih), (h, w) = image_wh, target_hw
    if h * iw >= w * ih:  # the height needs the larger scale
        return max(int(h * iw / ih), w), h
    return w, max(int(w * ih / iw), h)


class ImageRows:
    """Images decoded when indexed: ``rows[idx]`` -> float array [len(idx), *sample shape].
    ``items[i]`` is what ``open_image`` opens (a file path; a data set's row) and ``names[i]``
    what an error names; ``samples[i]`` the sample's position in the whole data set (what its
    augmentation draws are keyed by)."""

    def __init__(self, items: Sequence, open_image: Callable, names: Sequence[str],
                 samples: np.ndarray, prep: Preprocess, dtype: np.dtype, identity: str):
        self.items, self.open_image, self.names = items, open_image, names
        self.samples, self.prep, self.dtype = samples, prep, np.dtype(dtype)
        self.identity = identity  # what fingerprint() hashes besides the samples
        h, w = prep.size
        c = prep.channels
        self.shape = (len(samples), c, h, w) if prep.layout == "NCHW" else (len(samples), h, w, c)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx) -> np.ndarray:
        picked = np.arange(len(self))[idx]
        rows = np.atleast_1d(picked)
        out = np.empty((len(rows), *self.prep.size, self.prep.channels), np.float32)
        for j, i in enumerate(rows):
            out[j] = self._decode(int(i))
        if self.prep.layout == "NCHW":
            out = out.transpose(0, 3, 1, 2)
        out = np.ascontiguousarray(out, dtype=self.dtype)
        return out if np.ndim(picked) else out[0]

    def _decode(self, i: int) -> np.ndarray:
        from PIL import UnidentifiedImageError

        try:
            image = self.open_image(self.items[i])
            return self.prep(image, int(self.samples[i]))
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as exc:
            # Pillow raises OSError for truncated files, SyntaxError for some broken headers
            raise InputError(f"{self.names[i]}: not a readable image ({exc})") from None

    def _view(self, idx, prep: Preprocess) -> ImageRows:
        idx = np.asarray(idx)
        return ImageRows([self.items[i] for i in idx], self.open_image,
                         [self.names[i] for i in idx], self.samples[idx], prep, self.dtype,
                         self.identity)

    def subset(self, idx: np.ndarray) -> ImageRows:
        return self._view(idx, self.prep)

    def for_epoch(self, seed: int, epoch: int) -> ImageRows:
        """The same images with the training augmentation of ``epoch`` of a run seeded
        ``seed`` (itself when augmentation is off)."""
        if not self.prep.augment:
            return self
        return self._view(np.arange(len(self)), replace(self.prep, draw=(seed, epoch)))

    def fingerprint(self) -> int:
        crc = zlib.crc32(self.identity.encode())
        crc = zlib.crc32(repr(self.prep).encode(), crc)
        return zlib.crc32(np.ascontiguousarray(self.samples, np.int64).tobytes(), crc)


# ---- the folder ------------------------------------------------------------------------------

def scan(root: Path) -> tuple[list[str], list[Path], np.ndarray]:
    """(class names sorted, image files, class index per file): files sorted within a class."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise InputError(f"{root}: no class folders (an image folder holds one folder per "
                         "class: root/<class name>/*.jpg|png)")
    files, labels = [], []
    for k, name in enumerate(classes):
        found = sorted(f for f in (root / name).iterdir() if _is_image(f))
        if not found:
            raise InputError(f"{root / name}: class folder {name!r} holds no images (suffixes: "
                             f"{', '.join(sorted(IMAGE_SUFFIXES))})")
        files += found
        labels += [k] * len(found)
    return classes, files, np.asarray(labels, np.int64)


def _open_file(path: Path):
    from PIL import Image

    with Image.open(path) as image:
        image.load()  # decode now, inside the caller's error handling
        return image


def preprocess_for(input_specs, options, where: str) -> tuple[object, Preprocess]:
    """The model's single image input and how images become its samples (``[images]`` keys
    and the ``--image-*`` flags of ``options``)."""
    opts = section(options, "images", KEYS)
    if len(input_specs) != 1:
        raise InputError(f"{where}: images feed one input; the model has {len(input_specs)}: "
                         f"{[s.name for s in input_specs]}")
    (spec,) = input_specs
    if spec.dtype.kind != "f":
        raise InputError(f"{where}: images are floating point; model input {spec.name!r} is "
                         f"{spec.dtype}")
    if len(spec.shape) != 4:
        raise InputError(f"{where}: model input {spec.name!r} has shape {list(spec.shape)}; "
                         "images need [N, C, H, W] or [N, H, W, C]")
    layout = opts.get("layout") or _layout(spec)
    if layout not in LAYOUTS:
        raise InputError(f"{where}: [images] layout = {layout!r}; valid: {', '.join(LAYOUTS)}")
    dims = spec.shape[1:]
    c, hw = (dims[0], dims[1:]) if layout == "NCHW" else (dims[2], dims[:2])
    if c not in (1, 3):
        raise InputError(f"{where}: model input {spec.name!r} has shape {list(spec.shape)}: "
                         f"{c} channels in {layout}; images give 1 (L) or 3 (RGB)")
    size = _size(spec, hw, opts.get("size"), where)
    mean = _per_channel(opts, "mean", c, where)
    std = _per_channel(opts, "std", c, where)
    if np.any(std <= 0):
        raise InputError(f"{where}: [images] std {std.tolist()} must be > 0")
    return spec, Preprocess(size, c, layout, mean, std, bool(opts.get("augment", True)))


def _layout(spec) -> str:
    first, last = spec.shape[1] in (1, 3), spec.shape[3] in (1, 3)
    if first != last:
        return "NCHW" if first else "NHWC"
    if first:  # e.g. [N, 3, 3, 3]: torch's NCHW unless said otherwise
        return "NCHW"
    raise InputError(f"model input {spec.name!r} has shape {list(spec.shape)}: no channel axis "
                     "of 1 or 3 at axis 1 or -1 (--data-spec: [images] layout = \"NHWC\" or "
                     "\"NCHW\")")


def _size(spec, hw, given, where: str) -> tuple[int, int]:
    if given is not None:
        if len(given) != 2 or not all(isinstance(v, int) and v > 0 for v in given):
            raise InputError(f"{where}: [images] size = {given!r}; expected [H, W]")
        if any(isinstance(d, int) and d != v for d, v in zip(hw, given, strict=True)):
            raise InputError(f"{where}: [images] size = {given} but model input {spec.name!r} "
                             f"has H, W = {list(hw)}")
        return tuple(given)
    if not all(isinstance(d, int) for d in hw):
        raise InputError(f"{where}: model input {spec.name!r} has free H, W ({list(hw)}): "
                         "give the size in --data-spec, [images] size = [H, W]")
    return tuple(hw)


def _per_channel(opts, key: str, channels: int, where: str) -> np.ndarray:
    values = opts.get(key)
    if values is None:
        values = IMAGENET_MEAN if key == "mean" else IMAGENET_STD
        if channels == 1:  # one channel: the average of ImageNet's three
            values = [float(np.mean(values))]
    values = np.asarray(values, dtype=np.float32)
    if values.ndim != 1 or len(values) not in (1, channels):
        raise InputError(f"{where}: image {key} {values.tolist()}: give 1 or {channels} values "
                         "(one per channel)")
    return np.broadcast_to(values, (channels,)).copy()


def load(path: Path, input_specs, label_kind: str, label_dtype: np.dtype, options) -> Loaded:
    if not path.is_dir():
        raise InputError(f"{path}: an image folder must be a folder (root/<class name>/*.jpg)")
    spec, prep = preprocess_for(input_specs, options, str(path))
    classes, files, labels = scan(path)
    rows = ImageRows(files, _open_file, [str(f) for f in files], np.arange(len(files)), prep,
                     spec.dtype, _files_identity(files))
    return Loaded(({spec.name: rows}, class_labels(labels, len(classes), label_kind,
                                                    label_dtype)),
                  "images", {"classes": classes, **preprocess_meta(prep)})


def class_labels(labels: np.ndarray, classes: int, label_kind: str,
                 label_dtype: np.dtype) -> np.ndarray:
    """Class indices, or one-hot rows of ``label_dtype`` for a loss of dense targets."""
    if label_kind == "dense":
        return np.eye(classes, dtype=label_dtype)[labels]
    return labels


def preprocess_meta(prep: Preprocess) -> dict:
    """What an application needs to feed the trained model the same way."""
    return {"image_size": list(prep.size), "layout": prep.layout,
            "channels": prep.channels, "mean": prep.mean.tolist(), "std": prep.std.tolist(),
            "resize": "shorter side to the target, then center crop (bilinear)"}


def _files_identity(files: list[Path]) -> str:
    """The files' paths, sizes and modification times: a changed file changes the data."""
    parts = []
    for f in files:
        st = f.stat()
        parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)
