"""Side by side: one LightningModule and one DataLoader under accelerator="cpu" and "mncore".

Runs the MN-Core tutorial MLP (1024-256-10, batch 64, SGD momentum 0.9, one `self.log` per
step) through `trainer.fit` under:
  - a hand-written eager loop over the same DataLoader (no Lightning),
  - Lightning's cpu accelerator,
  - accelerator="mncore" with presets O0 and O1,
each in its own subprocess (so peak RSS is per configuration), repeated and interleaved.
Steps/s counts steady-state steps only (the first epoch, which holds the compile, is timed
separately as "first epoch seconds"). Also reports where an mncore step's time goes: the
DataLoader, Lightning's loop, the compiled call, replaying `self.log`, and the strategy's,
capture's and device layer's own overhead, and how often a fit synchronized the host. A config ending in "-bf16" runs precision="bf16-mixed";
`--model cnn` runs examples/mnist_cnn.py's CNN instead of the MLP. A config with "-k<K>"
(mncore-O1-k8) runs MNCoreStrategy(steps_per_call=K): K batches per device call.
"cpu-floor" is Lightning's own floor: the same DataLoader, loop and `self.log` under
accelerator="cpu" with a one-parameter training step (no model compute), so what any step
through `trainer.fit` costs before its model runs. For the MLP, the mncore profile also times
the step's matrix multiplications alone (forward, weight and input gradients, the part no
implementation can skip) and the report gives the steps/s ratio to cpu that the configuration
would reach if its whole compiled graph took only that long ("bound x cpu").

    python benchmarks/bench_lightning.py [--repeats 3] [--epochs 4] [--model mlp|cnn]
        [--configs eager cpu cpu-floor mncore-O0 mncore-O1 cpu-bf16 mncore-O1-bf16] [--out FILE]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS_PER_EPOCH = 100
BATCH = 64


def _data(model: str = "mlp"):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    side = 32 if model == "mlp" else 28  # the tutorial pads to 32x32; the CNN takes 28x28
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS_PER_EPOCH * BATCH, 1, side, side, generator=g)
    y = torch.randint(0, 10, (STEPS_PER_EPOCH * BATCH,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, drop_last=True)


def _module_cls(model: str = "mlp"):
    if model == "cnn":  # examples/mnist_cnn.py's MNISTConvNet (grokking-pytorch's CNN)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from mnist_cnn import MNISTConvNet

        return MNISTConvNet
    import lightning as L
    import torch
    import torch.nn.functional as F

    class TutorialMLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.linear1 = torch.nn.Linear(1024, 256)
            self.linear2 = torch.nn.Linear(256, 10)

        def forward(self, x):
            return self.linear2(F.relu(self.linear1(x.flatten(1))))

        def training_step(self, batch, batch_idx):
            x, t = batch
            loss = F.cross_entropy(self(x), t)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return TutorialMLP


def _floor_module():
    """Lightning's per-step floor: automatic optimization, one log, a one-parameter step."""
    import lightning as L
    import torch

    class Floor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            loss = self.w.sum()
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return Floor()


class _EpochTimer:
    """Wall time of each epoch; on mncore, also profiles a step's parts at the end of fit."""

    def __init__(self, loader) -> None:
        import lightning as L

        timer = self

        class Cb(L.Callback):
            def on_train_epoch_start(self, trainer, pl_module):
                timer.start = time.perf_counter()

            def on_train_epoch_end(self, trainer, pl_module):
                timer.epochs.append(time.perf_counter() - timer.start)

            def on_train_end(self, trainer, pl_module):
                if hasattr(trainer.strategy, "device_stats"):
                    timer.extra["compile_seconds"] = trainer.strategy.device_stats()[
                        "mncore/compile_seconds"
                    ]
                    timer.extra["profile_us"] = _profile_mncore_step(trainer, pl_module, loader)

        self.epochs: list[float] = []
        self.extra: dict = {}
        self.callback = Cb()

    def add_lightning_share(self) -> None:
        """The Lightning loop's share: a steady step's wall time less what was measured."""
        profile = self.extra.get("profile_us")
        if profile and len(self.epochs) > 1:
            step_us = statistics.median(self.epochs[1:]) / STEPS_PER_EPOCH * 1e6
            profile["Lightning loop (step - dataloader - strategy)"] = round(
                step_us
                - profile["dataloader (per batch)"]
                - profile["strategy.training_step (total)"],
                1,
            )


def run_one(config: str, epochs: int, model_name: str = "mlp", threads: int = 2) -> dict:
    """Run one configuration in this process; returns its timings.

    config: "eager", "cpu" or "mncore-<preset>", with "-bf16" for precision="bf16-mixed".
    """
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    loader = _data(model_name)
    model = _module_cls(model_name)()
    precision = "bf16-mixed" if config.endswith("-bf16") else "32-true"
    config = config.removesuffix("-bf16")
    steps_per_call = int(config.split("-k")[1]) if "-k" in config else 1
    config = config.split("-k")[0]
    if config == "eager":
        return _run_eager(model, loader, epochs)
    if config == "cpu-floor":
        model, config = _floor_module(), "cpu"
    import lightning as L

    import mncore_lightning  # noqa: F401  (registers "mncore")

    timer = _EpochTimer(loader)
    kwargs = dict(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer.callback],
        precision=precision,
    )
    if config == "cpu":
        trainer = L.Trainer(accelerator="cpu", **kwargs)
    else:
        preset = config.split("-")[1]
        strategy = mncore_lightning.MNCoreStrategy(
            device="pfvm:cpu", preset=preset, steps_per_call=steps_per_call
        )
        trainer = L.Trainer(accelerator="mncore", strategy=strategy, **kwargs)
    syncs = _count_host_syncs()
    trainer.fit(model, loader)
    timer.add_lightning_share()
    result = {**_summary(timer.epochs), **timer.extra}
    if config != "cpu":
        # Host refreshes during fit: this loop overrides only epoch-level hooks, so a plain
        # step never synchronizes; the count is per fit (epochs x 100 steps).
        result["host_syncs_per_fit"] = syncs[0]
    return result


def _count_host_syncs() -> list[int]:
    """Count the device's synchronize() calls from now on (the emulator's Context)."""
    from mncore_device import EmulatorContext

    count = [0]
    synchronize = EmulatorContext.synchronize

    def counting(self, tensors=None):
        count[0] += 1
        return synchronize(self, tensors)

    EmulatorContext.synchronize = counting
    return count


def _run_eager(model, loader, epochs: int) -> dict:
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        for x, t in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), t)
            loss.backward()
            optimizer.step()
        times.append(time.perf_counter() - start)
    return _summary(times)


def _summary(epoch_seconds: list[float]) -> dict:
    steady = epoch_seconds[1:] or epoch_seconds
    return {
        "first_epoch_seconds": epoch_seconds[0],
        "steps_per_second": STEPS_PER_EPOCH / statistics.median(steady),
        "epoch_seconds": epoch_seconds,
    }


def _profile_mncore_step(trainer, model, loader) -> dict:
    """Per-step microseconds of the parts of an mncore step, measured outside the loop
    (with steps_per_call=K, per call divided by K)."""
    from mncore_device.runtime.compiled import CompiledFunction
    from mncore_lightning.data import StepGroups

    strategy = trainer.strategy
    k = strategy.steps_per_call
    source = StepGroups(loader, k) if k > 1 else loader
    batches = [b for _, b in zip(range(max(50 // k, 4)), source, strict=False)]
    n = len(batches) * k

    def per_step(fn) -> float:  # the median of 3 passes: the machine may be shared
        passes = []
        for _ in range(3):
            start = time.perf_counter()
            for i, b in enumerate(batches):
                fn(i, b)
            passes.append((time.perf_counter() - start) / n * 1e6)
        return statistics.median(passes)

    data_us = _loader_us(loader, n)
    model._current_fx_name = "training_step"
    arguments = CompiledFunction._arguments
    kept: dict = {}

    def keeping(compiled, inputs):  # the executor's latest arguments, to time it alone
        kept[id(compiled)] = arguments(compiled, inputs)
        return kept[id(compiled)]

    CompiledFunction._arguments = keeping
    try:
        strategy.training_step(batches[0], 0)  # an epoch's shorter last group may have run last
    finally:
        CompiledFunction._arguments = arguments
    step_us = per_step(lambda i, b: strategy.training_step(b, i))
    hooks = [h for key, h in strategy._captured.items() if key[0] == "train"]
    compiled = next(c for h in hooks for c in h.compiled if id(c) in kept)
    args, executor = kept[id(compiled)], compiled._executor
    executor_us = per_step(lambda i, b: executor(args))
    # The strategy's own share: the same call with the graph replaced by its cached outputs,
    # without and with Lightning's self.log replay.
    outputs = executor(args)
    compiled._executor = lambda _: outputs
    with_replay_us = per_step(lambda i, b: strategy.training_step(b, i))
    replays = [(h._logs, h._logs.replay) for h in hooks]
    for logs, _ in replays:
        logs.replay = lambda module, size: None
    own_us = per_step(lambda i, b: strategy.training_step(b, i))
    for logs, replay in replays:
        logs.replay = replay
    compiled._executor = executor
    matmuls = _matmuls_us(model, batches[0] if k == 1 else batches[0][0], per_step, k)
    return {
        "dataloader (per batch)": round(data_us, 1),
        "strategy.training_step (total)": round(step_us, 1),
        "compiled graph (executor)": round(executor_us, 1),
        "self.log replay (Lightning)": round(with_replay_us - own_us, 1),
        "strategy + capture + device layer own": round(own_us, 1),
        **({"matmuls alone (forward + gradients)": round(matmuls, 1)} if matmuls else {}),
    }


def _matmuls_us(model, batch, per_step, steps: int = 1) -> float | None:
    """Microseconds of one step's matrix multiplications alone, for a stack of Linear layers
    (the MLP): each layer's forward addmm and weight-gradient mm, and the input-gradient mm of
    every layer but the first; None for other models. `per_step` divides by `steps` per call."""
    import torch

    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not layers or any(isinstance(m, torch.nn.Conv2d) for m in model.modules()):
        return None
    n = batch[0].shape[0]
    work = []
    for index, layer in enumerate(layers):
        w, b = layer.weight.detach(), layer.bias.detach()
        x = torch.randn(n, layer.in_features)
        g = torch.randn(n, layer.out_features)
        outs = (torch.empty(n, layer.out_features), torch.empty_like(w), torch.empty_like(x))
        work.append((index, w, b, x, g, outs))

    def matmuls(i, b) -> None:
        for index, w, bias, x, g, (y, gw, gx) in work * steps:
            torch.addmm(bias, x, w.t(), out=y)
            torch.mm(g.t(), x, out=gw)
            if index:
                torch.mm(g, w, out=gx)

    return per_step(matmuls)


def _loader_us(loader, n: int) -> float:
    start = time.perf_counter()
    for _, _b in zip(range(n), loader, strict=False):
        pass
    return (time.perf_counter() - start) / n * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--configs", nargs="+", default=["eager", "cpu", "mncore-O0", "mncore-O1"])
    parser.add_argument("--out", default="benchmarks/results/lightning.json")
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    # 1 thread gives steadier ratios on a machine shared with other jobs
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        result = run_one(args._child, args.epochs, args.model, args.threads)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("RESULT " + json.dumps(result))
        return result

    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    for repeat in range(args.repeats):
        for config in args.configs:  # interleaved, so drift hits every configuration alike
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--_child",
                    config,
                    "--epochs",
                    str(args.epochs),
                    "--model",
                    args.model,
                    "--threads",
                    str(args.threads),
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{config} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            runs[config].append(json.loads(line[len("RESULT ") :]))
            print(f"repeat {repeat} {config}: {runs[config][-1]['steps_per_second']:.0f} steps/s")

    report = {
        "model": args.model,
        "batch": BATCH,
        "steps_per_epoch": STEPS_PER_EPOCH,
        "threads": args.threads,
        "configs": {},
    }
    cpu = statistics.median(r["steps_per_second"] for r in runs["cpu"]) if "cpu" in runs else None
    for config, results in runs.items():
        sps = statistics.median(r["steps_per_second"] for r in results)
        entry = {
            "steps_per_second_median": round(sps, 1),
            "vs_lightning_cpu": round(sps / cpu, 2) if cpu else None,
            "first_epoch_seconds_median": round(
                statistics.median(r["first_epoch_seconds"] for r in results), 2
            ),
            "peak_rss_mb_median": round(statistics.median(r["peak_rss_mb"] for r in results), 1),
        }
        if "compile_seconds" in results[0]:
            entry["compile_seconds_median"] = round(
                statistics.median(r["compile_seconds"] for r in results), 2
            )
            entry["per_step_us"] = {  # medians over the runs
                key: round(statistics.median(r["profile_us"][key] for r in results), 1)
                for key in results[0]["profile_us"]
            }
            profile = entry["per_step_us"]
            matmuls = profile.get("matmuls alone (forward + gradients)")
            if cpu and matmuls:
                # the ratio to cpu with the graph as fast as its matmuls, all else as measured
                step_us = 1e6 / sps
                bound_us = step_us - profile["compiled graph (executor)"] + matmuls
                entry["graph_vs_matmuls"] = round(profile["compiled graph (executor)"] / matmuls, 2)
                entry["bound_vs_lightning_cpu"] = round(1e6 / cpu / bound_us, 2)
        if "host_syncs_per_fit" in results[0]:
            entry["host_syncs_per_fit"] = results[-1]["host_syncs_per_fit"]
        report["configs"][config] = entry

    eager = report["configs"].get("eager", {}).get("steps_per_second_median")
    header = f"{'config':<14} {'steps/s':>9} {'x cpu':>7} {'x eager':>8} {'compile s':>10}"
    print(f"\n{header} {'peak MB':>8} {'bound x cpu':>12}")
    for config, e in report["configs"].items():
        sps = e["steps_per_second_median"]
        e["vs_eager"] = round(sps / eager, 2) if eager else None
        print(
            f"{config:<14} {sps:>9.0f} {e['vs_lightning_cpu'] or 0:>7.2f} "
            f"{e['vs_eager'] or 0:>8.2f} {e.get('compile_seconds_median', 0):>10.2f} "
            f"{e['peak_rss_mb_median']:>8.0f} {e.get('bound_vs_lightning_cpu', ''):>12}"
        )
    for config, e in report["configs"].items():
        if "per_step_us" in e:
            print(f"{config} per-step microseconds: {e['per_step_us']}")
        if "host_syncs_per_fit" in e:
            print(f"{config} host synchronizations in a fit: {e['host_syncs_per_fit']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
