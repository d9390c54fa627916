"""Data-parallel scaling on this machine: 1 and 2 ranks, accelerator="mncore" vs "cpu".

Runs the MN-Core tutorial MLP (1024-256-10, batch 64 per rank, SGD momentum 0.9, one
`self.log` per step) through `trainer.fit` with one thread per rank, in these configurations:
  - cpu-1:           Lightning's cpu accelerator, one process
  - cpu-ddp2:        accelerator="cpu", strategy="ddp", devices=2
  - mncore-1:        accelerator="mncore" (preset O1), one device
  - mncore-ddp2:     accelerator="mncore", devices=2: the all-reduce inside the compiled step
  - mncore-ddp2-split: MNCoreDDPStrategy(split_step=True): host all-reduce between two calls
Each configuration is its own launch (Lightning starts rank 1 by re-running this script),
repeated and interleaved; medians are reported. Steps/s counts steady-state epochs (the first
epoch, which holds the compile, is excluded); samples/s = steps/s x 64 x ranks. The
all-reduce's time share: for the split step, the host all-reduce time the strategy measured;
for every 2-rank run, also one gloo all-reduce of the model's gradient (as one flat fp32
vector) timed on its own after fit, divided by the step time.

    python benchmarks/bench_ddp.py [--repeats 3] [--epochs 4] [--steps 50] [--out FILE]
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

BATCH = 64
CONFIGS = ("cpu-1", "cpu-ddp2", "mncore-1", "mncore-ddp2", "mncore-ddp2-split")


def _run(config: str, epochs: int, steps: int, out: Path) -> None:
    """One configuration (in each rank's process); rank 0 writes the measurements."""
    import lightning as L
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from mncore_lightning import MNCoreDDPStrategy

    ranks = 2 if "ddp2" in config else 1

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
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class EpochTimer(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_train_epoch_start(self, trainer, module) -> None:
            self._start = time.perf_counter()

        def on_train_epoch_end(self, trainer, module) -> None:
            self.seconds.append(time.perf_counter() - self._start)

    g = torch.Generator().manual_seed(0)
    n = steps * BATCH * ranks  # the same number of steps per rank in every configuration
    data = TensorDataset(
        torch.randn(n, 1, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    strategy: object = "auto"
    if config == "cpu-ddp2":
        strategy = "ddp"
    elif config == "mncore-ddp2-split":
        strategy = MNCoreDDPStrategy(split_step=True)
    timer = EpochTimer()
    trainer = L.Trainer(
        accelerator="cpu" if config.startswith("cpu") else "mncore",
        strategy=strategy,
        devices=ranks,
        max_epochs=epochs,
        callbacks=[timer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    L.seed_everything(0, verbose=False)
    model = TutorialMLP()
    trainer.fit(model, loader)
    steady = timer.seconds[1:]
    step_s = sum(steady) / (len(steady) * steps)
    result = {
        "config": config,
        "ranks": ranks,
        "threads_per_rank": torch.get_num_threads(),
        "steps_per_s": 1 / step_s,
        "samples_per_s": BATCH * ranks / step_s,
        "first_epoch_s": timer.seconds[0],
    }
    if ranks > 1:
        flat = torch.zeros(sum(p.numel() for p in model.parameters()))
        for _ in range(5):
            dist.all_reduce(flat)
        start = time.perf_counter()
        for _ in range(50):
            dist.all_reduce(flat)
        allreduce_s = (time.perf_counter() - start) / 50
        result["allreduce_ms"] = allreduce_s * 1e3
        result["allreduce_share"] = allreduce_s / step_s
        result["gradient_mb"] = flat.numel() * 4 / 1e6
    seconds = getattr(trainer.strategy, "allreduce_seconds", 0.0)
    if seconds:
        total_steps = steps * epochs
        result["split_host_allreduce_share"] = seconds / total_steps / step_s
    if trainer.global_rank == 0:
        out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50, help="steps per rank and epoch")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one configuration, in its launch
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        _run(args.run, args.epochs, args.steps, args.result)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MNCORE_PRESET": "O1", "MNCORE_DEVICE": "pfvm:cpu"}
    env.pop("LOCAL_RANK", None)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # interleaved: config order within each repeat
            for config in args.configs:
                result = Path(tmp) / f"{config}-{repeat}.json"
                command = [sys.executable, __file__, "--run", config, "--result", str(result)]
                command += ["--epochs", str(args.epochs), "--steps", str(args.steps)]
                subprocess.run(command, env=env, check=True, capture_output=True)
                runs[config].append(json.loads(result.read_text()))
                print(config, repeat, runs[config][-1], flush=True)
    summary = {}
    for config, results in runs.items():
        keys = [k for k, v in results[0].items() if isinstance(v, float)]
        summary[config] = {k: statistics.median(r[k] for r in results) for k in keys}
        summary[config]["ranks"] = results[0]["ranks"]
    base = {"cpu": summary.get("cpu-1"), "mncore": summary.get("mncore-1")}
    print(f"\n{'config':<20}{'steps/s':>9}{'samples/s':>11}{'x 1 rank':>10}{'all-reduce':>12}")
    for config, s in summary.items():
        one = base["cpu" if config.startswith("cpu") else "mncore"]
        scaling = s["samples_per_s"] / one["samples_per_s"] if one else float("nan")
        share = s.get("split_host_allreduce_share", s.get("allreduce_share"))
        share_text = f"{share:.0%}" if share is not None else "-"
        print(
            f"{config:<20}{s['steps_per_s']:>9.0f}{s['samples_per_s']:>11.0f}{scaling:>10.2f}{share_text:>12}"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "machine": "2 CPU cores shared with other jobs; 1 thread per rank; medians",
                    "repeats": args.repeats,
                    "epochs": args.epochs,
                    "steps_per_rank_per_epoch": args.steps,
                    "summary": summary,
                    "runs": runs,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
