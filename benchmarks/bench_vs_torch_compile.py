"""A training step three ways in one process: eager, `torch.compile(model)`, and mncore.

For each model, batch size and thread count, one fresh subprocess (with an empty Inductor
cache) builds three copies of the model from the same seed and times the same step on the
same batch: zero_grad, forward, cross entropy, backward, `torch.optim.SGD(lr=0.01,
momentum=0.9)` (momentum buffers created up front, as device state must be):

- eager: the step as written;
- torch.compile: the same step around `torch.compile(model)` (default mode: Inductor compiles
  the forward and AOTAutograd's backward; cross entropy and the optimizer run eagerly);
- mncore: the whole step (optimizer included) compiled as one graph with `mncore_device`'s
  `Context.compile` at `--preset` (default O1) on `pfvm:cpu`.

After warm-up, the three are timed interleaved, in `--rounds` rounds of a few steps each
(about half a second of steps per round and runner); the table shows the medians in ms per
step, the ratios (mncore against torch.compile and against eager: above 1 means mncore is
faster) and the cold compile seconds of torch.compile (its first step) and of mncore.
Before either compiles, the process compiles a tiny function both ways, so that neither
pays Inductor's one-off costs (its import, the CPU probes, building the precompiled header):
the compile seconds are those of a new model on a machine that has compiled before.
"loss diff" compares torch.compile's and mncore's losses with eager's, at their first step
(the same weights and batch: rounding only) and at the last timed step (after some tens of
steps on one batch, where rounding differences have grown).

    python benchmarks/bench_vs_torch_compile.py [--models resnet18 mobilenet_v2 mlp ...]
        [--batch 32 4] [--threads 1 2] [--image-size 32] [--rounds 5] [--preset O1]
        [--out benchmarks/results/vs_torch_compile.json]

Results are merged into `--out` by "model/batch/threads"; `--table` prints that file.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the helpers next to this script
import bench_zoo  # noqa: E402
from device_steps import make_step, registered, tutorial_mlp  # noqa: E402

MODELS = [
    "resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0",
    "convnext_tiny", "densenet121", "vit_small", "mlp",
]  # fmt: skip
ROUND_SECONDS = 0.5  # steps per round: about this long per runner


def model_and_batch(name: str, batch: int, image_size: int):
    """The model (from seed 0) and one batch `{"x", "t"}` of `batch` samples (seed 1)."""
    import torch

    model = tutorial_mlp() if name == "mlp" else bench_zoo.build_model(name, image_size)
    shape = (1024,) if name == "mlp" else (3, image_size, image_size)
    generator = torch.Generator().manual_seed(1)
    data = {
        "x": torch.randn(batch, *shape, generator=generator),
        "t": torch.randint(0, 10, (batch,), generator=generator),
    }
    return model, data


def _warm_up_inductor(preset: str) -> None:
    """A tiny step compiled both ways: Inductor's one-off costs are paid before the models'."""
    import torch
    import torch.nn as nn

    from mncore_device import Context, MNDevice

    model = nn.Linear(8, 4)
    data = {"x": torch.randn(2, 8), "t": torch.randint(0, 4, (2,))}
    make_step(torch.compile(model), bench_zoo.make_sgd(model.parameters()))(data)
    twin = copy.deepcopy(model)
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    optimizer = bench_zoo.make_sgd(twin.parameters())
    registered(context, twin, optimizer)
    context.compile(make_step(twin, optimizer), data, options={"option_json": preset})(data)


def measure(name: str, batch: int, image_size: int, rounds: int, preset: str) -> dict:
    """Compile seconds and median ms per step of eager, torch.compile and mncore, interleaved."""
    import torch

    from mncore_device import Context, MNDevice

    _warm_up_inductor(preset)
    model, data = model_and_batch(name, batch, image_size)
    eager_model, tc_model = copy.deepcopy(model), copy.deepcopy(model)
    runners = {"eager": make_step(eager_model, bench_zoo.make_sgd(eager_model.parameters()))}
    compile_seconds = {}

    compiled_model = torch.compile(tc_model)
    tc_step = make_step(compiled_model, bench_zoo.make_sgd(tc_model.parameters()))
    start = time.perf_counter()
    first = {"torch.compile": tc_step(data)["loss"].item()}  # compiles forward and backward
    compile_seconds["torch.compile"] = time.perf_counter() - start
    runners["torch.compile"] = tc_step

    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    optimizer = bench_zoo.make_sgd(model.parameters())
    registered(context, model, optimizer)
    compiled = context.compile(make_step(model, optimizer), data, options={"option_json": preset})
    compile_seconds["mncore"] = compiled.compile_seconds
    runners["mncore"] = compiled
    for key in ("eager", "mncore"):  # torch.compile's took one step: all have now
        first[key] = runners[key](data)["loss"].item()

    start = time.perf_counter()
    for _ in range(2):  # warm-up; also how many steps make a round
        for run in runners.values():
            run(data)["loss"].item()
    per_step = (time.perf_counter() - start) / 2 / len(runners)
    steps = max(1, round(ROUND_SECONDS / per_step))
    times: dict[str, list[float]] = {k: [] for k in runners}
    losses: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for key, run in runners.items():
            start = time.perf_counter()
            for _ in range(steps):
                loss = run(data)["loss"]
            losses[key].append(loss.item())
            times[key].append((time.perf_counter() - start) / steps)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {
        "preset": preset,
        "steps_per_round": steps,
        "rounds": rounds,
        "ms_per_step": ms,
        "round_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
        "compile_seconds": compile_seconds,
        "mncore_vs_torch_compile": ms["torch.compile"] / ms["mncore"],
        "mncore_vs_eager": ms["eager"] / ms["mncore"],
        "first_loss_diff": {k: abs(first[k] - first["eager"]) for k in runners},
        "last_loss_diff": {k: abs(losses[k][-1] - losses["eager"][-1]) for k in runners},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--batch", nargs="+", type=int, default=[32, 4])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--preset", default="O1")
    parser.add_argument("--out", default="benchmarks/results/vs_torch_compile.json")
    parser.add_argument("--table", action="store_true", help="print --out as a Markdown table")
    parser.add_argument("--_child", nargs=3, type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.table:
        print(markdown_table(json.loads(out.read_text())))
        return {}
    if args._child:
        import torch

        batch, threads, image_size = args._child
        torch.set_num_threads(threads)
        result = measure(args.models[0], batch, image_size, args.rounds, args.preset)
        print("RESULT " + json.dumps(result))
        return result
    report = json.loads(out.read_text()) if out.is_file() else {}
    measured = {}
    for name in args.models:
        for batch in args.batch:
            for threads in args.threads:
                key = f"{name}/{batch}/{threads}"
                child = [sys.executable, __file__, "--models", name, "--rounds", str(args.rounds)]
                child += ["--preset", args.preset, "--_child", str(batch), str(threads)]
                child.append(str(args.image_size))
                with tempfile.TemporaryDirectory() as cache:
                    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                    env["PYTHONWARNINGS"] = "ignore"
                    done = subprocess.run(child, capture_output=True, text=True, env=env)
                line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(f"{key}: FAILED\n{done.stderr[-3000:]}", file=sys.stderr, flush=True)
                    continue
                entry = json.loads(line[len("RESULT ") :])
                entry.update(
                    model=name, batch=batch, threads=threads, image_size=args.image_size,
                    date=time.strftime("%Y-%m-%d", time.gmtime()),
                    machine=f"{os.cpu_count()} CPUs",
                )  # fmt: skip
                report[key] = measured[key] = entry
                print(markdown_table({key: entry}, header=not measured.keys() - {key}), flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(report, indent=1))
    if len(measured) > 1:
        print("\n" + markdown_table(measured))
    return measured


def markdown_table(report: dict, header: bool = True) -> str:
    """One row per model, batch and thread count."""
    head = [
        "model", "batch", "threads", "eager (ms)", "torch.compile (ms)", "mncore (ms)",
        "mncore vs torch.compile", "mncore vs eager", "compile tc / mncore (s)", "loss diff tc, mncore: first, last step",
    ]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] if header else []
    for r in report.values():
        ms, cs = r["ms_per_step"], r["compile_seconds"]
        cells = [
            r["model"], str(r["batch"]), str(r["threads"]),
            f"{ms['eager']:.1f}", f"{ms['torch.compile']:.1f}", f"{ms['mncore']:.1f}",
            f"{r['mncore_vs_torch_compile']:.2f}x", f"{r['mncore_vs_eager']:.2f}x",
            f"{cs['torch.compile']:.1f} / {cs['mncore']:.1f}",
            "; ".join(
                ", ".join(f"{r[d][k]:.1g}" for k in ("torch.compile", "mncore"))
                for d in ("first_loss_diff", "last_loss_diff")
            ),
        ]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
