"""Gradient accumulation: gradients stay on the device between micro-batches, every micro-batch
is one compiled call, and losses, weights, global_step and schedulers match cpu (ATOL 1e-5)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler

from tests.lightning.lightning_testing import ATOL, assert_state_close, fit_once, loader


class CountGraphs(Callback):
    """The training graphs the strategy compiled: (window, ends the window with the update)."""

    def on_train_end(self, trainer, module) -> None:
        strategy = trainer.strategy
        self.kinds = strategy.training_graph_kinds() if hasattr(strategy, "context") else []


def _both(**kwargs):
    runs = [fit_once(accelerator, **kwargs) for accelerator in ("cpu", "mncore")]
    (cpu_trainer, cpu, cpu_losses), (mn_trainer, mn, mn_losses) = runs
    torch.testing.assert_close(
        torch.stack(cpu_losses.losses), torch.stack(mn_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu, mn)
    assert cpu_trainer.global_step == mn_trainer.global_step
    return cpu_trainer, mn_trainer


@pytest.mark.parametrize("n", [2, 3])
def test_accumulate_grad_batches_matches_cpu(n):
    # 6 batches an epoch: with n=3 two updates, with n=2 three
    graphs = CountGraphs()
    _, trainer = _both(
        model_kwargs={"scheduler": "step"},
        train=loader(n=96, shuffle=True),
        accumulate_grad_batches=n,
        max_epochs=2,
        callbacks=[graphs],
    )
    assert trainer.global_step == 2 * 6 // n
    assert trainer.strategy.compiled_calls >= 12  # every micro-batch is one call
    assert graphs.kinds == [(n, False), (n, True)]  # accumulate; accumulate and update


def test_gradient_accumulation_scheduler_changes_n_at_epoch_boundaries():
    _, trainer = _both(
        callbacks=[GradientAccumulationScheduler({0: 1, 1: 2, 2: 3})],
        train=loader(n=96, shuffle=True),
        max_epochs=3,
    )
    assert trainer.global_step == 6 + 3 + 2
