"""torchvision's classifiers on the device layer: parity with eager, trace/compile time, speed.

For each model (weights=None, num_classes=10, batch 4, SGD lr 0.01 momentum 0.9, the
MLSDK-style loop of zero_grad / forward / backward / step, compiled with `context.compile`
on `pfvm:cpu`), in a fresh subprocess with an empty Inductor cache:

- parity: `--parity-steps` steps at O0 against an eager copy on the same batches, with the
  same RNG seed (dropout and stochastic depth draw the same masks): the largest absolute
  differences of the losses, the parameters and the buffers (0.0 everywhere = bit-identical);
- trace seconds (the O0 compile: tracing and graph passes, no code generation) and compile
  seconds per preset (cold Inductor cache; they include tracing);
- steps/s per preset against eager, timed interleaved in rounds of `--steps` steps (medians).

    python benchmarks/bench_zoo.py [--models resnet18 vit_small ...] [--presets O0 O1 O2]
        [--steps 10 --rounds 3 --parity-steps 3 --threads 2 --out benchmarks/results/zoo.json]

Results are merged into the JSON file by model and key, so the list can be measured in parts
(a parity-only run, `--presets` with no names, keeps a model's speed figures).

One intra-op thread by default: on a shared machine, two OpenMP threads per process stall each
other (a thread waits at every op's barrier for one that is descheduled), and steps slow down
by 10x or more, eager and compiled alike, in a way that no interleaving cancels.
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

# model name -> (constructor keyword arguments, input side in pixels)
MODELS: dict[str, tuple[dict, int]] = {
    "resnet18": ({}, 32),
    "resnet50": ({}, 32),
    "mobilenet_v2": ({}, 32),
    "mobilenet_v3_small": ({}, 32),
    "efficientnet_b0": ({}, 32),
    "squeezenet1_1": ({}, 64),
    "shufflenet_v2_x0_5": ({}, 32),
    "mnasnet0_5": ({}, 32),
    "densenet121": ({}, 32),
    "googlenet": ({"aux_logits": False, "init_weights": True}, 32),
    "regnet_y_400mf": ({}, 32),
    "convnext_tiny": ({}, 32),
    "vit_small": ({}, 32),  # VisionTransformer(32, patch 8, 2 layers, 4 heads, width 64)
    "swin_t": ({}, 32),
    "alexnet": ({}, 64),
    "vgg11_bn": ({}, 32),
    "vit_b_16": ({}, 224),  # not in the default list: for trace-time measurements
}
DEFAULT_MODELS = [m for m in MODELS if m != "vit_b_16"]
BATCH = 4
LR, MOMENTUM = 0.01, 0.9


def build_model(name: str, image_size: int = 32):
    """The torchvision model `name`, initialized from seed 0 (`image_size`: vit_small's input
    side; the other models take any size their downsampling allows)."""
    import torch
    import torchvision

    torch.manual_seed(0)
    kwargs, _ = MODELS[name]
    if name == "vit_small":
        return torchvision.models.VisionTransformer(
            image_size=image_size, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
            num_classes=10,
        )  # fmt: skip
    return torchvision.models.get_model(name, weights=None, num_classes=10, **kwargs)


def batches(name: str, n: int) -> list[dict]:
    import torch

    side = MODELS[name][1]
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "x": torch.randn(BATCH, 3, side, side, generator=generator),
            "t": torch.randint(0, 10, (BATCH,), generator=generator),
        }
        for _ in range(n)
    ]


def make_sgd(params):
    """torch.optim.SGD with its momentum buffers created up front (device state)."""
    import torch

    params = list(params)
    optimizer = torch.optim.SGD(params, LR, MOMENTUM)
    for p in params:
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


def max_diff(a, b) -> float:
    if a.dtype.is_floating_point:
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return float((a != b).any())


def parity(name: str, steps: int) -> dict:
    """O0 against eager over `steps` steps, same batches, same seed."""
    import copy

    import torch

    from mncore_device import Context, MNDevice

    model = build_model(name)
    reference = copy.deepcopy(model)
    data = batches(name, steps)

    torch.manual_seed(123)
    eager_step = make_step(reference, make_sgd(reference.parameters()))
    eager_losses = [eager_step(b)["loss"].item() for b in data]

    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    optimizer = make_sgd(model.parameters())
    registered(context, model, optimizer)
    torch.manual_seed(123)
    start = time.perf_counter()
    compiled = context.compile(make_step(model, optimizer), data[0], options={"option_json": "O0"})
    trace_seconds = time.perf_counter() - start
    losses = [compiled(b)["loss"].item() for b in data]
    context.synchronize()
    params = dict(reference.named_parameters())
    buffers = dict(reference.named_buffers())
    return {
        "trace_seconds": trace_seconds,
        "graph_nodes": compiled_graph_size(compiled),
        "loss_max_diff": max(abs(a - b) for a, b in zip(losses, eager_losses, strict=True)),
        "param_max_diff": max(max_diff(p, params[n]) for n, p in model.named_parameters()),
        "buffer_max_diff": max(
            (max_diff(b, buffers[n]) for n, b in model.named_buffers()), default=0.0
        ),
        "losses": losses,
        "eager_losses": eager_losses,
    }


def compiled_graph_size(compiled) -> int | None:
    """Number of nodes of the compiled graph, where the executor exposes it (O0: the module)."""
    gm = getattr(getattr(compiled, "_executor", None), "__self__", None)
    return len(gm.graph.nodes) if gm is not None and hasattr(gm, "graph") else None


def speed(name: str, presets: list[str], steps: int, rounds: int) -> dict:
    """Steps/s of eager and of each preset, timed interleaved; compile seconds per preset."""
    import copy

    from mncore_device import Context, MNDevice

    model = build_model(name)
    reference = copy.deepcopy(model)
    data = batches(name, 1)[0]
    eager = make_step(reference, make_sgd(reference.parameters()))
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    optimizer = make_sgd(model.parameters())
    registered(context, model, optimizer)
    runners = {"eager": eager}
    result: dict = {"compile_seconds": {}}
    for preset in presets:
        compiled = context.compile(
            make_step(model, optimizer), data, options={"option_json": preset}
        )
        result["compile_seconds"][preset] = compiled.compile_seconds
        runners[preset] = compiled
    times: dict[str, list[float]] = {k: [] for k in runners}
    for run in runners.values():  # warm-up
        for _ in range(2):
            run(data)["loss"].item()
    for _ in range(rounds):
        for key, run in runners.items():
            start = time.perf_counter()
            for _ in range(steps):
                loss = run(data)["loss"]
            loss.item()
            times[key].append((time.perf_counter() - start) / steps)
    per_step = {k: statistics.median(v) for k, v in times.items()}
    result["steps_per_second"] = {k: 1.0 / v for k, v in per_step.items()}
    result["speedup_vs_eager"] = {k: per_step["eager"] / v for k, v in per_step.items()}
    return result


def child(name: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    report = {"input": [BATCH, 3, MODELS[name][1], MODELS[name][1]]}
    if args.parity_steps:
        report["parity"] = parity(name, args.parity_steps)
    if args.presets:
        report.update(speed(name, args.presets, args.steps, args.rounds))
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--presets", nargs="*", default=["O0", "O1", "O2"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parity-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/zoo.json")
    parser.add_argument("--table", action="store_true", help="print --out as a markdown table")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(Path(args.out).read_text())))
        return {}
    if args._child:
        print("RESULT " + json.dumps(child(args._child, args)))
        return {}
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.is_file() else {}
    passthrough = [
        "--steps", str(args.steps), "--rounds", str(args.rounds),
        "--parity-steps", str(args.parity_steps), "--threads", str(args.threads),
        "--presets", *args.presets,
    ]  # fmt: skip
    for name in args.models:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore"}
            done = subprocess.run(
                [sys.executable, __file__, "--_child", name, *passthrough],
                capture_output=True,
                text=True,
                env=env,
            )
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            report[name] = {"error": done.stderr.strip().splitlines()[-1:]}
            print(f"{name}: FAILED\n{done.stderr[-3000:]}", flush=True)
            continue
        entry = report.setdefault(name, {})
        for key, value in json.loads(line[len("RESULT ") :]).items():
            both = isinstance(value, dict) and isinstance(entry.get(key), dict)
            entry[key] = {**entry[key], **value} if both else value
        print(summary(name, report[name]), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    return report


def summary(name: str, r: dict) -> str:
    text = name
    if "parity" in r:
        p = r["parity"]
        text += (
            f"  trace {p['trace_seconds']:.1f}s  max|diff| loss {p['loss_max_diff']:.3g}"
            f" params {p['param_max_diff']:.3g} buffers {p['buffer_max_diff']:.3g}"
        )
    for preset, value in r.get("speedup_vs_eager", {}).items():
        if preset != "eager":
            text += f"  {preset} {value:.2f}x ({r['compile_seconds'][preset]:.0f}s)"
    return text


def markdown_table(report: dict) -> str:
    """One row per model: parity at O0, trace seconds, compile seconds and speed per preset."""
    presets = sorted({p for r in report.values() for p in r.get("compile_seconds", {})})
    head = ["model", "input", "O0 max abs diff (loss, params, buffers)", "trace (s)"]
    head += [f"{p} compile (s)" for p in presets if p != "O0"]
    head += ["eager steps/s"] + [f"{p} / eager" for p in presets]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in report.items():
        p = r.get("parity", {})
        diffs = [p.get(k) for k in ("loss_max_diff", "param_max_diff", "buffer_max_diff")]
        parity = "" if None in diffs else ", ".join(f"{d:.3g}" for d in diffs)
        cells = [name, "x".join(map(str, r.get("input", []))), parity]
        cells.append(f"{p['trace_seconds']:.1f}" if p else "")
        cells += [
            f"{r['compile_seconds'][q]:.0f}" if q in r.get("compile_seconds", {}) else ""
            for q in presets
            if q != "O0"
        ]
        speed = r.get("steps_per_second", {})
        cells.append(f"{speed['eager']:.1f}" if speed else "")
        cells += [
            f"{r['speedup_vs_eager'][q]:.2f}x" if q in r.get("speedup_vs_eager", {}) else ""
            for q in presets
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
