"""Python control flow on batch_idx fails at compile time instead of freezing the value."""

import inspect

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import mncore_lightning
from mncore_device import StaticGraphError


class _IndexUser(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        if batch_idx % 2 == 0:  # frozen at trace time: must be rejected
            loss = loss * 2
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _IndexPassthrough(_IndexUser):
    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).pow(2).mean()


def _fit(module: L.LightningModule) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="mncore",
        strategy=mncore_lightning.MNCoreStrategy(device="pfvm:cpu", preset="O0"),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4))
    return trainer


def test_control_flow_on_batch_idx_is_a_compile_error_naming_the_line():
    line = next(
        i
        for i, text in enumerate(inspect.getsourcelines(_IndexUser.training_step)[0])
        if "batch_idx % 2" in text
    )
    lineno = inspect.getsourcelines(_IndexUser.training_step)[1] + line
    with pytest.raises(StaticGraphError, match=rf"test_batch_index.py:{lineno}.*torch.where"):
        _fit(_IndexUser())


def test_a_step_that_ignores_batch_idx_trains():
    module = _IndexPassthrough()
    before = module.layer.weight.detach().clone()
    trainer = _fit(module)
    assert trainer.global_step == 3
    assert not torch.equal(module.layer.weight, before)
