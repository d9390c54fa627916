"""A list the step appends to at every call (`self.outputs.append(loss)`), on the Dynamo path.

TorchDynamo guards the length of a list a step touches, so a list that grows would re-compile
the step at every call; the captured hook takes such a list out of Dynamo's view once its
length guard has failed twice (mncore_device.capture.appended_lists). Fitted against
accelerator="cpu" (preset O0, same seed and batches): losses, every logged value (the
epoch-end means of the lists), final metrics and weights within ATOL, a bounded number of
re-compiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from tests.lightning.lightning_testing import LitClassifier
from tests.lightning.test_dynamo_capture import _assert_same, _fit


class Appends(LitClassifier):
    """Lightning's documented pattern: gather step outputs, reduce them at the epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []
        self.val_outputs: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.outputs.append(loss.detach())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.val_outputs.append(loss)
        self.log("val_loss", loss)

    def on_train_epoch_end(self) -> None:
        self.log("train_mean", torch.stack(self.outputs).mean())
        self.log("train_count", float(len(self.outputs)))
        self.outputs.clear()

    def on_validation_epoch_end(self) -> None:
        self.log("val_mean", torch.stack(self.val_outputs).mean())
        self.log("val_count", float(len(self.val_outputs)))
        self.val_outputs = []  # a new list, as some users write it


class Hooks(Callback):
    """At the end of training (before the strategy forgets them): the captured hooks'
    re-compiles."""

    def __init__(self) -> None:
        self.retraces: dict[str, int] = {}

    def on_train_end(self, trainer, module) -> None:
        strategy = trainer.strategy
        for hook in getattr(strategy, "_captured", {}).values():
            name = hook.hook_name
            self.retraces[name] = self.retraces.get(name, 0) + len(hook.frontend.retraces)


def test_lists_appended_to_in_training_and_validation_as_on_cpu():
    kwargs = {"epochs": 4, "batches": 3, "val_batches": 3}
    cpu = _fit("cpu", Appends, **kwargs)
    hooks = Hooks()
    mn = _fit("mncore", Appends, callbacks=[hooks], **kwargs)
    _assert_same(cpu, mn)
    assert mn.metrics["train_count"] == 3 and mn.metrics["val_count"] == 3
    # each list's length guard fails twice (empty -> 1 item, 1 -> 2), then never again: 12
    # training and 12 validation steps, 2 re-compiles each
    assert hooks.retraces == {"training_step": 2, "validation_step": 2}, hooks.retraces
    assert mn.trainer.strategy.retraces == 4
