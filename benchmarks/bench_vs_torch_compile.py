"""A training step three ways in one process: eager, `torch.compile(model)`, and mncore.

For each model, batch size and thread count, one fresh subprocess (with an empty Inductor
cache) builds three copies of the model from the same seed and times the same step on the
same batch: zero_grad, forward, cross entropy, backward, `torch.optim.SGD(lr=0.01,
momentum=0.9)` (momentum buffers created up front, as device state must be):

- eager: the step as written;
- torch.compile: the same step around `torch.compile(model)` (default mode: Inductor compiles
  the forward and AOTAutograd's backward; cross entropy and the optimizer run eagerly);
- mncore: the whole step (optimizer included) compiled as one graph with `mncore_device`'s
  `Context.compile` at `--preset` (default O1) on `pfvm:cpu`. Several presets (names or
  preset JSON files) are timed side by side, one table row each: a before/after in one
  process.

After warm-up, the three are timed interleaved, in `--rounds` rounds of a few steps each
(about half a second of steps per round and runner); the table shows the medians in ms per
step, the ratios (mncore against torch.compile and against eager: above 1 means mncore is
faster), the same ratios of the process's CPU time per step (at 1 thread, time the process
was descheduled by other jobs on a shared machine does not count there), and the cold
compile seconds of torch.compile (its first step) and of mncore. A preset whose graph
Inductor could not compile runs op by op (an InductorFallbackWarning): its row says so, as
its step time is then the interpreter's.
Before either compiles, the process compiles a tiny function both ways, so that neither
pays Inductor's one-off costs (its import, the CPU probes, building the precompiled header):
the compile seconds are those of a new model on a machine that has compiled before.
"loss diff" compares torch.compile's and mncore's losses with eager's, at their first step
(the same weights, batch and random seed: rounding only, except that torch.compile's
dropout draws from Inductor's own generator, other numbers) and at the last timed step
(after some tens of steps on one batch, where rounding differences have grown, and dropout
masks differ).

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
import warnings
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


def _warm_up_inductor(preset: str | None) -> None:
    """A tiny step compiled with torch.compile and (unless `preset` is None) at `preset`:
    Inductor's one-off costs are paid before the models' compiles."""
    import torch
    import torch.nn as nn

    from mncore_device import Context, MNDevice

    model = nn.Linear(8, 4)
    data = {"x": torch.randn(2, 8), "t": torch.randint(0, 4, (2,))}
    make_step(torch.compile(model), bench_zoo.make_sgd(model.parameters()))(data)
    if preset is None:
        return
    twin = copy.deepcopy(model)
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    optimizer = bench_zoo.make_sgd(twin.parameters())
    registered(context, twin, optimizer)
    context.compile(make_step(twin, optimizer), data, options={"option_json": preset})(data)


def measure(
    name: str,
    batch: int,
    image_size: int,
    rounds: int,
    presets: list[str],
    warm_up: bool = True,
    round_seconds: float = ROUND_SECONDS,
) -> dict:
    """Compile seconds and median ms per step of eager, torch.compile and mncore at each
    preset (runner "mncore <preset>"), interleaved. warm_up=False: no tiny compiles first
    (compile seconds then include Inductor's one-off costs)."""
    import torch

    from mncore_device import Context, InductorFallbackWarning, MNDevice
    from mncore_device.presets import load_preset

    inductor = [p for p in presets if load_preset(p).executor == "inductor"]
    if warm_up:
        _warm_up_inductor(inductor[0] if inductor else None)
    model, data = model_and_batch(name, batch, image_size)
    eager_model, tc_model = copy.deepcopy(model), copy.deepcopy(model)
    runners = {"eager": make_step(eager_model, bench_zoo.make_sgd(eager_model.parameters()))}
    compile_seconds = {}
    fell_back: dict[str, str] = {}  # an Inductor preset that ran its graph op by op: why

    compiled_model = torch.compile(tc_model)
    tc_step = make_step(compiled_model, bench_zoo.make_sgd(tc_model.parameters()))
    start = time.perf_counter()
    torch.manual_seed(0)  # each runner's first step draws from the same seed
    first = {"torch.compile": tc_step(data)["loss"].item()}  # compiles forward and backward
    compile_seconds["torch.compile"] = time.perf_counter() - start
    runners["torch.compile"] = tc_step

    for preset in presets:
        twin = copy.deepcopy(model)
        context = Context(MNDevice("pfvm:cpu"))
        Context.switch_context(context)
        optimizer = bench_zoo.make_sgd(twin.parameters())
        registered(context, twin, optimizer)
        step = make_step(twin, optimizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", InductorFallbackWarning)
            compiled = context.compile(step, data, options={"option_json": preset})
        for warning in caught:  # timed all the same, and marked in the table
            if issubclass(warning.category, InductorFallbackWarning):
                fell_back[f"mncore {preset}"] = str(warning.message).split("\n")[0]
                print(f"{name}: {warning.message}", file=sys.stderr, flush=True)
        compile_seconds[f"mncore {preset}"] = compiled.compile_seconds
        runners[f"mncore {preset}"] = compiled
    for key in runners.keys() - {"torch.compile"}:  # torch.compile's took one step: now all
        torch.manual_seed(0)
        first[key] = runners[key](data)["loss"].item()

    start = time.perf_counter()
    for _ in range(2):  # warm-up; also how many steps make a round
        for run in runners.values():
            run(data)["loss"].item()
    per_step = (time.perf_counter() - start) / 2 / len(runners)
    steps = max(1, round(round_seconds / per_step))
    times: dict[str, list[float]] = {k: [] for k in runners}
    cpu_times: dict[str, list[float]] = {k: [] for k in runners}
    losses: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for key, run in runners.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(steps):
                loss = run(data)["loss"]
            losses[key].append(loss.item())
            times[key].append((time.perf_counter() - start) / steps)
            cpu_times[key].append((time.process_time() - cpu_start) / steps)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {
        "presets": presets,
        "steps_per_round": steps,
        "rounds": rounds,
        "ms_per_step": ms,
        "round_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
        "cpu_ms_per_step": {k: 1e3 * statistics.median(v) for k, v in cpu_times.items()},
        "compile_seconds": compile_seconds,
        "fell_back": fell_back,
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
    parser.add_argument("--preset", nargs="+", default=["O1"], help="names or JSON files")
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
                child += ["--preset", *args.preset, "--_child", str(batch), str(threads)]
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
    """One row per model, batch, thread count and preset."""
    head = [
        "model", "batch", "threads", "preset", "eager (ms)", "torch.compile (ms)", "mncore (ms)",
        "mncore vs torch.compile", "mncore vs eager", "the same in CPU time",
        "compile tc / mncore (s)",
        "loss diff vs eager, tc / mncore: first step; last",
    ]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] if header else []
    for r in report.values():
        ms, cpu, cs = r["ms_per_step"], r["cpu_ms_per_step"], r["compile_seconds"]
        first, last = r["first_loss_diff"], r["last_loss_diff"]
        tc = "torch.compile"
        for preset in r["presets"]:
            mn = f"mncore {preset}"
            name = Path(preset).stem
            if mn in r.get("fell_back", {}):  # not the preset's code: its interpreter
                name += " (**fell back to op by op**)"
            cells = [
                r["model"], str(r["batch"]), str(r["threads"]), name,
                f"{ms['eager']:.1f}", f"{ms[tc]:.1f}", f"{ms[mn]:.1f}",
                f"{ms[tc] / ms[mn]:.2f}x", f"{ms['eager'] / ms[mn]:.2f}x",
                f"{cpu[tc] / cpu[mn]:.2f}x, {cpu['eager'] / cpu[mn]:.2f}x",
                f"{cs[tc]:.1f} / {cs[mn]:.1f}",
                f"{first[tc]:.1g} / {first[mn]:.1g}; {last[tc]:.1g} / {last[mn]:.1g}",
            ]  # fmt: skip
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
