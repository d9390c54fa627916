"""bf16 precision: autocast is recorded into the compiled step ("bf16-mixed"), or the module is
converted to bfloat16 ("bf16-true"). mncore must agree with cpu at the same precision within
the tolerance that cpu's bf16 run has against cpu's fp32 run."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

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
    if precision == "bf16-mixed":  # autocast on the host's tensors, as cpu's: the same numbers
        assert _state_diff(cpu, mn) == 0.0


def _fp16_plugin(init_scale: float) -> MixedPrecision:
    return MixedPrecision(
        "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale)
    )


@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**40])
def test_fp16_mixed_loss_scaling_skips_and_updates_as_grad_scaler(init_scale):
    """16-mixed: fp16 autocast, and torch.amp.GradScaler's dynamic loss scaling inside the
    compiled step. With a huge initial scale the first steps overflow: they are skipped and the
    scale backs off, exactly as GradScaler does on cpu (with the same explicit plugin)."""
    runs = {}
    for accelerator in ("cpu", "mncore"):
        plugin = _fp16_plugin(init_scale)
        trainer, model, losses = fit_once(accelerator, plugins=[plugin])
        runs[accelerator] = (trainer, model, losses)
    (cpu_trainer, cpu, cpu_losses), (mn_trainer, mn, mn_losses) = runs["cpu"], runs["mncore"]
    cpu_scale = cpu_trainer.precision_plugin.scaler.get_scale()
    mn_scale = mn_trainer.precision_plugin.scaler.get_scale()
    assert mn_scale == cpu_scale
    if init_scale > 2.0**30:
        assert mn_scale < init_scale  # overflows were found, steps skipped, the scale backed off
    assert _state_diff(cpu, mn) <= 1e-5
    torch.testing.assert_close(
        torch.stack(cpu_losses.losses).float(),
        torch.stack(mn_losses.losses).float(),
        atol=1e-3,
        rtol=0,
    )


def test_bf16_mixed_with_an_explicit_strategy_is_wrapped():
    trainer = make_trainer(strategy=MNCoreStrategy(), precision="bf16-mixed")
    assert isinstance(trainer.precision_plugin, MNCorePrecision)
    assert trainer.precision_plugin.precision == "bf16-mixed"


def test_the_precision_flag_applies_to_a_strategy_instance_holding_its_default_plugin():
    """A strategy instance already holding its default 32-true plugin (read before the Trainer
    was built): Lightning would keep that plugin and ignore precision="bf16-mixed", training
    in fp32; the flag applies, with cpu's bf16-mixed numbers."""
    strategy = MNCoreStrategy()
    assert strategy.precision_plugin.precision == "32-true"
    _, cpu, cpu_losses = fit_once("cpu", precision="bf16-mixed", max_epochs=1)
    trainer, mn, mn_losses = fit_once(
        "mncore", strategy=strategy, precision="bf16-mixed", max_epochs=1
    )
    assert trainer.precision == "bf16-mixed"
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"
    assert _state_diff(cpu, mn) == 0.0  # autocast recorded into the step, as cpu's bf16-mixed
    torch.testing.assert_close(torch.stack(cpu_losses.losses), torch.stack(mn_losses.losses))


def test_a_precision_flag_that_contradicts_the_strategys_own_plugin_is_refused():
    strategy = MNCoreStrategy(precision_plugin=MNCorePrecision())
    with pytest.raises(MisconfigurationException, match=r"precision='bf16-mixed'.*pass one"):
        make_trainer(strategy=strategy, precision="bf16-mixed")
    trainer = make_trainer(strategy=MNCoreStrategy(precision_plugin=MNCorePrecision()))
    assert trainer.precision == "32-true"  # no flag, or one that agrees: accepted


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_the_precision_flag_autocasts_on_the_host(precision):
    # Lightning would pick autocast's device "cuda" for accelerator="mncore": a silent no-op here
    trainer = make_trainer(precision=precision)
    inner = trainer.precision_plugin.inner
    assert isinstance(inner, MixedPrecision) and inner.device == "cpu"
    if precision == "16-mixed":
        assert inner.scaler is not None and inner.scaler.is_enabled()
