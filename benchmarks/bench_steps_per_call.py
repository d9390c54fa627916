"""steps_per_call=8 against steps_per_call=1, in ONE process, interleaved.

The tutorial MLP of bench_lightning.py (batch 64, 100 steps an epoch, preset O1), fit for
`--epochs` epochs per round. For each configuration: the median of
`strategy.training_step` per call (after the first epoch, which compiles) divided by the
steps a call runs, in microseconds per step, and the host part of it (the step less its
device call). Reports the median over rounds.

    python benchmarks/bench_steps_per_call.py [--rounds 5] [--epochs 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_lightning as bl  # noqa: E402

KS = (1, 8)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import lightning as L
    import torch

    import mncore_lightning
    from mncore_device.runtime import compiled
    from mncore_lightning.strategy import CompiledSteps

    torch.set_num_threads(1)
    steps: list[float] = []
    device: list[float] = []

    def timing(function, into):
        def timed(*a, **k):
            start = time.perf_counter()
            result = function(*a, **k)
            into.append(time.perf_counter() - start)
            return result

        return timed

    CompiledSteps.training_step = timing(CompiledSteps.training_step, steps)
    compiled.CompiledFunction.__call__ = timing(compiled.CompiledFunction.__call__, device)
    loader, mlp = bl._data(), bl._module_cls()

    def fit(k: int) -> tuple[float, float]:
        groups = -(-bl.STEPS_PER_EPOCH // k)  # a shorter last group is a call too
        strategy = mncore_lightning.MNCoreStrategy(device="pfvm:cpu", preset="O1", steps_per_call=k)
        trainer = L.Trainer(
            accelerator="mncore",
            strategy=strategy,
            max_epochs=args.epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        steps.clear()
        device.clear()
        trainer.fit(mlp(), loader)
        steady = steps[groups:]
        host = [s - d for s, d in zip(steady, device[-len(steady) :], strict=True)]
        return statistics.median(steady) / k * 1e6, statistics.median(host) / k * 1e6

    times: dict[str, list[tuple[float, float]]] = {f"steps_per_call={k}": [] for k in KS}
    for round_ in range(args.rounds):
        for k, capture in zip(KS, times, strict=True):
            times[capture].append(fit(k))
        print(
            f"round {round_}: "
            + ", ".join(
                f"{c} {t[-1][0]:.0f} us/step (host {t[-1][1]:.0f})" for c, t in times.items()
            ),
            flush=True,
        )
    report = {
        capture: {
            "step_us": statistics.median(t[0] for t in values),
            "host_us": statistics.median(t[1] for t in values),
        }
        for capture, values in times.items()
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
