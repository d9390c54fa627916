"""A linear weight stored as on the host or transposed (runtime/matmul_layout.py), side by side.

- layers: for linear layers on the batch (batch, in -> out), the matmuls the layout timing
  runs (the forward's `x @ W.t()` and the weight's gradient), timed as a compile times
  them, with the weight stored as on the host and transposed, and the input gradient's
  matmul (`g @ W`) that a hidden layer adds, which the timing leaves out (microseconds).
- fit: `trainer.fit` on the tutorial MLP (bench_lightning.py's module and data, batch 64, no
  progress bar, no logger, O1), with the transposition as the timing decides and turned
  off, interleaved in one process; the median over rounds of each fit's median steady
  epoch (the first epoch, which compiles, is not counted), in microseconds per step.

  python benchmarks/bench_matmul_layout.py [--rounds 5] [--epochs 4] [--threads 1] [--out F]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_lightning as bl  # noqa: E402

LAYERS = [(64, 1024, 256), (64, 784, 128), (32, 3072, 512), (32, 768, 3072), (128, 512, 512)]


def layers() -> list[dict]:
    import torch

    from mncore_device.runtime.matmul_layout import Matmul, _runs

    rows = []
    cpu = torch.device("cpu")
    for batch, fan_in, fan_out in LAYERS:
        forward = Matmul((batch, fan_in), (fan_in, 1), (fan_in, fan_out), (1, fan_in), True,
                         "float32")  # fmt: skip
        gradient = Matmul((fan_out, batch), (1, fan_out), (batch, fan_in), (fan_in, 1), False,
                          "float32")  # fmt: skip
        row = {"layer": f"{batch}, {fan_in} -> {fan_out}"}
        for name, case in (("forward", forward), ("weight_gradient", gradient)):
            for transposed in (False, True):
                run = _runs([case], cpu, transposed)
                run()
                seconds = min(run() for _ in range(5)) / 5  # a pass runs each matmul 5 times
                row[f"{name}_{'transposed' if transposed else 'stored'}_us"] = round(seconds * 1e6)
        w = torch.randn(fan_out, fan_in)
        g = torch.randn(batch, fan_out)
        for transposed in (False, True):
            weight = w.t().contiguous().t() if transposed else w
            torch.mm(g, weight)
            start = time.perf_counter()
            for _ in range(20):
                torch.mm(g, weight)
            key = f"input_gradient_{'transposed' if transposed else 'stored'}_us"
            row[key] = round((time.perf_counter() - start) / 20 * 1e6)
        rows.append(row)
        print(row, flush=True)
    return rows


def fits(rounds: int, epochs: int) -> dict:
    import lightning as L
    import torch

    import mncore_lightning  # noqa: F401 (registers accelerator="mncore")
    from mncore_device.runtime import executors, matmul_layout

    timed = executors.transposed_where_faster
    decided = []

    def recorded(*args, **kwargs):
        decided.append(timed(*args, **kwargs))
        return decided[-1]

    def stored(*args, **kwargs):
        return matmul_layout.Transposition()

    us: dict[str, list[float]] = {"stored": [], "transposed": []}
    for _ in range(rounds):
        for variant in us:
            executors.transposed_where_faster = recorded if variant == "transposed" else stored
            torch.manual_seed(0)
            loader = bl._data()
            timer = bl._EpochTimer(loader)
            timer.callback.on_train_end = lambda *a: None  # the wall time only, no profile
            trainer = L.Trainer(
                accelerator="mncore", max_epochs=epochs, callbacks=[timer.callback],
                logger=False, enable_progress_bar=False, enable_checkpointing=False,
                enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(bl._module_cls()(), loader)
            steps_per_second = bl._summary(timer.epochs)["steps_per_second"]
            us[variant].append(round(1e6 / steps_per_second, 1))
            print(variant, us[variant][-1], flush=True)
    executors.transposed_where_faster = timed
    medians = {k: statistics.median(v) for k, v in us.items()}
    return {
        "us_per_step_median": medians,
        "us_per_step_all": us,
        "transposed_inputs": sorted({len(d.inputs) for d in decided}),
        "steps_per_second_ratio": round(medians["stored"] / medians["transposed"], 3),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", nargs="+", default=["layers", "fit"], choices=["layers", "fit"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    import torch

    torch.set_num_threads(args.threads)
    report = {
        "command": "python benchmarks/bench_matmul_layout.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads,
    }
    if "layers" in args.parts:
        report["layers"] = layers()
    if "fit" in args.parts:
        report["fit"] = fits(args.rounds, args.epochs)
        print(
            json.dumps(report["fit"]["us_per_step_median"]), report["fit"]["steps_per_second_ratio"]
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
