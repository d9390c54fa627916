"""Where a `trainer.fit` step's time goes, every configuration in ONE process, interleaved.

The tutorial MLP of bench_lightning.py (1024-256-10, batch 64, shuffled DataLoader, one
`self.log(..., prog_bar=True)` per step) under:
  - data: iterating the DataLoader alone,
  - eager: the hand-written loop (no Lightning),
  - cpu: Lightning's accelerator="cpu",
  - cpu-floor: Lightning's cpu loop with a one-parameter step (Lightning's own cost per step),
  - mncore: accelerator="mncore", O1, and mncore-k8 with steps_per_call=8,
  - mncore-nograph: mncore O1 with the compiled graph replaced, after the first epoch, by its
    cached outputs: the DataLoader, Lightning's loop and the strategy, without the graph.
  - mncore-stream: mncore-nograph that, in place of the graph, reads and writes a copy of
    every graph input once (the bytes the graph streams, without its arithmetic): how much
    the graph's memory traffic alone slows the Python around it.
  - matmuls: the step's five matrix multiplications alone, eager, in a tight loop (hot
    caches), with the first weight stored as on the host and transposed (the faster): the
    arithmetic no graph of this step goes below. With mncore-nograph it bounds
    what a step at one step per call can reach against Lightning's cpu (`best_vs_lightning_cpu`).
The mncore configuration also times its graph's executor inside the fit, so the report splits
what the graph adds to a step into the graph itself and the slower Python around it.
Each round runs every configuration once (a fit of `--epochs` epochs of 100 steps; the first
epoch, which compiles, is not timed); the report is the median over rounds of each
configuration's median steady epoch, in microseconds per step. One process, interleaved, so
that a busy machine slows every configuration alike (bench_lightning.py runs a process each).

    python benchmarks/bench_fit_floor.py [--rounds 5] [--epochs 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_lightning as bl  # noqa: E402

CONFIGS = (
    "data",
    "eager",
    "cpu",
    "cpu-floor",
    "mncore-nograph",
    "mncore-stream",
    "mncore",
    "mncore-k8",
    "matmuls",
)
NOT_A_FIT = ("matmuls",)  # a part of a step, left out of the ratios


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    import torch

    torch.set_num_threads(args.threads)
    import lightning as L

    import mncore_lightning

    loader = bl._data()
    mlp = bl._module_cls()

    executor_us: list[float] = []  # the graph's executor, timed inside the mncore fits
    stream_us: list[float] = []  # mncore-stream's pass over the inputs' copies

    class Executor(L.Callback):
        """From the second epoch on, wraps the compiled graph's executor: timed (as is), or
        replaced by the outputs of its next call (`stream`: plus one pass over a copy of every
        input, the bytes the graph reads and writes)."""

        def __init__(self, mode: str) -> None:
            self.mode = mode

        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch != 0:
                return
            (compiled,) = trainer.strategy._captured[("train", 1, True)].compiled
            executor, cached, scratch = compiled._executor, [], []

            def timed(args):
                start = time.perf_counter()
                outputs = executor(args)
                executor_us.append((time.perf_counter() - start) * 1e6)
                return outputs

            def replay(args):
                if not cached:
                    cached.append(executor(args))
                    if self.mode == "stream":
                        scratch.extend(a.clone() for a in args if a.is_floating_point())
                if scratch:
                    start = time.perf_counter()
                    for tensor in scratch:
                        tensor.mul_(1.0)
                    stream_us.append((time.perf_counter() - start) * 1e6)
                return cached[0]

            compiled._executor = timed if self.mode == "timed" else replay

    def fit(model, callbacks=(), **kwargs) -> float:
        timer = bl._EpochTimer(loader)
        timer.callback.on_train_end = lambda *a: None  # no profile: the wall time only
        trainer = L.Trainer(
            max_epochs=args.epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer.callback, *callbacks],
            **kwargs,
        )
        trainer.fit(model, loader)
        return statistics.median(timer.epochs[1:]) / bl.STEPS_PER_EPOCH * 1e6

    def data() -> float:
        start = time.perf_counter()
        for _ in range(args.epochs):
            for _batch in loader:
                pass
        return (time.perf_counter() - start) / args.epochs / bl.STEPS_PER_EPOCH * 1e6

    def matmuls(calls: int = 200) -> float:
        """The step's five matmuls, with the first layer's weight stored as on the host or
        transposed (as O1 stores it where its timing found that faster): the faster."""
        x, h = torch.randn(bl.BATCH, 1024), torch.randn(bl.BATCH, 256)
        w1, b1, w2, b2 = (
            torch.randn(256, 1024),
            torch.randn(256),
            torch.randn(10, 256),
            torch.randn(10),
        )
        grad = torch.randn(bl.BATCH, 10)
        w1_stored_transposed = w1.t().contiguous().t()

        def step(w1: torch.Tensor) -> None:
            torch.addmm(b1, x, w1.t())  # forward
            torch.addmm(b2, h, w2.t())
            torch.mm(grad, w2)  # the hidden layer's gradient
            torch.mm(grad.t(), h)  # the weights' gradients
            if w1.is_contiguous():  # the first layer's: [256, 64] x [64, 1024]
                torch.mm(h.t(), x)
            else:  # laid out as its weight: ([1024, 64] x [64, 256]).t()
                torch.mm(x.t(), h).t()

        times = []
        for weight in (w1, w1_stored_transposed):
            for _ in range(20):
                step(weight)
            start = time.perf_counter()
            for _ in range(calls):
                step(weight)
            times.append((time.perf_counter() - start) / calls * 1e6)
        return min(times)

    def mncore(k: int = 1, executor: str = "timed") -> float:
        strategy = mncore_lightning.MNCoreStrategy(device="pfvm:cpu", preset="O1", steps_per_call=k)
        callbacks = [Executor(executor)] if k == 1 else []
        return fit(mlp(), callbacks, accelerator="mncore", strategy=strategy)

    runs = {
        "data": data,
        "eager": lambda: 1e6 / bl._run_eager(mlp(), loader, args.epochs)["steps_per_second"],
        "cpu": lambda: fit(mlp(), accelerator="cpu"),
        "cpu-floor": lambda: fit(bl._floor_module(), accelerator="cpu"),
        "mncore-nograph": lambda: mncore(executor="replay"),
        "mncore-stream": lambda: mncore(executor="stream"),
        "mncore": mncore,
        "mncore-k8": lambda: mncore(8),
        "matmuls": matmuls,
    }
    times: dict[str, list[float]] = {c: [] for c in args.configs}
    for round_ in range(args.rounds):
        for config in args.configs:
            times[config].append(runs[config]())
        print(f"round {round_}: " + ", ".join(f"{c} {t[-1]:.0f}" for c, t in times.items()))
    us = {c: statistics.median(t) for c, t in times.items()}
    report = {
        "threads": args.threads,
        "rounds": args.rounds,
        "us_per_step_median": {c: round(v, 1) for c, v in us.items()},
        "us_per_step_all": {c: [round(v, 1) for v in t] for c, t in times.items()},
    }
    fits = {c: v for c, v in us.items() if c not in NOT_A_FIT}
    if "cpu" in us:
        report["vs_lightning_cpu"] = {c: round(us["cpu"] / v, 2) for c, v in fits.items()}
    if "eager" in us:
        report["vs_eager"] = {c: round(us["eager"] / v, 2) for c, v in fits.items()}
    if {"cpu", "mncore-nograph", "matmuls"} <= us.keys():
        # a step with its graph no longer than its matmuls: the best one step per call can do
        report["best_vs_lightning_cpu"] = round(
            us["cpu"] / (us["mncore-nograph"] + us["matmuls"]), 2
        )
    if "mncore" in us and "mncore-nograph" in us and "cpu" in us:
        # what a step's graph may take for the step to reach 2x cpu, all else as measured
        report["graph_budget_for_2x_cpu_us"] = round(us["cpu"] / 2 - us["mncore-nograph"], 1)
        report["graph_in_fit_us"] = round(us["mncore"] - us["mncore-nograph"], 1)
    if executor_us and "mncore" in us:
        # what the graph adds to a step: its executor, and the Python around it run slower
        report["executor_in_fit_us"] = round(statistics.median(executor_us), 1)
        if "mncore-nograph" in us:
            report["python_slowdown_in_fit_us"] = round(
                us["mncore"] - us["mncore-nograph"] - report["executor_in_fit_us"], 1
            )
    if stream_us and "mncore-nograph" in us:
        # the same split for the memory stream that stands in for the graph
        report["stream_in_fit_us"] = round(statistics.median(stream_us), 1)
        report["python_slowdown_from_stream_us"] = round(
            us["mncore-stream"] - us["mncore-nograph"] - report["stream_in_fit_us"], 1
        )
    print(json.dumps({k: v for k, v in report.items() if k != "us_per_step_all"}, indent=1))
    out = args.out or f"benchmarks/results/fit_floor_{args.threads}thread.json"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
