"""The cost of drawing random numbers from eager's stream under Inductor (preset O1).

A small ViT-style encoder (patch embedding, 4 pre-norm Transformer layers of width 192 with
dropout 0.1 in attention and MLP, a classification head), batch 32 of 3x32x32, AdamW-like SGD
with momentum: a training step where every layer draws dropout masks. Compiled at O1 with
`random="eager"` (the default: torch's generator, eager's numbers; Inductor's
fallback_random) and `random="inductor"` (Inductor's in-kernel generator, other numbers),
it prints the median step time of each over `--steps` interleaved steps after warm-up, and
the ratio.

    python benchmarks/bench_random.py [--steps 30] [--preset O1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from mncore_device import Context, MNDevice

sys.path.insert(0, str(Path(__file__).parent))  # device_steps.py, next to this script
from device_steps import make_step, registered  # noqa: E402


class TinyViT(nn.Module):
    def __init__(self, width: int = 192, depth: int = 4, patch: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Conv2d(3, width, patch, stride=patch)
        self.position = nn.Parameter(torch.zeros(1, (32 // patch) ** 2, width))
        layer = nn.TransformerEncoderLayer(
            width, 3, 2 * width, dropout=0.1, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2) + self.position
        return self.head(self.encoder(x).mean(1))


def compiled_step(random: str, preset: str):
    """The training step compiled with the given random stream, and its batch."""
    torch.manual_seed(0)
    model = TinyViT()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    registered(context, model, optimizer)
    step = make_step(model, optimizer)
    batch = {"x": torch.randn(32, 3, 32, 32), "t": torch.randint(0, 10, (32,))}
    compiled = context.compile(step, batch, options={"option_json": preset, "random": random})
    for _ in range(3):
        compiled(batch)
    return compiled, batch


def measure(preset: str, steps: int) -> dict[str, float]:
    """Median step time of each stream, the steps of the two interleaved (a busy machine's
    load then weighs on both alike)."""
    runs = {random: compiled_step(random, preset) for random in ("eager", "inductor")}
    times: dict[str, list[float]] = {random: [] for random in runs}
    for _ in range(steps):
        for random, (compiled, batch) in runs.items():
            start = time.perf_counter()
            compiled(batch)["loss"].item()
            times[random].append(time.perf_counter() - start)
    return {random: statistics.median(t) for random, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--preset", default="O1")
    args = parser.parse_args()
    medians = measure(args.preset, args.steps)
    eager, inductor = medians["eager"], medians["inductor"]
    print(f"preset {args.preset}, torch threads {torch.get_num_threads()}")
    print(f"random='eager'    median step {eager * 1e3:.2f} ms")
    print(f"random='inductor' median step {inductor * 1e3:.2f} ms")
    print(f"eager / inductor  {eager / inductor:.3f}")


if __name__ == "__main__":
    main()
