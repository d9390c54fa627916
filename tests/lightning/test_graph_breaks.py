"""Host code inside training_step (graph breaks) runs between device calls, as on cpu.

A training step with `print`, a NumPy draw or a logger call in the middle of its forward is
several TorchDynamo graphs. Each runs as a forward device call (keeping what its backward
needs) and a backward device call, wrapped as one autograd function, so the host's backward
after the step runs through them in reverse; the update is one more device call
(mncore_device.capture.autograd_graphs, steps.hooks.CapturedHook._split_update). Each test
fits a tiny model with accelerator="cpu" and "mncore" (preset O0, same seed, same batches)
and compares every loss, every logged value, the final metrics and the weights and buffers
within ATOL = 1e-5.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from mncore_device import StaticGraphError
from mncore_lightning import MNCoreStrategy
from tests.lightning.lightning_testing import ATOL, LitClassifier
from tests.lightning.test_dynamo_capture import Run, _assert_same, _counting, _fit, _line_of


class TrainHook(Callback):
    """At the end of training (before the strategy's teardown forgets them): the captured
    training step."""

    def __init__(self) -> None:
        self.hook: Any = None

    def on_train_end(self, trainer, module) -> None:
        strategy = trainer.strategy
        captured = getattr(strategy, "_captured", {})
        hooks = [hook for key, hook in captured.items() if key[0] == "train"]
        self.hook = hooks[-1] if hooks else None


def _train_hook(run: Run) -> Any:
    """The captured training step of an mncore run."""
    [keeper] = [c for c in run.trainer.callbacks if isinstance(c, TrainHook)]
    assert keeper.hook is not None
    return keeper.hook


class HostCodeInTraining(LitClassifier):
    """print, a NumPy draw (added as a tensor) and a TensorBoard call between two layers."""

    def __init__(self, net: str = "mlp") -> None:
        super().__init__(net=net)
        self.rng = np.random.default_rng(0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net[:2](x)
        print(f"training batch {batch_idx}")
        noise = self.rng.normal(scale=0.1, size=tuple(h.shape)).astype(np.float32)
        h = h + torch.from_numpy(noise)
        self.logger.experiment.add_scalar("train/h_mean", h.mean(), self.global_step)
        loss = F.cross_entropy(self.net[2:](h), y)
        self.log("train_loss", loss)
        return loss


def _fit_both(tmp_path, make_model, **kwargs) -> tuple[Run, Run, list, list]:
    runs, calls = [], {}
    for accelerator in ("cpu", "mncore"):
        tensorboard = TensorBoardLogger(tmp_path / accelerator, name="tb")
        calls[accelerator] = []
        _counting(tensorboard.experiment, calls[accelerator])
        runs.append(
            _fit(accelerator, make_model, loggers=[tensorboard], callbacks=[TrainHook()], **kwargs)
        )
    _assert_same(*runs)
    return runs[0], runs[1], calls["cpu"], calls["mncore"]


def test_print_numpy_draw_and_tensorboard_in_training_step_as_on_cpu(tmp_path, caplog, capsys):
    with caplog.at_level("INFO", logger="lightning.pytorch"):
        cpu, mn, cpu_calls, mn_calls = _fit_both(tmp_path, HostCodeInTraining, epochs=3)
    # the host code ran once a step, as on cpu: same prints, draws and writer calls
    printed = capsys.readouterr().out
    assert printed.count("training batch 0") == 2 * 3  # both runs, 3 epochs
    assert mn.model.rng.bit_generator.state == cpu.model.rng.bit_generator.state
    ours = [(t, v) for _, t, v, _ in mn_calls if t == "train/h_mean"]
    theirs = [(t, v) for _, t, v, _ in cpu_calls if t == "train/h_mean"]
    assert len(ours) == len(theirs) == 6
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    # the breaks are reported once, with the user's lines and the device calls a step
    hook = _train_hook(mn)
    lines = [_line_of(HostCodeInTraining.training_step, text) for text in ("print(", "rng.normal")]
    where = [b.where for b in hook.frontend.breaks]
    for line in lines:
        assert any(f"{__file__}:{line}" in w for w in where), where
    said = [r.getMessage() for r in caplog.records if "device calls per step" in r.getMessage()]
    assert len(said) == 1, said
    assert f"{__file__}:{lines[0]}" in said[0]
    assert f"{hook.device_calls_per_step} device calls per step" in said[0]
    # each graph a forward and at most one backward call, and the update
    graphs = hook.frontend.device_calls
    assert graphs + 1 < hook.device_calls_per_step <= 2 * graphs + 1


class BatchNormWithBreak(LitClassifier):
    """BatchNorm's running statistics are device state the forward calls write."""

    def __init__(self) -> None:
        super().__init__(net="bn")

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net[:2](x)  # Linear, BatchNorm1d
        print("batch", batch_idx, "mean", round(float(h.detach().mean()), 3))
        loss = F.cross_entropy(self.net[2:](h), y)
        self.log("train_loss", loss)
        return loss


def test_batchnorm_and_a_break_in_training_step_as_on_cpu():
    """Weights, running statistics and num_batches_tracked as on cpu; validation (eval
    mode: the running statistics) too."""
    cpu = _fit("cpu", BatchNormWithBreak, epochs=3, val_batches=2)
    mn = _fit("mncore", BatchNormWithBreak, epochs=3, val_batches=2, callbacks=[TrainHook()])
    _assert_same(cpu, mn)
    assert int(mn.model.net[1].num_batches_tracked) == 6
    hook = _train_hook(mn)
    assert hook.frontend.breaks
    # two graphs, each a forward and a backward call, and the update (the graph of the
    # update marker's call after the break computes nothing: it runs on the host)
    assert hook.device_calls_per_step == 5


def test_accumulation_and_clipping_with_a_break_as_on_cpu():
    """Gradients of two micro-batches gather on the device; the window's update clips."""
    overrides = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    cpu = _fit("cpu", BatchNormWithBreak, epochs=2, batches=4, **overrides)
    mn = _fit(
        "mncore", BatchNormWithBreak, epochs=2, batches=4, callbacks=[TrainHook()], **overrides
    )
    _assert_same(cpu, mn)
    assert _train_hook(mn).frontend.breaks
    assert mn.trainer.global_step == cpu.trainer.global_step == 4


def test_fullgraph_with_a_break_in_training_step_names_the_users_line():
    line = _line_of(HostCodeInTraining.training_step, "print(")
    strategy = MNCoreStrategy(device="pfvm:cpu", preset="O0", fullgraph=True)
    with pytest.raises(StaticGraphError, match="fullgraph=True") as error:
        _fit("mncore", HostCodeInTraining, epochs=1, strategy=strategy)
    assert f"{__file__}:{line}" in str(error.value), str(error.value)


@torch.compiler.disable
def _record_norm(norms: list[float], weight: torch.Tensor) -> None:
    """Host code, as a logger's add_histogram is (a graph break)."""
    norms.append(float(weight.detach().norm()))


class ReadsWeightsOnTheHost(LitClassifier):
    """Host code that reads a weight, and dropout."""

    def __init__(self) -> None:
        super().__init__(dropout=0.3)
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        _record_norm(self.norms, self.net[0].weight)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss


def test_host_code_reading_weights_and_dropout_in_training_step_as_on_cpu():
    """The host code sees each step's weights (before its update), as on cpu; dropout in a
    forward device call draws what cpu draws, and its backward uses the same mask."""
    cpu = _fit("cpu", ReadsWeightsOnTheHost, epochs=2)
    mn = _fit("mncore", ReadsWeightsOnTheHost, epochs=2, callbacks=[TrainHook()])
    _assert_same(cpu, mn)
    assert len(mn.model.norms) == len(cpu.model.norms) == 4
    assert mn.model.norms == pytest.approx(cpu.model.norms, abs=ATOL)
    assert _train_hook(mn).frontend.breaks


class DataDependentBranch(LitClassifier):
    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        if loss > 1.1:  # a branch on a tensor's value: a graph break, decided on the host
            loss = loss * 0.5
        self.log("train_loss", loss)
        return loss


def test_data_dependent_branch_in_training_step_as_on_cpu():
    """Dynamo splits the step at the branch and the host decides it at every step, as on
    cpu."""
    cpu = _fit("cpu", DataDependentBranch, epochs=3)
    mn = _fit("mncore", DataDependentBranch, epochs=3, callbacks=[TrainHook()])
    _assert_same(cpu, mn)
    losses = torch.stack(mn.losses)
    assert (losses < 0.8).any() and (losses > 0.8).any()  # both ways taken (halved or not)
    line = _line_of(DataDependentBranch.training_step, "if loss > 1.1")
    assert any(f"{__file__}:{line}" in b.where for b in _train_hook(mn).frontend.breaks)


class PrintsUnderFp16(LitClassifier):
    """Host code in the forward under 16-mixed: the loss scale is device state."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net[:2](x)
        print(f"fp16 batch {batch_idx}")
        loss = F.cross_entropy(self.net[2:](h), y)
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("init_scale", [2.0**8, 2.0**40])
def test_host_code_under_16_mixed_scales_skips_and_backs_off_as_on_cpu(init_scale, caplog):
    """The host's backward runs on the loss scaled by the device's scale (the host is
    synchronized before the step) and the update call unscales, skips a step with inf/NaN
    gradients and updates the scale on the device, as GradScaler does on cpu. With a huge
    initial scale the first steps overflow: skipped, and the scale backs off."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugin() -> MixedPrecision:
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        return MixedPrecision("16-mixed", "cpu", scaler=scaler)

    cpu = _fit("cpu", PrintsUnderFp16, epochs=2, plugins=[plugin()], callbacks=[TrainHook()])
    with caplog.at_level("INFO", logger="lightning.pytorch"):
        mn = _fit("mncore", PrintsUnderFp16, epochs=2, plugins=[plugin()], callbacks=[TrainHook()])
    _assert_same(cpu, mn)
    scales = [run.trainer.precision_plugin.scaler.get_scale() for run in (cpu, mn)]
    assert scales[0] == scales[1]
    if init_scale > 2.0**30:
        assert scales[1] < init_scale  # steps overflowed, were skipped, and the scale backed off
    assert _train_hook(mn).device_calls_per_step > 1  # the forward split at the print


def test_host_code_under_bf16_mixed_as_on_cpu():
    """Autocast around a step with a graph break: Dynamo resumes torch.autocast after the
    break (MNCorePrecision.capture_context), so each graph's device calls run under it, and
    the backward and the update outside it, as on cpu."""
    cpu = _fit("cpu", PrintsUnderFp16, epochs=2, precision="bf16-mixed")
    mn = _fit("mncore", PrintsUnderFp16, epochs=2, precision="bf16-mixed", callbacks=[TrainHook()])
    _assert_same(cpu, mn)
    assert _train_hook(mn).device_calls_per_step > 1


def _state_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return max((x.float() - y.float()).abs().max().item() for x, y in pairs)


class HostCodeUnderBf16True(LitClassifier):
    """Host code in the forward that reads the default dtype: bf16 inside training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net[:2](x)
        self.dtypes.append(torch.get_default_dtype())
        print(f"bf16 batch {batch_idx}")
        h = h + torch.full(tuple(h.shape), 0.01)  # made in the default dtype
        loss = F.cross_entropy(self.net[2:](h), y)
        self.log("train_loss", loss)
        return loss


def test_host_code_under_bf16_true_as_on_cpu():
    """bf16-true's default dtype is entered around the captured step, outside Dynamo's
    frame (MNCorePrecision.default_dtype_context): host code and tensors made in the step
    see bfloat16 as on cpu, and the update is traced under the default dtype outside the
    step, as cpu runs it."""
    cpu32 = _fit("cpu", HostCodeUnderBf16True, epochs=2)
    cpu = _fit("cpu", HostCodeUnderBf16True, epochs=2, precision="bf16-true")
    mn = _fit(
        "mncore", HostCodeUnderBf16True, epochs=2, precision="bf16-true", callbacks=[TrainHook()]
    )
    torch.testing.assert_close(torch.stack(mn.losses), torch.stack(cpu.losses), atol=ATOL, rtol=0)
    # weights within the error cpu's own bf16 run has (the update's rounding in bf16 is the
    # MN-Core optimizer's, as in test_precision.py)
    tolerance = _state_diff(cpu.model, cpu32.model)
    assert _state_diff(cpu.model, mn.model) <= tolerance
    assert mn.model.dtypes == cpu.model.dtypes == [torch.bfloat16] * 4
    assert next(mn.model.parameters()).dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    assert _train_hook(mn).device_calls_per_step > 1


class BatchIdxAfterABreak(LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        print(f"batch {batch_idx}")  # the rest of the step is a frame of its own
        loss = F.cross_entropy(self(x), y) * (1 + batch_idx % 3)
        self.log("train_loss", loss)
        return loss


def test_batch_idx_after_a_break_is_a_graph_input_as_on_cpu():
    """After a graph break Dynamo captures the rest of training_step as a frame of its own,
    whose `batch_idx` is an input from the first step on: no re-compile as it changes."""
    cpu = _fit("cpu", BatchIdxAfterABreak, epochs=2, batches=6)
    mn = _fit("mncore", BatchIdxAfterABreak, epochs=2, batches=6, callbacks=[TrainHook()])
    _assert_same(cpu, mn)
    assert mn.trainer.strategy.retraces == 0
    assert _train_hook(mn).device_calls_per_step > 1
