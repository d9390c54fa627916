"""Which convolution layout O1 picks for each model, and what the timing costs at compile time.

For each model (torchvision's, `bench_zoo.build_model`, batch `--batch`, 32x32 images), the
forward graph's convolutions are found as the executor finds them (a fake-tensor run of the
nodes they depend on) and timed in both layouts by `mncore_device.runtime.convolution_layout`,
as a compile does when no decision is kept for them. The report gives the timed sums (stored
layout over channels_last: above 1 means channels_last is faster), the layout chosen, and
the seconds spent finding the shapes and timing them. Whole steps in both layouts are
`bench_vs_torch_compile.py --preset O1 <O1 with "layout_optimization": true>`.

    python benchmarks/bench_convolution_layout.py [--models resnet18 densenet121 ...]
        [--batch 32] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # bench_zoo.py, next to this script
import bench_zoo  # noqa: E402

MODELS = [
    "resnet18", "resnet50", "googlenet", "vgg11_bn", "densenet121", "squeezenet1_1",
    "regnet_y_400mf", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny",
]  # fmt: skip


def measure(name: str, batch: int, repeats: int) -> dict:
    """Shapes and timing of `name`'s forward convolutions, as a compile finds and times them."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from mncore_device.runtime import convolution_layout

    model = bench_zoo.build_model(name, 32)
    x = torch.randn(batch, 3, 32, 32)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())

    def forward(params, buffers, x):
        return torch.func.functional_call(model, {**params, **buffers}, (x,))

    gm = make_fx(forward)(params, buffers, x)
    for node in gm.graph.nodes:  # as the executor gets a graph: from JSON, no metadata
        node.meta.clear()
    args = [*params.values(), *buffers.values(), x]
    start = time.perf_counter()
    convolutions = convolution_layout.convolutions_of(gm, args)
    shapes_seconds = time.perf_counter() - start
    ratios, seconds = [], []
    for _ in range(repeats):  # each as a compile with no decision kept: warm-up, then timed
        start = time.perf_counter()
        stored, channels_last = convolution_layout._time_both(convolutions, torch.device("cpu"))
        seconds.append(time.perf_counter() - start)
        ratios.append(stored / channels_last)
    return {
        "convolutions": sum(convolutions.values()),
        "shapes": len(convolutions),
        "timed_sum_stored_over_channels_last": [round(r, 3) for r in ratios],
        "chosen": "channels_last" if sum(r > 1 for r in ratios) * 2 > len(ratios) else "stored",
        "shapes_seconds": round(shapes_seconds, 3),
        "timing_seconds": [round(s, 3) for s in seconds],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=sorted(bench_zoo.MODELS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(
        "| model | convolutions (shapes) | timed sum, stored / channels_last | chosen | shapes s | timing s |"
    )
    print("|---|---|---|---|---|---|")
    report = {}
    for name in args.models:
        row = report[name] = measure(name, args.batch, args.repeats)
        ratios = ", ".join(f"{r:.2f}" for r in row["timed_sum_stored_over_channels_last"])
        timing = ", ".join(f"{s:.2f}" for s in row["timing_seconds"])
        print(
            f"| {name} | {row['convolutions']} ({row['shapes']}) | {ratios} | {row['chosen']} "
            f"| {row['shapes_seconds']:.2f} | {timing} |",
            flush=True,
        )
    return report


if __name__ == "__main__":
    main()
