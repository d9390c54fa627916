"""The training step's capture, before (make_fx) and after (TorchDynamo), side by side.

"before" is the make_fx tracer of user steps, which this package no longer has: it runs from
a checkout of a commit that still had it (`--before DIR`, with MNCORE_CAPTURE=trace there;
for example `git worktree add /tmp/before b7af94a`), in child processes interleaved with those
of this tree ("after").

  - compile: the first training step's wall time (from the call to the strategy's
    training_step until it returns: Dynamo's capture, the device graph's trace, Inductor's
    build and the first run) and the compile_seconds the strategy reports (the device graph's
    trace and build), for the tutorial MLP (1024-256-10, batch 64) and torchvision's ResNet-18
    (32x32, batch 32), preset O1. Each run is a fresh process on a fresh Inductor cache: a copy
    of one on which a tiny model was compiled (bench_compile.py's "cold": Inductor's one-time
    CPU probes are built, nothing of these models is cached).
  - guards: what the Dynamo frontend adds to a call on top of its device function (guards,
    Dynamo's entry, noting graph breaks, the mapping of arguments), in microseconds, with the
    device graph's executor replaced by its cached outputs; split into its parts; and the
    strategy's whole host-side cost of a training step (graph excluded), trace vs dynamo, in
    one process. Also the frontend's floor: a one-op function through DynamoFrontend.
  - fit: `trainer.fit` steady steps/s on the tutorial MLP (bench_lightning.py's module and
    data, batch 64, no progress bar, no logger), a process per fit, modes interleaved.

    python benchmarks/bench_capture.py --before DIR [--parts compile guards fit]
        [--models mlp resnet18] [--repeats 3] [--rounds 3] [--epochs 4] [--calls 2000]
        [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the benchmarks next to this one

import bench_lightning as bl  # noqa: E402

MODES = ("trace", "dynamo")  # before (the --before tree's make_fx path), after (this tree)
RESNET_BATCH = 32


def _resnet_module():
    """torchvision's ResNet-18 (10 classes) as a LightningModule: cross entropy, one log, SGD
    with momentum (the tutorial's step, on another model)."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    import torchvision

    class ResNet18(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torchvision.models.resnet18(num_classes=10)

        def training_step(self, batch, batch_idx):
            x, t = batch
            loss = F.cross_entropy(self.net(x), t)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return ResNet18()


def _resnet_data(steps: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * RESNET_BATCH, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (steps * RESNET_BATCH,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=RESNET_BATCH, drop_last=True)


def _trainer(callbacks=(), **kwargs):
    import lightning as L

    return L.Trainer(
        accelerator="mncore",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **kwargs,
    )


def _strategy(mode: str):
    """An O1 MNCoreStrategy of the tree this child runs (see _child)."""
    import mncore_lightning

    strategy = mncore_lightning.MNCoreStrategy(device="pfvm:cpu", preset="O1")
    assert getattr(strategy, "capture", "dynamo") == mode, (mode, mncore_lightning.__file__)
    return strategy


# --- compile -----------------------------------------------------------------------------------


def first_step(model: str, mode: str) -> dict:
    """Seconds of the first training step (which compiles), in this fresh process."""
    import torch

    torch.manual_seed(0)
    if model == "mlp":
        module, loader = bl._module_cls()(), bl._data()
    else:
        module, loader = _resnet_module(), _resnet_data(4)
    strategy = _strategy(mode)
    seconds: list[float] = []
    training_step = strategy.training_step

    cpu: list[float] = []

    def timed(*args, **kwargs):
        start, start_cpu = time.perf_counter(), _cpu_seconds()
        try:
            return training_step(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)
            cpu.append(_cpu_seconds() - start_cpu)

    strategy.training_step = timed  # what Lightning's loop calls
    stats = _StatsAtEnd()
    trainer = _trainer([stats], strategy=strategy, max_steps=3, limit_val_batches=0)
    trainer.fit(module, loader)
    return {
        "first_step_s": round(seconds[0], 3),
        "first_step_cpu_s": round(cpu[0], 3),
        "compile_seconds": round(stats.stats["mncore/compile_seconds"], 3),
        "later_step_ms": round(statistics.median(seconds[1:]) * 1e3, 2),
        "compiled_functions": stats.stats["mncore/compiled_functions"],
        "retraces": stats.stats["mncore/retraces"],
    }


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (Inductor's C++ compiler runs):
    steadier than the wall time where other jobs share the cores."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _EpochCpuTime():
    """A callback keeping each epoch's CPU seconds of this process (`time.process_time`)."""
    import lightning as L

    class EpochCpuTime(L.Callback):
        def __init__(self) -> None:
            self.epochs: list[float] = []

        def on_train_epoch_start(self, trainer, pl_module):
            self.start = time.process_time()

        def on_train_epoch_end(self, trainer, pl_module):
            self.epochs.append(time.process_time() - self.start)

    return EpochCpuTime()


def _StatsAtEnd():
    """A callback keeping the strategy's device_stats() at the end of training (teardown
    drops the compiled functions they count)."""
    import lightning as L

    class StatsAtEnd(L.Callback):
        stats: dict = {}

        def on_train_end(self, trainer, pl_module):
            self.stats = trainer.strategy.device_stats()

    return StatsAtEnd()


# --- guards ------------------------------------------------------------------------------------


def _per_call_us(fns: dict, calls: int, passes: int = 7) -> dict[str, float]:
    """Microseconds per call of each of `fns`: the median over `passes` passes of `calls //
    passes` calls, the functions interleaved pass by pass (a busy machine slows them alike)."""
    n = max(calls // passes, 1)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(passes):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - start) / n * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def guards(mode: str, calls: int) -> dict:
    """Per-call microseconds of the strategy's host-side training step (and, after, of the
    Dynamo frontend's parts), with the device graph's executor replayed, in this process."""
    import lightning as L
    import torch

    from mncore_device import CompiledFunction  # (not mncore_device.runtime: --before lacks it)
    from mncore_device.capture import dynamo

    graph_calls: list = []  # every _GraphCall built; each keeps its latest call's arguments
    init, call = dynamo._GraphCall.__init__, dynamo._GraphCall.__call__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        graph_calls.append(self)

    def recording_call(self, *args):
        self.last_args = args
        return call(self, *args)

    dynamo._GraphCall.__init__ = recording_init
    dynamo._GraphCall.__call__ = recording_call
    arguments = CompiledFunction._arguments

    def keeping(self, inputs):  # the executor's latest arguments, to time it alone
        self.last_args = arguments(self, inputs)
        return self.last_args

    CompiledFunction._arguments = keeping
    loader = bl._data()
    batches = [b for _, b in zip(range(8), loader, strict=False)]
    runs: dict[str, list[dict]] = {mode: []}

    class Measure(L.Callback):
        def __init__(self, mode: str) -> None:
            self.mode = mode

        def on_train_end(self, trainer, pl_module):
            strategy = trainer.strategy
            pl_module._current_fx_name = "training_step"
            strategy.training_step(batches[0], 0)
            if self.mode == "trace":
                compiled = strategy._train_hook.compiled
            else:
                hook = strategy._captured[("train", 1, True)]
                (compiled,) = hook.compiled
            executor = compiled._executor
            result = _per_call_us({"executor": lambda: executor(compiled.last_args)}, calls // 10)
            outputs = executor(compiled.last_args)
            compiled._executor = lambda args: outputs  # the graph, replayed
            i = iter(range(10**9))

            def step():
                strategy.training_step(batches[next(i) % 8], 5)

            if self.mode == "trace":
                result.update(_per_call_us({"strategy.training_step": step}, calls))
            else:
                result.update(_frontend_parts(hook, batches[0], graph_calls[-1], step, calls))
            compiled._executor = executor
            runs[self.mode].append(result)

    torch.manual_seed(0)
    trainer = _trainer([Measure(mode)], strategy=_strategy(mode), max_steps=4)
    trainer.fit(bl._module_cls()(), loader)
    (report,) = runs[mode]
    if mode == "dynamo":
        report["trivial graph through DynamoFrontend"] = _trivial_frontend(calls)
    return report


def _frontend_parts(hook, batch, graph_call, step, calls: int) -> dict:
    """The parts of one training-step call of `hook` (a CapturedHook) on the host, its
    device graph replayed: the strategy's whole step, the hook, the frontend, Dynamo's entry
    and guards, the graph call (`_GraphCall`) and its device function, and what the frontend
    does around Dynamo (noting graph breaks)."""
    from mncore_device.capture import dynamo

    frontend = hook.frontend
    graph_args = graph_call.last_args
    captured, function = graph_call._compiled[dynamo._key(graph_call._captured, graph_args)]
    inputs = captured.device_inputs(graph_args)
    outputs = function(inputs)
    module = hook.module
    logged = hook._logs.calls  # emptied before each call, as CapturedHook does (a guard)

    def log_methods():
        state = module.__dict__
        state["log"], state["log_dict"] = hook._logs.log, hook._logs.log_dict
        del state["log"], state["log_dict"]

    hook(batch, 5)
    (name, value, log_args, log_kwargs), *_ = logged

    def lightning_log():
        from lightning.pytorch import LightningModule

        LightningModule.log(module, name, value, *log_args, **log_kwargs)

    parts = _per_call_us(
        {
            "strategy.training_step": step,
            "CapturedHook call": lambda: hook(batch, 5),
            "self.log replay (LightningModule.log, per call)": lightning_log,
            "module.log/log_dict set + del": log_methods,
        },
        calls,
    )
    module.log, module.log_dict = hook._logs.log, hook._logs.log_dict  # as while the hook runs
    try:
        graphs = len(frontend.graphs)
        parts |= _per_call_us(
            {
                "frontend(*args)": lambda: (logged.clear(), frontend(batch, 5)),
                "Dynamo entry + guards + _GraphCall": lambda: (
                    logged.clear(),
                    frontend._compiled(batch, 5),
                ),
                "_GraphCall(*graph_args)": lambda: graph_call(*graph_args),
                "_GraphCall: _key": lambda: dynamo._key(captured, graph_args),
                "_GraphCall: device_inputs": lambda: captured.device_inputs(graph_args),
                "_GraphCall: results": lambda: captured.results(graph_args, outputs),
                "device function (run: CompiledFunction + to_host)": lambda: function(inputs),
            },
            calls,
        )
        assert len(frontend.graphs) == graphs, "a timed call compiled again"
    finally:
        del module.log, module.log_dict
    device = parts["device function (run: CompiledFunction + to_host)"]
    parts["frontend overhead (frontend - device function)"] = parts["frontend(*args)"] - device
    parts["Dynamo entry + guards (alone)"] = (
        parts["Dynamo entry + guards + _GraphCall"] - parts["_GraphCall(*graph_args)"]
    )
    parts["graph arguments"] = float(len(graph_args))
    parts["guards"] = _guard_count(frontend)
    return parts


def _guard_count(frontend) -> float:
    """How many guards Dynamo checks per call of the frontend's (one) compiled entry."""
    import torch

    code = frontend._compiled._torchdynamo_orig_callable.__code__
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
    count, stack = 0, [entries[0].guard_manager.root]
    while stack:
        node = stack.pop()
        count += len(node.get_leaf_guards())
        stack.extend(node.get_child_managers())
    return float(count)


def _trivial_frontend(calls: int) -> dict:
    """A one-op function (x * 2) through DynamoFrontend, its device function a replay, next
    to the same function under torch.compile(backend="eager") and eager."""
    import torch

    from mncore_device.capture import DynamoFrontend

    x = torch.randn(4)

    def compile_graph(captured):
        outputs = captured.run(captured.sample())
        return lambda inputs: outputs

    frontend = DynamoFrontend(lambda t: t * 2, compile_graph, is_state=lambda t: False)
    frontend(x)
    compiled = torch.compile(lambda t: t * 2, backend="eager")
    compiled(x)

    times = _per_call_us(
        {
            "frontend(x)": lambda: frontend(x),
            "frontend._compiled(x) (Dynamo alone)": lambda: frontend._compiled(x),
            'torch.compile(backend="eager")(x)': lambda: compiled(x),
            "eager x * 2": lambda: x * 2,
        },
        calls,
    )
    return {k: round(v, 1) for k, v in times.items()}


# --- fit ---------------------------------------------------------------------------------------


def fit(mode: str, epochs: int) -> dict:
    """Steady steps/s of `trainer.fit` on the tutorial MLP (the first epoch, which compiles,
    is not counted)."""
    import torch

    torch.manual_seed(0)
    loader = bl._data()
    timer = bl._EpochTimer(loader)
    timer.callback.on_train_end = lambda *a: None  # the wall time only, no profile
    stats = _StatsAtEnd()
    cpu = _EpochCpuTime()
    trainer = _trainer([timer.callback, stats, cpu], strategy=_strategy(mode), max_epochs=epochs)
    trainer.fit(bl._module_cls()(), loader)
    summary = bl._summary(timer.epochs)
    cpu_summary = bl._summary(cpu.epochs)
    return {
        "steps_per_second": round(summary["steps_per_second"], 1),
        # per second of this process's CPU time: what the VM's other tenants steal is left out
        "steps_per_cpu_second": round(cpu_summary["steps_per_second"], 1),
        "first_epoch_seconds": round(summary["first_epoch_seconds"], 2),
        "compile_seconds": round(stats.stats["mncore/compile_seconds"], 3),
        "retraces": stats.stats["mncore/retraces"],
    }


# --- the parent ---------------------------------------------------------------------------------


_BEFORE: list[Path] = []  # the --before tree


def _child(args: list[str], env: dict | None = None, mode: str = "dynamo") -> dict:
    """Run this script with `args` in a child process: of the --before tree (its make_fx
    path) for mode "trace", else of this tree."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    env.pop("MNCORE_CAPTURE", None)
    tree = HERE.parent
    if mode == "trace":
        tree = _BEFORE[0]
        env["MNCORE_CAPTURE"] = "trace"
    env["PYTHONPATH"] = os.pathsep.join(str(tree / p) for p in ("", "device", "compat"))
    out = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env, cwd=tree
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def _primed_cache() -> str:
    """An Inductor cache on which a tiny model was compiled (bench_compile.py's "prime")."""
    cache = tempfile.mkdtemp(prefix="bench_capture_prime_")
    _child_script = [str(HERE / "bench_compile.py"), "--_child", "tiny", "--preset", "O1"]
    out = subprocess.run(
        [sys.executable, *_child_script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "TORCHINDUCTOR_CACHE_DIR": cache},
    )
    if out.returncode:
        raise RuntimeError(f"priming the Inductor cache failed:\n{out.stderr[-3000:]}")
    return cache


def _median(values):
    return round(statistics.median(values), 3)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a checkout that has the make_fx path")
    parser.add_argument("--parts", nargs="+", default=["compile", "guards", "fit"])
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet18"])
    parser.add_argument("--repeats", type=int, default=3, help="compile runs per model and mode")
    parser.add_argument("--rounds", type=int, default=3, help="fit runs per mode")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000, help="calls per per-call timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/capture.json")
    parser.add_argument("--table", default=None, help="print the table of a saved report")
    parser.add_argument("--_child", nargs="+", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.table:
        report = json.loads(Path(args.table).read_text())
        _print_table(report)
        return report
    if args._child:
        import torch

        torch.set_num_threads(args.threads)
        kind, *rest = args._child
        if kind == "compile":
            result = first_step(*rest)
        elif kind == "fit":
            result = fit(rest[0], args.epochs)
        else:
            result = guards(rest[0], args.calls)
        result["load_average_1min"] = round(os.getloadavg()[0], 2)  # how shared the machine was
        print("RESULT " + json.dumps(result))
        return result

    if args.before is None:
        parser.error("--before DIR: a checkout of a commit that has the make_fx path")
    _BEFORE.append(args.before.resolve())
    command = "python benchmarks/bench_capture.py " + " ".join(argv or sys.argv[1:])
    report: dict = {
        "command": command.strip(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "threads": args.threads,
        "preset": "O1",
    }
    common = ["--threads", str(args.threads), "--epochs", str(args.epochs)]
    if "compile" in args.parts:
        primed = _primed_cache()
        runs: dict = {}
        for repeat in range(args.repeats):
            for model in args.models:
                for mode in MODES:  # interleaved
                    cache = tempfile.mkdtemp(prefix="bench_capture_")
                    shutil.copytree(primed, cache, dirs_exist_ok=True)
                    result = _child(
                        ["--_child", "compile", model, mode, *common],
                        {"TORCHINDUCTOR_CACHE_DIR": cache},
                        mode,
                    )
                    shutil.rmtree(cache, ignore_errors=True)
                    runs.setdefault(model, {}).setdefault(mode, []).append(result)
                    print(f"compile {repeat} {model} {mode}: {result}", flush=True)
        shutil.rmtree(primed, ignore_errors=True)
        report["compile"] = {
            model: {
                mode: {
                    "first_step_s_median": _median(r["first_step_s"] for r in results),
                    "first_step_cpu_s_median": _median(r["first_step_cpu_s"] for r in results),
                    "compile_seconds_median": _median(r["compile_seconds"] for r in results),
                    "runs": results,
                }
                for mode, results in by_mode.items()
            }
            for model, by_mode in runs.items()
        }
    if "guards" in args.parts:
        rounds: dict = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:  # interleaved
                child = ["--_child", "guards", mode, "--calls", str(args.calls), *common]
                rounds[mode].append(_child(child, mode=mode))
        report["guards_us"] = {
            mode: {
                k: (
                    round(statistics.median(r[k] for r in results), 1)
                    if isinstance(results[0][k], float | int)
                    else results[0][k]
                )
                for k in results[0]
            }
            for mode, results in rounds.items()
        }
        trivial = report["guards_us"]["dynamo"].pop("trivial graph through DynamoFrontend")
        report["guards_us"]["trivial graph through DynamoFrontend"] = trivial
        print(f"guards: {report['guards_us']}", flush=True)
    if "fit" in args.parts:
        fits: dict = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            for mode in MODES:
                fits[mode].append(_child(["--_child", "fit", mode, *common], mode=mode))
                print(f"fit {round_} {mode}: {fits[mode][-1]}", flush=True)
        report["fit"] = {
            mode: {
                "steps_per_second_median": _median(r["steps_per_second"] for r in results),
                "steps_per_cpu_second_median": _median(r["steps_per_cpu_second"] for r in results),
                "runs": results,
            }
            for mode, results in fits.items()
        }
    _print_table(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def _loads(report: dict) -> list[float]:
    """The 1-minute load averages the child processes saw as they ended."""
    runs = [e for by_mode in report.get("compile", {}).values() for e in by_mode.values()]
    runs = [r for e in runs for r in e["runs"]]
    runs += [r for e in report.get("fit", {}).values() for r in e["runs"]]
    runs.append(report.get("guards_us", {}))
    return [r["load_average_1min"] for r in runs if "load_average_1min" in r]


def _print_table(report: dict) -> None:
    """The Markdown table: one row per measure, before (trace) and after (dynamo)."""
    print(f"\n`{report['command']}`; {report['machine']}; {report['date']}\n")
    loads = _loads(report)
    if loads:
        print(f"1-minute load average during the runs: {min(loads)} to {max(loads)}\n")
    print("| measure | before (trace) | after (dynamo) | after / before | requirement |")
    print("|---|---:|---:|---:|---|")

    def row(name, before, after, requirement, digits=2):
        ratio = f"{after / before:.2f}" if before and after is not None else ""
        b = f"{before:.{digits}f}" if before is not None else "-"
        a = f"{after:.{digits}f}" if after is not None else "-"
        print(f"| {name} | {b} | {a} | {ratio} | {requirement} |")

    for model, by_mode in report.get("compile", {}).items():
        t, d = by_mode.get("trace", {}), by_mode.get("dynamo", {})
        row(
            f"{model}: first training step, s (median)",
            t.get("first_step_s_median"),
            d.get("first_step_s_median"),
            "after <= 1.2x before",
        )
        row(
            f"{model}: first training step, CPU s (process + compiler runs)",
            t.get("first_step_cpu_s_median"),
            d.get("first_step_cpu_s_median"),
            "",
        )
        row(
            f"{model}: of which compile_seconds, s",
            t.get("compile_seconds_median"),
            d.get("compile_seconds_median"),
            "",
        )
    guards = report.get("guards_us")
    if guards:
        t, d = guards["trace"], guards["dynamo"]
        key = "strategy.training_step"
        row("MLP: strategy.training_step on the host (graph replayed), us", t[key], d[key], "", 1)
        key = "frontend overhead (frontend - device function)"
        row(f"MLP: Dynamo {key}, us", None, d[key], "<= 20 us", 1)
        for key, name in (
            ("Dynamo entry + guards (alone)", "of which Dynamo's entry and guard checks"),
            ("_GraphCall(*graph_args)", "of which _GraphCall (with the device function)"),
            ("device function (run: CompiledFunction + to_host)", "device function alone"),
            ("self.log replay (LightningModule.log, per call)", "self.log replay per call"),
        ):
            row(f"MLP: {name}, us", None, d[key], "", 1)
        trivial = guards["trivial graph through DynamoFrontend"]
        row("x * 2: frontend(x), device function a replay, us", None, trivial["frontend(x)"], "", 1)
    fits = report.get("fit")
    if fits:
        row(
            "MLP trainer.fit steps/s (median)",
            fits["trace"]["steps_per_second_median"],
            fits["dynamo"]["steps_per_second_median"],
            "after >= before",
            0,
        )
        row(
            "MLP trainer.fit steps per CPU second of the process (median)",
            fits["trace"]["steps_per_cpu_second_median"],
            fits["dynamo"]["steps_per_cpu_second_median"],
            "",
            0,
        )


if __name__ == "__main__":
    main()
