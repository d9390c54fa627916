"""Pieces the Lightning examples share: device selection, tutorial-style console lines, metrics.

Kept apart so that each example file reads as the model plus its ``main`` and nothing else.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

PRESETS = ("O0", "O1", "O2", "O3", "O4", "debug")
PROGRESS_STYLES = ("auto", "bar", "lines", "none")

TUTORIAL_PRINT_EVERY = 100


class _DropLightningTips(logging.Filter):
    """Drops Lightning's advertising tips (``💡 Tip: ... litlogger``), keeps its other notices."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in record.getMessage()


def quiet_console() -> None:
    """Silence the notices a newcomer cannot act on, and nothing else.

    - Lightning's tips (installing litlogger): a log record of Lightning's rank-zero logger,
      dropped by a filter on that logger; its other notices (GPU/TPU, the MN-Core banner) stay.
    - Lightning 2.6's use of torch's deprecated ``LeafSpec`` (a FutureWarning raised inside
      Lightning at every fit and test with torch 2.14; Lightning's code to change, not ours).
    - torch's "No CUDA runtime is found, using CUDA_HOME" note, logged when TorchInductor loads
      its C++ builder on a machine without a GPU, where it means nothing.
    Warnings of this project (mncore_lightning, mncore_device, the examples) are never silenced.
    """
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropLightningTips) for f in rank_zero.filters):
        rank_zero.addFilter(_DropLightningTips())
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
    )
    if not torch.cuda.is_available():
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def add_mncore_arguments(
    parser: argparse.ArgumentParser, default_device: str = "auto", default_preset: str | None = None
) -> None:
    """``--preset`` and ``--device``: how MN-Core code is compiled and where it runs.

    The defaults ``auto`` and None leave the choice to the plugin, which honours
    ``$MNCORE_DEVICE`` and ``$MNCORE_PRESET`` before its own defaults (O1).
    """
    parser.add_argument(
        "--preset",
        default=default_preset,
        choices=PRESETS,
        help="MN-Core compiler preset: O0..O4 (more optimisation, longer compiles) or debug "
        f"(default: {default_preset or '$MNCORE_PRESET, else O1'})",
    )
    parser.add_argument(
        "--device",
        default=default_device,
        help="MN-Core device: mncore2:auto, mncore2:0, pfvm:cpu, pfvm:cuda, ... (%(default)s)",
    )


def add_run_arguments(
    parser: argparse.ArgumentParser, outdir: str, epochs: int = 10, seed: int = 0
) -> None:
    """The options every example has: where outputs and data are, how long, which seed."""
    parser.add_argument("--outdir", type=Path, default=Path(outdir), help="outputs go here")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="holds MNIST/raw/ (torchvision layout)"
    )
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument(
        "--limit-train-batches", type=int, default=None, help="batches per epoch (quick runs)"
    )
    parser.add_argument("--seed", type=int, default=seed)


def add_trainer_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the Lightning examples: MN-Core compile settings and the progress bar."""
    add_mncore_arguments(parser)
    parser.add_argument(
        "--progress",
        choices=PROGRESS_STYLES,
        default="auto",
        help="bar: TQDM's bar; lines: one line per epoch (for log files); none; "
        "auto (default): bar on a terminal, lines otherwise",
    )
    parser.add_argument(
        "--no-progress-bar",
        dest="progress",
        action="store_const",
        const="none",
        help="the same as --progress none",
    )


def progress_style(requested: str) -> str:
    """``auto`` resolved: TQDM's bar redraws one terminal row with ``\\r``, which a log file
    or a pipe shows as one endless line, so there it becomes one printed line per epoch."""
    if requested != "auto":
        return requested
    return "bar" if sys.stdout.isatty() else "lines"


def device_trainer_kwargs(
    accelerator: str,
    device: str = "auto",
    preset: str | None = None,
    codegen_dir: Path | None = None,
) -> dict[str, Any]:
    """Trainer arguments that select the hardware.

    ``mncore`` imports the plugin only here, so that ``--accelerator cpu`` runs on machines
    without it. Any other name (cpu, cuda, gpu, auto) is passed to Lightning as it is.
    """
    if accelerator != "mncore":
        return {"accelerator": accelerator, "devices": 1}
    try:
        # Importing the plugin is what makes Lightning know accelerator="mncore".
        from mncore_lightning import MNCoreStrategy
    except ImportError as error:
        raise SystemExit(
            "accelerator 'mncore' needs the mncore_lightning plugin "
            f"({error}); install the project (pip install -e .) or pass --accelerator cpu"
        ) from error
    strategy = MNCoreStrategy(
        device=device,
        preset=preset,
        codegen_dir=str(codegen_dir) if codegen_dir is not None else None,
    )
    return {"accelerator": "mncore", "devices": 1, "strategy": strategy}


def tensorboard_logger(outdir: Path, resume: bool = False) -> TensorBoardLogger:
    """TensorBoard logs under ``<outdir>/tensorboard/version_N``.

    A fresh run gets a new version directory, so one curve is one run; a resumed run appends to
    the newest one, so its curve continues where the interrupted run stopped.
    """
    version = None
    if resume:
        versions = [
            int(path.name.split("_", 1)[1])
            for path in (outdir / "tensorboard").glob("version_*")
            if path.name.split("_", 1)[1].isdigit()
        ]
        version = max(versions, default=None)
    return TensorBoardLogger(
        save_dir=str(outdir), name="tensorboard", version=version, default_hp_metric=False
    )


def build_trainer(
    args: argparse.Namespace,
    accelerator: str,
    datamodule: L.LightningDataModule,
    logger: TensorBoardLogger,
    checkpoint: Callback,
) -> L.Trainer:
    """The Trainer of the Lightning examples, from their parsed ``add_*_arguments`` options.

    Steps are logged every 10 batches, or more often in epochs of fewer than 100 batches, so
    that even a quick run leaves a loss curve; each logged step costs a host read on MN-Core.
    """
    quiet_console()
    train_batches = len(datamodule.train_dataloader())
    if args.limit_train_batches is not None:
        train_batches = min(train_batches, args.limit_train_batches)
    style = progress_style(args.progress)
    # TQDM's bar, explicitly: Lightning picks Rich's when `rich` is installed (transformers
    # brings it), and the examples' console output should not depend on that.
    bars = {"bar": [TQDMProgressBar()], "lines": [LineProgressBar()], "none": []}[style]
    return L.Trainer(
        **device_trainer_kwargs(accelerator, args.device, args.preset, args.outdir / "codegen"),
        max_epochs=args.epochs,
        limit_train_batches=args.limit_train_batches,
        logger=logger,
        callbacks=[TutorialPrinter(), checkpoint, *bars],
        log_every_n_steps=max(1, min(10, train_batches // 10)),
        enable_progress_bar=bool(bars),
        enable_model_summary=False,
        default_root_dir=args.outdir,
    )


class LineProgressBar(ProgressBar):
    """Lightning's progress bar as plain lines: one per training epoch, with the epoch's time
    and the metrics logged with ``prog_bar=True``. For log files and pipes, where a redrawn
    bar would run into one line; ``print`` (the tutorial's lines) writes whole lines too."""

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._epoch_start = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self._enabled:
            print(*args, **{"flush": True, **kwargs})

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        seconds = time.perf_counter() - self._epoch_start
        metrics = {
            name: value
            for name, value in self.get_metrics(trainer, pl_module).items()
            if name != "v_num"
        }
        shown = ", ".join(
            f"{name} {value:.4f}" if isinstance(value, float) else f"{name} {value}"
            for name, value in metrics.items()
        )
        batches = trainer.num_training_batches
        self.print(
            f"Epoch {trainer.current_epoch}: {batches} batches in {seconds:.1f} s"
            + (f", {shown}" if shown else "")
        )


class TutorialPrinter(Callback):
    """Prints the MN-Core tutorial's console lines from the metrics the module logged.

    ``epoch E, iter I, loss L`` every ``every`` iterations and ``epoch E, loss L`` (the epoch
    mean) at the end of each epoch. The printing lives here, not in ``training_step``: on MN-Core
    the step is traced into a static graph, where ``.item()`` and ``print`` have no place. The
    metrics are read only on the lines that print, so other steps pay nothing.
    """

    def __init__(self, metric: str = "train_loss", every: int = TUTORIAL_PRINT_EVERY) -> None:
        self.metric = metric
        self.every = every

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if batch_idx % self.every:
            return
        metrics = trainer.callback_metrics
        value = metrics.get(f"{self.metric}_step", metrics.get(self.metric))
        if value is not None:
            _print(trainer, f"epoch {trainer.current_epoch}, iter {batch_idx}, loss {float(value)}")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = trainer.callback_metrics
        value = metrics.get(f"{self.metric}_epoch", metrics.get(self.metric))
        if value is not None:
            _print(trainer, f"epoch {trainer.current_epoch}, loss {float(value)}")


def _print(trainer: L.Trainer, line: str) -> None:
    """Print above the progress bar instead of through it."""
    if not trainer.is_global_zero:
        return
    bar = trainer.progress_bar_callback
    if bar is not None:
        bar.print(line)
    else:
        print(line, flush=True)


def log_classification_metrics(
    module: L.LightningModule,
    stage: str,
    loss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
) -> None:
    """Log ``<stage>_loss`` and ``<stage>_acc``; for test also the counts behind the accuracy.

    ``batch_size`` is given so the epoch means weigh a short last batch correctly, and the
    counts are summed, so ``Correct: N / M`` covers every sample of the split.
    """
    batch_size = target.shape[0]
    correct = (logits.argmax(dim=1) == target).sum().float()
    module.log(f"{stage}_loss", loss, prog_bar=True, batch_size=batch_size)
    module.log(f"{stage}_acc", correct / batch_size, prog_bar=True, batch_size=batch_size)
    if stage == "test":
        # Tensors, both: a Python number logged in a compiled step would be the value the step
        # was traced with (the plugin warns about that); this count is the batch's, every call.
        total = torch.full_like(correct, batch_size)
        module.log("test_correct", correct, reduce_fx="sum", batch_size=batch_size)
        module.log("test_total", total, reduce_fx="sum", batch_size=batch_size)


def print_accuracy(correct: int, total: int) -> dict[str, Any]:
    """Print the tutorial's ``Correct: N / M. Accuracy: A`` line; return the three numbers."""
    accuracy = correct / total
    print(f"Correct: {correct} / {total}. Accuracy: {accuracy:.4f}", flush=True)
    return {"correct": correct, "total": total, "accuracy": accuracy}


def report_test_accuracy(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The accuracy line from the summed ``test_correct`` / ``test_total`` test metrics."""
    return print_accuracy(
        round(float(metrics["test_correct"])), round(float(metrics["test_total"]))
    )


def save_tutorial_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Path:
    """The tutorial's ``checkpoint.pt``: plain state dicts, loadable without Lightning."""
    torch.save(
        {"model_state_dict": model.state_dict(), "optim_state_dict": optimizer.state_dict()}, path
    )
    return path


def tensorboard_command(log_dir: str | Path) -> str:
    """The command that opens ``log_dir`` in TensorBoard: this interpreter's ``tensorboard``
    (``.venv/bin/tensorboard`` after scripts/setup.sh), plain ``tensorboard`` where that one is
    first on the PATH; paths relative to the current directory where they are below it."""
    program = Path(sys.executable).with_name("tensorboard")
    if not program.is_file() or shutil.which("tensorboard") == str(program):
        command = "tensorboard"
    else:
        command = _relative(program)
    return f"{shlex.quote(command)} --logdir {shlex.quote(_relative(Path(log_dir)))}"


def _relative(path: Path) -> str:
    absolute = Path(os.path.abspath(path))  # symlinks kept: .venv/bin/tensorboard stays so
    return str(absolute.relative_to(Path.cwd()) if absolute.is_relative_to(Path.cwd()) else path)


def print_summary(
    name: str,
    seconds: float,
    accuracy: float | None = None,
    log_dir: str | Path | None = None,
    extra: str = "",
) -> str:
    """The line every example ends with: what ran, how well, how long, where to look next."""
    parts = [f"{name} done in {seconds:.1f} s"]
    if accuracy is not None:
        parts.append(f"test accuracy {accuracy:.4f}")
    if extra:
        parts.append(extra)
    if log_dir is not None:
        parent = Path(log_dir).parent  # every version_N of the run, side by side
        parts.append(f"TensorBoard logs in {log_dir}: {tensorboard_command(parent)}")
    line = "; ".join(parts)
    print(line, flush=True)
    return line
