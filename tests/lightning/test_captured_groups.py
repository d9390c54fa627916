"""MNCoreStrategy(steps_per_call=K) on the TorchDynamo capture (steps/groups.py).

Each group of K batches is ONE device call, and each of its steps runs the user's Python as
a step on cpu does: a value changed by a hook between epochs (a tuple attribute), a branch on global_step that flips inside a group, a tensor a step
leaves on the module for the next one. Every test compares with accelerator="cpu" (one step
per batch, same seed and batches) within ATOL = 1e-5: every value `self.log` received, in
order, the final callback metrics and the final weights; and checks that the steps ran on
the expected device functions.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from mncore_device import StaticGraphError
from mncore_lightning import MNCoreStrategy
from mncore_lightning.steps.groups import GROUP_KEY
from tests.lightning.lightning_testing import (
    ATOL,
    LitClassifier,
    assert_metrics_close,
    assert_state_close,
    loader,
    trainer_kwargs,
)
from tests.lightning.test_dynamo_capture import Branch, TupleAttribute

BATCH = 16


class LogsEveryCall:
    """Keeps every value Lightning's `self.log` receives, in call order (the K steps of a
    group are replayed in step order after the group's device call)."""

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if not hasattr(self, "logged"):
            self.logged = []
        number = value.detach() if isinstance(value, torch.Tensor) else value
        self.logged.append((name, float(number)))
        super().log(name, value, *args, **kwargs)


class Path(Callback):
    """Before the strategy's teardown: the device functions compiled for the captured
    groups."""

    functions = 0

    def on_train_end(self, trainer, module) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, MNCoreStrategy):
            return
        hook = strategy._captured.get(GROUP_KEY)
        self.functions = len(hook.compiled) if hook is not None else 0


def _fit(accelerator: str, model_cls: type, k: int = 1, *, epochs: int, batches: int):
    L.seed_everything(0, verbose=False)
    model = model_cls()
    path = Path()
    kwargs = trainer_kwargs(max_epochs=epochs, callbacks=[path])
    if accelerator == "mncore":
        kwargs["strategy"] = MNCoreStrategy(steps_per_call=k)
    trainer = L.Trainer(accelerator=accelerator, **kwargs)
    trainer.fit(model, loader(n=BATCH * batches, batch_size=BATCH, shuffle=True))
    return trainer, model, path


def _assert_as_on_cpu(model_cls: type, k: int, *, epochs: int, batches: int):
    cpu_trainer, cpu_model, _ = _fit("cpu", model_cls, epochs=epochs, batches=batches)
    trainer, model, path = _fit("mncore", model_cls, k, epochs=epochs, batches=batches)
    assert [n for n, _ in model.logged] == [n for n, _ in cpu_model.logged]
    assert len(model.logged) >= epochs * batches
    for (name, got), (_, want) in zip(model.logged, cpu_model.logged, strict=True):
        assert got == pytest.approx(want, abs=ATOL), name
    assert_metrics_close(trainer.callback_metrics, cpu_trainer.callback_metrics)
    assert_state_close(model, cpu_model)
    assert trainer.global_step == cpu_trainer.global_step == epochs * batches
    assert trainer.strategy.compiled_calls == epochs * -(-batches // k)
    return trainer, path


class GroupedTuple(LogsEveryCall, TupleAttribute):
    """Reads `self.scales`, a tuple a hook replaces after every epoch."""


def test_tuple_attribute_changed_between_epochs_under_steps_per_call_as_on_cpu():
    """Each step reads the tuple under Dynamo's guards: the tuple changed after epoch 0
    re-compiles the step once, and the next groups run a second group function."""
    trainer, path = _assert_as_on_cpu(GroupedTuple, 2, epochs=2, batches=4)
    assert trainer.strategy.retraces == 1
    assert path.functions == 2  # a group function for each value the tuple was captured with


class GroupedBranch(LogsEveryCall, Branch):
    """`if self.global_step > 2:` adds a term: step 3 is the last step of the first group."""


def test_branch_on_global_step_flipping_inside_a_group_as_on_cpu():
    """Step i of a group sees global_step + i: the branch flips at step 3, inside the first
    group of 4, whose device function holds three steps of the first graph and one of the
    second; later groups hold four of the second. One re-compile in the fit."""
    trainer, path = _assert_as_on_cpu(GroupedBranch, 4, epochs=2, batches=4)
    assert trainer.strategy.retraces == 1
    assert path.functions == 2


class CarriedAverage(LogsEveryCall, LitClassifier):
    """A running average of the loss, a tensor the step keeps on the module for the next
    step, scales the loss: inside a group, step i+1 reads what step i left."""

    def __init__(self) -> None:
        super().__init__()
        self.average = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        detached = loss.detach()
        average = detached if self.average is None else 0.5 * self.average + 0.5 * detached
        self.average = average
        self.log("average", average)
        return loss * (1.0 + average)


def test_a_tensor_carried_from_step_to_step_inside_a_group_as_on_cpu():
    _, path = _assert_as_on_cpu(CarriedAverage, 3, epochs=2, batches=5)
    # (first graph, carried in-group) x3 / x2, and (carried from the last group, in-group)
    assert path.functions >= 2


class LogsAnItem(LogsEveryCall, LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss.item())  # a number the host code needs before the group's call
        return loss


class PrintsInAGroup(LogsEveryCall, LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        print(f"group step {batch_idx}")  # host code: a graph break
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss


@pytest.mark.parametrize(
    ("model_cls", "said"), [(LogsAnItem, "Python number"), (PrintsInAGroup, "host code")]
)
def test_a_step_that_cannot_wait_for_the_groups_call_runs_one_by_one_as_on_cpu(
    model_cls, said, caplog
):
    """Dynamo's code after the graph turns `loss.item()` into a Python number at once (for
    the log call), and host code runs between graphs: a deferred step can give neither.
    Found when Dynamo hands the graph over, before anything of the step ran: from then on
    each step runs on its own, as steps_per_call=1 runs it (said once), and matches cpu."""
    cpu_trainer, cpu_model, _ = _fit("cpu", model_cls, epochs=2, batches=4)
    with caplog.at_level("INFO", logger="lightning.pytorch"):
        trainer, model, path = _fit("mncore", model_cls, 2, epochs=2, batches=4)
    assert [n for n, _ in model.logged] == [n for n, _ in cpu_model.logged]
    for (name, got), (_, want) in zip(model.logged, cpu_model.logged, strict=True):
        assert got == pytest.approx(want, abs=ATOL), name
    assert_state_close(model, cpu_model)
    assert trainer.global_step == cpu_trainer.global_step == 8
    messages = [
        r.getMessage() for r in caplog.records if "runs as its own device" in r.getMessage()
    ]
    assert len(messages) == 1 and said in messages[0], messages


class GrowsAList(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.seen.append(loss.detach())
        return loss


def test_a_list_appended_to_in_every_step_of_a_group_as_on_cpu():
    """Dynamo guards the list's length, which changes at every step: after it failed twice
    the list is taken out of Dynamo's view (AppendedLists), and every step's append lands in
    order, with the values each step computed inside the group's one device call."""
    _, cpu_model, _ = _fit("cpu", GrowsAList, epochs=2, batches=8)
    _, model, path = _fit("mncore", GrowsAList, 4, epochs=2, batches=8)
    assert len(model.seen) == len(cpu_model.seen) == 16
    for got, want in zip(model.seen, cpu_model.seen, strict=True):
        assert got.item() == pytest.approx(want.item(), abs=ATOL)


class RenamesItselfEveryStep(LitClassifier):
    """A string attribute the step reads and changes at every step: its guard fails at every
    call, and no graph input can stand for a string."""

    def __init__(self) -> None:
        super().__init__()
        self.tag = "step"

    def training_step(self, batch, batch_idx):
        self.tag = self.tag + "+"
        x, y = batch
        return F.cross_entropy(self(x), y) * len(self.tag)


def test_a_guard_failing_at_every_step_of_a_group_is_refused_past_max_retraces():
    """Each step re-compiles (as torch.compile would), until max_retraces: then an error
    names the guard that keeps failing, with the user's line."""
    with pytest.raises(StaticGraphError, match=r"max_retraces=8.*\.tag == 'step\+*'"):
        _fit("mncore", RenamesItselfEveryStep, 4, epochs=1, batches=16)


class LogsInGradientClipping(LitClassifier):
    """Logs the norm it clips in its own configure_gradient_clipping."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, **kwargs):
        self.log("clipped_norm", torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5))


def test_a_log_in_gradient_clipping_under_steps_per_call_is_refused():
    """The group's device call runs each step's update but logs no update's value step by
    step: an error naming the value, not a lost log (steps_per_call=1 logs it:
    test_side_effects.py)."""
    with pytest.raises(
        MisconfigurationException, match=r"configure_gradient_clipping.*clipped_norm"
    ):
        _fit("mncore", LogsInGradientClipping, 2, epochs=1, batches=2)
