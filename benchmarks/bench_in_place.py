"""Before/after of the Inductor executor's in-place state update, side by side in one process.

For each model this compiles the same step at O1 twice, against two copies of the model in
two Contexts: "out_of_place" as the executor was before (the graph returns every new weight
and momentum as a fresh tensor, and Inductor fuses `momentum * buf + grad` into an addmm),
and "in_place" as it is now (new state written into the device tensors, matmuls kept apart
from full-size adds). Eager and both compiled steps are then timed interleaved, in rounds of
`--steps` steps; medians. Diagnosis only: it switches the executor's behaviour through
internals (`emulator.build_executor`, `executors._KEEP_MATMULS_APART`).

    python benchmarks/bench_in_place.py [--models alexnet vgg11_bn resnet18 vit_small mlp bn_mlp]
        [--rounds 5 --threads 1 --out benchmarks/results/in_place.json]

Each model runs in a fresh subprocess with an empty Inductor cache. Models are bench_zoo's
(batch 4) plus the MLSDK tutorial MLP 1024-256-10 and a BatchNorm variant (batch 64).
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

sys.path.insert(0, str(Path(__file__).parent))
import bench_zoo  # noqa: E402
from device_steps import make_step, registered  # noqa: E402

STEPS = {"alexnet": 5, "vgg11_bn": 3, "resnet18": 10, "vit_small": 50, "mlp": 300, "bn_mlp": 300}


def model_and_batch(name: str):
    import torch
    import torch.nn as nn

    if name in ("mlp", "bn_mlp"):
        torch.manual_seed(0)
        middle = [nn.BatchNorm1d(256)] if name == "bn_mlp" else []
        model = nn.Sequential(nn.Linear(1024, 256), *middle, nn.ReLU(), nn.Linear(256, 10))
        generator = torch.Generator().manual_seed(1)
        batch = {
            "x": torch.randn(64, 1024, generator=generator),
            "t": torch.randint(0, 10, (64,), generator=generator),
        }
        return model, batch
    return bench_zoo.build_model(name), bench_zoo.batches(name, 1)[0]


def measure(name: str, steps: int, rounds: int) -> dict:
    from mncore_device import Context, MNDevice, emulator
    from mncore_device.runtime import executors

    model, batch = model_and_batch(name)
    reference = copy.deepcopy(model)
    runners = {"eager": make_step(reference, bench_zoo.make_sgd(reference.parameters()))}
    build = emulator.build_executor
    compile_seconds = {}
    for variant in ("out_of_place", "in_place"):
        before = variant == "out_of_place"
        # out of place: no mutated_inputs, so the graph returns new state; no unfusing pass
        emulator.build_executor = (lambda *a, **k: build(*a[:6])) if before else build
        executors._KEEP_MATMULS_APART = not before
        twin = copy.deepcopy(model)
        context = Context(MNDevice("pfvm:cpu"))
        Context.switch_context(context)
        optimizer = bench_zoo.make_sgd(twin.parameters())
        registered(context, twin, optimizer)
        step = make_step(twin, optimizer)
        runners[variant] = context.compile(step, batch, options={"option_json": "O1"})
        compile_seconds[variant] = runners[variant].compile_seconds
    emulator.build_executor, executors._KEEP_MATMULS_APART = build, True
    times: dict[str, list[float]] = {k: [] for k in runners}
    for run in runners.values():
        for _ in range(2):
            run(batch)["loss"].item()
    for _ in range(rounds):
        for key, run in runners.items():
            start = time.perf_counter()
            for _ in range(steps):
                loss = run(batch)["loss"]
            loss.item()
            times[key].append((time.perf_counter() - start) / steps)
    per_step = {k: statistics.median(v) for k, v in times.items()}
    return {
        "steps_per_round": steps,
        "rounds": rounds,
        "compile_seconds": compile_seconds,
        "steps_per_second": {k: 1.0 / v for k, v in per_step.items()},
        "speedup_vs_eager": {k: per_step["eager"] / v for k, v in per_step.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(STEPS), choices=list(STEPS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/in_place.json")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        import torch

        torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps(measure(args._child, STEPS[args._child], args.rounds)))
        return
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.is_file() else {}
    report["machine"] = f"{os.cpu_count()} CPUs shared with other jobs, {args.threads} thread(s)"
    for name in args.models:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore"}
            command = [sys.executable, __file__, "--_child", name, "--rounds", str(args.rounds)]
            command += ["--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True, env=env)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: FAILED\n{done.stderr[-3000:]}", flush=True)
            continue
        report[name] = json.loads(line[len("RESULT ") :])
        ratios = report[name]["speedup_vs_eager"]
        print(
            f"{name}: O1/eager out of place {ratios['out_of_place']:.2f}x, "
            f"in place {ratios['in_place']:.2f}x",
            flush=True,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
