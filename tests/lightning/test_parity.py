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

from mncore_lightning import MNCoreStrategy
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


def _assert_fits_match(mncore_run, cpu_run, steps_per_call: int = 1) -> None:
    """Two `_run` results of 3 epochs of 3 steps agree within ATOL: every step's loss (with
    `steps_per_call=K`, the loss Lightning gets from each call: its last step's), the
    weights, the optimizer state and every epoch's logged metrics."""
    (mn_trainer, mn_model, mn), (cpu_trainer, cpu_model, cpu) = mncore_run, cpu_run
    cpu_losses = cpu.losses[steps_per_call - 1 :: steps_per_call]
    assert len(cpu.losses) == 3 * 3 and len(mn.losses) == len(cpu_losses)
    torch.testing.assert_close(torch.stack(mn.losses), torch.stack(cpu_losses), atol=ATOL, rtol=0)
    assert_state_close(mn_model, cpu_model)
    assert_optimizer_state_close(mn_trainer.optimizers[0], cpu_trainer.optimizers[0])
    for mn_metrics, cpu_metrics in zip(mn.epoch_metrics, cpu.epoch_metrics, strict=True):
        assert_metrics_close(mn_metrics, cpu_metrics)


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
    _assert_fits_match((mn_trainer, mn_model, mn), (cpu_trainer, cpu_model, cpu))


class _SmallMapsClassifier(LitClassifier):
    """LitClassifier over 2x2 maps of 8 channels made by a view of a Linear's output, in NCHW
    or channels_last, through a 1x1 and a 3x3 convolution (which O1 runs as matmuls on maps
    this small), viewed again to rows: views that hold only for the strides PyTorch's
    convolutions give their output and their input's gradient."""

    def __init__(self, channels_last: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.channels_last = channels_last
        self.net = torch.nn.ModuleDict(
            {
                "rows": torch.nn.Linear(8, 32),
                "pointwise": torch.nn.Conv2d(8, 8, 1),
                "dense": torch.nn.Conv2d(8, 8, 3, padding=1),
                "head": torch.nn.Linear(32, 3),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.net["rows"](x)
        if self.channels_last:
            maps = rows.view(-1, 2, 2, 8).permute(0, 3, 1, 2)
        else:
            maps = rows.view(-1, 8, 2, 2)
        y = torch.relu(self.net["pointwise"](maps)) + self.net["dense"](maps)
        if self.channels_last:
            return self.net["head"](y.permute(0, 2, 3, 1).reshape(-1, 32))
        return self.net["head"](y.view(-1, 32))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_mncore_o1_matches_cpu_with_convolutions_on_small_maps(monkeypatch, channels_last):
    """At O1 a convolution on a map of at most 4 pixels runs as matmuls, laid out as the
    convolution would lay out its output and its input's gradient; a fit through them
    matches cpu (losses, weights, optimizer state, logged metrics within ATOL), with both
    rewrites applied (their floors lowered to reach this small model) and no fallback to
    running op by op."""
    import warnings

    from mncore_device import InductorFallbackWarning
    from tests.device.device_testing import recording_small_map_rewrites

    rewritten = recording_small_map_rewrites(monkeypatch)
    monkeypatch.setenv("MNCORE_PRESET", "O1")
    model_kwargs = dict(channels_last=channels_last, optimizer="sgd", lr=0.1)
    cpu_trainer, cpu_model, cpu = _run("cpu", model_kwargs, model_cls=_SmallMapsClassifier)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InductorFallbackWarning)
        mn_trainer, mn_model, mn = _run("mncore", model_kwargs, model_cls=_SmallMapsClassifier)

    assert {"_pointwise_as_matmul", "_small_map_as_matmul"} <= {name for name, _ in rewritten}
    _assert_fits_match((mn_trainer, mn_model, mn), (cpu_trainer, cpu_model, cpu))


@pytest.mark.parametrize(("optimizer", "steps_per_call"), [("sgd", 1), ("adamw", 1), ("adamw", 3)])
def test_mncore_o1_matches_cpu_with_its_first_weight_stored_transposed(
    monkeypatch, tmp_path, optimizer, steps_per_call
):
    """At O1 an MLP's first weight, read only as `W.t()` by its forward's matmul, is stored
    transposed with its optimizer state where the timing found that faster
    (runtime/matmul_layout.py; chosen here): the training graph holds it so (with
    `steps_per_call=3`, one graph of three steps, each computing its gradient transposed),
    the sanity check's and validation's graphs each as they were compiled for, and the fit
    matches cpu (losses, weights, optimizer state, logged metrics within ATOL), without
    falling back to running op by op."""
    import warnings

    from mncore_device import InductorFallbackWarning
    from mncore_device.runtime import executors, matmul_layout, timed_layouts

    monkeypatch.setattr(matmul_layout, "_time_both", lambda cases, device: (2.0, 1.0))
    monkeypatch.setattr(timed_layouts, "_DECIDED", {})
    monkeypatch.setattr(timed_layouts, "_inductor_cache_dir", lambda: tmp_path)
    transposed = []

    def recorded(*args, **kwargs):
        transposed.append(matmul_layout.transposed_where_faster(*args, **kwargs))
        return transposed[-1]

    monkeypatch.setattr(executors, "transposed_where_faster", recorded)
    monkeypatch.setenv("MNCORE_PRESET", "O1")
    model_kwargs = dict(net="mlp", optimizer=optimizer, lr=0.05)
    cpu_run = _run("cpu", model_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InductorFallbackWarning)
        strategy = MNCoreStrategy(steps_per_call=steps_per_call)
        mn_run = _run("mncore", model_kwargs, strategy=strategy)

    moments = 2 if optimizer == "adamw" else 1
    trained = [t for t in transposed if t.matmuls]  # the weight, its gradient and its state
    assert trained and all(len(t.inputs) == 1 + moments for t in trained)
    assert max(len(t.matmuls) for t in trained) == steps_per_call
    _assert_fits_match(mn_run, cpu_run, steps_per_call)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_mncore_o1_matches_cpu_with_its_state_held_channels_last(monkeypatch, channels_last):
    """At O1 a graph compiled in channels_last holds its convolution weights and their Adam
    state channels_last on the device (runtime/state_layout.py): the training, sanity-check
    and validation graphs, whose views of the convolutions' maps hold only for the host's
    layout, fit as cpu does (losses, weights, optimizer state, logged metrics within ATOL),
    none of them falling back to running op by op."""
    import warnings

    from mncore_device import InductorFallbackWarning
    from mncore_device.runtime import executors

    monkeypatch.setattr(executors, "_channels_last_is_faster", lambda gm, args: True)
    restrided = []

    class Recorded(executors.StateLayout):
        @classmethod
        def of(cls, *args, **kwargs):
            layout = super().of(*args, **kwargs)
            restrided.append(layout.restrided)
            return layout

    monkeypatch.setattr(executors, "StateLayout", Recorded)
    monkeypatch.setenv("MNCORE_PRESET", "O1")
    model_kwargs = dict(channels_last=channels_last, optimizer="adam", lr=0.01)
    cpu_run = _run("cpu", model_kwargs, model_cls=_SmallMapsClassifier)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InductorFallbackWarning)
        mn_run = _run("mncore", model_kwargs, model_cls=_SmallMapsClassifier)

    assert restrided and all(restrided)  # the dense 3x3 weight and its Adam state, each graph
    _assert_fits_match(mn_run, cpu_run)
