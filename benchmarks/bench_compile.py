"""Where an O1 compile of a training step goes: "first" (an empty Inductor cache: the first
compile on a machine, which also builds Inductor's CPU-feature probes, 10 small C++ programs),
"cold" (a new model on a cache that has compiled another one) and "warm" (the same model
again, in a new process on the same cache).

Each phase is timed in a fresh process: importing TorchInductor, tracing (trace_step: the
make_fx trace of the whole step and its functionalization), and building the executor
(build_executor: AOT lowering, Inductor's codegen and the C++ build, or a cache load), with
torch's own phase timers (torch._dynamo.utils.compilation_time_metrics) inside the last. Models: the
MN-Core tutorial MLP (1024-256-10, batch 64, SGD momentum) and torchvision's ResNet-18 on
32x32 inputs (batch 32).

    python benchmarks/bench_compile.py [--models mlp resnet18] [--preset O1] [--out FILE]
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


def _model_and_batch(name: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "tiny":  # compiled first to prime the cache for the "cold" run
        return nn.Sequential(nn.Linear(8, 4)), torch.randn(4, 8), torch.randint(0, 4, (4,))
    if name == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))
        return model, torch.randn(64, 1, 32, 32), torch.randint(0, 10, (64,))
    if name == "resnet18":
        import torchvision

        model = torchvision.models.resnet18(num_classes=10)
        return model, torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    raise ValueError(name)


def run_child(name: str, preset: str) -> dict:
    """One compile in this process; seconds per phase."""
    start = time.perf_counter()
    import torch

    torch.set_num_threads(2)
    import mncore_device
    from mncore_device import emulator

    imports = time.perf_counter() - start
    start = time.perf_counter()
    import torch._inductor.compile_fx  # noqa: F401  (Inductor's import, paid by the first compile)

    inductor_import = time.perf_counter() - start

    phases: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t

        return wrapper

    emulator.trace_step = timed("trace (make_fx + functionalize)", emulator.trace_step)
    emulator.build_executor = timed("build executor (Inductor)", emulator.build_executor)

    model, x, t = _model_and_batch(name)
    context = mncore_device.Context(mncore_device.MNDevice("pfvm:cpu"))
    mncore_device.Context.switch_context(context)
    from mncore_lightning.optimizers import MNCoreSGD  # the tutorial's optimizer

    optimizer = MNCoreSGD(model.parameters(), 0.01, 0.9, 0.0)
    registered(context, model, optimizer)
    step = make_step(model, optimizer)

    start = time.perf_counter()
    compiled = context.compile(step, {"x": x, "t": t}, options={"option_json": preset})
    total = time.perf_counter() - start
    compiled({"x": x, "t": t})  # the first call runs (nothing is compiled lazily)
    from torch._dynamo.utils import compilation_time_metrics

    inductor = {k: sum(v) for k, v in compilation_time_metrics.items() if v}
    top = {k: round(v, 2) for k, v in sorted(inductor.items(), key=lambda kv: -kv[1])[:8]}
    return {
        "imports (torch, mncore_device)": round(imports, 2),
        "import torch._inductor": round(inductor_import, 2),
        "compile total": round(total, 2),
        **{k: round(v, 2) for k, v in phases.items()},
        "inductor phases (torch's timers, top 8)": top,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet18"])
    parser.add_argument("--preset", default="O1")
    parser.add_argument("--out", default="benchmarks/results/compile.json")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        print("RESULT " + json.dumps(run_child(args._child, args.preset)))
        return {}
    report: dict = {"preset": args.preset, "threads": 2, "models": {}}
    for name in args.models:
        cache = tempfile.mkdtemp(prefix="bench_compile_")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore"}
        runs = {}
        # "first" and "cold" compile the model on separate empty caches, "cold" after a tiny
        # model; "warm" finds the "cold" one's cache entries
        for kind, model in (("first", name), ("prime", "tiny"), ("cold", name), ("warm", name)):
            if kind == "prime":
                env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_compile_")
            out = subprocess.run(
                [sys.executable, __file__, "--_child", model, "--preset", args.preset],
                capture_output=True,
                text=True,
                env=env,
            )
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{name} {kind} failed:\n{out.stderr[-3000:]}")
            if kind != "prime":
                runs[kind] = json.loads(line[len("RESULT ") :])
                print(f"{name} {kind}: {json.dumps(runs[kind])}")
        report["models"][name] = runs
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
