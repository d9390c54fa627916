"""The standalone `pytorch_lightning` package, which most tutorials import: `pl.Trainer(
accelerator="mncore")` works exactly as with `lightning.pytorch` (same results as pl's cpu)."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
import torch.nn.functional as F

try:  # the installed distribution; importlib.util.find_spec would consume the plugin's hook
    importlib.metadata.distribution("pytorch-lightning")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("pytorch_lightning is not installed", allow_module_level=True)
# imported here, not by importorskip: an ImportError of the plugin's mirror (a module missing
# from standalone.py's lists) must fail this file, not skip it
import pytorch_lightning as pl  # noqa: E402

import mncore_lightning  # noqa: E402
from tests.lightning.lightning_testing import ATOL, CLASSES, IN_FEATURES, loader  # noqa: E402


class TutorialStyle(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(IN_FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)]


def _fit(accelerator: str, **kwargs):
    pl.seed_everything(0, verbose=False)
    model = TutorialStyle()
    trainer = pl.Trainer(
        accelerator=accelerator,
        **kwargs,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader(shuffle=True), loader(n=32))
    return trainer, model


def test_pl_trainer_accelerator_mncore_matches_pl_cpu():
    cpu_trainer, cpu = _fit("cpu")
    trainer, mn = _fit("mncore")
    assert isinstance(trainer.strategy, mncore_lightning.pl.MNCoreStrategy)
    assert isinstance(trainer.accelerator, mncore_lightning.pl.MNCoreAccelerator)
    assert isinstance(trainer.strategy, pl.strategies.Strategy)  # pl's own class tree
    assert trainer.strategy.compiled_calls > 0  # the steps really ran compiled
    for (name, a), b in zip(cpu.state_dict().items(), mn.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=name)
    for key in ("train_loss", "val_loss"):
        torch.testing.assert_close(
            cpu_trainer.callback_metrics[key], trainer.callback_metrics[key], atol=ATOL, rtol=0
        )


def test_pl_trainer_refuses_a_foreign_pairing_as_lightning_does():
    with pytest.raises(ValueError, match="MNCoreStrategy needs accelerator='mncore'"):
        pl.Trainer(accelerator="cpu", strategy=mncore_lightning.pl.MNCoreStrategy(), logger=False)


def test_pl_trainer_several_devices_pick_pls_ddp_strategy():
    trainer = pl.Trainer(accelerator="mncore", devices=2, logger=False)
    assert isinstance(trainer.strategy, mncore_lightning.pl.MNCoreDDPStrategy)
    assert isinstance(trainer.strategy, pl.strategies.DDPStrategy)  # pl's own class tree


def test_pl_trainer_takes_the_lightning_pytorch_strategy_class_as_tutorials_write_it():
    """`pl.Trainer(strategy=mncore_lightning.MNCoreStrategy(...))`: the lightning.pytorch class
    is rebuilt, with its arguments, as mncore_lightning.pl's; same results as pl's cpu."""
    cpu_trainer, cpu = _fit("cpu")
    given = mncore_lightning.MNCoreStrategy(preset="O0", max_retraces=3)
    trainer, mn = _fit(mncore_lightning.MNCoreAccelerator(), strategy=given)
    assert isinstance(trainer.accelerator, mncore_lightning.pl.MNCoreAccelerator)
    assert isinstance(trainer.strategy, mncore_lightning.pl.MNCoreStrategy)
    assert trainer.strategy.preset == given.preset and trainer.strategy.max_retraces == 3
    assert trainer.strategy.compiled_calls > 0
    for (name, a), b in zip(cpu.state_dict().items(), mn.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=name)


def test_a_strategy_of_the_other_package_with_its_plugins_names_the_class_to_use():
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    given = mncore_lightning.MNCoreStrategy(checkpoint_io=TorchCheckpointIO())
    with pytest.raises(ValueError, match=r"use mncore_lightning\.pl\.MNCoreStrategy\(\.\.\.\)"):
        pl.Trainer(accelerator="mncore", strategy=given, logger=False)
