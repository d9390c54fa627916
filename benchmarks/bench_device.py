"""Device-layer training loop vs a hand-written eager PyTorch loop, on the same batches.

For each model (the MLSDK tutorial MLP 1024-256-10, and 1024-256-BatchNorm-ReLU-10) this
trains an eager copy (zero_grad / forward / backward / step with torch.optim.SGD, momentum
0.9) and one compiled copy per preset (`context.compile(step, ...)` on `pfvm:cpu`), all on
the same pre-generated batches of 64 in the same order. After a warm-up it times `--steps`
steps `--repeats` times, interleaving eager and compiled, and reports medians.

Compile seconds are cold: the process starts with a fresh, empty TORCHINDUCTOR_CACHE_DIR,
and (unless --no-cold-subprocess) each Inductor preset is also compiled once in a fresh
process with its own empty cache, which is the number to quote for a first compile.

    python benchmarks/bench_device.py [--steps 200 --repeats 5 --presets O0 O1
                                       --models mlp bn_mlp --out benchmarks/results/device.json]

--profile adds, per compiled preset, where the time of one call goes: the executor alone
(the Inductor or interpreter graph call with prepared arguments) against the whole
`CompiledFunction.__call__` (argument checks, constants refresh, output dict).
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

# A real, cold compile: Inductor's on-disk cache starts empty (set before torch is imported).
if "--keep-inductor-cache" not in sys.argv:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_device_inductor_")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mncore_device import Context, MNDevice  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # device_steps.py, next to this script
from device_steps import make_step, registered  # noqa: E402

MODELS = {
    "mlp": "MLP 1024-256-10 (MLSDK tutorial)",
    "bn_mlp": "MLP 1024-256-BN-ReLU-10",
    "bn_mlp784": "MLP 784-128-BN-ReLU-10 (tracing notes)",
}
BATCH = 64
LR, MOMENTUM = 0.1, 0.9


def build_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))
    if name == "bn_mlp":
        return nn.Sequential(
            nn.Linear(1024, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 10)
        )
    if name == "bn_mlp784":
        return nn.Sequential(
            nn.Linear(784, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10)
        )
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)}")


def in_features(name: str) -> int:
    return 784 if name == "bn_mlp784" else 1024


def make_batches(features: int, n: int = 32) -> list[dict[str, torch.Tensor]]:
    """`n` fixed synthetic batches of 64 (labels from a fixed linear rule of the inputs)."""
    generator = torch.Generator().manual_seed(1)
    rule = torch.randn(features, 10, generator=generator)
    batches = []
    for _ in range(n):
        x = torch.randn(BATCH, features, generator=generator)
        batches.append({"x": x, "t": (x @ rule).argmax(dim=1)})
    return batches


class EagerLoop:
    """The hand-written loop: torch.optim.SGD creates its momentum lazily, as usual."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), LR, MOMENTUM, 0.0)

    def step(self, batch) -> torch.Tensor:
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(batch["x"]), batch["t"])
        loss.backward()
        self.optimizer.step()
        return loss

    def final_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


class DeviceLoop:
    """The MLSDK-style loop: one compiled call per step, synchronize at the end."""

    def __init__(self, model: nn.Module, preset: str, optimizer_kind: str) -> None:
        self.model = model
        self.context = Context(MNDevice("pfvm:cpu"))
        Context.switch_context(self.context)
        self.optimizer = make_device_optimizer(model, optimizer_kind)
        registered(self.context, model, self.optimizer)
        self.preset = preset
        self.compiled = None

    def compile(self, sample) -> float:
        train_step = make_step(self.model, self.optimizer)
        start = time.perf_counter()
        self.compiled = self.context.compile(
            train_step, sample, options={"option_json": self.preset}
        )
        return time.perf_counter() - start

    def step(self, batch):
        return self.compiled(batch)["loss"]

    def final_state(self) -> dict[str, torch.Tensor]:
        self.context.synchronize()
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def make_device_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "mncore":
        from mncore_lightning.optimizers import MNCoreSGD

        return MNCoreSGD(model.parameters(), LR, MOMENTUM, 0.0)
    optimizer = torch.optim.SGD(model.parameters(), LR, MOMENTUM, 0.0)
    for p in model.parameters():  # device state must exist before compile
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


def time_steps(loop, batches, start: int, steps: int) -> tuple[float, float]:
    """(wall steps/s, CPU ms per step) of `steps` steps, starting at batch index `start`.

    CPU time is that of the whole process, all threads: less disturbed by other processes
    on a shared machine than wall time, though it also counts OpenMP spin-waiting.
    """
    n = len(batches)
    cpu, begin = time.process_time(), time.perf_counter()
    for i in range(start, start + steps):
        loop.step(batches[i % n])
    wall = time.perf_counter() - begin
    return steps / wall, (time.process_time() - cpu) / steps * 1e3


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def profile_call(
    compiled, model: nn.Module, batch, eager: EagerLoop, calls: int = 300
) -> dict[str, float]:
    """Where one compiled call's time goes, in CPU microseconds with 1 thread (min of 5).

    call: the whole `CompiledFunction.__call__`; executor: the graph alone, with arguments
    prepared beforehand (Inductor's runtime wrapper, its generated `call`, the fused C++
    kernels and the extern matmuls); matmuls: just the matmuls of the model's Linear layers
    (forward, weight gradients, input gradients), the part that eager and compiled share;
    eager: one step of the eager loop, for comparison. Uses CompiledFunction internals (`_arguments`, `_executor`): diagnosis only.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = compiled._arguments(batch)
        matmuls = matmul_workload(model, batch["x"].shape[0])

        def per_call(fn) -> float:
            fn()
            times = []
            for _ in range(5):
                begin = time.process_time()
                for _ in range(calls):
                    fn()
                times.append((time.process_time() - begin) / calls * 1e6)
            return min(times)

        full = per_call(lambda: compiled(batch))
        executor = per_call(lambda: compiled._executor(args))
        arguments = per_call(lambda: compiled._arguments(batch))
        matmul = per_call(matmuls)
        eager_step = per_call(lambda: eager.step(batch))
    finally:
        torch.set_num_threads(threads)
    return {
        "call_us": full,
        "executor_us": executor,
        "call_overhead_us": full - executor,
        "arguments_us": arguments,
        "matmuls_us": matmul,
        "executor_minus_matmuls_us": executor - matmul,
        "eager_us": eager_step,
        "eager_minus_matmuls_us": eager_step - matmul,
    }


def matmul_workload(model: nn.Module, batch: int):
    """A function doing the matmuls of one training step of `model`'s Linear layers."""
    work = []
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for index, layer in enumerate(linears):
        x = torch.randn(batch, layer.in_features)
        w = layer.weight.detach().clone()
        b = layer.bias.detach().clone()
        g = torch.randn(batch, layer.out_features)
        work.append((x, w, b, g, index > 0))

    def run() -> None:
        for x, w, b, g, needs_input_grad in work:
            torch.addmm(b, x, w.t())  # forward
            torch.mm(g.t(), x)  # weight gradient
            if needs_input_grad:
                torch.mm(g, w)  # input gradient

    return run


def cold_compile_in_subprocess(model: str, preset: str, optimizer_kind: str) -> float:
    """Compile seconds in a fresh process with a fresh, empty Inductor cache."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="bench_cold_")}
    result = subprocess.run(
        [sys.executable, __file__, "--compile-only", model, preset, "--optimizer", optimizer_kind],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])["compile_s"]


def compile_only(model: str, preset: str, optimizer_kind: str) -> None:
    torch.set_num_threads(2)
    loop = DeviceLoop(build_model(model), preset, optimizer_kind)
    print(json.dumps({"compile_s": loop.compile(make_batches(in_features(model), 1)[0])}))


def bench_model(name: str, args) -> list[dict]:
    batches = make_batches(in_features(name))
    eager = EagerLoop(build_model(name))
    devices = {}
    compile_s = {}
    for preset in args.presets:
        devices[preset] = DeviceLoop(build_model(name), preset, args.optimizer)
        compile_s[preset] = devices[preset].compile(batches[0])
        print(f"  {name} {preset}: compiled in {compile_s[preset]:.2f} s", flush=True)
    loops = {"eager": eager, **devices}

    position = 0
    for loop in loops.values():  # warm up, all on the same batches
        time_steps(loop, batches, position, args.warmup)
    position += args.warmup
    rates: dict[str, list[float]] = {k: [] for k in loops}
    cpu_ms: dict[str, list[float]] = {k: [] for k in loops}
    for repeat in range(args.repeats):
        order = list(loops) if repeat % 2 == 0 else list(reversed(loops))
        for key in order:
            rate, cpu = time_steps(loops[key], batches, position, args.steps)
            rates[key].append(rate)
            cpu_ms[key].append(cpu)
        position += args.steps

    eager_state = eager.final_state()
    eager_rate = statistics.median(rates["eager"])
    eager_cpu = statistics.median(cpu_ms["eager"])
    rows = []
    for preset, loop in devices.items():
        rate = statistics.median(rates[preset])
        cpu = statistics.median(cpu_ms[preset])
        row = {
            "model": name,
            "description": MODELS[name],
            "preset": preset,
            "optimizer": args.optimizer,
            "eager_steps_per_s": eager_rate,
            "compiled_steps_per_s": rate,
            "ratio": rate / eager_rate,
            "eager_ms_per_step": 1e3 / eager_rate,
            "compiled_ms_per_step": 1e3 / rate,
            "eager_cpu_ms_per_step": eager_cpu,
            "compiled_cpu_ms_per_step": cpu,
            "cpu_ratio": eager_cpu / cpu,
            "compile_s": compile_s[preset],
            "compile_cold_subprocess_s": None,
            "steps_trained": position,
            "max_abs_diff_vs_eager": max_abs_diff(loop.final_state(), eager_state),
            "eager_repeats": rates["eager"],
            "compiled_repeats": rates[preset],
            "eager_cpu_ms_repeats": cpu_ms["eager"],
            "compiled_cpu_ms_repeats": cpu_ms[preset],
        }
        if args.profile:
            row["profile"] = profile_call(loop.compiled, loop.model, batches[0], eager)
        if args.cold_subprocess and preset not in ("debug", "O0"):
            row["compile_cold_subprocess_s"] = cold_compile_in_subprocess(
                name, preset, args.optimizer
            )
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'model':<10} {'preset':<6} {'eager st/s':>10} {'device st/s':>11} {'ratio':>6} "
        f"{'eager cpu ms':>12} {'device cpu ms':>13} {'cpu ratio':>9} "
        f"{'compile s':>9} {'cold s':>7} {'max|diff|':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        cold = r["compile_cold_subprocess_s"]
        print(
            f"{r['model']:<10} {r['preset']:<6} {r['eager_steps_per_s']:>10.0f} "
            f"{r['compiled_steps_per_s']:>11.0f} {r['ratio']:>5.2f}x "
            f"{r['eager_cpu_ms_per_step']:>12.3f} {r['compiled_cpu_ms_per_step']:>13.3f} "
            f"{r['cpu_ratio']:>8.2f}x {r['compile_s']:>9.2f} "
            f"{'-' if cold is None else f'{cold:.2f}':>7} {r['max_abs_diff_vs_eager']:>9.1e}"
        )
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            print(
                f"{r['model']} {r['preset']}, 1 thread, CPU us per call: {p['call_us']:.0f} = "
                f"CompiledFunction overhead {p['call_overhead_us']:.0f} (argument checks "
                f"{p['arguments_us']:.0f}) + executor {p['executor_us']:.0f} (of which the "
                f"Linear matmuls {p['matmuls_us']:.0f}, everything else "
                f"{p['executor_minus_matmuls_us']:.0f}); eager step {p['eager_us']:.0f} = "
                f"matmuls + {p['eager_minus_matmuls_us']:.0f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--presets", nargs="+", default=["O0", "O1"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--optimizer", choices=["torch", "mncore"], default="torch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/device.json"))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-cold-subprocess", dest="cold_subprocess", action="store_false")
    parser.add_argument("--keep-inductor-cache", action="store_true")
    parser.add_argument("--compile-only", nargs=2, metavar=("MODEL", "PRESET"))
    args = parser.parse_args()

    if args.compile_only:
        compile_only(*args.compile_only, args.optimizer)
        return

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    for name in args.models:
        rows.extend(bench_model(name, args))
    print()
    print_table(rows)
    result = {
        "torch": torch.__version__,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "batch": BATCH,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out} (load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
