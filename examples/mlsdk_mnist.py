"""The MNIST tutorial written straight against the device layer, MLSDK style, without Lightning.

    python examples/mlsdk_mnist.py                          # MN-Core's CPU virtual machine
    python examples/mlsdk_mnist.py --device mncore2:auto    # a real MN-Core 2

This is what ``examples/mnist.py`` does under the hood, spelled out: name and register the
model's and optimizer's tensors with a ``Context``, compile the whole training step (zero_grad,
forward, backward, optimizer step) into one static graph from a sample batch, call it batch by
batch, ``synchronize()`` the trained state back to the host, save, and evaluate with a second
compiled function. Read it to see what the Lightning plugin automates, or to port an existing
MLSDK script.

Outputs in ``--outdir``: ``checkpoint.pt`` (same format and parameter names as mnist.py's),
the compiled steps under ``train_step/`` and ``eval_step/``, and ``loss_curve.png``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from example_utils import (
    TUTORIAL_PRINT_EVERY,
    add_mncore_arguments,
    add_run_arguments,
    print_accuracy,
    print_summary,
    quiet_console,
)
from mnist import MLP
from mnist_datamodule import MNISTDataModule
from plotting import plot_loss_curve
from torch.utils.data import DataLoader

EVAL_BATCH_SIZE = 125
IGNORED_LABEL = -1  # labels of padding rows: argmax never equals it, so they are never counted


def padded_batches(
    loader: DataLoader, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of exactly ``batch_size``: a short last batch is filled up with zero images.

    A compiled function has fixed shapes, and the test split need not divide by the batch size
    (the scikit-learn digits' 300 do not divide by 125). Padding, with labels no prediction can
    match, evaluates every real sample with one compiled function and counts no padding row.
    """
    for x, t in loader:
        missing = batch_size - x.shape[0]
        if missing:
            x = torch.cat([x, x.new_zeros((missing, *x.shape[1:]))])
            t = torch.cat([t, t.new_full((missing,), IGNORED_LABEL)])
        yield x, t


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, outdir="outputs/mlsdk_mnist", epochs=10)
    add_mncore_arguments(parser, default_device="pfvm:cpu", default_preset="O1")
    parser.add_argument("--batch-size", type=int, default=64)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, save and evaluate on the device; returns accuracy, counts, data set and paths."""
    start = time.perf_counter()
    args = build_parser().parse_args(argv)
    quiet_console()
    from mncore_device import (
        Context,
        MNDevice,
        set_buffer_name_in_optimizer,
        set_tensor_name_in_module,
        storage,
    )
    from mncore_lightning.optimizers import MNCoreSGD, device_optimizer

    torch.manual_seed(args.seed)
    outdir: Path = args.outdir
    outdir.mkdir(parents=True, exist_ok=True)
    datamodule = MNISTDataModule(
        args.data_dir,
        batch_size=args.batch_size,
        eval_batch_size=EVAL_BATCH_SIZE,
        pad_to=32,
        seed=args.seed,
    )
    datamodule.setup("fit")
    train_loader = datamodule.train_dataloader()

    device = MNDevice(args.device)
    context = Context(device)
    Context.switch_context(context)

    # Everything the device keeps between calls is named and registered before compiling.
    model = MLP()
    set_tensor_name_in_module(model, "model")
    for param in model.parameters():
        context.register_param(param)
    for buffer in model.buffers():
        context.register_buffer(buffer)
    # On real hardware (MLSDK backend) this becomes mlsdk.MNCoreSGD with the same arguments.
    optimizer = device_optimizer(context, MNCoreSGD(model.parameters(), 0.1, 0.9, 0.0))
    set_buffer_name_in_optimizer(optimizer, "optimizer")
    context.register_optimizer_buffers(optimizer)

    def train_step(inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inp["x"]), inp["t"])
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    def eval_step(inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            prediction = model(inp["x"]).argmax(dim=1)
        return {"correct": (prediction == inp["t"]).sum()}

    x, t = next(iter(train_loader))
    options = {"option_json": args.preset}
    compiled_train = context.compile(
        train_step, {"x": x, "t": t}, storage.path(str(outdir / "train_step")), options=options
    )

    # The loss is read back every step, for the curve and the epoch mean. That is one small
    # device-to-host copy per step; a throughput-minded loop would read it every 100 steps only.
    losses: list[tuple[int, float]] = []
    epoch_losses: list[tuple[int, float]] = []
    for epoch in range(args.epochs):
        epoch_sum, batches = 0.0, 0
        for i, (x, t) in enumerate(train_loader):
            if args.limit_train_batches is not None and i >= args.limit_train_batches:
                break
            loss = compiled_train({"x": x, "t": t})["loss"].item()
            losses.append((len(losses), loss))
            epoch_sum, batches = epoch_sum + loss, batches + 1
            if i % TUTORIAL_PRINT_EVERY == 0:
                print(f"epoch {epoch}, iter {i}, loss {loss}", flush=True)
        epoch_losses.append((len(losses), epoch_sum / batches))
        print(f"epoch {epoch}, loss {epoch_sum / batches}", flush=True)

    context.synchronize()  # host copies of parameters and optimizer state are stale until now
    checkpoint = outdir / "checkpoint.pt"
    torch.save(
        {"model_state_dict": model.state_dict(), "optim_state_dict": optimizer.state_dict()},
        checkpoint,
    )

    eval_batches = list(padded_batches(datamodule.test_dataloader(), EVAL_BATCH_SIZE))
    sample_x, sample_t = eval_batches[0]
    compiled_eval = context.compile(
        eval_step,
        {"x": sample_x, "t": sample_t},
        storage.path(str(outdir / "eval_step")),
        options=options,
    )
    correct = sum(int(compiled_eval({"x": x, "t": t})["correct"].item()) for x, t in eval_batches)
    result = print_accuracy(correct, len(datamodule.test_dataset))

    loss_curve = plot_loss_curve(
        {"train_loss_step": losses, "train_loss_epoch": epoch_losses},
        outdir / "loss_curve.png",
        title="MNIST MLP (MLSDK style)",
    )
    print_summary(
        "mlsdk_mnist.py",
        time.perf_counter() - start,
        result["accuracy"],
        extra=f"loss curve in {loss_curve} (this loop writes no TensorBoard logs)",
    )
    return {
        **result,
        "dataset": datamodule.dataset_name,
        "checkpoint": checkpoint,
        "loss_curve": loss_curve,
    }


if __name__ == "__main__":
    main()
