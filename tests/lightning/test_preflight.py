"""The preflight report (mncore_lightning.preflight), field by field, on modules that compile,
break the graph, re-compile, read Python values, carry state and read ragged data; the
callback, LightningCLI and the command line. Each report runs one batch per stage through the
TorchDynamo capture at O0 on tiny models."""

from __future__ import annotations

import inspect
import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from mncore_lightning import MNCorePreflight
from mncore_lightning.preflight import PreflightError, run_preflight
from mncore_lightning.preflight.graph import (
    activation_peak,
    measured_peak,
    op_counts,
    propagate_shapes,
)
from tests.lightning.lightning_testing import (
    CLASSES,
    IN_FEATURES,
    LitClassifier,
    loader,
    make_dataset,
    make_trainer,
)

ROOT = Path(__file__).resolve().parents[2]


def _hook(report, name):
    (hook,) = [h for h in report.hooks if h.hook == name]
    return hook


def _line_of(cls, text: str) -> str:
    lines, start = inspect.getsourcelines(cls)
    index = next(i for i, line in enumerate(lines) if text in line)
    return f"{Path(inspect.getsourcefile(cls)).name}:{start + index}"


# --- a module that compiles: every field ---------------------------------------------------


class Plain(LitClassifier):
    def __init__(self) -> None:
        super().__init__(net="mlp", optimizer="sgd", lr=0.1)


def test_the_report_of_a_module_that_compiles_field_by_field() -> None:
    module = Plain()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    rng = torch.random.get_rng_state()
    report = run_preflight(
        module,
        {"train": loader(64, 16), "validate": loader(48, 16), "test": loader(32, 8)},
        board_memory_bytes=2**30,
    )
    assert [h.hook for h in report.hooks] == ["training_step", "validation_step", "test_step"]
    train = _hook(report, "training_step")
    assert train.compiles and train.device_calls_per_step == 1 and train.graph_breaks == []
    assert train.graphs == 1 and train.retraces == [] and train.carried == []
    assert train.batch_shapes == {
        "batch[0]": [[16, IN_FEATURES], "float32"],
        "batch[1]": [[16], "int64"],
    }
    assert train.replayed == ["self.log('train_loss')"]
    assert train.live_inputs == [
        "optimizer hyperparameters (dampening, lr, momentum, weight_decay)"
    ] or (
        train.live_inputs[0].startswith("optimizer hyperparameters (")
        and "lr" in train.live_inputs[0]
    )
    # Dynamo's value guards, by the user's names: the Dropout's p and mode the forward reads;
    # none of the plumbing (the capture's closures, Lightning's private attributes)
    guarded = {g.name: g.value for g in train.guarded}
    assert guarded["self.net.2.p"] == 0.0 and guarded["self.net.2.training"] is True
    assert all(re.fullmatch(r"self(\.[a-z0-9]\w*)+", name) for name in guarded), guarded
    assert all(g.written_by == [] for g in train.guarded)
    assert {g.name: g.value for g in _hook(report, "validation_step").guarded}[
        "self.net.2.training"
    ] is False  # evaluation runs in eval mode: its own graph, guarded on it
    # parameters: Linear(8, 16) + Linear(16, 3), float32; SGD without momentum keeps no
    # per-parameter tensors but its step counters
    params = 4 * (IN_FEATURES * 16 + 16 + 16 * CLASSES + CLASSES)
    memory = train.memory
    assert memory.parameter_bytes == params and memory.buffer_bytes == 0
    # the batch, and its size: a number input of the graph (int64)
    assert memory.input_bytes == 16 * IN_FEATURES * 4 + 16 * 8 + 8
    assert memory.peak_bytes == (
        params
        + memory.optimizer_state_bytes
        + memory.input_bytes
        + max(memory.activation_peak_bytes, memory.measured_activation_peak_bytes)
    )
    # the estimate from shapes alone is within 1% of the emulator's measured peak
    error = abs(memory.activation_peak_bytes - memory.measured_activation_peak_bytes)
    assert memory.measured_activation_peak_bytes > 0 and error <= 0.01 * memory.peak_bytes
    assert memory.fits is True
    assert train.op_counts["matmul"] >= 4 and train.op_counts["convolution"] == 0
    assert train.op_counts["collective"] == 0 and set(train.seconds) == {"O0"}
    val = _hook(report, "validation_step")
    assert val.replayed == ["self.log('val_loss')", "self.log('val_acc')"]
    assert val.live_inputs == [] and val.op_counts["matmul"] == 2
    assert _hook(report, "test_step").batch_shapes["batch[0]"] == [[8, IN_FEATURES], "float32"]
    data = {d.stage: d for d in report.data}
    assert (data["train"].batches, data["train"].dropped_per_epoch) == (4, 0)
    # the user's module and random state are as they were
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng, torch.random.get_rng_state()) and module._trainer is None
    # JSON and Markdown carry the same figures
    data = json.loads(report.to_json())
    assert data["schema"] == 1 and data["hooks"][0]["memory"]["fits"] is True
    assert data["hooks"][0]["memory"]["parameter_bytes"] == params
    text = report.to_markdown()
    assert "| compiles | yes | yes | yes |" in text and "trace + compile, O0" in text
    plain, styled = io.StringIO(), io.StringIO()
    report.print(file=plain)  # not a terminal: the Markdown as it is
    report.print(file=styled, rich=True)  # a terminal: rich draws the tables
    assert plain.getvalue() == text
    assert "───" in styled.getvalue() and "| compiles |" not in styled.getvalue()
    assert report.failures(("graph_break", "retrace", "memory")) == []
    train.memory.board_bytes = train.memory.peak_bytes - 1  # a board one byte too small
    assert train.memory.fits is False
    assert report.failures(("memory",)) == [
        f"training_step: peak {train.memory.peak_bytes:,} bytes > board "
        f"{train.memory.peak_bytes - 1:,} bytes"
    ]


@pytest.mark.parametrize(
    ("spec", "ops", "optimizer_tensors"),
    [
        # 2 convolutions and 2 linears: forward and backward (the first conv's input needs no
        # gradient: one convolution_backward each); SGD with momentum: one buffer per parameter
        ("examples/mnist_cnn.py:MNISTConvNet", {"matmul": 6, "convolution": 4}, 1),
        # 4 linears: 4 forward, 4 weight gradients, 3 input gradients; Adam: two per parameter
        ("examples/autoencoder.py:LitAutoEncoder", {"matmul": 11, "convolution": 0}, 2),
    ],
)
def test_the_report_of_the_examples(spec, ops, optimizer_tensors) -> None:
    from mncore_lightning.preflight.__main__ import load_class

    module = load_class(spec)()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(40, 1, 28, 28, generator=g), torch.randint(0, 10, (40,), generator=g)
    )
    loaders = {stage: DataLoader(data, batch_size=16) for stage in ("train", "validate", "test")}
    report = run_preflight(module, loaders)
    assert [h.hook for h in report.hooks] == ["training_step", "validation_step", "test_step"]
    train, val, test = report.hooks
    assert all(h.compiles and h.device_calls_per_step == 1 and h.graphs == 1 for h in report.hooks)
    assert {k: train.op_counts[k] for k in ops} == ops and train.op_counts["collective"] == 0
    assert train.replayed == ["self.log('train_loss')"] and train.carried == []
    assert train.live_inputs[0].startswith("optimizer hyperparameters (") and val.live_inputs == []
    params = sum(p.numel() * 4 for p in module.parameters())
    assert train.memory.parameter_bytes == params
    # per-parameter tensors, and each parameter's step count (a float32 0-d tensor)
    count = len(list(module.parameters()))
    assert train.memory.optimizer_state_bytes == optimizer_tensors * params + 4 * count
    assert test.memory.optimizer_state_bytes == 0  # trainer.test sets up no optimizer
    for hook in report.hooks:
        assert hook.batch_shapes == {
            "batch[0]": [[16, 1, 28, 28], "float32"],
            "batch[1]": [[16], "int64"],
        }
        memory = hook.memory
        # aten.mse_loss returns its 0-d mean in the storage of the whole squared difference,
        # which the emulator holds as long as the loss; the estimate, from shapes, counts 4 B:
        # it falls short by at most that storage
        pinned = 16 * 784 * 4 if "autoencoder" in spec else 0
        missed = memory.measured_activation_peak_bytes - memory.activation_peak_bytes
        assert 0 <= missed <= pinned and (missed > 0) == (pinned > 0)
    guarded = {g.name: g.value for g in train.guarded}
    assert all(name.startswith("self.") for name in guarded), guarded
    if "mnist_cnn" in spec:
        assert guarded["self.conv2_drop.p"] == 0.5 and guarded["self.conv1.stride"] == (1, 1)
        assert val.replayed == ["self.log('val_loss')", "self.log('val_acc')"]
        assert test.replayed[2:] == ["self.log('test_correct')", "self.log('test_total')"]
    else:
        assert guarded["self.encoder.1.inplace"] is False  # the ReLU's flag its forward reads
        assert val.replayed == ["self.log('val_loss')"]
    data = {d.stage: d for d in report.data}
    assert (data["train"].batches, data["train"].dropped_per_epoch) == (2, 8)
    assert (data["validate"].batches, data["validate"].ragged_last_batch) == (3, 8)
    assert report.notes == [
        "MNCoreStrategy set drop_last=True on the training DataLoader (a compiled step has a "
        "static batch size of 16): 8 samples per epoch are skipped. To train them as cpu "
        "does, pass MNCoreStrategy(last_batch='compile'): the short last batch then runs as a "
        "second compiled graph."
    ]


# --- graph breaks ------------------------------------------------------------------------------


class Branching(LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if loss > 1:  # a branch on a tensor: host code between device calls
            loss = loss * 2
        return loss


def test_a_graph_break_names_the_users_line_and_the_other_hooks_still_report() -> None:
    report = run_preflight(Branching(), {"train": loader(), "validate": loader()})
    train = _hook(report, "training_step")
    # it runs, as forward and backward device calls around the branch and an update call
    assert train.compiles and train.device_calls_per_step >= 3 and train.memory is not None
    (brk,) = train.graph_breaks
    assert brk.line.endswith(_line_of(Branching, "if loss > 1"))
    assert "branching" in brk.reason.lower()
    assert _hook(report, "validation_step").compiles
    assert _hook(report, "validation_step").graph_breaks == []
    assert report.failures(("graph_break",)) == [f"training_step: {brk.reason} (at {brk.line})"]
    assert not report.failures(("retrace",))
    assert f"- training_step: graph break at {brk.line}: " in report.to_markdown()


class Printing(LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        print("loss", loss)  # host code: the graph breaks here
        self.log("train_loss", loss)
        return loss


def test_a_print_is_a_graph_break_at_its_line_with_the_runs_device_calls(caplog) -> None:
    report = run_preflight(Printing(), {"train": loader()})
    train = _hook(report, "training_step")
    assert train.compiles and train.replayed == ["self.log('train_loss')"]
    (brk,) = train.graph_breaks
    assert brk.line.endswith(_line_of(Printing, "print(")) and "print" in brk.reason
    # the device calls a step takes are those of a real run, which says them once
    caplog.clear()  # what the preflight's own fits said (Lightning's level may be INFO)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        make_trainer("mncore", max_epochs=1, limit_train_batches=2).fit(Printing(), loader())
    (said,) = re.findall(r"it runs as (\d+) device calls per step", caplog.text)
    assert train.device_calls_per_step == int(said) and train.device_calls_per_step > 1
    assert f"| device calls per step | {int(said)} |" in report.to_markdown()


class ManualPrinting(LitClassifier):
    """Manual optimization with host code: it runs host-driven, several device calls a step."""

    def __init__(self) -> None:
        super().__init__(scheduler="step")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt, sch = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        print("loss", loss)  # host code inside a manual step
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        sch.step()


def test_a_manual_step_with_host_code_reports_its_break_and_device_calls(caplog) -> None:
    """The user's print is the one graph break reported (the optimizer calls the host runs
    are the package's, not breaks of the user's), with the device calls a real run says."""
    report = run_preflight(ManualPrinting(), {"train": loader()})
    train = _hook(report, "training_step")
    assert train.compiles and train.error is None
    (brk,) = train.graph_breaks
    assert brk.line.endswith(_line_of(ManualPrinting, "print("))
    caplog.clear()  # what the preflight's own fits said (Lightning's level may be INFO)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        make_trainer("mncore", max_epochs=1, limit_train_batches=2).fit(ManualPrinting(), loader())
    (said,) = re.findall(r"it runs as (\d+) device calls per step", caplog.text)
    assert train.device_calls_per_step == int(said) > 1
    assert f"| device calls per step | {int(said)} |" in report.to_markdown()


def test_a_manual_steps_scheduler_step_is_replayed_on_the_host() -> None:
    class Manual(ManualPrinting):
        def training_step(self, batch, batch_idx):
            opt, sch = self.optimizers(), self.lr_schedulers()
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            sch.step()
            self.log("loss", loss)

    train = _hook(run_preflight(Manual(), {"train": loader()}), "training_step")
    assert train.compiles and train.device_calls_per_step == 1
    assert train.replayed == ["lr_scheduler.step()", "self.log('loss')"]


# --- guarded values, live inputs and re-compiles ------------------------------------------------

SCALES = {"train": 2.0}  # a module-level dict the step reads


def _scaled_by(factor: float):
    def scale(loss):
        return loss * factor  # a closure cell

    return scale


HALVE = _scaled_by(0.5)


class ReadsPython(LitClassifier):
    MARGIN = 0.25  # a class attribute

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.temperature = 1.5

    def training_step(self, batch, batch_idx):
        x, y = batch
        lr = self.optimizers().param_groups[0]["lr"]
        loss = F.cross_entropy(self(x) / self.temperature, y) * SCALES["train"] + self.MARGIN
        return HALVE(loss) * (self.hparams.lr / lr) + torch.zeros(()) * batch_idx


def test_guarded_values_and_live_inputs_by_the_users_names() -> None:
    report = run_preflight(ReadsPython(), {"train": loader()})
    train = _hook(report, "training_step")
    guarded = {g.name: g.value for g in train.guarded}
    assert {
        name: guarded.get(name)
        for name in (
            "self.temperature",
            "self.hparams.lr",
            "self.optimizers().param_groups[0]['lr']",
            "SCALES['train']",
            "ReadsPython.MARGIN",
            "_scaled_by.<locals>.factor",
        )
    } == {
        "self.temperature": 1.5,
        "self.hparams.lr": 0.05,
        "self.optimizers().param_groups[0]['lr']": 0.05,
        "SCALES['train']": 2.0,
        "ReadsPython.MARGIN": 0.25,
        "_scaled_by.<locals>.factor": 0.5,
    }
    # Dynamo's own names and the framework's values are not shown
    assert not [n for n in guarded if "L[" in n or "G[" in n or "__" in n or "._" in n]
    assert "batch_idx" in train.live_inputs and train.retraces == []  # an input: not guarded
    assert "batch_idx" not in guarded
    text = report.to_markdown()
    assert "| guarded values | " in text and "self.temperature=1.5" in text


class Rescaled(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def on_train_epoch_start(self) -> None:
        self.scale = 1.0 + self.current_epoch

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y) * self.scale


def test_a_value_a_hook_changes_is_flagged_and_the_recompile_observed() -> None:
    report = run_preflight(Rescaled(), {"train": loader()})
    train = _hook(report, "training_step")
    scale = next(g for g in train.guarded if g.name == "self.scale")
    assert scale.value == 1.0 and scale.written_by == ["on_train_epoch_start"]
    # Dynamo's reason: the guard that failed, in the user's names, at the user's line
    (retrace,) = train.retraces
    assert retrace.startswith("training_step: self.scale == 1.0 failed, at ")
    assert retrace.endswith(f"{_line_of(Rescaled, '* self.scale')} in training_step")
    assert train.graphs == 2  # the second epoch captured it again
    assert "self.scale" in train.live_inputs  # a float that changed: a graph input since
    risks = report.failures(("retrace",))
    assert risks[0] == f"re-compiled {retrace}"
    assert len(risks) == 2 and "on_train_epoch_start assigns" in risks[1]


class Annealed(LitClassifier):
    """A submodule's float that a later epoch hook changes, and one that setup fixes."""

    def __init__(self) -> None:
        super().__init__(dropout=0.1)
        self.width = 0

    def setup(self, stage: str) -> None:
        self.width = 16  # before the first step: captured as it is, never changed after

    def on_train_epoch_end(self) -> None:
        if self.current_epoch == 5:
            self.net[2].p = 0.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y) * (self.width / 16)


def test_values_written_later_are_flagged_from_the_source_and_setup_is_not() -> None:
    report = run_preflight(Annealed(), {"train": loader()})
    train = _hook(report, "training_step")
    guarded = {g.name: g for g in train.guarded}
    assert guarded["self.net.2.p"].value == 0.1
    assert guarded["self.net.2.p"].written_by == ["on_train_epoch_end"]
    assert guarded["self.width"].value == 16 and guarded["self.width"].written_by == []
    assert train.retraces == [] and train.graphs == 1  # epoch 5 is not reached
    (risk,) = report.failures(("retrace",))
    assert "self.net.2.p=0.1, which on_train_epoch_end assigns" in risk


class Crashing(LitClassifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        return self.net(x[:, :3])  # a shape error: not a graph break


def test_an_error_that_is_no_graph_break_is_reported_as_an_error_at_the_line() -> None:
    report = run_preflight(Crashing(), {"train": loader(), "validate": loader()})
    assert _hook(report, "training_step").compiles
    val = _hook(report, "validation_step")
    assert not val.compiles and val.graph_breaks == [] and "RuntimeError" in val.error.reason
    assert val.error.line.endswith(_line_of(Crashing, "x[:, :3]"))
    assert report.failures(("graph_break",)) == [
        f"validation_step failed: {val.error.reason} (at {val.error.line})"
    ]
    assert "| compiles | yes | **no: error** |" in report.to_markdown()


def test_the_callback_stops_the_fit_on_a_retrace_before_any_step() -> None:
    model = Rescaled()
    trainer = make_trainer("cpu", callbacks=[MNCorePreflight(fail_on=("retrace",))])
    with pytest.raises(PreflightError, match="self.scale"):
        trainer.fit(model, loader())
    assert trainer.global_step == 0


def test_the_callback_stops_the_fit_on_a_graph_break_naming_the_line() -> None:
    preflight = MNCorePreflight(fail_on=("graph_break", "retrace"), print_report=False)
    trainer = make_trainer("mncore", callbacks=[preflight])
    with pytest.raises(PreflightError) as stopped:
        trainer.fit(Printing(), loader())
    assert _line_of(Printing, "print(") in str(stopped.value) and trainer.global_step == 0
    assert str(stopped.value).startswith("MNCorePreflight(fail_on=('graph_break', 'retrace'))")


# --- carried state and replayed appends -------------------------------------------------------


class Carrying(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.ema = torch.zeros(())
        self.val_losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        warm = torch.clamp(torch.as_tensor(self.global_step / 4), max=1.0)
        loss = F.cross_entropy(self(x), y) * (1 + warm)
        self.ema = 0.9 * self.ema + 0.1 * loss.detach()
        self.log("ema", self.ema)
        self.log("step", self.global_step)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(F.cross_entropy(self(x), y))


def test_carried_tensors_live_counters_and_replayed_appends() -> None:
    report = run_preflight(Carrying(), {"train": loader(), "validate": loader()})
    train = _hook(report, "training_step")
    assert train.carried == ["self.ema"]  # a tensor attribute: a graph input at every call
    assert train.live_inputs[0] == "self.global_step"
    assert train.replayed == ["self.log('ema')", "self.log('step')"]
    val = _hook(report, "validation_step")
    assert val.replayed == ["self.val_losses.append(...)"] and val.carried == []


# --- a ragged data set ----------------------------------------------------------------------


def test_a_ragged_data_set_drop_last_and_the_second_evaluation_graph() -> None:
    train = DataLoader(make_dataset(100), batch_size=32)  # drop_last=False: rebuilt with it
    val = DataLoader(make_dataset(70), batch_size=32)
    report = run_preflight(Plain(), {"train": train, "validate": val})
    data = {d.stage: d for d in report.data}
    assert (data["train"].batches, data["train"].dropped_per_epoch) == (3, 4)
    assert data["train"].drop_last and data["train"].ragged_last_batch is None
    assert (data["validate"].batches, data["validate"].ragged_last_batch) == (3, 6)
    assert not data["validate"].drop_last and data["validate"].dropped_per_epoch == 0
    text = report.to_markdown()
    assert "| train | 32 | 3 | 3 | 100 | 4 samples | no |" in text
    assert "| validate | 32 | 3 | 3 | 70 | no | 6 samples: a second graph |" in text


# --- memory and op counts against the graph --------------------------------------------------


class SmallCNN(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_the_cnn_memory_estimate_matches_the_emulators_measured_peak() -> None:
    x = torch.randn(64, 1, 16, 16)
    data = DataLoader(torch.utils.data.TensorDataset(x, torch.randint(0, 10, (64,))), batch_size=16)
    report = run_preflight(SmallCNN(), {"train": data})
    train = _hook(report, "training_step")
    memory = train.memory
    error = abs(memory.activation_peak_bytes - memory.measured_activation_peak_bytes)
    assert error <= 0.02 * memory.measured_activation_peak_bytes, memory
    assert memory.buffer_bytes == 4 * (8 + 8) + 8  # BatchNorm2d: mean, var; int64 count
    assert memory.buffer_bytes == sum(b.numel() * b.element_size() for b in SmallCNN().buffers())
    # Adam keeps two tensors per parameter and a step count
    params = sum(p.numel() * 4 for p in SmallCNN().parameters())
    assert memory.parameter_bytes == params and memory.optimizer_state_bytes >= 2 * params
    assert train.op_counts["convolution"] == 4  # 2 forward, 2 backward (convolution_backward)
    assert train.op_counts["matmul"] == 3  # the Linear: forward, and 2 for its backward


def test_op_counts_and_the_liveness_walk_on_a_known_graph() -> None:
    def f(a, w, b):
        h = torch.relu(a @ w)  # mm, relu
        return (h + b).sum(), h.t()  # add, sum; t is a view

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(
        torch.ones(4, 8), torch.ones(8, 2), torch.ones(2)
    )
    counts = op_counts(gm)
    assert counts == {
        "matmul": 1,
        "convolution": 0,
        "elementwise": 2,
        "reduction": 1,
        "collective": 0,
        "other": 0,
    }
    specs = [((4, 8), torch.float32), ((8, 2), torch.float32), ((2,), torch.float32)]
    propagate_shapes(gm, specs)
    estimate = activation_peak(gm)
    # mm (32 B) freed after relu; relu (32 B, an output through its view) lives to the end;
    # add (32 B) lives until sum; peak: relu + add + the 0-d sum = 68 B
    assert estimate.peak_bytes == 32 + 32 + 4
    args = [torch.randn(s) for s, _ in specs]
    assert measured_peak(gm, args) == estimate.peak_bytes


# --- the callback, LightningCLI, the command line ----------------------------------------


def test_the_callback_reports_on_cpu_and_mncore_and_leaves_the_fit_as_it_was(tmp_path) -> None:
    results = {}
    for accelerator in ("cpu", "mncore"):
        L.seed_everything(0, verbose=False)
        model = Plain()
        preflight = MNCorePreflight(json_path=tmp_path / f"{accelerator}.json", print_report=False)
        trainer = make_trainer(accelerator, callbacks=[preflight], max_epochs=1)
        trainer.fit(model, loader(), loader(32))
        assert [h.hook for h in preflight.report.hooks] == ["training_step", "validation_step"]
        results[accelerator] = [p.detach().clone() for p in model.parameters()]
        assert json.loads((tmp_path / f"{accelerator}.json").read_text())["module"] == "Plain"
    L.seed_everything(0, verbose=False)
    model = Plain()
    make_trainer("cpu", max_epochs=1).fit(model, loader(), loader(32))
    for a, b in zip(results["cpu"], model.parameters(), strict=True):
        assert torch.equal(a, b)  # the preflight changed neither the weights nor the RNG
    for a, b in zip(results["mncore"], model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


CLI_SCRIPT = """
import sys
from lightning.pytorch.cli import LightningCLI
from tests.lightning.test_preflight import CLIData, LitClassifier
cli = LightningCLI(
    LitClassifier, CLIData, run=False, args=sys.argv[1:], save_config_callback=None
)
preflight = [c for c in cli.trainer.callbacks if type(c).__name__ == "MNCorePreflight"]
assert len(preflight) == 1, cli.trainer.callbacks
cli.trainer.fit(cli.model, cli.datamodule)
print("hooks:", [h.hook for h in preflight[0].report.hooks], preflight[0].fail_on)
"""


class CLIData(L.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return loader(64, self.batch_size)


def _run(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "device"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        "MNCORE_PRESET": "O0",
        "MNCORE_DEVICE": "pfvm:cpu",
    }
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_lightning_cli_resolves_the_callback(tmp_path) -> None:
    # LightningCLI needs jsonargparse (setup.cfg's dev extra installs it)
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures]")
    result = _run(
        [
            "-c",
            CLI_SCRIPT,
            "--trainer.callbacks+=mncore_lightning.MNCorePreflight",
            "--trainer.callbacks.print_report=false",
            "--trainer.callbacks.fail_on=[graph_break, retrace]",
            "--trainer.accelerator=cpu",
            "--trainer.max_epochs=1",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hooks: ['training_step'] ('graph_break', 'retrace')" in result.stdout


def test_the_command_line_on_the_mnist_example(tmp_path) -> None:
    out = tmp_path / "report.json"
    result = _run(
        [
            "-m",
            "mncore_lightning.preflight",
            "examples/mnist.py:MNISTClassifier",
            "--datamodule",
            "examples/mnist_datamodule.py:MNISTDataModule",
            "--init-args",
            '{"momentum": 0.0}',
            "--batch-size",
            "32",
            "--json",
            str(out),
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "# MN-Core preflight: MNISTClassifier" in result.stdout
    assert "| compiles | yes | yes | yes |" in result.stdout  # Markdown: not a terminal
    report = json.loads(out.read_text())
    hooks = {h["hook"]: h for h in report["hooks"]}
    assert list(hooks) == ["training_step", "validation_step", "test_step"]
    train = hooks["training_step"]
    assert train["batch_shapes"]["batch[0]"] == [[32, 1, 32, 32], "float32"]
    assert train["memory"]["parameter_bytes"] == 4 * (1024 * 256 + 256 + 256 * 10 + 10)
    # momentum=0.0 reached the module: SGD keeps no momentum buffers
    assert train["memory"]["optimizer_state_bytes"] < train["memory"]["parameter_bytes"]
    assert train["op_counts"]["matmul"] == 5 and train["replayed"] == ["self.log('train_loss')"]
    data = {d["stage"]: d for d in report["data"]}
    assert data["train"]["dropped_per_epoch"] == 4000 % 32 and data["train"]["batch_size"] == 32


def test_predict_and_several_steps_per_call() -> None:
    report = run_preflight(
        Plain(), {"train": loader(64, 16), "predict": loader(32, 16)}, steps_per_call=2
    )
    train, predict = report.hooks
    assert train.device_calls_per_step == 0.5 and train.compiles
    assert train.replayed == ["self.log('train_loss')"]  # each step's, after the group's call
    # a call of two steps takes the two batches: the graph's inputs are both
    assert train.batch_shapes["batch[0][0]"] == [[16, IN_FEATURES], "float32"]
    assert train.batch_shapes["batch[1][0]"] == [[16, IN_FEATURES], "float32"]
    assert predict.hook == "predict_step" and predict.device_calls_per_step == 1
    assert predict.replayed == [] and predict.op_counts["matmul"] == 2
    data = {d.stage: d for d in report.data}
    assert (data["train"].batches, data["train"].device_calls) == (4, 2)
    assert (data["predict"].batches, data["predict"].device_calls) == (2, 2)


MODULE_FILE = """
import torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset


class Branches(L.LightningModule):
    def __init__(self, width=4):
        super().__init__()
        self.layer = torch.nn.Linear(3, width)
        self.batch_size = 8

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        if loss.item() > 0:
            loss = loss * 2
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(20, 3)), batch_size=self.batch_size)
"""


def test_the_command_line_fails_on_a_graph_break_naming_the_line(tmp_path, capsys) -> None:
    from mncore_lightning.preflight.__main__ import main

    (tmp_path / "branches.py").write_text(MODULE_FILE)
    out = tmp_path / "r.json"
    argv = [f"{tmp_path / 'branches.py'}:Branches", "--init-args", '{"width": 5}']
    argv += ["--batch-size", "4", "--no-rich", "--json", str(out), "--fail-on", "graph_break"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "- training_step: graph break at " in captured.out
    assert "branches.py:15" in captured.err  # `if loss.item() > 0:`: a branch on a tensor
    report = json.loads(out.read_text())
    (hook,) = report["hooks"]
    (brk,) = hook["graph_breaks"]
    assert brk["line"].endswith("branches.py:15") and "branching" in brk["reason"].lower()
    assert hook["compiles"] is True and hook["device_calls_per_step"] > 1
    assert report["data"] == [
        {
            "stage": "train",
            "batch_size": 4,
            "batches": 5,
            "samples": 20,
            "drop_last": True,
            "dropped_per_epoch": 0,
            "ragged_last_batch": None,
            "device_calls": 5,
        }
    ]


class BranchesLater(LitClassifier):
    """Compiles at first; at the second epoch a hook sets a value the step branches on."""

    def __init__(self) -> None:
        super().__init__()
        self.clip = False

    def on_train_epoch_start(self) -> None:
        self.clip = self.current_epoch > 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.clip and loss > 1:  # read only once clip is set: refused then
            loss = loss.clamp(max=1)
        return loss


def test_a_step_that_breaks_only_when_recompiled_is_reported_with_its_first_graph() -> None:
    report = run_preflight(BranchesLater(), {"train": loader()})
    train = _hook(report, "training_step")
    (retrace,) = train.retraces
    assert retrace.startswith("training_step: self.clip == False failed, at ")
    (brk,) = train.graph_breaks  # in the graph captured again
    assert brk.line.endswith(_line_of(BranchesLater, "if self.clip and loss > 1"))
    assert train.compiles and train.device_calls_per_step > 1 and train.graphs > 2
    # ops and memory are the first graph's: the step of the class it extends
    plain = _hook(run_preflight(LitClassifier(), {"train": loader()}), "training_step")
    assert train.op_counts == plain.op_counts and train.memory == plain.memory
    text = report.to_markdown()
    assert "| compiles | yes |" in text and f"| graphs captured | {train.graphs} |" in text
