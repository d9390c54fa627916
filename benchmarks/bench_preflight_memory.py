"""How close the preflight's device-memory estimate is to what the emulator measures.

For the MN-Core tutorial's MLP (examples/mnist.py), the CNN of examples/mnist_cnn.py, the
autoencoder of examples/autoencoder.py and torchvision's ResNet-18 (10 classes, 3x32x32 inputs), runs the preflight on a training batch
and compares the activation peak estimated from the graph's shapes alone (a liveness walk)
with the peak the emulator measures running the same graph op by op at O0 (the bytes of the
distinct tensor storages it holds at once). Parameters, buffers, optimizer state and the
batch are exact sizes, so the activations are the only estimated part of the peak.

    python benchmarks/bench_preflight_memory.py [--batch-size 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def models(batch_size: int):
    import lightning as L
    import torch
    import torch.nn.functional as F
    from autoencoder import LitAutoEncoder
    from mnist import MNISTClassifier
    from mnist_cnn import MNISTConvNet
    from torch.utils.data import DataLoader, TensorDataset

    class ResNet18(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            import torchvision

            self.net = torchvision.models.resnet18(num_classes=10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def data(shape):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2 * batch_size, *shape, generator=g)
        y = torch.randint(0, 10, (2 * batch_size,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=batch_size)

    yield "tutorial MLP (examples/mnist.py)", MNISTClassifier(), data((1, 32, 32))
    yield "CNN (examples/mnist_cnn.py)", MNISTConvNet(), data((1, 28, 28))
    yield "autoencoder (examples/autoencoder.py)", LitAutoEncoder(), data((1, 28, 28))
    yield "ResNet-18 (torchvision)", ResNet18(), data((3, 32, 32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    os.environ.setdefault("MNCORE_PRESET", "O0")
    import torch

    from mncore_lightning.preflight import run_preflight

    results = []
    for name, module, loader in models(args.batch_size):
        start = time.perf_counter()
        report = run_preflight(module, {"train": loader})
        (train,) = report.hooks
        m = train.memory
        error = (m.activation_peak_bytes - m.measured_activation_peak_bytes) / (
            m.measured_activation_peak_bytes
        )
        results.append(
            {
                "model": name,
                "batch_size": args.batch_size,
                "parameter_bytes": m.parameter_bytes,
                "optimizer_state_bytes": m.optimizer_state_bytes,
                "activation_peak_estimated": m.activation_peak_bytes,
                "activation_peak_measured": m.measured_activation_peak_bytes,
                "activation_error": round(error, 6),
                "peak_bytes": m.peak_bytes,
                "peak_error": round(
                    (m.activation_peak_bytes - m.measured_activation_peak_bytes) / m.peak_bytes, 6
                ),
                "ops": train.op_counts,
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
        r = results[-1]
        print(
            f"{name}: activations estimated {r['activation_peak_estimated'] / 2**20:.2f} MiB, "
            f"measured {r['activation_peak_measured'] / 2**20:.2f} MiB "
            f"(error {100 * error:+.3f}%); peak {m.peak_bytes / 2**20:.2f} MiB; "
            f"{r['seconds']} s",
            flush=True,
        )
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "command": "python benchmarks/bench_preflight_memory.py "
        + " ".join(f"--batch-size {args.batch_size}".split()),
    }
    if args.json:
        args.json.write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
