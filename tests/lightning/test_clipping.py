"""Gradient clipping is part of the compiled step and matches cpu.

Tolerance: ATOL = 1e-5 absolute (conftest) on weights and losses.
"""

from __future__ import annotations

import pytest
import torch

from tests.lightning.lightning_testing import assert_state_close, fit_once, loader


def _run(accelerator, optimizer="sgd", **overrides):
    return fit_once(
        accelerator,
        dict(optimizer=optimizer, lr=0.5 if optimizer == "sgd" else 0.05),
        train=loader(n=48, batch_size=16, shuffle=True),
        max_epochs=2,
        **overrides,
    )


@pytest.mark.parametrize(
    "optimizer,clip",
    [
        ("sgd", dict(gradient_clip_val=0.01)),  # algorithm defaults to "norm"
        ("sgd", dict(gradient_clip_val=0.005, gradient_clip_algorithm="value")),
        ("adam", dict(gradient_clip_val=0.01, gradient_clip_algorithm="norm")),
    ],
    ids=["sgd-norm", "sgd-value", "adam-norm"],
)
def test_clipping_matches_cpu_and_changes_training(optimizer, clip):
    _, cpu_model, cpu = _run("cpu", optimizer, **clip)
    _, model, ours = _run("mncore", optimizer, **clip)
    torch.testing.assert_close(torch.stack(ours.losses), torch.stack(cpu.losses), atol=1e-5, rtol=0)
    assert_state_close(model, cpu_model)
    _, unclipped, _ = _run("cpu", optimizer)
    assert not torch.allclose(unclipped.net[0].weight, model.net[0].weight, atol=1e-3)
