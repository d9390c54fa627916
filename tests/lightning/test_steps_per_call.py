"""MNCoreStrategy(steps_per_call=K): K training batches per device call train exactly as K=1.

Tolerance: ATOL = 1e-5 absolute (lightning_testing) on every logged per-step value, every
final weight and optimizer state tensor, and the learning rates. The K-step graph runs the
same aten ops in the same order as K calls of the one-step graph.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from mncore_lightning import MNCoreStrategy
from tests.lightning.lightning_testing import (
    ATOL,
    LitClassifier,
    assert_optimizer_state_close,
    assert_state_close,
    loader,
    trainer_kwargs,
)


class LoggingClassifier(LitClassifier):
    """Logs the loss, a value computed from the live step counter, the learning rate and its
    scheduler's last rate and count at every step, and keeps every value Lightning received from `self.log`, in call order."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.logged: list[tuple[str, float]] = []
        self.batch_ends: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("step_x2", self.global_step * 2.0 + batch_idx)  # arithmetic on live counters
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log("last_lr", self.lr_schedulers().get_last_lr()[0])  # the scheduler's, live
        self.log("scheduler_epoch", self.lr_schedulers().last_epoch)
        return loss

    def log(self, name, value, *args, **kwargs):
        self.logged.append((name, float(value)))
        super().log(name, value, *args, **kwargs)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.batch_ends.append((batch_idx, self.trainer.global_step, len(batch)))

    def on_train_end(self):
        functions = getattr(self.trainer.strategy, "compiled_functions", None)
        self.train_graphs = len(functions("train")) if functions else 0


def _fit(accelerator: str, steps_per_call: int = 1, **model_kwargs):
    L.seed_everything(0, verbose=False)
    model = LoggingClassifier(optimizer="adam", lr=0.05, scheduler="step", **model_kwargs)
    kwargs = trainer_kwargs(max_epochs=2)
    if accelerator == "mncore":
        kwargs["strategy"] = MNCoreStrategy(steps_per_call=steps_per_call)
    trainer = L.Trainer(accelerator=accelerator, **kwargs)
    # 10 batches per epoch: with K=4, groups of 4, 4 and a last group of 2
    trainer.fit(model, loader(n=160, batch_size=16, shuffle=True))
    return trainer, model


def test_k_steps_per_call_trains_as_one_step_per_call():
    cpu_trainer, cpu_model = _fit("cpu")
    one_trainer, one_model = _fit("mncore", 1)
    k_trainer, k_model = _fit("mncore", 4)

    # every step's logged loss, counter-derived value and learning rate, in order
    assert [n for n, _ in k_model.logged] == [n for n, _ in one_model.logged]
    assert len(k_model.logged) == 5 * 20
    for (name, k_value), (_, one_value), (_, cpu_value) in zip(
        k_model.logged, one_model.logged, cpu_model.logged, strict=True
    ):
        assert k_value == pytest.approx(one_value, abs=ATOL), name
        assert k_value == pytest.approx(cpu_value, abs=ATOL), name
    # the epoch aggregate Lightning computed from the per-step values
    torch.testing.assert_close(
        k_trainer.callback_metrics["train_loss_epoch"],
        one_trainer.callback_metrics["train_loss_epoch"],
        atol=ATOL,
        rtol=0,
    )
    assert_state_close(k_model, one_model)
    assert_state_close(k_model, cpu_model)
    assert_optimizer_state_close(k_trainer.optimizers[0], one_trainer.optimizers[0])
    # the epoch-interval StepLR halved the learning rate twice
    assert k_trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 / 4)
    # global_step counts optimizer steps; Lightning's batches are the groups (4, 4, 2)
    assert k_trainer.global_step == one_trainer.global_step == 20
    # and batch-level hooks get each group as the list of its batches
    assert k_model.batch_ends == [
        (0, 4, 4),
        (1, 8, 4),
        (2, 10, 2),
        (0, 14, 4),
        (1, 18, 4),
        (2, 20, 2),
    ]
    # one device function for full groups, one for the shorter last group of an epoch, and
    # both again after the learning rate's first change (a float Dynamo specializes until it
    # changes once, then a graph input: one re-compile in the fit)
    assert k_model.train_graphs == 4
    assert k_trainer.strategy.retraces == 1
    assert k_trainer.strategy.compiled_calls == 6


class ManualModel(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.manual_backward(loss)
        opt.step()


class StepScheduled(LitClassifier):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize(
    ("model_cls", "overrides", "message"),
    [
        (ManualModel, {}, "manual optimization"),
        (StepScheduled, {}, "interval='step'"),
        (LitClassifier, {"accumulate_grad_batches": 2}, "accumulate_grad_batches=2"),
    ],
    ids=["manual", "step-scheduler", "accumulation"],
)
def test_unsupported_combinations_are_refused(model_cls, overrides, message):
    trainer = L.Trainer(
        accelerator="mncore",
        strategy=MNCoreStrategy(steps_per_call=4),
        **trainer_kwargs(max_epochs=1, **overrides),
    )
    with pytest.raises(MisconfigurationException, match=f"steps_per_call=4.*{message}"):
        trainer.fit(model_cls(), loader(n=128, batch_size=16))


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_steps_per_call_must_be_a_positive_int(bad):
    with pytest.raises((TypeError, ValueError), match="steps_per_call"):
        MNCoreStrategy(steps_per_call=bad)


class EpochLogged(LitClassifier):
    """Lightning's own `log` (not overridden): replays take the direct path after the first."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("loss_max", loss, on_step=False, on_epoch=True, reduce_fx="max")
        return loss


@pytest.mark.parametrize("accelerator", ["cpu", "mncore"])
def test_epoch_aggregates_of_k_step_calls_match(accelerator):
    def fit(k: int):
        L.seed_everything(0, verbose=False)
        model = EpochLogged()
        kwargs = trainer_kwargs(max_epochs=1)
        kwargs["accelerator"] = accelerator if k == 1 else "mncore"
        if k > 1:
            kwargs["strategy"] = MNCoreStrategy(steps_per_call=k)
        trainer = L.Trainer(**kwargs)
        trainer.fit(model, loader(n=112, batch_size=16, shuffle=True))  # 7 batches: 3 + 3 + 1
        return trainer.callback_metrics

    reference, grouped = fit(1), fit(3)
    for key in ("loss_epoch", "loss_max"):
        torch.testing.assert_close(grouped[key], reference[key], atol=ATOL, rtol=0, msg=key)


class UngroupsBatches(LitClassifier):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch[0]  # the group's first batch instead of the group


def test_a_hook_that_replaces_the_group_is_named():
    trainer = L.Trainer(
        accelerator="mncore",
        strategy=MNCoreStrategy(steps_per_call=2),
        **trainer_kwargs(max_epochs=1),
    )
    with pytest.raises(MisconfigurationException, match="steps_per_call=2.*got a list"):
        trainer.fit(UngroupsBatches(), loader(n=64, batch_size=16))


def test_max_steps_counts_optimizer_steps():
    def fit(k: int):
        L.seed_everything(0, verbose=False)
        model = LitClassifier()
        trainer = L.Trainer(
            accelerator="mncore",
            strategy=MNCoreStrategy(steps_per_call=k),
            **trainer_kwargs(max_epochs=5, max_steps=8),
        )
        trainer.fit(model, loader(n=96, batch_size=16, shuffle=True))  # 6 batches per epoch
        return trainer, model

    # with K=4: groups of 4 and 2 in epoch 0, then one of 4 cut to the 2 steps left
    (one_trainer, one_model), (k_trainer, k_model) = fit(1), fit(4)
    assert k_trainer.global_step == one_trainer.global_step == 8
    assert k_trainer.current_epoch == one_trainer.current_epoch  # stopped in the same epoch
    assert_state_close(k_model, one_model)
