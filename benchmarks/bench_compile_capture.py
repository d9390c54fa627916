"""`Context.compile` of an MLSDK-style training step, traced by make_fx (capture="trace") and
captured by TorchDynamo (capture="dynamo", the default), side by side.

The step is the MLSDK tutorial's: the 1024-256-10 MLP, batch 64, torch.optim.SGD with
momentum, `zero_grad`, `loss.backward()`, `step` inside the compiled function. For each mode,
in a fresh process each time, on an empty Inductor cache (cold: nothing of Dynamo, Inductor or
the model built before):

  - compile_s: the wall time of `context.compile(...)`;
  - call_us: the median host time of one compiled call (O0 interpreter included), over
    `--calls` calls after 20 warm-up calls.

    python benchmarks/bench_compile_capture.py [--preset O0] [--repeats 3] [--calls 200]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("trace", "dynamo")


def one_run(mode: str, preset: str, calls: int) -> dict[str, float]:
    import time

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from mncore_device import (
        Context,
        MNDevice,
        set_buffer_name_in_optimizer,
        set_tensor_name_in_module,
    )

    torch.manual_seed(0)
    torch.set_num_threads(1)
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    model = nn.Sequential(nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    set_tensor_name_in_module(model, "model")
    for p in model.parameters():
        context.register_param(p)
    set_buffer_name_in_optimizer(optimizer, "optimizer")
    context.register_optimizer_buffers(optimizer)

    def train_step(inputs):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs["x"]), inputs["t"])
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    sample = {"x": torch.randn(64, 1024), "t": torch.randint(0, 10, (64,))}
    start = time.perf_counter()
    compiled = context.compile(train_step, sample, options={"option_json": preset}, capture=mode)
    compile_s = time.perf_counter() - start
    for _ in range(20):
        compiled(sample)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        compiled(sample)
        times.append(time.perf_counter() - start)
    return {"compile_s": compile_s, "call_us": statistics.median(times) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="O0")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.child, args.preset, args.calls)))
        return
    root = HERE.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'device'}"}
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:  # interleaved: the machine's load hits both alike
            command = [sys.executable, __file__, "--child", mode, "--preset", args.preset]
            command += ["--calls", str(args.calls)]
            with tempfile.TemporaryDirectory() as cache:  # Inductor's cache: cold for each
                child_env = {**env, "TORCHINDUCTOR_CACHE_DIR": cache}
                output = subprocess.run(
                    command, env=child_env, capture_output=True, text=True, check=True
                )
            runs[mode].append(json.loads(output.stdout.strip().splitlines()[-1]))
    summary = {
        mode: {
            key: statistics.median(run[key] for run in runs[mode])
            for key in ("compile_s", "call_us")
        }
        for mode in MODES
    }
    summary["ratio_compile"] = summary["dynamo"]["compile_s"] / summary["trace"]["compile_s"]
    result = {"preset": args.preset, "repeats": args.repeats, "summary": summary, "runs": runs}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
