"""Step counters and hyperparameters read inside a compiled step follow their live values.

Same seed and data on accelerator="cpu" and "mncore" (O0); ATOL = 1e-5 absolute.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from mncore_device import StaticGraphError
from tests.lightning.lightning_testing import ATOL, LitClassifier, assert_state_close, fit_once


class LoggedPerStep(Callback):
    """What each training step logged, read after the step."""

    def __init__(self, *keys: str) -> None:
        self.keys = keys
        self.values: list[list[float]] = []

    def on_train_batch_end(self, trainer, module, *args) -> None:
        self.values.append([float(trainer.callback_metrics[k]) for k in self.keys])


def _both(model_cls, keys=(), **kwargs):
    runs = []
    for accelerator in ("cpu", "mncore"):
        spy = LoggedPerStep(*keys)
        trainer, model, losses = fit_once(
            accelerator, model_cls=model_cls, callbacks=[spy], **kwargs
        )
        runs.append((trainer, model, losses, spy))
    (_, cpu_model, cpu_losses, cpu_spy), (_, mn_model, mn_losses, mn_spy) = runs
    torch.testing.assert_close(
        torch.stack(cpu_losses.losses), torch.stack(mn_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu_model, mn_model)
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


class BranchesOnStep(LitClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step < 2:  # a Python branch on a counter cannot follow it
            loss = loss * 2
        return loss


def test_control_flow_on_a_counter_raises_at_the_line():
    lines, first = inspect.getsourcelines(BranchesOnStep.training_step)
    lineno = first + next(i for i, t in enumerate(lines) if "self.global_step < 2" in t)
    with pytest.raises(StaticGraphError, match=rf"global_step.*:{lineno}.*torch.where"):
        fit_once("mncore", model_cls=BranchesOnStep)


class LogsAPythonNumber(LitClassifier):
    def training_step(self, batch, batch_idx):
        self.log("constant", 0.5)
        return super().training_step(batch, batch_idx)


def test_logging_another_python_number_warns_that_it_is_the_trace_time_value():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit_once("mncore", model_cls=LogsAPythonNumber)
    messages = [str(w.message) for w in record if "traced with" in str(w.message)]
    assert len(messages) == 1 and "'constant'" in messages[0]
