"""Learning-rate changes made on the host reach the compiled step, without recompiling.

Tolerance: ATOL = 1e-5 absolute on weights (conftest).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.lightning.lightning_testing import LitClassifier, assert_state_close, fit_once, loader


class CompileWatcher(Callback):
    """Records the compiled training function and the compiled-function count per epoch."""

    def __init__(self) -> None:
        self.compiled: list[object] = []
        self.counts: list[float] = []
        self.lrs: list[list[float]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.lrs.append([g["lr"] for g in trainer.optimizers[0].param_groups])
        strategy = trainer.strategy
        if hasattr(strategy, "device_stats"):
            self.compiled.append(tuple(strategy.compiled_functions("train")))
            self.counts.append(strategy.device_stats()["mncore/compiled_functions"])


class DecayLearningRate(Callback):
    """Lightning docs' DecayLearningRate: edits param_group["lr"] at every epoch end."""

    def __init__(self, factor: float = 0.5) -> None:
        self.factor = factor
        self.old_lrs: list[list[float]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        for optimizer in trainer.optimizers:
            self.old_lrs.append([group["lr"] for group in optimizer.param_groups])

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        for index, optimizer in enumerate(trainer.optimizers):
            new_lrs = []
            for p_index, group in enumerate(optimizer.param_groups):
                new_lr = self.old_lrs[index][p_index] * self.factor
                new_lrs.append(new_lr)
                group["lr"] = new_lr
            self.old_lrs[index] = new_lrs


class PerStepDecay(Callback):
    """Changes the lr before every training batch (a warm-up style schedule)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = group.setdefault("base_lr", group["lr"]) * (0.8**step)


class TwoGroups(LitClassifier):
    """Two param groups with different learning rates."""

    def configure_optimizers(self):
        first, last = self.net[0], self.net[-1]
        groups = [
            {"params": first.parameters(), "lr": self.hparams.lr},
            {"params": last.parameters(), "lr": self.hparams.lr / 4},
        ]
        if self.hparams.optimizer == "adamw":
            return torch.optim.AdamW(groups, weight_decay=0.1)
        return torch.optim.SGD(groups, momentum=0.9)


def _run(accelerator, model_kwargs, callbacks=(), model_cls=LitClassifier, epochs=3):
    watcher = CompileWatcher()
    trainer, model, collector = fit_once(
        accelerator,
        model_kwargs,
        model_cls=model_cls,
        train=loader(n=48, batch_size=16, shuffle=True),
        max_epochs=epochs,
        callbacks=[*callbacks, watcher],
    )
    return trainer, model, watcher


def _assert_one_compile(watcher: CompileWatcher) -> None:
    assert len(watcher.compiled) == 3
    assert all(c == watcher.compiled[0] for c in watcher.compiled), "training step recompiled"
    assert watcher.counts == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.2), ("adamw", 0.05)])
def test_step_lr_scheduler(optimizer, lr):
    kwargs = dict(optimizer=optimizer, lr=lr, scheduler="step")
    _, cpu_model, cpu_watch = _run("cpu", kwargs)
    trainer, model, watch = _run("mncore", kwargs)
    # lr observed at epoch end is after the scheduler stepped (epoch interval): lr * 0.5**e
    assert cpu_watch.lrs == [[lr * 0.5], [lr * 0.25], [lr * 0.125]]
    assert watch.lrs == cpu_watch.lrs
    assert_state_close(model, cpu_model)
    _assert_one_compile(watch)
    # and the schedule really changed the trained weights
    _, constant_model, _ = _run("cpu", dict(optimizer=optimizer, lr=lr))
    assert not torch.allclose(constant_model.net[0].weight, model.net[0].weight, atol=1e-3)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_callback_editing_param_group_lr(optimizer):
    kwargs = dict(optimizer=optimizer, lr=0.1)
    _, cpu_model, cpu_watch = _run("cpu", kwargs, [DecayLearningRate()], TwoGroups)
    _, model, watch = _run("mncore", kwargs, [DecayLearningRate()], TwoGroups)
    assert watch.lrs == cpu_watch.lrs == [[0.05, 0.0125], [0.025, 0.00625], [0.0125, 0.003125]]
    assert_state_close(model, cpu_model)
    _assert_one_compile(watch)
    _, undecayed, _ = _run("cpu", kwargs, [], TwoGroups)
    assert not torch.allclose(undecayed.net[0].weight, model.net[0].weight, atol=1e-3)


def test_lr_changed_before_every_batch():
    kwargs = dict(optimizer="sgd", lr=0.3)
    _, cpu_model, _ = _run("cpu", kwargs, [PerStepDecay()])
    _, model, watch = _run("mncore", kwargs, [PerStepDecay()])
    assert_state_close(model, cpu_model)
    _assert_one_compile(watch)


class CustomScheduler(LitClassifier):
    """configure_optimizers with a scheduler built by `make_scheduler(optimizer)`."""

    def __init__(self, kind: str = "sequential", **kwargs) -> None:
        super().__init__(**kwargs)
        self.kind = kind

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler
        if self.kind == "sequential":
            scheduler = sched.SequentialLR(
                optimizer,
                [
                    sched.ConstantLR(optimizer, factor=0.5, total_iters=1),
                    sched.StepLR(optimizer, 1),
                ],
                milestones=[1],
            )
            return {"optimizer": optimizer, "lr_scheduler": scheduler}
        if self.kind == "plateau":
            # mode="max" on a decreasing loss: the lr drops after every epoch (patience=0)
            scheduler = sched.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "train_loss"},
            }
        if self.kind == "lambda-step":
            scheduler = sched.LambdaLR(optimizer, lambda step: 0.9**step)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }
        raise ValueError(self.kind)


@pytest.mark.parametrize(
    "kind",
    [
        "sequential",
        "plateau",
        "lambda-step",
    ],
)
def test_other_schedulers_match_cpu(kind):
    kwargs = dict(kind=kind, lr=0.2)
    _, cpu_model, cpu_watch = _run("cpu", kwargs, model_cls=CustomScheduler)
    _, model, watch = _run("mncore", kwargs, model_cls=CustomScheduler)
    assert sum(watch.lrs, []) == pytest.approx(sum(cpu_watch.lrs, []), rel=1e-12)
    assert_state_close(model, cpu_model)
    _assert_one_compile(watch)


def test_scheduler_gives_no_spurious_warning(recwarn):
    _run("mncore", dict(scheduler="step"), epochs=2)
    messages = [str(w.message) for w in recwarn.list]
    assert not [m for m in messages if "lr_scheduler" in m or "learning rate scheduler" in m]
