"""A user's data-parallel script, run in 2 processes by tests/lightning/test_ddp.py.

    python -m tests.lightning.ddp_script OUT RUN [RUN ...]             (Lightning launches rank 1)
    python -m torch.distributed.run --nproc_per_node 2 -m tests.lightning.ddp_script OUT RUN ...

Each RUN fits the same model on the same data (2 epochs, a ragged validation set), then
validates, tests and predicts; every rank saves what it saw to OUT/<run>-rank<r>.pt. Several
runs share one launch: the imports of a 2-process start cost more than the runs themselves.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from mncore_lightning import MNCoreDDPStrategy
from tests.lightning.lightning_testing import LitClassifier, LossCollector, make_dataset

TRAIN, VAL, BATCH = 64, 26, 4  # 8 batches per rank; validation: 13 per rank, last batch of 1


class SyncedClassifier(LitClassifier):
    """Logs with sync_dist=True: Lightning averages the values over the ranks."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_loss_sum", loss, sync_dist=True, reduce_fx="sum", on_epoch=True)
        return loss

    def _evaluate(self, batch, stage: str):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log(f"{stage}_loss", loss, sync_dist=True)
        self.log(f"{stage}_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)
        return loss


class ManualClassifier(SyncedClassifier):
    """Manual optimization: the user's step calls manual_backward and step (DDP averages the
    gradients in every backward)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss, sync_dist=True)
        return loss


def _loaders() -> tuple[DataLoader, DataLoader]:
    train = DataLoader(make_dataset(TRAIN), batch_size=BATCH, shuffle=True)
    val = DataLoader(make_dataset(VAL, seed=1), batch_size=BATCH)
    return train, val


RUNS = {
    # name: (accelerator, strategy factory, model kwargs, trainer overrides)
    "cpu": ("cpu", lambda: "ddp", {}, {}),
    "mncore": ("mncore", lambda: "auto", {}, {}),
    "split": ("mncore", lambda: MNCoreDDPStrategy(split_step=True), {}, {}),
    "cpu_acc": ("cpu", lambda: "ddp", {"optimizer": "adam", "lr": 0.01}, {"acc": 2}),
    "mncore_acc": ("mncore", lambda: "mncore_ddp", {"optimizer": "adam", "lr": 0.01}, {"acc": 2}),
    "split_acc": (
        "mncore",
        lambda: MNCoreDDPStrategy(split_step=True),
        {"optimizer": "adam", "lr": 0.01},
        {"acc": 2},
    ),
    # per-rank BatchNorm statistics: DDP's broadcast_buffers=False
    "cpu_bn": ("cpu", lambda: DDPStrategy(broadcast_buffers=False), {"net": "bn"}, {}),
    "mncore_bn": ("mncore", lambda: MNCoreDDPStrategy(broadcast_buffers=False), {"net": "bn"}, {}),
    # the defaults: rank 0's BatchNorm statistics broadcast before each synced forward
    "cpu_bn_bcast": ("cpu", lambda: "ddp", {"net": "bn"}, {}),
    "mncore_bn_bcast": ("mncore", lambda: "auto", {"net": "bn"}, {}),
    # with accumulation: DDP syncs buffers only in a forward after a gradient sync
    "cpu_bn_bcast_acc": ("cpu", lambda: "ddp", {"net": "bn"}, {"acc": 2}),
    "mncore_bn_bcast_acc": ("mncore", lambda: "auto", {"net": "bn"}, {"acc": 2}),
    # SyncBatchNorm (Lightning converts the model): the global batch's statistics
    "mncore_syncbn": ("mncore", lambda: "auto", {"net": "bn"}, {"sync_bn": True}),
    "cpu_manual": ("cpu", lambda: "ddp", {"manual": True}, {}),
    "mncore_manual": ("mncore", lambda: "auto", {"manual": True}, {}),
    # MLSDK (the strict fake, tests/fake_mlsdk): each rank on its own board, split step by default
    "mlsdk": ("mncore", lambda: MNCoreDDPStrategy(device="mncore2:auto"), {}, {}),
}


def _use_fake_mlsdk() -> None:
    """Make `import mlsdk` give the fake (as tests/fake_mlsdk/install.py does in-process)."""
    from tests.fake_mlsdk.install import FAKE_ROOT, PRESET_DIR

    os.environ["PRESET_OPTIONS_DIR"] = str(PRESET_DIR)
    sys.path.insert(0, str(FAKE_ROOT))


class CaptureCollector(LossCollector):
    """LossCollector, and which frontend captured the training step (read before the
    strategy's teardown): "dynamo"; None on cpu."""

    train_capture: str | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        if hasattr(strategy, "_captured"):
            captured = any(k[0] == "train" for k in strategy._captured)
            self.train_capture = "dynamo" if captured else None


def run(name: str, out: Path) -> None:
    accelerator, strategy, model_kwargs, options = RUNS[name]
    model_kwargs = dict(model_kwargs)
    if name in ("mncore", "mncore_syncbn"):  # their graphs are read by the test
        codegen = out / ("codegen" if name == "mncore" else f"codegen_{name}")
        strategy = lambda: MNCoreDDPStrategy(codegen_dir=codegen)  # noqa: E731
    if name == "mlsdk":
        _use_fake_mlsdk()
    L.seed_everything(0, verbose=False)
    model_cls = ManualClassifier if model_kwargs.pop("manual", False) else SyncedClassifier
    model = model_cls(**model_kwargs)
    collector = CaptureCollector()
    trainer = L.Trainer(
        accelerator=accelerator,
        strategy=strategy(),
        devices=2,
        max_epochs=2,
        accumulate_grad_batches=options.get("acc", 1),
        sync_batchnorm=options.get("sync_bn", False),
        callbacks=[collector],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    train, val = _loaders()
    trainer.fit(model, train, val)
    results = {
        "world_size": dist.get_world_size(),
        "strategy": type(trainer.strategy).__name__,
        "losses": [loss.item() for loss in collector.losses],
        "epoch_metrics": [{k: v.item() for k, v in m.items()} for m in collector.epoch_metrics],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "compiled_calls_fit": getattr(trainer.strategy, "compiled_calls", None),
        "split_step": getattr(trainer.strategy, "split_step", None),
        "train_capture": collector.train_capture,
        "device": str(getattr(trainer.strategy, "mncore_device", "")),
        "validate": trainer.validate(model, val, verbose=False),
        "test": trainer.test(model, val, verbose=False),
        "predict": torch.cat(trainer.predict(model, val)),
    }
    if name == "mncore":  # checkpoint after epoch 1, resume to epoch 2: as one 2-epoch fit
        ckpt = out / "mncore-epoch1.ckpt"
        L.seed_everything(0, verbose=False)
        model = SyncedClassifier(**model_kwargs)
        quiet = dict(
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
        )
        first = L.Trainer(accelerator="mncore", devices=2, max_epochs=1, **quiet)
        first.fit(model, *_loaders())
        first.save_checkpoint(ckpt)  # rank 0 writes; every rank waits for it
        resumed_model = SyncedClassifier(**model_kwargs)
        resumed = L.Trainer(accelerator="mncore", devices=2, max_epochs=2, **quiet)
        resumed.fit(resumed_model, *_loaders(), ckpt_path=ckpt)
        results["resumed_state"] = resumed_model.state_dict()
        results["checkpoint_files"] = sorted(p.name for p in out.glob("*.ckpt"))
    if name == "mlsdk":
        import mlsdk

        results["mlsdk_calls"] = [call.name for call in mlsdk.call_log]
    torch.save(results, out / f"{name}-rank{trainer.global_rank}.pt")


def collectives_o1(out: Path) -> None:
    """The device layer alone: a step whose gradients are averaged by torch's functional
    collectives traces into one graph and runs under TorchInductor (O1) as eager DDP-style
    code does (dist.all_reduce). Needs the process group a previous run left."""
    import torch.distributed._functional_collectives as funcol

    from mncore_device import Context, MNDevice, set_tensor_name_in_module

    rank, world = dist.get_rank(), dist.get_world_size()

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        # no momentum: its buffer is created at the first step (the strategy pre-creates it)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, optimizer = model_and_optimizer()
    set_tensor_name_in_module(model, "model")
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    for param in model.parameters():
        context.register_param(param)

    def step(inputs):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs["x"]), inputs["y"])
        loss.backward()
        for param in model.parameters():
            summed = funcol.wait_tensor(
                funcol.all_reduce(param.grad / world, "sum", dist.group.WORLD)
            )
            param.grad.copy_(summed)
        optimizer.step()
        return {"loss": loss.detach()}

    data = make_dataset(32, seed=rank)
    batches = [
        {"x": data.tensors[0][i : i + 8], "y": data.tensors[1][i : i + 8]} for i in (0, 8, 16)
    ]
    compiled = context.compile(
        step, batches[0], out / f"collectives-rank{rank}", {"option_json": "O1"}
    )
    losses = [compiled(b)["loss"].item() for b in batches]
    context.synchronize()
    eager, eager_optimizer = model_and_optimizer()
    eager_losses = []
    for b in batches:
        eager_optimizer.zero_grad()
        loss = F.cross_entropy(eager(b["x"]), b["y"])
        loss.backward()
        for param in eager.parameters():
            param.grad /= world
            dist.all_reduce(param.grad)
        eager_optimizer.step()
        eager_losses.append(loss.item())
    results = {
        "losses": losses,
        "eager_losses": eager_losses,
        "state": model.state_dict(),
        "eager_state": eager.state_dict(),
        "graph": (out / f"collectives-rank{rank}" / "graph.py").read_text(),
    }
    torch.save(results, out / f"collectives_o1-rank{rank}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    for name in sys.argv[2:]:
        if name == "collectives_o1":
            collectives_o1(out)
        else:
            run(name, out)


if __name__ == "__main__":
    main()
