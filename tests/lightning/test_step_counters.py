"""Step counters and hyperparameters read inside a compiled step follow their live values.

The step is captured by TorchDynamo: the counters are graph inputs, Python arithmetic on them
is computed in the graph, and a branch on one guards the comparison (a re-compile when it
flips). Same seed and data on accelerator="cpu" and "mncore" (O0); ATOL = 1e-5 absolute.
Branches and math on `global_step` are in test_dynamo_capture.py too (a branch compiles twice
in a fit; cos, log2, floor, round of it compile once).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from tests.lightning.lightning_testing import ATOL, LitClassifier, assert_state_close, fit_once


class LoggedPerStep(Callback):
    """What each training step logged, read after the step."""

    def __init__(self, *keys: str) -> None:
        self.keys = keys
        self.values: list[list[float]] = []

    def on_train_batch_end(self, trainer, module, *args) -> None:
        self.values.append([float(trainer.callback_metrics[k]) for k in self.keys])


def _both(model_cls, keys=(), retraces=None, **kwargs):
    """Fit on cpu and mncore: the same losses and weights; the values `keys` logged at each
    step (cpu's, mncore's); `retraces`: the mncore run's re-compiles, if given."""
    runs = []
    for accelerator in ("cpu", "mncore"):
        spy = LoggedPerStep(*keys)
        trainer, model, losses = fit_once(
            accelerator, model_cls=model_cls, callbacks=[spy], **kwargs
        )
        runs.append((trainer, model, losses, spy))
    (_, cpu_model, cpu_losses, cpu_spy), (trainer, mn_model, mn_losses, mn_spy) = runs
    torch.testing.assert_close(
        torch.stack(cpu_losses.losses), torch.stack(mn_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu_model, mn_model)
    if retraces is not None:
        assert trainer.strategy.retraces == retraces
    return cpu_spy.values, mn_spy.values


class WarmUp(LitClassifier):
    """A warm-up on global_step and a KL-style weight on current_epoch, inside the loss."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        warm = torch.clamp(torch.as_tensor(self.global_step / 4), max=1.0)
        beta = 0.5 + self.current_epoch * 0.25 + batch_idx * 0.01
        return loss * warm * beta


def test_arithmetic_on_counters_follows_the_live_values():
    _both(WarmUp, max_epochs=2)


class LogsCounters(LitClassifier):
    def training_step(self, batch, batch_idx):
        self.log("epoch", self.current_epoch)
        self.log("step", self.global_step)
        self.log("idx", batch_idx)
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)


def test_logged_counters_and_learning_rate_are_the_live_values():
    cpu, mn = _both(
        LogsCounters,
        keys=("epoch", "step", "idx", "lr"),
        model_kwargs={"scheduler": "step"},
        max_epochs=3,
    )
    assert cpu == mn
    assert {row[0] for row in mn} == {0.0, 1.0, 2.0}  # the epoch moved ...
    assert len({row[3] for row in mn}) == 3  # ... and so did the learning rate (StepLR)


class LogsAPythonNumber(LitClassifier):
    def training_step(self, batch, batch_idx):
        self.log("constant", 0.5)
        return super().training_step(batch, batch_idx)


def test_logging_another_python_number_logs_it_as_on_cpu():
    """A Python number logged in the step is logged at every step, as on cpu, with no
    warning (the make_fx tracer warned that it was the trace-time value)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cpu, mn = _both(LogsAPythonNumber, keys=("constant",), retraces=0)
    assert mn == cpu == [[0.5]] * 8
    assert not [w for w in record if "traced with" in str(w.message)]


class CountersOnTheRight(LitClassifier):
    """A counter on the right of a Python float (float's own arithmetic runs first), in a
    power, as an index, through torch.tensor / torch.as_tensor, and read from the trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.linspace(0.5, 1.5, 64)  # one factor per global step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        trainer = self.trainer
        factors = (
            1.0 + 0.1 * self.current_epoch,
            0.9**self.global_step,
            self.table[self.global_step],
            torch.tensor(self.global_step, dtype=torch.float32) / 8 + 1,
            torch.as_tensor([batch_idx, 2.0]).sum() / 4,
            1.0 + 0.5 * trainer.current_epoch + 0.01 * trainer.global_step,
        )
        for factor in factors:
            loss = loss * factor
        return loss


def test_counters_follow_the_live_value_on_either_side_and_through_tensor_factories():
    _both(CountersOnTheRight, max_epochs=3)


class ReturnsTheCounters(LitClassifier):
    """The step returns its counters in the output dict and appends them to a list, as
    Python ints."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []
        self.appended: list = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.appended.append({"idx": batch_idx, "epoch": self.current_epoch})
        return {"loss": loss, "idx": batch_idx, "step": self.trainer.global_step}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append((outputs["idx"], outputs["step"], type(outputs["idx"])))


def test_counters_returned_or_appended_by_the_step_are_their_values_at_each_step():
    runs = [fit_once(a, model_cls=ReturnsTheCounters, max_epochs=2) for a in ("cpu", "mncore")]
    (_, cpu, _), (_, mn, _) = runs
    assert mn.seen == cpu.seen
    assert len({idx for idx, _, _ in mn.seen}) > 1 and mn.seen[-1][2] is int
    assert mn.appended == cpu.appended
    assert {type(v) for item in mn.appended for v in item.values()} == {int}


class ComputesWithTheLearningRate(LitClassifier):
    """The learning rate read from the param group, computed with in the loss and logged
    through Python arithmetic, while StepLR halves it every epoch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        lr = self.optimizers().param_groups[0]["lr"]
        loss = F.cross_entropy(self(x), y)
        self.log("lr_x10", lr * 10)
        return loss / lr * 0.1 + 0.01 * (1.0 / lr) + (2.0 * lr) ** 2


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "RMSprop"])
def test_computing_with_the_learning_rate_follows_its_live_value(optimizer):
    cpu, mn = _both(
        ComputesWithTheLearningRate,
        keys=("lr_x10",),
        model_kwargs={"scheduler": "step", "optimizer": optimizer},
        max_epochs=3,
    )
    torch.testing.assert_close(torch.tensor(mn), torch.tensor(cpu), atol=ATOL, rtol=0)
    assert len({row[0] for row in mn}) == 3  # StepLR moved it each epoch


class ReadsItsScheduler(LitClassifier):
    """Logs its scheduler's last learning rate and count, and warms the loss up on the count
    (StepLR halving every second step or epoch)."""

    interval = "epoch"

    def training_step(self, batch, batch_idx):
        scheduler = self.lr_schedulers()
        self.log("last_lr", scheduler.get_last_lr()[0])
        self.log("last_epoch", scheduler.last_epoch)
        warm_up = torch.clamp(torch.as_tensor((scheduler.last_epoch + 1) / 3), max=1.0)
        return super().training_step(batch, batch_idx) * warm_up

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return [optimizer], [{"scheduler": scheduler, "interval": self.interval}]


class ReadsItsSchedulerEachStep(ReadsItsScheduler):
    interval = "step"


@pytest.mark.parametrize("model_cls", [ReadsItsScheduler, ReadsItsSchedulerEachStep])
def test_a_schedulers_last_lr_and_count_follow_their_live_values(model_cls):
    cpu, mn = _both(model_cls, keys=("last_lr", "last_epoch"), max_epochs=3)
    assert mn == cpu
    assert len({row[0] for row in mn}) >= 2 and len({row[1] for row in mn}) >= 3  # they moved


class BranchesOnItsScheduler(LitClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.lr_schedulers().last_epoch < 1:  # frozen if it were the Python int
            loss = loss * 2
        return loss


def test_control_flow_on_a_schedulers_count_as_on_cpu():
    """The branch guards `last_epoch < 1`, which flips once, after the first epoch."""
    _both(BranchesOnItsScheduler, model_kwargs={"scheduler": "step"}, max_epochs=3, retraces=1)


class ComparesTheLearningRate(LitClassifier):
    """Comparisons with the learning rate that follow it: through a tensor, and with one."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        lr = self.optimizers().param_groups[0]["lr"]
        boost = torch.where(torch.as_tensor(lr) < 0.07, 2.0, 1.0)
        return loss * boost + (lr < loss.detach()).float() * 0.01


def test_comparing_the_learning_rate_through_tensors_follows_it():
    _both(ComparesTheLearningRate, model_kwargs={"scheduler": "step"}, max_epochs=3)


class BranchesOnTheLearningRate(LitClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.optimizers().param_groups[0]["lr"] < 0.07:  # frozen if it were compared
            loss = loss * 2
        return loss


class BranchesOnAScaledLearningRate(LitClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.optimizers().param_groups[0]["lr"] * 10 < 0.7:  # computed from it, then compared
            loss = loss * 2
        return loss


@pytest.mark.parametrize("model_cls", [BranchesOnTheLearningRate, BranchesOnAScaledLearningRate])
def test_a_python_comparison_of_the_learning_rate_as_on_cpu(model_cls):
    """StepLR halves the learning rate every epoch (0.1, 0.05, 0.025): the branch is taken
    from the second epoch on, as on cpu; its first change re-compiles once."""
    _both(model_cls, model_kwargs={"scheduler": "step"}, max_epochs=3, retraces=1)


class ReadsIsLastBatch(LitClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("last", float(self.trainer.is_last_batch))  # True at one batch on cpu
        return loss


def test_reading_is_last_batch_in_the_step_as_on_cpu():
    """True at each epoch's last batch: its guard fails there once (the graph for False is
    kept, and the next epoch's first batch uses it again)."""
    cpu, mn = _both(ReadsIsLastBatch, keys=("last",), max_epochs=2, retraces=1)
    assert mn == cpu == [[0.0], [0.0], [0.0], [1.0]] * 2


class LogsWithACountedBatchSize(LitClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("weighted", loss, on_epoch=True, batch_size=batch_idx + 1)
        return loss


class EpochMeans(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_epoch_end(self, trainer, module) -> None:
        self.values.append(float(trainer.callback_metrics["weighted_epoch"]))


def test_a_logging_option_computed_from_a_counter_as_on_cpu():
    """batch_size=batch_idx + 1 is computed in the graph and given to Lightning at each
    step: the epoch means are weighted as on cpu."""
    means = []
    for accelerator in ("cpu", "mncore"):
        epochs = EpochMeans()
        trainer, _, _ = fit_once(
            accelerator, model_cls=LogsWithACountedBatchSize, callbacks=[epochs]
        )
        means.append(epochs.values)
    assert len(means[1]) == 2
    assert means[1] == pytest.approx(means[0], abs=ATOL)
    assert trainer.strategy.retraces == 0
    _both(LogsWithACountedBatchSize, keys=("weighted_step",), retraces=0)
