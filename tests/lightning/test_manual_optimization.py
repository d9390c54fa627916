"""Manual optimization and several optimizers: the whole training_step, every backward and
update in it, is ONE compiled step, and trains as on cpu (same seed and data, ATOL = 1e-5)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel, RandomDataset
from torch.utils.data import DataLoader

from mncore_device import StaticGraphError
from mncore_lightning import MNCoreStrategy
from tests.lightning.lightning_testing import ATOL, assert_state_close, trainer_kwargs
from tests.lightning.test_dynamo_manual import Captured


def _fit(accelerator: str, model_cls, data, **overrides):
    L.seed_everything(0, verbose=False)
    model = model_cls()
    kwargs = trainer_kwargs(**{"max_epochs": 2, **overrides})
    if accelerator == "mncore":
        kwargs["strategy"] = MNCoreStrategy(device="pfvm:cpu", preset="O0")
    trainer = L.Trainer(accelerator=accelerator, **kwargs)
    trainer.fit(model, data())
    return trainer, model


def _both(model_cls, data, **overrides):
    cpu = _fit("cpu", model_cls, data, **overrides)
    mn = _fit("mncore", model_cls, data, **overrides)
    assert_state_close(cpu[1], mn[1])
    assert cpu[0].global_step == mn[0].global_step  # Lightning counts the updates as on cpu
    return cpu, mn


def _random_data():
    return DataLoader(RandomDataset(32, 64), batch_size=8)


def test_lightning_manual_optim_boring_model_matches_cpu():
    (cpu_trainer, _), (mn_trainer, _) = _both(ManualOptimBoringModel, _random_data)
    assert mn_trainer.global_step == 16
    assert mn_trainer.strategy.compiled_calls >= 16


class GAN(L.LightningModule):
    """Lightning's basic-GAN tutorial pattern: a generator and a discriminator, each with its
    own Adam, toggled in turn inside one training_step; a scheduler stepped by the module."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        sch_g = self.lr_schedulers()
        z = torch.randn(real.shape[0], 4)
        ones = torch.ones(real.shape[0], 1)
        zeros = torch.zeros(real.shape[0], 1)

        self.toggle_optimizer(opt_g)
        fake = self.generator(z)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        sch_g.step()
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
        sch_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=3, gamma=0.5)
        return [opt_g, opt_d], [sch_g]


def _real_data():
    g = torch.Generator().manual_seed(0)
    return DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g)), batch_size=8)


def test_a_two_optimizer_gan_matches_cpu():
    (cpu_trainer, cpu), (mn_trainer, mn) = _both(GAN, _real_data)
    assert mn_trainer.global_step == 2 * 6 * 2  # two updates per batch, 6 batches, 2 epochs
    for key in ("g_loss", "d_loss"):
        torch.testing.assert_close(
            cpu_trainer.callback_metrics[key], mn_trainer.callback_metrics[key], atol=ATOL, rtol=0
        )
    # the scheduler the module steps itself moved the generator's learning rate as on cpu
    lr = mn_trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == cpu_trainer.optimizers[0].param_groups[0]["lr"] < 2e-3


def test_several_optimizers_are_registered_as_optimizer0_optimizer1():
    seen = {}

    class Peek(L.Callback):
        def on_train_end(self, trainer, module):
            seen["names"] = trainer.strategy.context.registered_names

    _fit("mncore", GAN, _real_data, callbacks=[Peek()], max_epochs=1)
    names = seen["names"]
    assert any(n.startswith("optimizer0@") for n in names)
    assert any(n.startswith("optimizer1@") for n in names)


class PlateauInTheStep(L.LightningModule):
    """Manual optimization that steps ReduceLROnPlateau with each batch's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(32, 2)
        self.lrs: list[float] = []

    def update(self, batch) -> torch.Tensor:
        opt = self.optimizers()
        loss = self.layer(batch).pow(2).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss

    def training_step(self, batch, batch_idx):
        loss = self.update(batch)
        self.lr_schedulers().step(loss)  # this step's loss, on the host after each call
        return loss

    def on_train_batch_end(self, *args) -> None:
        self.lrs.append(self.optimizers().param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sch = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return [opt], [sch]


def test_a_scheduler_stepped_with_the_loss_in_a_manual_step_gets_each_steps_loss():
    (_, cpu), (_, mn) = _both(PlateauInTheStep, _random_data)
    assert mn.lrs == cpu.lrs
    assert len(set(mn.lrs)) > 2 and min(mn.lrs) > 0.1 * 0.5**16  # not halved at every step


class SchedulesBetweenUpdates(PlateauInTheStep):
    def training_step(self, batch, batch_idx):
        for _ in range(2):
            loss = self.update(batch)
            self.lr_schedulers().step(loss)
        return loss


def test_an_update_after_a_scheduler_step_in_the_same_step_is_refused():
    with pytest.raises(StaticGraphError, match=r"opt.step\(\) after stepping its LR scheduler"):
        _fit("mncore", SchedulesBetweenUpdates, _random_data)


class LogsItsSchedulerAfterStepping(PlateauInTheStep):
    """StepLR stepped in the step, then its last learning rate and count logged."""

    def training_step(self, batch, batch_idx):
        sch = self.lr_schedulers()
        loss = self.update(batch)
        before = sch.last_epoch
        sch.step()
        self.log("counted", sch.last_epoch - before)
        self.log("last_lr", sch.get_last_lr()[0])
        self.log("last_epoch", sch.last_epoch)
        return loss

    def on_train_batch_end(self, *args) -> None:
        metrics = self.trainer.callback_metrics
        self.lrs.append(tuple(float(metrics[k]) for k in ("counted", "last_lr", "last_epoch")))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


def test_a_scheduler_read_after_its_step_in_a_manual_step_reads_as_on_cpu():
    """The reads after sch.step() need the scheduler stepped at once: the step runs
    host-driven on the Dynamo capture (steps/manual_host.py)."""
    cpu_trainer, cpu = _fit("cpu", LogsItsSchedulerAfterStepping, _random_data)
    captured = Captured()
    mn_trainer, mn = _fit(
        "mncore", LogsItsSchedulerAfterStepping, _random_data, callbacks=[captured]
    )
    assert_state_close(cpu, mn)
    assert cpu_trainer.global_step == mn_trainer.global_step
    assert mn.lrs == cpu.lrs
    assert {row[0] for row in mn.lrs} == {1.0} and len({row[1] for row in mn.lrs}) > 2
    assert captured.host_calls_per_step == 3  # the loss's forward and backward, the update
