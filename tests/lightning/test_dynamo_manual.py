"""Manual optimization captured by TorchDynamo (steps/manual.py): a training_step that calls
manual_backward, opt.step(), opt.zero_grad(), clip_gradients, toggle_optimizer and a scheduler's
step() itself is ONE device call per step, and trains as accelerator="cpu" does.

Each test fits a tiny model with accelerator="cpu" and accelerator="mncore" (preset O0, same
seed and batches) and checks every per-step loss, every value handed to a logger, the final
callback metrics and weights (ATOL = 1e-5) and trainer.global_step (one per opt.step(), as
Lightning counts in manual optimization), and that the step was captured by Dynamo: no graph
break, one device call per training batch. A step that reads
what only the host has (its gradients, a learning rate after its scheduler's step) runs
host-driven instead (steps/manual_host.py; more in test_manual_host.py).
"""

from __future__ import annotations

import re
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mncore_lightning import MNCoreStrategy
from tests.lightning.lightning_testing import (
    ATOL,
    IN_FEATURES,
    LitClassifier,
    assert_state_close,
    loader,
    trainer_kwargs,
)
from tests.lightning.test_dynamo_capture import BATCH, Run, _assert_same, _fit, _line_of


class Captured(L.Callback):
    """At the end of training: how the training step ran (before teardown forgets it)."""

    def __init__(self) -> None:
        self.breaks: list[str] = []
        self.calls = 0
        self.batches = 0
        self.host_calls_per_step: int | None = None  # a host-driven step's (steps/manual_host.py)

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def on_train_end(self, trainer, module) -> None:
        strategy = trainer.strategy
        self.breaks = [
            str(b)
            for key, h in strategy._captured.items()
            if key[0] == "train"
            for b in h.frontend.breaks
        ]
        self.calls = strategy.compiled_calls
        for key, hook in strategy._captured.items():
            if key[0] == "train":
                self.host_calls_per_step = hook.device_calls_per_step


def _both_manual(make_model: Any, **kwargs: Any) -> tuple[Run, Run, Captured]:
    """Fit on cpu and on mncore; the same results, and each mncore step one Dynamo graph call."""
    cpu = _fit("cpu", make_model, **kwargs)
    captured = Captured()
    mn = _fit("mncore", make_model, callbacks=[captured], **kwargs)
    _assert_same(cpu, mn)
    assert mn.trainer.global_step == cpu.trainer.global_step
    assert not captured.breaks, captured.breaks
    assert captured.calls == captured.batches > 0  # one device call per training batch
    return cpu, mn, captured


_REPORT = re.compile(r"MN-Core: training_step (.*); it runs as (\d+) device calls per step")


def host_driven(
    make_model: Any, caplog: Any, mncore_callbacks: Any = (), **kwargs: Any
) -> tuple[Run, Run, Captured, str]:
    """Fit on cpu and on mncore: the same results; the mncore step ran host-driven on the
    Dynamo capture, said once. Returns both runs, how the step ran, and what was said."""
    cpu = _fit("cpu", make_model, **kwargs)
    captured = Captured()
    with caplog.at_level("INFO", logger="lightning.pytorch"):
        mn = _fit("mncore", make_model, callbacks=[captured, *mncore_callbacks], **kwargs)
    _assert_same(cpu, mn)
    assert mn.trainer.global_step == cpu.trainer.global_step
    assert captured.host_calls_per_step is not None  # host-driven
    said = [m for r in caplog.records if _REPORT.search(m := r.getMessage())]
    assert len(said) == 1, said
    assert int(_REPORT.search(said[0]).group(2)) == captured.host_calls_per_step
    return cpu, mn, captured, said[0]


class Manual(LitClassifier):
    """The canonical manual step: zero_grad, manual_backward, step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)
        return loss


def test_manual_step_is_one_dynamo_graph_as_on_cpu():
    cpu, mn, _ = _both_manual(Manual, epochs=2, batches=3)
    assert mn.trainer.global_step == 6
    assert mn.graphs.functions == 1


def test_manual_step_with_adam_as_on_cpu():
    _both_manual(lambda: Manual(optimizer="adam", lr=0.01), epochs=2, batches=2)


class Clipped(Manual):
    ALGORITHM = "norm"

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm=self.ALGORITHM)
        opt.step()
        self.log("train_loss", loss)
        return loss


class ClippedByValue(Clipped):
    ALGORITHM = "value"


@pytest.mark.parametrize("model", [Clipped, ClippedByValue], ids=["norm", "value"])
def test_manual_step_with_clip_gradients_as_on_cpu(model):
    cpu, mn, _ = _both_manual(model, epochs=2, batches=2)
    # the clipping mattered: without it the weights end elsewhere
    unclipped = _fit("cpu", Manual, epochs=2, batches=2)
    assert any(
        (a - b).abs().max() > 1e-3
        for a, b in zip(unclipped.model.parameters(), cpu.model.parameters(), strict=True)
    )


class AccumulatesByHand(Manual):
    """Gradients of N batches summed in p.grad (across training_step calls, and across an
    epoch's end), one update per N batches: a branch on batch_idx."""

    N = 2

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch) / self.N
        self.manual_backward(loss)
        if (batch_idx + 1) % self.N == 0:
            opt.step()
            opt.zero_grad()
        self.log("train_loss", loss)
        return loss


def test_accumulation_by_hand_as_on_cpu_with_three_graphs():
    """3 batches an epoch, 3 epochs: the windows end at batch_idx 1 of each epoch, and the
    gradients of batch_idx 2 carry over into the next epoch's first window, as on cpu. Dynamo
    guards the comparison on batch_idx and which gradients exist: three graphs for the 9
    steps (a window's first micro-batch, starting without gradients; a later one; the one
    with the update), and 3 optimizer steps."""
    cpu, mn, _ = _both_manual(AccumulatesByHand, epochs=3, batches=3)
    assert mn.trainer.global_step == 3
    assert mn.graphs.functions == 3


class GAN(L.LightningModule):
    """Two optimizers toggled in turn in one training_step (Lightning's GAN pattern), the
    discriminator's gradients clipped, the generator's scheduler stepped in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.real = nn.Linear(IN_FEATURES, 8)  # "real" samples, fixed

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

        self.toggle_optimizer(opt_d)
        real = self.real(x).detach()
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

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-2, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-2, betas=(0.5, 0.999))
        sch_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=2, gamma=0.5)
        return [opt_g, opt_d], [sch_g]


def test_two_optimizers_toggled_in_one_step_as_on_cpu():
    cpu, mn, _ = _both_manual(GAN, epochs=2, batches=3)
    assert mn.trainer.global_step == 2 * 2 * 3  # two updates per batch
    assert mn.graphs.functions == 1
    lr = mn.trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == cpu.trainer.optimizers[0].param_groups[0]["lr"] < 2e-2


class SchedulerInTheStep(Manual):
    """sch.step() in every step; the step reads (and logs) the learning rate, which the
    next step reads changed: a graph input, not a re-compile per value."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        lr = opt.param_groups[0]["lr"]
        loss = self.loss(batch) * (1.0 + lr)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        self.log("train_loss", loss)
        self.log("lr", lr)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


def test_scheduler_stepped_in_the_step_as_on_cpu_without_a_recompile_per_step():
    cpu, mn, _ = _both_manual(SchedulerInTheStep, epochs=2, batches=3)
    # 6 learning rates, not 6 graphs: Dynamo specializes a float it reads for the first
    # graph, and makes it a graph input when it first changes (one re-compile)
    assert mn.graphs.functions <= 2 and mn.trainer.strategy.retraces <= 1
    assert mn.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.2 * 0.7**6)


class ScalesFromATuple(Manual):
    """A tuple attribute changed by a hook between epochs, read by the manual step."""

    def __init__(self) -> None:
        super().__init__()
        self.scales = (1.0, 1.0)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch) * self.scales[0] * self.scales[1]
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        self.scales = (1.0, 0.5 / (self.current_epoch + 1))


def test_tuple_attribute_changed_by_a_hook_read_by_a_manual_step_as_on_cpu():
    """Dynamo guards `self.scales` and re-compiles once per new value (a trace of the
    step's Python would have kept its first value)."""
    cpu, mn, _ = _both_manual(ScalesFromATuple, epochs=3, batches=2)
    assert mn.trainer.strategy.retraces == 2


def _fit_resumed(accelerator: str, tmp_path, epochs: int) -> L.Trainer:
    """Fit 1 epoch and save a checkpoint; a new Trainer resumes from it up to `epochs`."""
    path = tmp_path / f"{accelerator}.ckpt"
    trainers = []
    for max_epochs, ckpt in ((1, None), (epochs, path)):
        L.seed_everything(0, verbose=False)
        kwargs = trainer_kwargs(max_epochs=max_epochs)
        if accelerator == "mncore":
            kwargs["strategy"] = MNCoreStrategy(device="pfvm:cpu", preset="O0")
        trainer = L.Trainer(accelerator=accelerator, **kwargs)
        trainer.fit(GAN(), loader(n=BATCH * 3, batch_size=BATCH), ckpt_path=ckpt)
        if ckpt is None:
            trainer.save_checkpoint(path)
        trainers.append(trainer)
    return trainers[-1]


def test_global_step_through_a_checkpoint_and_resume_as_on_cpu(tmp_path):
    cpu = _fit_resumed("cpu", tmp_path, epochs=3)
    mn = _fit_resumed("mncore", tmp_path, epochs=3)
    assert mn.global_step == cpu.global_step == 2 * 3 * 3
    saved = torch.load(tmp_path / "mncore.ckpt", weights_only=False)
    assert saved["global_step"] == 2 * 3
    assert_state_close(cpu.lightning_module, mn.lightning_module)
    torch.testing.assert_close(
        mn.optimizers[0].param_groups[0]["lr"],
        cpu.optimizers[0].param_groups[0]["lr"],
        atol=ATOL,
        rtol=0,
    )


class ReadsGlobalStepAfterEachUpdate(GAN):
    """trainer.global_step read between and after the two updates of a step: Lightning
    counts each opt.step() as it runs, so the reads differ by one (as on cpu)."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        before = self.global_step
        loss = self.generator(x).pow(2).mean()
        opt_g.zero_grad()
        self.manual_backward(loss)
        opt_g.step()
        between = self.global_step
        d_loss = self.discriminator(self.real(x).detach()).pow(2).mean() * (1 + between % 3)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.log_dict({"before": float(before), "between": float(between)})
        self.log("after", float(self.global_step))
        return d_loss


def test_global_step_read_after_an_update_in_the_step_as_on_cpu():
    cpu, mn, _ = _both_manual(ReadsGlobalStepAfterEachUpdate, epochs=2, batches=2)
    assert mn.metrics["after"] == mn.metrics["between"] + 1 == mn.metrics["before"] + 2
    # the counts are graph inputs, counted in the graph: no re-compile per step
    assert mn.graphs.functions == 1 and mn.trainer.strategy.retraces == 0


class LogsGradientsInHooks(Manual):
    """The hooks that read gradients (they run inside opt.step() and manual_backward, where
    the device graph computes them) log from them, as Lightning's docs suggest."""

    def on_after_backward(self) -> None:
        self.log("grad_sum", sum(p.grad.sum() for p in self.parameters()))

    def on_before_optimizer_step(self, optimizer) -> None:
        norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.log("grad_norm", torch.stack(norms).norm())


def test_gradient_hooks_logging_in_a_manual_step_as_on_cpu():
    cpu, mn, _ = _both_manual(LogsGradientsInHooks, epochs=2, batches=2)
    assert {"grad_sum", "grad_norm"} <= set(mn.metrics)
    assert len({values["grad_norm"] for _, values in mn.logged if "grad_norm" in values}) == 4


class ScalesGradients(Manual):
    """Reads and changes p.grad between manual_backward and opt.step in the step."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(0.25)
        opt.step()
        self.log("train_loss", loss)
        return loss


def test_a_step_reading_gradients_runs_host_driven_as_on_cpu(caplog):
    """Gradients exist only in a one-call device graph: Dynamo would read the host's (None)
    and skip the loop silently. The read is found by its guard, and the step runs
    host-driven (steps/manual_host.py): the gradients are the host's p.grad, as on cpu."""
    _, _, _, said = host_driven(ScalesGradients, caplog, epochs=1, batches=2)
    where = f"{__file__}:{_line_of(ScalesGradients.training_step, 'p.grad.mul_')}"
    assert "reads gradients" in said and where in said, said


class ClosureStep(Manual):
    """opt.step(closure=...) inside toggled_optimizer: the closure (forward, zero_grad and
    backward) runs in the step, before the update, as torch.optim runs it on cpu."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()

        def closure():
            loss = self.loss(batch)
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        with self.toggled_optimizer(opt):
            loss = opt.step(closure=closure)
        self.log("train_loss", loss)
        return loss


def test_an_update_with_a_closure_in_a_toggled_optimizer_as_on_cpu():
    cpu, mn, _ = _both_manual(ClosureStep, epochs=2, batches=2)
    assert mn.trainer.global_step == 4


def test_a_profiled_manual_step_is_captured_and_profiles_each_update_as_on_cpu():
    """A profiler's start/stop (Lightning's "optimizer_step" around each update) run on the
    host after the call, in the step's order: the step is still one Dynamo graph."""
    cpu, mn, _ = _both_manual(GAN, epochs=1, batches=2, profiler="simple")
    actions = [
        p.recorded_durations["optimizer_step"] for p in (cpu.trainer.profiler, mn.trainer.profiler)
    ]
    assert len(actions[0]) == len(actions[1]) == 4


class ZeroesAtTheEnd(Manual):
    """backward, step, zero_grad (Lightning's GAN tutorial order), with a parameter no loss
    uses and weight decay: on cpu its gradient stays None, and SGD skips it at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.ones(3))

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch)
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5, weight_decay=0.1)


def test_a_gradient_that_is_none_on_cpu_is_none_in_the_captured_step():
    """The gradients are device state between steps, but None where cpu's are: the unused
    parameter is never updated, and the step is one graph (it never uses a gradient from
    before it)."""
    cpu, mn, _ = _both_manual(ZeroesAtTheEnd, epochs=2, batches=2)
    assert torch.equal(mn.model.unused.detach(), torch.ones(3))
    assert mn.graphs.functions == 1


class LogsTheLearningRateAfterItsStep(SchedulerInTheStep):
    """The learning rate read after sch.step() in the same step: on cpu, the new one."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        self.log("train_loss", loss)
        self.log("lr_after", opt.param_groups[0]["lr"])
        return loss


def test_the_learning_rate_read_after_a_scheduler_step_in_the_step_as_on_cpu(caplog):
    """In a one-call step the scheduler steps on the host after the device call: a read of
    what it changes after it, in the same step, would read the value before it. Such a step
    runs host-driven, where the scheduler steps at once, as on cpu."""
    cpu, mn, _, said = host_driven(LogsTheLearningRateAfterItsStep, caplog, epochs=2, batches=2)
    assert "after a scheduler's step()" in said, said
    lrs = [values["lr_after"] for _, values in mn.logged if "lr_after" in values]
    assert lrs == pytest.approx([0.2 * 0.7 ** (i + 1) for i in range(4)], abs=1e-7)
