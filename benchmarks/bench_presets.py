"""What each compile preset costs and gives: compile seconds (cold cache) and steps/s.

Compiles the MN-Core tutorial's training step (MLP 1024-256-10, batch 64, MNCoreSGD(0.1, 0.9,
0.0)) with every preset, each in a fresh subprocess with an empty Inductor cache, and times
steady-state calls of the compiled step on `pfvm:cpu` with 2 threads.

    python benchmarks/bench_presets.py [--presets debug O0 O1 O2 O3 O4] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # device_steps.py, next to this script
from device_steps import make_step, registered  # noqa: E402


def run_one(preset: str, steps: int) -> dict:
    import torch

    from mncore_device import Context, MNDevice
    from mncore_lightning.optimizers import MNCoreSGD

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(1024, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )
    context = Context(MNDevice("pfvm:cpu"))
    optimizer = MNCoreSGD(model.parameters(), 0.1, 0.9, 0.0)
    registered(context, model, optimizer)
    step = make_step(model, optimizer)

    batch = {"x": torch.randn(64, 1, 32, 32), "t": torch.randint(0, 10, (64,))}
    compiled = context.compile(step, batch, options={"option_json": preset})
    for _ in range(20):
        compiled(batch)
    start = time.perf_counter()
    for _ in range(steps):
        compiled(batch)
    compiled(batch)["loss"].item()
    return {
        "compile_seconds": compiled.compile_seconds,
        "steps_per_second": steps / (time.perf_counter() - start),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["debug", "O0", "O1", "O2", "O3", "O4"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="benchmarks/results/presets.json")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        print("RESULT " + json.dumps(run_one(args._child, args.steps)))
        return {}
    report = {}
    for preset in args.presets:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore"}
            out = subprocess.run(
                [sys.executable, __file__, "--_child", preset, "--steps", str(args.steps)],
                capture_output=True,
                text=True,
                env=env,
            )
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{preset} failed:\n{out.stderr[-3000:]}")
        report[preset] = json.loads(line[len("RESULT ") :])
        r = report[preset]
        print(
            f"{preset:<6} compile {r['compile_seconds']:7.2f} s   {r['steps_per_second']:8.0f} steps/s"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
