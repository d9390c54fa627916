"""Cold compile vs `load_codegen_dir` of an Inductor preset, each in a fresh process.

Compiles a training step (the tutorial MLP 1024-256-10, batch 64, or a torchvision ResNet-18,
batch 8 of 3x32x32; SGD with momentum) into a codegen dir with an empty Inductor cache, then
loads that dir in new processes, three times each way, and prints the seconds of each (the
call itself, Inductor's imports included) and the ratio of the compile to the median load:

* cold, trusted: an empty Inductor cache per load (a fresh machine) and
  `trust_compiled_code=True`: the dir's compiled code runs, nothing is compiled;
* warm: the compile's Inductor cache, not trusting the dir: the graph is compiled again and
  Inductor's cache has it;
* cold, untrusted (--untrusted): an empty cache, not trusting the dir: a full compile.

Every load's first step must give the compile's loss (`same_loss`).

    python benchmarks/bench_codegen.py [--model mlp|resnet18] [--preset O1] [--untrusted]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # device_steps.py, next to this script
from device_steps import make_step, registered  # noqa: E402


def run_one(mode: str, model_name: str, preset: str, codegen: str) -> dict:
    import torch
    import torch.nn as nn

    from mncore_device import Context, MNDevice

    torch.manual_seed(0)
    if model_name == "mlp":
        model = nn.Sequential(nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))
        batch = {"x": torch.randn(64, 1024), "t": torch.randint(0, 10, (64,))}
    else:
        import torchvision

        model = torchvision.models.resnet18(num_classes=10)
        batch = {"x": torch.randn(8, 3, 32, 32), "t": torch.randint(0, 10, (8,))}
    optimizer = torch.optim.SGD(model.parameters(), 0.1, 0.9)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    registered(context, model, optimizer)
    step = make_step(model, optimizer)

    start = time.perf_counter()
    if mode == "compile":
        compiled = context.compile(step, batch, codegen, options={"option_json": preset})
    else:
        trusted = mode == "cold-trusted"
        compiled = context.load_codegen_dir(codegen, trust_compiled_code=trusted)
    seconds = time.perf_counter() - start
    return {"mode": mode, "seconds": round(seconds, 2), "loss": compiled(batch)["loss"].item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "resnet18"], default="mlp")
    parser.add_argument("--preset", default="O1")
    parser.add_argument("--untrusted", action="store_true", help="also time untrusted cold loads")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child[0], args.model, args.preset, args.child[1])))
        return
    modes = ["cold-trusted", "warm"] + (["cold-untrusted"] if args.untrusted else [])
    results: dict[str, list[dict]] = {mode: [] for mode in ["compile", *modes]}
    with tempfile.TemporaryDirectory() as tmp:
        codegen = str(Path(tmp) / "codegen")
        runs = [("compile", "shared")] + [(m, "shared" if m == "warm" else None) for m in modes] * 3
        for index, (mode, cache) in enumerate(runs):
            cache_dir = Path(tmp) / (cache or f"empty-{index}") / "inductor"
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
            command = [sys.executable, __file__, "--model", args.model, "--preset", args.preset]
            out = subprocess.run(
                [*command, "--child", mode, codegen], env=env, capture_output=True, text=True
            )
            if out.returncode:
                sys.exit(out.stderr)
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[mode][-1]))
    (compiled,) = results["compile"]
    summary = {"model": args.model, "preset": args.preset, "compile_s": compiled["seconds"]}
    for mode in modes:
        median = statistics.median(r["seconds"] for r in results[mode])
        summary[f"{mode}_load_median_s"] = median
        summary[f"{mode}_ratio"] = round(compiled["seconds"] / median, 1) if median else None
    summary["same_loss"] = all(r["loss"] == compiled["loss"] for m in modes for r in results[m])
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
