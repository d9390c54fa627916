"""How far each way of running a training step drifts from the exact result: float64 eager.

When mncore's losses differ from `accelerator="cpu"`'s after a few steps, is that a bug or
rounding? Differences of rounding grow, on some models very fast (BatchNorm over a few
values per channel amplifies them), and eager float32 is one rounding among others. This
script measures each against a reference that has (almost) none: the same model in float64.

For each model, from the same seed, `--steps` training steps on different batches (zero_grad,
forward, cross entropy, backward, `torch.optim.SGD(lr=0.01, momentum=0.9)`) run:
- float64: eager in float64 (the reference);
- eager: eager in float32, as `accelerator="cpu"` runs it;
- torch.compile: the same step around `torch.compile(model)`;
- mncore <preset>: the whole step compiled with `Context.compile` at each `--preset`.
The report gives each one's losses, the largest |loss - float64's| at each step, and the
largest |weight - float64's| after the last step. A way of running that rounds no worse than
eager drifts from float64 about as much as eager does, or less; one that computes something
else drifts more, from the first step on.

    python benchmarks/bench_drift.py [--models resnet18 mlp] [--batch 8] [--steps 6] [--seeds 3]
        [--preset O0 O1] [--threads 1] [--out benchmarks/results/drift.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the helpers next to this script
import bench_zoo  # noqa: E402
from bench_vs_torch_compile import MODELS, model_and_batch  # noqa: E402
from device_steps import make_step, registered  # noqa: E402


def drift(
    name: str, batch: int, steps: int, image_size: int, presets: list[str], seed: int
) -> dict:
    """Losses of every runner, and their distances from float64's, on `steps` batches drawn
    from `seed`."""
    import torch

    from mncore_device import Context, MNDevice

    model, data = model_and_batch(name, batch, image_size)
    generator = torch.Generator().manual_seed(seed)
    batches = [
        {
            "x": torch.randn(data["x"].shape, generator=generator),
            "t": torch.randint(0, 10, data["t"].shape, generator=generator),
        }
        for _ in range(steps)
    ]

    def run(twin, step, cast=lambda b: b) -> tuple[list[float], list]:
        torch.manual_seed(0)
        losses = [step(cast(b))["loss"].item() for b in batches]
        return losses, [p.detach().double() for p in twin.parameters()]

    runs = {}
    twin = copy.deepcopy(model).double()
    step = make_step(twin, bench_zoo.make_sgd(twin.parameters()))
    runs["float64"] = run(twin, step, lambda b: {"x": b["x"].double(), "t": b["t"]})
    twin = copy.deepcopy(model)
    runs["eager"] = run(twin, make_step(twin, bench_zoo.make_sgd(twin.parameters())))
    twin = copy.deepcopy(model)
    step = make_step(torch.compile(twin), bench_zoo.make_sgd(twin.parameters()))
    runs["torch.compile"] = run(twin, step)
    for preset in presets:
        twin = copy.deepcopy(model)
        context = Context(MNDevice("pfvm:cpu"))
        Context.switch_context(context)
        optimizer = bench_zoo.make_sgd(twin.parameters())
        registered(context, twin, optimizer)
        compiled = context.compile(
            make_step(twin, optimizer), batches[0], options={"option_json": preset}
        )
        losses, _ = run(twin, compiled)
        context.synchronize()  # the device's weights to the host model
        runs[f"mncore {preset}"] = (losses, [p.detach().double() for p in twin.parameters()])

    reference_losses, reference_weights = runs["float64"]
    report = {}
    for key, (losses, weights) in runs.items():
        report[key] = {
            "losses": losses,
            "loss_drift": [abs(a - b) for a, b in zip(losses, reference_losses, strict=True)],
            "weight_drift": max(
                (w - r).abs().max().item() for w, r in zip(weights, reference_weights, strict=True)
            ),
        }
    return report


def median_drift(reports: list[dict]) -> dict:
    """Per runner: the median over `reports` (one per seed) of each step's loss drift, and
    of the weight drift."""
    return {
        key: {
            "loss_drift": [
                statistics.median(r[key]["loss_drift"][i] for r in reports)
                for i in range(len(reports[0][key]["loss_drift"]))
            ],
            "weight_drift": statistics.median(r[key]["weight_drift"] for r in reports),
        }
        for key in reports[0]
        if key != "float64"
    }


def markdown_table(title: str, medians: dict) -> str:
    steps = len(next(iter(medians.values()))["loss_drift"])
    lines = [
        title,
        "",
        "| runner | " + " | ".join(f"step {i + 1}" for i in range(steps)) + " | weights |",
        "|---" * (steps + 2) + "|",
    ]
    for key, entry in medians.items():
        cells = " | ".join(f"{d:.1e}" for d in entry["loss_drift"])
        lines.append(f"| {key} | {cells} | {entry['weight_drift']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mlp"], choices=MODELS)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=3, help="batches drawn from seeds 1..N")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--preset", nargs="+", default=["O0", "O1"], help="names or JSON files")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/drift.json")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    results = {}
    for name in args.models:
        reports = [
            drift(name, args.batch, args.steps, args.image_size, args.preset, seed)
            for seed in range(1, args.seeds + 1)
        ]
        medians = median_drift(reports)
        results[name] = {
            "batch": args.batch,
            "threads": args.threads,
            "image_size": args.image_size,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "median_over_seeds": medians,
            "per_seed": reports,
        }
        title = (
            f"{name}, batch {args.batch}, median over {args.seeds} seeds: |loss - float64's| "
            "at each step, and max |weight - float64's| after the last"
        )
        print(markdown_table(title, medians) + "\n", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
