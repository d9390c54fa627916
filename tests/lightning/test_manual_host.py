"""Manual-optimization steps that only the host can run as cpu does, host-driven (steps/manual_host.py).

A manual training_step with host code (print, a NumPy draw, a branch on a tensor's value), or
one that reads p.grad, runs as on cpu: each Dynamo graph between host code is a forward and a
backward device call, and manual_backward, opt.step(), zero_grad(), clip_gradients and the
toggles run on the host (each opt.step() one update device call). Each test fits a tiny model
with accelerator="cpu" and "mncore" (preset O0, same seed and batches) and compares every
per-step loss, every value handed to a logger, the final callback metrics and weights
(ATOL = 1e-5) and trainer.global_step, and checks that the step ran host-driven on the Dynamo
capture with the device calls per step it reported once.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mncore_device import StaticGraphError
from mncore_lightning import MNCoreStrategy
from mncore_lightning.steps.manual_host import HOST_CALL, HostManualSteps
from tests.lightning.lightning_testing import ATOL
from tests.lightning.test_dynamo_capture import _fit, _line_of
from tests.lightning.test_dynamo_manual import (
    GAN,
    Manual,
    ScalesGradients,
    host_driven,
)


class PrintsAndDraws(Manual):
    """print and a NumPy draw (noise on the hidden layer) in a manual step."""

    def __init__(self, net: str = "mlp") -> None:
        super().__init__(net=net)
        self.rng = np.random.default_rng(0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        h = self.net[:2](x)
        print("a manual step")
        noise = self.rng.normal(scale=0.1, size=tuple(h.shape)).astype(np.float32)
        loss = F.cross_entropy(self.net[2:](h + torch.from_numpy(noise)), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)
        return loss


def test_print_and_a_numpy_draw_in_a_manual_step_as_on_cpu(caplog, capsys):
    cpu, mn, captured, said = host_driven(PrintsAndDraws, caplog, epochs=2, batches=3)
    assert mn.trainer.global_step == 6
    assert capsys.readouterr().out.count("a manual step") == 2 * 6  # both runs, every step
    assert mn.model.rng.bit_generator.state == cpu.model.rng.bit_generator.state
    # the report names the user's lines, not the manual calls run on the host
    for text in ("print(", "rng.normal"):
        assert f"{__file__}:{_line_of(PrintsAndDraws.training_step, text)}" in said, said
    assert HOST_CALL not in said and "manual_backward(loss)" not in said
    # two graphs (before and after the print) and the update: their forward and backward
    # calls, and the update call
    assert captured.host_calls_per_step == 5


def test_batchnorm_statistics_of_a_host_driven_step_as_on_cpu(caplog):
    """The running statistics are device state the forward calls write (Linear, BatchNorm
    before the print; ReLU, Linear after it)."""
    cpu, mn, _, _ = host_driven(lambda: PrintsAndDraws(net="bn"), caplog, epochs=2, batches=2)
    assert int(mn.model.net[1].num_batches_tracked) == 4


@torch.compiler.disable
def _on_the_host(seen: list, tensor: torch.Tensor) -> None:
    """Host code that reads a tensor's host value (as a logger's add_histogram does)."""
    seen.append(tensor.detach().clone())


class ReadsWeightsOnTheHost(Manual):
    """Host code reads a weight before the step's update and after it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        _on_the_host(self.seen, self.net[0].weight)
        loss = self.loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        _on_the_host(self.seen, self.net[0].weight)
        self.log("train_loss", loss)
        return loss


def test_host_code_reads_the_weights_of_the_step_before_and_after_its_update(caplog):
    cpu, mn, _, _ = host_driven(ReadsWeightsOnTheHost, caplog, epochs=2, batches=2)
    assert len(mn.model.seen) == len(cpu.model.seen) == 8
    for ours, theirs in zip(mn.model.seen, cpu.model.seen, strict=True):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    assert not torch.equal(mn.model.seen[0], mn.model.seen[1])  # the update changed it


class GANWithHostCode(GAN):
    """The GAN of test_dynamo_manual (two toggled optimizers, clipping, a scheduler stepped in
    the step), with a NumPy draw and a print between its two updates, and global_step read
    after the first (Lightning counts each opt.step() as it runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(1)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        sch_g = self.lr_schedulers()
        ones = torch.ones(x.shape[0], 1)
        zeros = torch.zeros(x.shape[0], 1)

        self.toggle_optimizer(opt_g)
        fake = self.generator(x)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        print(f"generator loss {float(g_loss):.3f}")
        self.log("between", float(self.global_step))
        jitter = torch.from_numpy(self.rng.normal(scale=0.05, size=(1, 8)).astype(np.float32))
        self.toggle_optimizer(opt_d)
        real = self.real(x).detach() + jitter
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        d_loss = (real_loss + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        sch_g.step()
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})
        return d_loss


def test_a_gan_with_two_toggled_optimizers_and_host_code_as_on_cpu(caplog):
    """Profiled: Lightning's "optimizer_step" action around each update, as on cpu."""
    cpu, mn, captured, _ = host_driven(
        GANWithHostCode, caplog, epochs=2, batches=3, profiler="simple"
    )
    assert mn.trainer.global_step == 2 * 2 * 3  # two updates per batch
    between = [values["between"] for _, values in mn.logged if "between" in values]
    assert between == [float(2 * i + 1) for i in range(6)]
    lr = mn.trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == cpu.trainer.optimizers[0].param_groups[0]["lr"] < 2e-2
    assert all(p.requires_grad for p in mn.model.parameters())  # untoggled at the end
    actions = [
        len(p.recorded_durations["optimizer_step"])
        for p in (cpu.trainer.profiler, mn.trainer.profiler)
    ]
    assert actions == [12, 12]
    # six graphs between the host code and the manual calls (those of the two losses with a
    # backward call too; the last one, of the logs, computes nothing), and the two updates
    assert captured.host_calls_per_step == 6 + 2 + 2


class HostCodeInTheClosure(Manual):
    """opt.step(closure): the closure (forward, zero_grad, backward) has a NumPy draw."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(2)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch

        def closure():
            scale = float(self.rng.uniform(0.5, 1.5))
            loss = F.cross_entropy(self(x), y) * scale
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        loss = opt.step(closure=closure)
        self.log("train_loss", loss)
        return loss


def test_an_update_with_a_closure_that_has_host_code_as_on_cpu(caplog):
    cpu, mn, _, said = host_driven(HostCodeInTheClosure, caplog, epochs=2, batches=2)
    assert mn.trainer.global_step == 4
    assert f"{__file__}:{_line_of(HostCodeInTheClosure.training_step, 'rng.uniform')}" in said


class AccumulatesWithHostCode(Manual):
    """Gradients of N batches summed in p.grad across steps (and epochs) by hand, with a print
    in every step; the update logs the summed gradients' norm, read from p.grad."""

    N = 2

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch) / self.N
        self.manual_backward(loss)
        print("accumulating")
        if (batch_idx + 1) % self.N == 0:
            norm = torch.stack([p.grad.norm() for p in self.parameters()]).norm()
            self.log("accumulated_norm", norm)
            opt.step()
            opt.zero_grad()
        self.log("train_loss", loss)
        return loss


def test_accumulation_by_hand_with_host_code_and_gradients_read_as_on_cpu(caplog):
    """3 batches an epoch: the gradients of each epoch's last batch carry into the next
    epoch's first window, in p.grad, as on cpu."""
    cpu, mn, _, _ = host_driven(AccumulatesWithHostCode, caplog, epochs=3, batches=3)
    assert mn.trainer.global_step == 3
    assert "accumulated_norm" in mn.metrics


class ReadsGradientsToUpdate(Manual):
    """Accumulation by hand with no host code: one device call per step until the window's
    end reads p.grad (at batch_idx 1); from then on host-driven, with the gradient of batch 0,
    which only the device held, in p.grad."""

    N = 2

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch) / self.N
        self.manual_backward(loss)
        if (batch_idx + 1) % self.N == 0:
            self.log("grad_sum", sum(p.grad.sum() for p in self.parameters()))
            opt.step()
            opt.zero_grad()
        self.log("train_loss", loss)
        return loss


class HostDrivenYet(L.Callback):
    """After each training batch: whether the manual step runs host-driven."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        [hook] = [h for key, h in trainer.strategy._captured.items() if key[0] == "train"]
        self.seen.append(isinstance(hook._manual, HostManualSteps))


def test_a_step_turning_host_driven_mid_fit_keeps_the_gradients_the_device_held(caplog):
    """The weights match cpu's only if the update at batch_idx 1 had batch 0's gradient."""
    seen = HostDrivenYet()
    _, mn, _, said = host_driven(
        ReadsGradientsToUpdate, caplog, epochs=2, batches=3, mncore_callbacks=[seen]
    )
    assert seen.seen == [False] + [True] * 5  # one device call, then host-driven
    assert "reads gradients" in said
    assert f"{__file__}:{_line_of(ReadsGradientsToUpdate.training_step, 'p.grad.sum')}" in said


class BranchesOnTheLoss(Manual):
    """`if loss > 1:` (a branch on a tensor's value) before the backward."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch)
        if loss > 1:
            loss = loss * 0.5
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_a_branch_on_the_loss_in_a_manual_step_as_on_cpu(caplog):
    cpu, mn, _, said = host_driven(BranchesOnTheLoss, caplog, epochs=3, batches=3)
    # both sides of the branch were taken
    losses = [float(loss) for loss in cpu.losses]
    assert any(loss > 0.5 for loss in losses) and mn.trainer.global_step == 9
    assert f"{__file__}:{_line_of(BranchesOnTheLoss.training_step, 'if loss > 1')}" in said


class ClipsWithHostCode(Manual):
    """self.clip_gradients by hand, with a print; the gradient hooks log from p.grad."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        print("clipping")
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()
        self.log("train_loss", loss)
        return loss

    def on_after_backward(self) -> None:
        self.log("grad_sum", sum(p.grad.sum() for p in self.parameters()))

    def on_before_optimizer_step(self, optimizer) -> None:
        self.log("clipped_norm", torch.stack([p.grad.norm() for p in self.parameters()]).norm())


def test_clipping_by_hand_in_a_host_driven_step_as_on_cpu(caplog):
    cpu, mn, _, _ = host_driven(ClipsWithHostCode, caplog, epochs=2, batches=2)
    assert float(mn.metrics["clipped_norm"]) == pytest.approx(0.05, abs=1e-5)  # it clipped


class LogsTheGradientNorm(Manual):
    """The gradient norm computed from p.grad between manual_backward and opt.step, logged;
    no other host code."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.log("grad_norm", torch.stack(norms).norm())
        opt.step()
        self.log("train_loss", loss)
        return loss


def test_a_step_logging_a_gradient_norm_from_p_grad_as_on_cpu(caplog):
    cpu, mn, captured, said = host_driven(LogsTheGradientNorm, caplog, epochs=2, batches=2)
    values = [v["grad_norm"] for _, v in mn.logged if "grad_norm" in v]
    assert len(set(values)) == 4  # one per step, each this step's
    assert "reads gradients" in said
    where = _line_of(LogsTheGradientNorm.training_step, "p.grad.norm()")
    assert f"{__file__}:{where}" in said
    # the forward and backward of the loss, the norm's graph (forward only), the update
    assert captured.host_calls_per_step == 4


@pytest.mark.parametrize(
    ("model", "text"),
    [(PrintsAndDraws, "print("), (ScalesGradients, "if p.grad is not None")],
    ids=["host-code", "gradients"],
)
def test_fullgraph_refuses_a_host_driven_manual_step_naming_the_line(model, text):
    with pytest.raises(StaticGraphError, match="fullgraph=True") as error:
        _fit(
            "mncore",
            model,
            epochs=1,
            batches=1,
            strategy=MNCoreStrategy(device="pfvm:cpu", preset="O0", fullgraph=True),
        )
    where = f"{inspect.getsourcefile(model)}:{_line_of(model.training_step, text)}"
    assert where in str(error.value), str(error.value)
