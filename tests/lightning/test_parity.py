"""accelerator="mncore" (preset O0) trains exactly as accelerator="cpu".

Dropout: with the same seed, training with Dropout active (p=0.25, CNN) matches the cpu run
to float32 rounding: the compiled step draws fresh masks from the global RNG on every call, in
the same order as eager PyTorch, so no p=0 fallback is needed.

Tolerance: ATOL = 1e-5 absolute (conftest) on every per-step loss, every final weight/buffer,
optimizer state and every logged metric. The O0 graph runs the same aten ops as eager
PyTorch; observed differences are ~1e-7 (float32 rounding of the functionalized graph).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from tests.lightning.lightning_testing import (
    ATOL,
    LitClassifier,
    assert_metrics_close,
    assert_optimizer_state_close,
    assert_state_close,
    fit_once,
    loader,
)

CASES = {
    "mlp-sgd-momentum": dict(net="mlp", optimizer="sgd", lr=0.1),
    "cnn-dropout-sgd": dict(net="cnn", optimizer="sgd", lr=0.05, dropout=0.25),
    "cnn-no-dropout-adam": dict(net="cnn", optimizer="adam", lr=0.01),
    "bn-sgd": dict(net="bn", optimizer="sgd", lr=0.1),
    "mlp-adam": dict(net="mlp", optimizer="adam", lr=0.01),
    "bn-adamw": dict(net="bn", optimizer="adamw", lr=0.01),
}


def _run(accelerator: str, model_kwargs: dict, **overrides):
    # shuffle=True and drop_last=True in both runs: the same batches in the same order
    return fit_once(
        accelerator,
        model_kwargs,
        train=loader(n=56, batch_size=16, shuffle=True, drop_last=True),  # 3 steps, 8 dropped
        val=loader(n=40, batch_size=16, drop_last=False, seed=1),
        max_epochs=3,
        **overrides,
    )


@pytest.mark.parametrize("model_kwargs", list(CASES.values()), ids=list(CASES))
def test_mncore_matches_cpu(model_kwargs):
    cpu_trainer, cpu_model, cpu = _run("cpu", model_kwargs)
    mn_trainer, mn_model, mn = _run("mncore", model_kwargs)

    assert len(cpu.losses) == len(mn.losses) == 3 * 3
    torch.testing.assert_close(torch.stack(mn.losses), torch.stack(cpu.losses), atol=ATOL, rtol=0)
    # weights and buffers (BatchNorm running stats and num_batches_tracked included)
    assert_state_close(mn_model, cpu_model)
    assert_optimizer_state_close(mn_trainer.optimizers[0], cpu_trainer.optimizers[0])
    # per-epoch validation and training metrics
    assert len(mn.epoch_metrics) == len(cpu.epoch_metrics) == 3
    for mn_metrics, cpu_metrics in zip(mn.epoch_metrics, cpu.epoch_metrics, strict=True):
        assert_metrics_close(mn_metrics, cpu_metrics)
    assert {"train_loss", "val_loss", "val_acc"} <= set(mn.epoch_metrics[-1])
    assert mn_trainer.global_step == cpu_trainer.global_step == 9
    # the model actually trained: the weights moved from their (seeded) initial values
    L.seed_everything(0, verbose=False)
    initial = LitClassifier(**model_kwargs)
    assert not torch.allclose(initial.net[-1].weight, mn_model.net[-1].weight, atol=1e-3)
    if model_kwargs["net"] == "bn":  # running stats were updated on the device and synced
        bn = mn_model.net[1]
        assert int(bn.num_batches_tracked) == 9
        assert bn.running_mean.abs().max() > 1e-3
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))


@pytest.mark.parametrize("cpp_wrapper_max_ops", [1000, 0], ids=["cpp_wrapper", "python_wrapper"])
def test_mncore_o1_matches_cpu(cpp_wrapper_max_ops, tmp_path, monkeypatch):
    """At O1 (TorchInductor: fused kernels, state updated in place, the matmul kept apart from
    the momentum add) the SGD-momentum MLP matches cpu too, with either Inductor wrapper: the
    C++ one (graphs of up to `cpp_wrapper_max_ops` operations) and the Python one."""
    import json

    from mncore_device import preset_path

    preset = json.loads(preset_path("O1").read_text())
    preset["cpp_wrapper_max_ops"] = cpp_wrapper_max_ops
    (tmp_path / "O1.json").write_text(json.dumps(preset))
    monkeypatch.setenv("MNCORE_PRESET", str(tmp_path / "O1.json"))
    model_kwargs = CASES["mlp-sgd-momentum"]
    cpu_trainer, cpu_model, cpu = _run("cpu", model_kwargs)
    mn_trainer, mn_model, mn = _run("mncore", model_kwargs)

    assert mn_trainer.strategy.preset == str(tmp_path / "O1.json")
    assert len(cpu.losses) == len(mn.losses) == 3 * 3
    torch.testing.assert_close(torch.stack(mn.losses), torch.stack(cpu.losses), atol=ATOL, rtol=0)
    assert_state_close(mn_model, cpu_model)
    assert_optimizer_state_close(mn_trainer.optimizers[0], cpu_trainer.optimizers[0])
    for mn_metrics, cpu_metrics in zip(mn.epoch_metrics, cpu.epoch_metrics, strict=True):
        assert_metrics_close(mn_metrics, cpu_metrics)
