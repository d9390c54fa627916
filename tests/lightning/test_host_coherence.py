"""Hooks and callbacks see and change the real weights and gradients during fit, as on cpu.

Every test runs the same seed and data on accelerator="cpu" and "mncore" (O0) and compares
what the hooks saw or did. Tolerance: ATOL = 1e-5 absolute (lightning_testing).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import (
    Callback,
    EMAWeightAveraging,
    LearningRateMonitor,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import grad_norm
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from mncore_lightning import MNCoreStrategy
from tests.lightning.lightning_testing import (
    ATOL,
    LitClassifier,
    assert_state_close,
    fit_once,
    loader,
    make_trainer,
)

HOOKS = ("on_train_batch_end", "on_train_epoch_end", "on_validation_epoch_end", "on_train_end")


class WeightSpy(Callback):
    """Copies the first layer's weight in each hook it is named for."""

    def __init__(self) -> None:
        self.seen: dict[str, list[torch.Tensor]] = {h: [] for h in HOOKS}

    def _see(self, hook: str, module) -> None:
        self.seen[hook].append(module.net[0].weight.detach().clone())

    def on_train_batch_end(self, trainer, module, *args) -> None:
        self._see("on_train_batch_end", module)

    def on_train_epoch_end(self, trainer, module) -> None:
        self._see("on_train_epoch_end", module)

    def on_validation_epoch_end(self, trainer, module) -> None:
        self._see("on_validation_epoch_end", module)

    def on_train_end(self, trainer, module) -> None:
        self._see("on_train_end", module)


def _both(**kwargs):
    """fit_once on cpu and on mncore with fresh callbacks from `kwargs['callbacks']()`."""
    make_callbacks = kwargs.pop("callbacks", list)
    runs = {}
    for accelerator in ("cpu", "mncore"):
        callbacks = make_callbacks()
        trainer, model, _ = fit_once(accelerator, callbacks=callbacks, **kwargs)
        runs[accelerator] = (trainer, model, callbacks)
    return runs["cpu"], runs["mncore"]


def test_hooks_read_the_current_weights():
    (_, cpu, [cpu_spy]), (_, mn, [mn_spy]) = _both(
        callbacks=lambda: [WeightSpy()], val=loader(n=32), max_epochs=2
    )
    for hook in HOOKS:
        assert len(cpu_spy.seen[hook]) == len(mn_spy.seen[hook]) > 0, hook
        for a, b in zip(cpu_spy.seen[hook], mn_spy.seen[hook], strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=hook)
    assert_state_close(cpu, mn)


class ClampWeights(Callback):
    def on_train_batch_end(self, trainer, module, *args) -> None:
        with torch.no_grad():
            for p in module.parameters():
                p.clamp_(-0.05, 0.05)


def test_host_edits_in_a_hook_reach_the_device():
    (_, cpu, _), (_, mn, _) = _both(callbacks=lambda: [ClampWeights()], max_epochs=2)
    assert max(p.abs().max().item() for p in mn.parameters()) <= 0.05 + 1e-7
    assert_state_close(cpu, mn)


class DataAssignment(Callback):
    def on_train_epoch_end(self, trainer, module) -> None:
        module.net[0].weight.data = module.net[0].weight.data * 0.5


def test_data_assignment_reaches_the_device():
    (_, cpu, _), (_, mn, _) = _both(callbacks=lambda: [DataAssignment()], max_epochs=3)
    assert_state_close(cpu, mn)


class Boom(RuntimeError):
    pass


class FailAtStep(Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == 5:
            raise Boom("stop")


class EmergencySave(Callback):
    def __init__(self) -> None:
        self.saved: dict[str, torch.Tensor] | None = None

    def on_exception(self, trainer, module, exception) -> None:
        self.saved = {k: v.clone() for k, v in module.state_dict().items()}


def test_on_exception_sees_the_trained_weights():
    saved = {}
    for accelerator in ("cpu", "mncore"):
        save = EmergencySave()
        with pytest.raises(Boom):
            fit_once(accelerator, callbacks=[EmergencySave(), save, FailAtStep()], max_epochs=3)
        saved[accelerator] = save.saved
    assert saved["cpu"].keys() == saved["mncore"].keys()
    for key in saved["cpu"]:
        torch.testing.assert_close(saved["cpu"][key], saved["mncore"][key], atol=ATOL, rtol=0)
    initial = LitClassifier().state_dict()  # same seed as fit_once: the weights did move
    assert not torch.equal(initial["net.0.weight"], saved["mncore"]["net.0.weight"])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_stochastic_weight_averaging(tmp_path, checkpointing):
    (_, cpu, _), (_, mn, _) = _both(
        callbacks=lambda: [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)],
        max_epochs=3,
        enable_checkpointing=checkpointing,
        default_root_dir=tmp_path,
    )
    assert_state_close(cpu, mn)


def test_ema_weight_averaging_validates_and_ends_with_the_average():
    (cpu_trainer, cpu, _), (mn_trainer, mn, _) = _both(
        callbacks=lambda: [EMAWeightAveraging(decay=0.9)], val=loader(n=32), max_epochs=2
    )
    assert_state_close(cpu, mn)
    for key in ("val_loss", "val_acc"):
        torch.testing.assert_close(
            cpu_trainer.callback_metrics[key], mn_trainer.callback_metrics[key], atol=ATOL, rtol=0
        )


def test_model_pruning_retraces_and_matches_cpu():
    (_, cpu, _), (mn_trainer, mn, _) = _both(
        callbacks=lambda: [ModelPruning("l1_unstructured", amount=0.3)], max_epochs=3
    )
    assert_state_close(cpu, mn)
    assert (mn.net[0].weight == 0).float().mean() > 0.25  # the masks are applied


class GradNormLogger(LitClassifier):
    def on_before_optimizer_step(self, optimizer) -> None:
        norms = grad_norm(self, norm_type=2)
        assert norms, "no gradients in on_before_optimizer_step"
        self.log_dict(norms)
        self.seen = getattr(self, "seen", []) + [norms["grad_2.0_norm_total"].clone()]


def test_grad_norm_in_on_before_optimizer_step_matches_cpu():
    (_, cpu, _), (_, mn, _) = _both(model_cls=GradNormLogger, gradient_clip_val=0.5)
    assert len(cpu.seen) == len(mn.seen) > 0
    # as Lightning orders it: the hook sees the gradients before clipping
    assert max(n.item() for n in mn.seen) > 0.5
    torch.testing.assert_close(torch.stack(cpu.seen), torch.stack(mn.seen), atol=ATOL, rtol=0)
    assert_state_close(cpu, mn)


class AfterBackwardSpy(LitClassifier):
    def on_after_backward(self) -> None:
        self.grads = getattr(self, "grads", []) + [self.net[0].weight.grad.clone()]


def test_on_after_backward_sees_the_gradients():
    (_, cpu, _), (_, mn, _) = _both(model_cls=AfterBackwardSpy)
    assert len(cpu.grads) == len(mn.grads) > 0
    torch.testing.assert_close(torch.stack(cpu.grads), torch.stack(mn.grads), atol=ATOL, rtol=0)


class GradientEditor(LitClassifier):
    def on_before_optimizer_step(self, optimizer) -> None:
        self.net[0].weight.grad.mul_(0.0)


def test_changing_a_gradient_in_a_hook_raises():
    with pytest.raises(MisconfigurationException, match="on_before_optimizer_step changed"):
        fit_once("mncore", model_cls=GradientEditor)


class CustomClipping(LitClassifier):
    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="value")


def test_custom_configure_gradient_clipping_without_clip_val():
    (_, cpu, _), (_, mn, _) = _both(model_cls=CustomClipping)
    assert_state_close(cpu, mn)
    unclipped = fit_once("cpu")[1]
    assert not torch.allclose(unclipped.net[0].weight, mn.net[0].weight, atol=ATOL)


class SelfStepped(LitClassifier):
    """Keeps its scheduler and steps it itself (not returned to Lightning)."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
        return optimizer

    def on_train_epoch_end(self) -> None:
        self.scheduler.step()


def test_a_scheduler_the_module_keeps_drives_the_device():
    (cpu_trainer, cpu, _), (mn_trainer, mn, _) = _both(model_cls=SelfStepped, max_epochs=3)
    optimizer = mn_trainer.optimizers[0]
    assert mn.scheduler.optimizer is optimizer  # the user's object, converted in place
    assert isinstance(optimizer, torch.optim.SGD) and type(optimizer).__name__ == "SGD"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    assert_state_close(cpu, mn)


def test_learning_rate_monitor_keys_are_those_of_cpu(tmp_path):
    keys = {}
    for accelerator in ("cpu", "mncore"):
        logger = CSVLogger(tmp_path, name=accelerator)
        fit_once(
            accelerator,
            {"scheduler": "step"},
            callbacks=[LearningRateMonitor()],
            logger=logger,
            log_every_n_steps=1,
        )
        keys[accelerator] = set(logger.experiment.metrics_keys)
    assert "lr-SGD" in keys["mncore"]
    assert keys["cpu"] == keys["mncore"]


def test_a_plain_loop_never_synchronizes_between_steps(monkeypatch):
    strategy = MNCoreStrategy(device="pfvm:cpu", preset="O0")
    calls = []
    original = MNCoreStrategy.synchronize

    def counting(self):
        calls.append(self._device_is_newer)
        original(self)

    monkeypatch.setattr(MNCoreStrategy, "synchronize", counting)
    trainer = make_trainer(strategy=strategy, max_epochs=2)
    trainer.fit(LitClassifier(), loader())
    # only the end of fit refreshes the host (8 steps ran): no hook asked for more
    assert sum(calls) == 1, calls


def test_device_stats_count_retraces():
    trainer, _, _ = fit_once("mncore", callbacks=[ModelPruning("l1_unstructured", amount=0.3)])
    assert trainer.strategy.retraces >= 1
