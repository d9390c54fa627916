"""Lightning's getting-started LitAutoEncoder, from training to exported models.

    python examples/autoencoder.py                      # MN-Core (needs the mncore_lightning plugin)
    python examples/autoencoder.py --accelerator cpu    # plain Lightning on the CPU

The walk-through of Lightning's "Lightning in 15 minutes" page, on MN-Core: train with a
LightningDataModule, watch TensorBoard, reload the checkpoint with ``load_from_checkpoint``,
use the encoder alone for embeddings, and export the model with ``to_onnx`` and
``to_torchscript``. Each export is run and its output compared with the PyTorch model's, so a
user sees that what leaves the accelerator is the model that was trained.

Outputs in ``--outdir``: ``checkpoints/``, ``tensorboard/``, ``autoencoder.onnx``,
``autoencoder.torchscript.pt`` and ``loss_curve.png``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from example_utils import (
    add_run_arguments,
    add_trainer_arguments,
    build_trainer,
    print_summary,
    tensorboard_logger,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from mnist_datamodule import MNISTDataModule
from plotting import plot_tensorboard_losses
from torch import nn

EXPORT_ATOL = 1e-5


class LitAutoEncoder(L.LightningModule):
    """Encoder 784-64-3 and decoder 3-64-784 trained with MSE, as on Lightning's first page.

    Unlike the page, the two halves are built here from hyper-parameters rather than passed in,
    so ``load_from_checkpoint(path)`` needs no arguments. ``forward`` reconstructs the image;
    that is what gets exported.
    """

    def __init__(self, hidden: int = 64, latent: int = 3, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(
            nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Linear(hidden, latent)
        )
        self.decoder = nn.Sequential(
            nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, 28 * 28)
        )
        self.example_input_array = torch.zeros(1, 1, 28, 28)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x.flatten(1)))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, _ = batch
        return F.mse_loss(self(x), x.flatten(1))

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, batch_size=batch[0].shape[0])

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), batch_size=batch[0].shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def export_onnx(model: LitAutoEncoder, path: Path, sample: torch.Tensor) -> np.ndarray:
    """Export with a dynamic batch dimension, validate the file and run it on ``sample``.

    onnxruntime runs it when installed; otherwise onnx's own reference evaluator does, which is
    slow but needs nothing beyond the ``onnx`` package.
    """
    import onnx

    batch = torch.export.Dim("batch")
    model.to_onnx(
        path,
        model.example_input_array,
        dynamo=True,
        input_names=["image"],
        output_names=["reconstruction"],
        dynamic_shapes=({0: batch},),
        verbose=False,
    )
    onnx.checker.check_model(str(path), full_check=True)
    feeds = {"image": sample.numpy()}
    try:
        import onnxruntime
    except ImportError:
        from onnx.reference import ReferenceEvaluator

        return ReferenceEvaluator(str(path)).run(None, feeds)[0]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def export_torchscript(model: LitAutoEncoder, path: Path, sample: torch.Tensor) -> torch.Tensor:
    """Script the model, save it, load it back the way a deployment would, and run it."""
    with warnings.catch_warnings():
        # TorchScript is deprecated in torch and Lightning 2.7 (torch.export is its successor);
        # it still works, and the warning would only distract here.
        warnings.filterwarnings("ignore", message=".*(to_torchscript|torch.jit).*deprecated")
        model.to_torchscript(file_path=path, method="script")
        scripted = torch.jit.load(str(path))
    with torch.no_grad():
        return scripted(sample)


def compare_with_pytorch(name: str, output: np.ndarray, reference: torch.Tensor) -> bool:
    """Print whether an export reproduces the PyTorch output (allclose, atol 1e-5)."""
    expected = reference.numpy()
    match = output.shape == expected.shape and np.allclose(output, expected, atol=EXPORT_ATOL)
    error = (
        float(np.abs(output - expected).max()) if output.shape == expected.shape else float("inf")
    )
    verdict = "matches" if match else "DIFFERS FROM"
    print(f"{name} export {verdict} the PyTorch model (max abs diff {error:.2e})", flush=True)
    return match


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, outdir="outputs/autoencoder", epochs=5)
    parser.add_argument("--accelerator", default="mncore", help="mncore (default), cpu, cuda, ...")
    add_trainer_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, reload, embed and export; returns losses, export errors and output paths."""
    start = time.perf_counter()
    args = build_parser().parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    outdir: Path = args.outdir
    outdir.mkdir(parents=True, exist_ok=True)

    datamodule = MNISTDataModule(args.data_dir, pad_to=None, seed=args.seed)
    logger = tensorboard_logger(outdir)
    checkpoint = ModelCheckpoint(dirpath=outdir / "checkpoints", filename="autoencoder-{epoch:02d}")
    trainer = build_trainer(args, args.accelerator, datamodule, logger, checkpoint)
    trainer.fit(LitAutoEncoder(), datamodule=datamodule)
    (test_metrics,) = trainer.test(ckpt_path="best", datamodule=datamodule, verbose=False)
    print(f"test_loss {test_metrics['test_loss']:.4f} (MSE on normalised pixels)", flush=True)

    # Reload on the host: from here on the model is an ordinary PyTorch module.
    model = LitAutoEncoder.load_from_checkpoint(
        checkpoint.best_model_path, map_location="cpu"
    ).eval()
    images, labels = next(iter(datamodule.test_dataloader()))
    sample, sample_labels = images[:8], labels[:8]
    with torch.no_grad():
        embeddings = model.encoder(sample.flatten(1))
        reference = model(sample)
    print("embeddings of the first test images (label: 3-d code):", flush=True)
    for label, code in zip(sample_labels.tolist()[:4], embeddings[:4].tolist(), strict=True):
        print(f"  {label}: [{', '.join(f'{v:+.3f}' for v in code)}]", flush=True)

    onnx_out = export_onnx(model, outdir / "autoencoder.onnx", sample)
    script_out = export_torchscript(model, outdir / "autoencoder.torchscript.pt", sample)
    matches = {
        "onnx": compare_with_pytorch("onnx", onnx_out, reference),
        "torchscript": compare_with_pytorch("torchscript", script_out.numpy(), reference),
    }

    loss_curve = plot_tensorboard_losses(
        logger.log_dir, outdir / "loss_curve.png", title="LitAutoEncoder"
    )
    exports = ", ".join(f"{name} {'matches' if ok else 'DIFFERS'}" for name, ok in matches.items())
    print_summary(
        "autoencoder.py",
        time.perf_counter() - start,
        log_dir=logger.log_dir,
        extra=f"test loss {float(test_metrics['test_loss']):.4f}; exports: {exports}",
    )
    return {
        "dataset": datamodule.dataset_name,
        "test_loss": float(test_metrics["test_loss"]),
        "embeddings": embeddings,
        "exports_match": matches,
        "onnx_output": onnx_out,
        "torchscript_output": script_out,
        "pytorch_output": reference,
        "onnx": outdir / "autoencoder.onnx",
        "torchscript": outdir / "autoencoder.torchscript.pt",
        "lightning_checkpoint": Path(checkpoint.best_model_path),
        "log_dir": Path(logger.log_dir),
        "loss_curve": loss_curve,
    }


if __name__ == "__main__":
    main()
