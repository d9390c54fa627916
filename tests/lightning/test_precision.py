"""bf16 precision: autocast is recorded into the compiled step ("bf16-mixed"), or the module is
converted to bfloat16 ("bf16-true"). mncore must agree with cpu at the same precision within
the tolerance that cpu's bf16 run has against cpu's fp32 run."""

from __future__ import annotations

import pytest
import torch

from mncore_lightning import MNCorePrecision, MNCoreStrategy
from tests.lightning.lightning_testing import fit_once, make_trainer


def _state_diff(a, b) -> float:
    return max(
        (x.float() - y.float()).abs().max().item()
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_matches_cpu_within_cpus_own_bf16_error(precision):
    _, cpu32, cpu32_losses = fit_once("cpu")
    _, cpu, cpu_losses = fit_once("cpu", precision=precision)
    trainer, mn, mn_losses = fit_once("mncore", precision=precision)
    tolerance = _state_diff(cpu, cpu32)
    assert tolerance > 0  # bf16 does change the numbers
    assert _state_diff(cpu, mn) <= tolerance
    reference, ours, fp32 = (
        torch.stack(losses.losses).float() for losses in (cpu_losses, mn_losses, cpu32_losses)
    )
    loss_tolerance = (reference - fp32).abs().max().item()
    assert (reference - ours).abs().max().item() <= loss_tolerance
    assert isinstance(trainer.precision_plugin, MNCorePrecision)
    assert trainer.precision_plugin.precision == precision
    expected = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert next(mn.parameters()).dtype == expected  # master weights fp32 for mixed


def test_bf16_mixed_with_an_explicit_strategy_is_wrapped():
    trainer = make_trainer(strategy=MNCoreStrategy(), precision="bf16-mixed")
    assert isinstance(trainer.precision_plugin, MNCorePrecision)
    assert trainer.precision_plugin.precision == "bf16-mixed"
