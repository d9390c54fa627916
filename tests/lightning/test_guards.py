"""What a compiled step was traced for changes at a batch boundary: it is traced again, with
the reason reported, and trains as on cpu. Same seed and data; ATOL = 1e-5 absolute."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import BackboneFinetuning, Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from mncore_lightning import MNCoreStrategy
from tests.lightning.lightning_testing import (
    ATOL,
    IN_FEATURES,
    LitClassifier,
    assert_state_close,
    fit_once,
    loader,
    make_trainer,
)

# Lightning's rank-zero messages: "lightning.pytorch." or, once pytorch_lightning is imported
# (the two packages share the module that picks the logger), "pytorch_lightning."
RANK_ZERO_LOGGER = "utilities.rank_zero"


class WithBackbone(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(IN_FEATURES, IN_FEATURES), nn.ReLU())

    def forward(self, x):
        return self.net(self.backbone(x))

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(trainable, lr=0.1, momentum=0.9)


def _both(**kwargs):
    return [fit_once(accelerator, **kwargs) for accelerator in ("cpu", "mncore")]


def _assert_same(cpu, mn):
    torch.testing.assert_close(
        torch.stack(cpu[2].losses), torch.stack(mn[2].losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu[1], mn[1])


def test_backbone_finetuning_unfreezes_and_trains_as_on_cpu(caplog):
    def callbacks():
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)]

    with caplog.at_level(logging.INFO):
        cpu = fit_once("cpu", model_cls=WithBackbone, callbacks=callbacks(), max_epochs=3)
        mn = fit_once("mncore", model_cls=WithBackbone, callbacks=callbacks(), max_epochs=3)
    _assert_same(cpu, mn)
    assert mn[0].strategy.retraces >= 1
    reasons = [r.getMessage() for r in caplog.records if "re-tracing" in r.getMessage()]
    assert any("trainable parameters:" in m and "+ backbone.0.weight" in m for m in reasons), (
        reasons
    )


class FreezeBatchNorm(Callback):
    def on_train_epoch_start(self, trainer, module) -> None:
        if trainer.current_epoch == 1:
            module.net[1].eval()  # BatchNorm: running statistics frozen from now on


def test_a_submodule_switched_to_eval_is_traced_again():
    cpu, mn = _both(model_kwargs={"net": "bn"}, callbacks=[FreezeBatchNorm()], max_epochs=3)
    _assert_same(cpu, mn)
    assert mn[0].strategy.retraces >= 1


class Refreezes(Callback):
    """Changes requires_grad at every epoch: more re-traces than allowed."""

    def on_train_epoch_start(self, trainer, module) -> None:
        for p in module.net[0].parameters():
            p.requires_grad_(trainer.current_epoch % 2 == 0)


def test_a_fact_that_keeps_changing_is_refused_past_max_retraces():
    strategy = MNCoreStrategy(device="pfvm:cpu", preset="O0", max_retraces=2)
    trainer = make_trainer(strategy=strategy, max_epochs=6, callbacks=[Refreezes()])
    with pytest.raises(MisconfigurationException, match=r"trainable parameters.*max_retraces"):
        trainer.fit(LitClassifier(), loader())


def test_retraces_are_counted_in_device_stats():
    trainer, _, _ = fit_once(
        "mncore", model_kwargs={"net": "bn"}, callbacks=[FreezeBatchNorm()], max_epochs=2
    )
    assert trainer.strategy.device_stats()["mncore/retraces"] == trainer.strategy.retraces >= 1


def test_validation_between_epochs_does_not_retrace_the_training_step():
    # Lightning switches the whole module to eval for validation and back: no change of fact
    trainer, _, _ = fit_once(
        "mncore", callbacks=[FreezeBatchNorm()], val=loader(n=32), max_epochs=1
    )
    assert trainer.strategy.retraces == 0


class SwitchesOptimizerTerms(LitClassifier):
    """A hook turns on terms the update left out while they were zero or off: weight decay
    and momentum (SGD), nesterov; and AdamW's weight decay, Adam's maximize."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.kind = optimizer

    def configure_optimizers(self):
        if self.kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        if self.kind == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.0)
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def on_train_epoch_start(self) -> None:
        group = self.optimizers().param_groups[0]
        if self.current_epoch == 1:
            group["weight_decay"] = 0.1
            if self.kind == "sgd":
                group["momentum"] = 0.9
            if self.kind == "adam":
                group["maximize"] = True
        if self.current_epoch == 2 and self.kind == "sgd":
            group["nesterov"] = True


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adam"])
def test_optimizer_terms_switched_on_by_a_hook_are_traced_again(optimizer):
    runs = [
        fit_once(a, {"optimizer": optimizer}, model_cls=SwitchesOptimizerTerms, max_epochs=3)
        for a in ("cpu", "mncore")
    ]
    (_, cpu_model, cpu_losses), (mn_trainer, mn_model, mn_losses) = runs
    torch.testing.assert_close(
        torch.stack(cpu_losses.losses), torch.stack(mn_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu_model, mn_model)
    assert mn_trainer.strategy.retraces == (2 if optimizer == "sgd" else 1)
