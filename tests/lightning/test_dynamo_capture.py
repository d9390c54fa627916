"""Python values a captured step reads are followed, not frozen (TorchDynamo capture).

Each test fits a tiny model twice, with accelerator="cpu" and accelerator="mncore" (preset O0,
same seed, same batches), while a hook or callback CHANGES something the step reads between
epochs (a tuple, a NumPy scalar, None -> a number, an enum member, a class attribute, the
learning rate, a module-level dict, a closure cell, the step counters), and checks that
every per-step loss, every value Lightning hands to a logger, the final callback metrics and
the final weights agree within ATOL = 1e-5. Evaluation hooks with host code (a NumPy draw,
print, a TensorBoard call) run it between their device calls, as on cpu (training steps too:
test_graph_breaks.py); what cannot be captured (fullgraph=True with a graph break, a value
that changes at every step past max_retraces) fails with an error naming the user's line or
the guard.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import re
from collections.abc import Sequence
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from torch import nn

from mncore_device import StaticGraphError
from mncore_lightning import MNCoreStrategy
from tests.lightning.lightning_testing import (
    ATOL,
    CLASSES,
    IN_FEATURES,
    LitClassifier,
    LossCollector,
    assert_metrics_close,
    assert_state_close,
    loader,
    trainer_kwargs,
)

BATCH = 16


class MemoryLogger(Logger):
    """Every metrics dict Lightning hands to a logger, with its step, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.history.append((step, {k: float(v) for k, v in metrics.items()}))


class TrainGraphs(Callback):
    """At the end of training (before the strategy's teardown forgets them): the device
    functions compiled for the captured training step, the graph breaks of the captured
    validation step, and the re-compile reasons reported."""

    def __init__(self) -> None:
        self.functions = 0
        self.validation_breaks: list[str] = []
        self.reasons: list[tuple[str, str]] = []

    def on_fit_start(self, trainer, module) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, MNCoreStrategy):
            retrace = strategy._retrace

            def recording(what: str, reason: str) -> None:
                self.reasons.append((what, reason))
                retrace(what, reason)

            strategy._retrace = recording  # CapturedHook looks it up at every re-compile

    def on_train_end(self, trainer, module) -> None:
        captured = getattr(trainer.strategy, "_captured", {})
        self.functions = sum(
            len(hook.compiled) for key, hook in captured.items() if key[0] == "train"
        )
        self.validation_breaks = [
            str(b)
            for key, hook in captured.items()
            if key[-1] == "validation_step"
            for b in hook.frontend.breaks
        ]


@dataclasses.dataclass
class Run:
    trainer: L.Trainer
    model: L.LightningModule
    losses: list[torch.Tensor]
    logged: list[tuple[int | None, dict[str, float]]]
    metrics: dict[str, torch.Tensor]
    graphs: TrainGraphs


def _fit(
    accelerator: str,
    make_model: Any,
    *,
    epochs: int = 3,
    batches: int = 2,
    val_batches: int = 0,
    callbacks: Any = (),
    strategy: MNCoreStrategy | None = None,
    loggers: Sequence[Logger] = (),
    **overrides: Any,
) -> Run:
    """Seed, build, fit; `batches` training batches of BATCH a epoch (shuffled)."""
    L.seed_everything(0, verbose=False)
    model = make_model()
    losses, memory, graphs = LossCollector(), MemoryLogger(), TrainGraphs()
    kwargs = trainer_kwargs(
        max_epochs=epochs,
        logger=[*loggers, memory],  # self.logger: the first
        log_every_n_steps=1,
        callbacks=[*callbacks, losses, graphs],
        **overrides,
    )
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer = L.Trainer(accelerator=accelerator, **kwargs)
    train = loader(n=BATCH * batches, batch_size=BATCH, shuffle=True)
    val = loader(n=8 * val_batches, batch_size=8, seed=1) if val_batches else None
    trainer.fit(model, train, val)
    metrics = {k: v.clone() for k, v in trainer.callback_metrics.items()}
    return Run(trainer, model, losses.losses, memory.history, metrics, graphs)


def _assert_same(cpu: Run, mn: Run) -> None:
    """Losses, every logged value (same names, same steps), final metrics and weights."""
    assert len(cpu.losses) == len(mn.losses) > 0
    torch.testing.assert_close(torch.stack(mn.losses), torch.stack(cpu.losses), atol=ATOL, rtol=0)
    assert [(s, sorted(m)) for s, m in mn.logged] == [(s, sorted(m)) for s, m in cpu.logged]
    for (_, mn_values), (_, cpu_values) in zip(mn.logged, cpu.logged, strict=True):
        assert_metrics_close(mn_values, cpu_values)
    assert_metrics_close(mn.metrics, cpu.metrics)
    assert_state_close(mn.model, cpu.model)


def _both(make_model: Any, make_callbacks: Any = list, **kwargs: Any) -> tuple[Run, Run]:
    cpu = _fit("cpu", make_model, callbacks=make_callbacks(), **kwargs)
    mn = _fit("mncore", make_model, callbacks=make_callbacks(), **kwargs)
    _assert_same(cpu, mn)
    return cpu, mn


def _line_of(function: Any, text: str) -> int:
    """The line number of the first line of `function`'s source containing `text`."""
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


class Scaled(LitClassifier):
    """Cross-entropy times `self.weight()`, a Python number the subclasses read in their way;
    on_train_epoch_end changes what it reads (`self.change(epoch)`)."""

    def weight(self) -> float:
        raise NotImplementedError

    def change(self, epoch: int) -> None:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y) * self.weight()
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        self.change(self.current_epoch)


# --- 1-8: a Python value the step reads, changed by a hook between epochs ----------------------


class TupleAttribute(Scaled):
    def __init__(self) -> None:
        super().__init__()
        self.scales = (1.0, 1.0)

    def weight(self):
        return self.scales[0] * self.scales[1]

    def change(self, epoch):
        self.scales = (1.0, 0.5 / (epoch + 1))


def test_tuple_attribute_changed_by_a_hook_as_on_cpu():
    _both(TupleAttribute)


class NumpyScalar(Scaled):
    def __init__(self) -> None:
        super().__init__()
        self.factor = np.float64(1.0)

    def weight(self):
        return self.factor

    def change(self, epoch):
        self.factor = np.float64(0.25 * (epoch + 1))


def test_numpy_scalar_attribute_changed_by_a_hook_as_on_cpu():
    _both(NumpyScalar)


class NumpyArray(LitClassifier):
    """Class weights held as a NumPy array (Dynamo passes it to the graph as a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.class_weights = np.ones(CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        weight = torch.from_numpy(self.class_weights).float()
        loss = F.cross_entropy(self(x), y, weight=weight)
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        self.class_weights = np.array([1.0, 2.0 + self.current_epoch, 0.5])


def test_numpy_array_attribute_changed_by_a_hook_as_on_cpu():
    _both(NumpyArray)


class NoneThenNumber(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.penalty = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        if self.penalty is not None:
            loss = loss + self.penalty * logits.pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        self.penalty = 0.1 * (self.current_epoch + 1)


def test_attribute_none_then_a_number_as_on_cpu():
    _both(NoneThenNumber)


class Loss(enum.Enum):
    PLAIN = "plain"
    SMOOTHED = "smoothed"


class EnumAttribute(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.loss_kind = Loss.PLAIN

    def training_step(self, batch, batch_idx):
        x, y = batch
        smoothing = 0.2 if self.loss_kind is Loss.SMOOTHED else 0.0
        loss = F.cross_entropy(self(x), y, label_smoothing=smoothing)
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        self.loss_kind = Loss.SMOOTHED if self.current_epoch % 2 == 0 else Loss.PLAIN


def test_enum_member_attribute_as_on_cpu():
    _both(EnumAttribute)


class ClassAttribute(Scaled):
    loss_weight = 1.0  # changed on the class, by a callback

    def weight(self):
        return self.loss_weight

    def change(self, epoch):
        pass  # the callback changes the class attribute


class ChangeClassAttribute(Callback):
    def on_fit_start(self, trainer, module) -> None:
        ClassAttribute.loss_weight = 1.0

    def on_train_epoch_end(self, trainer, module) -> None:
        ClassAttribute.loss_weight = 2.0 / (trainer.current_epoch + 2)


def test_class_attribute_changed_on_the_class_as_on_cpu():
    try:
        _both(ClassAttribute, lambda: [ChangeClassAttribute()])
    finally:
        ClassAttribute.loss_weight = 1.0


class LearningRateRead(Scaled):
    def __init__(self) -> None:
        super().__init__(scheduler="step")  # StepLR(step_size=1, gamma=0.5), every epoch

    def weight(self):
        return math.sqrt(self.optimizers().param_groups[0]["lr"]) * 3

    def change(self, epoch):
        pass  # the scheduler changes the learning rate


def test_sqrt_of_the_scheduled_learning_rate_as_on_cpu():
    cpu, mn = _both(LearningRateRead)
    assert mn.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


SETTINGS = {"weight": 1.0}  # a module-level dict the step reads


class ModuleDict(Scaled):
    def __init__(self) -> None:
        super().__init__()
        SETTINGS["weight"] = 1.0

    def weight(self):
        return SETTINGS["weight"]

    def change(self, epoch):
        SETTINGS["weight"] = 1.0 / (epoch + 2)


def test_module_level_dict_changed_by_a_hook_as_on_cpu():
    _both(ModuleDict)


def test_closure_cell_changed_by_a_hook_as_on_cpu():
    def make_model():
        scale = 1.0

        def weight():
            return scale

        def change(epoch):
            nonlocal scale
            scale = 0.5 / (epoch + 1)

        class Closure(Scaled):
            pass

        Closure.weight = staticmethod(weight)
        Closure.change = staticmethod(change)
        return Closure()

    _both(make_model)


# --- 9-10: the step counters --------------------------------------------------------------------


class Warmup(LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        w = min(1.0, (self.global_step + 1) / 4)
        loss = F.cross_entropy(self(x), y) * w
        self.log("train_loss", loss)
        self.log("w", w)
        return loss


def test_warmup_from_global_step_as_on_cpu():
    """global_step is a graph input of the one training graph: never re-compiled for."""
    cpu, mn = _both(Warmup)
    assert mn.graphs.functions == 1
    assert mn.trainer.strategy.retraces == 0


class Branch(LitClassifier):
    SWITCH = 2

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        if self.global_step > self.SWITCH:
            loss = loss + 0.5 * logits.pow(2).mean()
        self.log("train_loss", loss)
        return loss


def test_branch_on_global_step_as_on_cpu_with_two_training_graphs():
    """global_step is a graph input from the first call (no re-compile per step); the branch
    guards on `global_step > 2`, which fails once, at step 3: the training step is captured
    twice over the fit (6 steps): one re-compile reported through strategy._retrace, and two
    device functions for the captured training step (strategy._captured's "train" keys)."""
    cpu, mn = _both(Branch, epochs=3, batches=2)
    assert mn.trainer.global_step == 6
    assert mn.graphs.functions == 2
    assert mn.trainer.strategy.retraces == 1
    [(what, reason)] = mn.graphs.reasons
    assert what == "training_step"
    line = _line_of(Branch.training_step, "if self.global_step")
    assert "<= 2" in reason and f"test_dynamo_capture.py:{line}" in reason, reason


# Schedules computed from global_step with Python's math (Dynamo records math.cos of a
# changing int as torch._sym_cos, math.floor as math.floor, round as __round__)
SCHEDULES: dict[str, Any] = {
    "power": lambda step: 0.9**step,
    "cosine": lambda step: 0.5 * (1 + math.cos(math.pi * step / 8)),
    "log2": lambda step: 1 / math.log2(step + 2),
    "floor": lambda step: 1 + math.floor(step / 2),
    "round": lambda step: 1 + round(step / 3),
}


class Schedules(LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        for name, schedule in SCHEDULES.items():
            w = schedule(self.global_step)
            loss = loss * w
            self.log(name, float(w))
        return loss


def test_math_schedules_of_global_step_are_one_graph_as_on_cpu():
    """global_step is a graph input, and the math on it is computed in the graph: one
    training graph for the 4 steps, never re-compiled (max_retraces=2 would refuse a step
    re-compiled for each new global_step)."""
    cpu = _fit("cpu", Schedules, epochs=2)
    strategy = MNCoreStrategy(device="pfvm:cpu", preset="O0", max_retraces=2)
    mn = _fit("mncore", Schedules, epochs=2, strategy=strategy)
    _assert_same(cpu, mn)
    assert set(SCHEDULES) <= set(mn.metrics)
    assert mn.graphs.functions == 1
    assert mn.trainer.strategy.retraces == 0


# --- 11-14: values computed in the step ---------------------------------------------------------


class ItemLogged(LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_item", loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("val_loss", loss.item())


def test_item_logged_in_training_and_validation_as_on_cpu():
    cpu, mn = _both(ItemLogged, epochs=2, val_batches=2)
    assert {"train_item", "val_loss"} <= set(mn.metrics)


# Python arithmetic on `loss.item()`, a number the graph computes
ITEM_OPS: dict[str, Any] = {
    "int": lambda v: int(v * 10),
    "sqrt": lambda v: v**0.5,
    "abs": lambda v: abs(-v),
    "max": lambda v: max(v, 0.1, 0.2),
    "mod": lambda v: (v * 10) % 3,
    "floordiv": lambda v: (v * 10) // 3,
    "round-3": lambda v: round(v, 3),
    "round": lambda v: round(v),
    "floor": lambda v: math.floor(v * 10),
    "ceil": lambda v: math.ceil(v * 10),
}
ROUNDING = ("round-3", "round", "floor", "ceil")


class ItemArithmetic(LitClassifier):
    def __init__(self, ops: tuple[str, ...]) -> None:
        super().__init__()
        self.ops = ops

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        value = loss.item()
        for name in self.ops:
            self.log(name, float(ITEM_OPS[name](value)))
        return loss


def test_arithmetic_on_item_in_training_step_as_on_cpu():
    ops = tuple(op for op in ITEM_OPS if op not in ROUNDING)
    cpu, mn = _both(lambda: ItemArithmetic(ops), epochs=1)
    assert set(ops) <= set(mn.metrics)


def test_round_floor_ceil_of_item_in_training_step_as_on_cpu():
    cpu, mn = _both(lambda: ItemArithmetic(ROUNDING), epochs=1)
    assert set(ROUNDING) <= set(mn.metrics)


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from torchmetrics.functional.classification import multiclass_accuracy

    return multiclass_accuracy(logits, y, num_classes=CLASSES)


class AccuracyInValidation(LitClassifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", _accuracy(logits, y))


def test_torchmetrics_functional_accuracy_in_validation_step_as_on_cpu():
    cpu, mn = _both(AccuracyInValidation, epochs=2, val_batches=2)
    assert {"train_loss", "val_acc"} <= set(mn.metrics)


def test_torchmetrics_functional_accuracy_first_called_in_a_captured_step(monkeypatch):
    """In a fresh process the first multiclass_accuracy call runs inside the captured step,
    and so does torchmetrics' lazy `bool(_XLA_AVAILABLE)` (lightning_utilities'
    RequirementCache, which catches importlib.metadata's PackageNotFoundError; Dynamo of
    torch 2.14.1 raises an InternalTorchDynamoError there). The other tests evaluate it
    first in their cpu run; here its cache is emptied, as in a process that never ran cpu."""
    from torchmetrics.utilities import imports

    monkeypatch.delattr(imports._XLA_AVAILABLE, "available", raising=False)
    mn = _fit("mncore", AccuracyInValidation, epochs=2, val_batches=2)
    cpu = _fit("cpu", AccuracyInValidation, epochs=2, val_batches=2)
    _assert_same(cpu, mn)


class GaussianLikelihood(LitClassifier):
    """A regression head: the negative log-likelihood of a Normal (validate_args default)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        mean, scale = out[:, 0], F.softplus(out[:, 1]) + 0.1
        loss = -torch.distributions.Normal(mean, scale).log_prob(y.float()).mean()
        self.log("nll", loss)
        return loss


def test_torch_distributions_log_prob_in_training_step_as_on_cpu():
    _both(GaussianLikelihood)


class SharedConfig:
    """As a Hugging Face config: one object every submodule holds and reads."""

    def __init__(self) -> None:
        self.problem_type: str | None = None
        self.hidden = 16
        self.num_labels = CLASSES


class Encoder(nn.Module):
    def __init__(self, config: SharedConfig) -> None:
        super().__init__()
        self.config = config
        self.linear = nn.Linear(IN_FEATURES, config.hidden)

    def forward(self, x):
        h = torch.relu(self.linear(x))
        return h * 0.5 if self.config.problem_type == "regression" else h


class Head(nn.Module):
    def __init__(self, config: SharedConfig) -> None:
        super().__init__()
        self.config = config
        self.linear = nn.Linear(config.hidden, config.num_labels)

    def forward(self, h):
        return self.linear(h)


class ConfigWriter(LitClassifier):
    """Its forward sets config.problem_type (as a Hugging Face model's does) on the first
    call; the encoder and the loss read it."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SharedConfig()
        self.encoder, self.head = Encoder(self.config), Head(self.config)

    def forward(self, x, labels=None):
        if self.config.problem_type is None and labels is not None:
            if labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "regression"
        logits = self.head(self.encoder(x))
        if self.config.problem_type == "single_label_classification":
            return logits, F.cross_entropy(logits, labels)
        return logits, F.mse_loss(logits[:, 0], labels.float())

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self(x, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self(x, y)
        self.log("val_loss", loss)


def test_forward_setting_a_shared_config_field_as_on_cpu():
    cpu, mn = _both(ConfigWriter, epochs=2, val_batches=2)
    assert mn.model.config.problem_type == cpu.model.config.problem_type
    assert mn.model.config.problem_type == "single_label_classification"


# --- 15-17: host code in evaluation hooks (graph breaks), run between device calls -------------


class NumpyNoiseInValidation(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(0)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        noise = self.rng.normal(size=tuple(x.shape)).astype(np.float32)
        x = x + 0.3 * torch.from_numpy(noise)
        loss = F.cross_entropy(self(x), y)
        self.log("val_loss", loss)
        self.log("noise", float(noise.sum()))


def test_numpy_random_draw_in_validation_step_as_on_cpu():
    """The draw runs on the host between two device calls; the graph after it takes the
    NumPy array as a tensor input."""
    cpu, mn = _both(NumpyNoiseInValidation, epochs=2, val_batches=2)
    # the host drew as often as on cpu: the generators end in the same state
    assert mn.model.rng.bit_generator.state == cpu.model.rng.bit_generator.state
    line = _line_of(NumpyNoiseInValidation.validation_step, "self.rng.normal")
    assert any(f"{__file__}:{line}" in b for b in mn.graphs.validation_breaks), (
        mn.graphs.validation_breaks
    )


class PrintsInValidation(LitClassifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        print(f"validation batch {batch_idx}: loss {loss.item():.7f}")
        self.log("val_loss", loss * 2)


def _printed(text: str) -> list[tuple[str, float]]:
    found = re.findall(r"validation batch (\d+): loss ([0-9.]+)", text)
    return [(index, float(value)) for index, value in found]


def test_print_in_validation_step_as_on_cpu(capsys):
    cpu = _fit("cpu", PrintsInValidation, epochs=2, val_batches=2)
    cpu_printed = _printed(capsys.readouterr().out)
    mn = _fit("mncore", PrintsInValidation, epochs=2, val_batches=2)
    mn_printed = _printed(capsys.readouterr().out)
    _assert_same(cpu, mn)
    assert [i for i, _ in mn_printed] == [i for i, _ in cpu_printed] == ["0", "1"] * 2
    for (_, a), (_, b) in zip(mn_printed, cpu_printed, strict=True):
        assert a == pytest.approx(b, abs=ATOL)
    line = _line_of(PrintsInValidation.validation_step, "print(")
    assert any(f"{__file__}:{line}" in b for b in mn.graphs.validation_breaks), (
        mn.graphs.validation_breaks
    )


class WritesTensorBoard(LitClassifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        writer = self.logger.experiment
        writer.add_scalar("val/loss_per_batch", loss, self.global_step * 10 + batch_idx)
        image = x[:1].reshape(1, 2, 4)
        writer.add_image("val/input", (image - image.min()) / (image.max() - image.min()))
        self.log("val_loss", loss)


def _counting(writer: Any, calls: list) -> None:
    """Wrap the writer's add_scalar and add_image: record each call's tag and values."""
    for name in ("add_scalar", "add_image"):
        original = getattr(writer, name)

        def counted(tag, value, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, tag, torch.as_tensor(value).detach().clone(), args))
            return _original(tag, value, *args, **kwargs)

        # host code, as the writer's own methods are (steps/hooks.py): the counting is the
        # test's instrumentation, not code of the step
        setattr(writer, name, torch.compiler.disable(counted))


def test_tensorboard_writer_calls_in_validation_step_as_on_cpu(tmp_path):
    runs, calls = [], {}
    for accelerator in ("cpu", "mncore"):
        tensorboard = TensorBoardLogger(tmp_path / accelerator, name="tb")
        calls[accelerator] = []
        _counting(tensorboard.experiment, calls[accelerator])
        runs.append(
            _fit(accelerator, WritesTensorBoard, epochs=2, val_batches=2, loggers=[tensorboard])
        )
    _assert_same(*runs)
    cpu_calls, mn_calls = calls["cpu"], calls["mncore"]
    assert [(n, t, a) for n, t, _, a in mn_calls] == [(n, t, a) for n, t, _, a in cpu_calls]
    # the step's own calls (Lightning's log_metrics calls add_scalar too): two a validation
    # batch, 2 batches an epoch, 2 epochs
    assert len([t for _, t, _, _ in mn_calls if t.startswith("val/")]) == 2 * 2 * 2
    for (_, _, a, _), (_, _, b, _) in zip(mn_calls, cpu_calls, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert runs[1].graphs.validation_breaks  # the writer's calls ran on the host


# --- 18-20: what cannot be captured fails with the user's line or the guard --------------------


class PrintsInTraining(LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        print("training batch", batch_idx)  # host code: a graph break
        return loss


def test_fullgraph_with_a_graph_break_in_validation_names_the_users_line():
    strategy = MNCoreStrategy(device="pfvm:cpu", preset="O0", fullgraph=True)
    line = _line_of(PrintsInValidation.validation_step, "print(")
    with pytest.raises(StaticGraphError, match="fullgraph=True") as error:
        _fit("mncore", PrintsInValidation, epochs=1, val_batches=1, strategy=strategy)
    assert f'File "{__file__}", line {line}, in validation_step' in str(error.value), str(
        error.value
    )


def test_a_graph_break_in_training_step_names_the_users_line(caplog):
    """Host code in a training step runs between its device calls, as on cpu (said once,
    with the line and the device calls per step; test_graph_breaks.py has the rest);
    fullgraph=True makes it an error at the line."""
    line = _line_of(PrintsInTraining.training_step, "print(")
    strategy = MNCoreStrategy(device="pfvm:cpu", preset="O0", fullgraph=True)
    with pytest.raises(StaticGraphError, match="fullgraph=True") as error:
        _fit("mncore", PrintsInTraining, epochs=1, strategy=strategy)
    assert f"{__file__}:{line}" in str(error.value), str(error.value)
    with caplog.at_level("INFO", logger="lightning.pytorch"):
        _both(PrintsInTraining, epochs=1)
    messages = [r.getMessage() for r in caplog.records]
    said = [m for m in messages if "device calls per step" in m]
    assert len(said) == 1 and f"{__file__}:{line}" in said[0], said


class TagChangesEveryStep(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.tag = "step0"

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.tag.endswith(("1", "3", "5", "7", "9")):
            loss = loss * 0.5
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.tag = f"step{self.global_step}"


def test_a_value_changing_every_step_is_refused_past_max_retraces_naming_the_guard(caplog):
    """A string that changes at every step cannot be a graph input: each new value
    re-compiles (reported with Dynamo's reason), until max_retraces; then an error names the
    guard that keeps failing, with the user's line."""
    strategy = MNCoreStrategy(device="pfvm:cpu", preset="O0", max_retraces=2)
    with (
        caplog.at_level("INFO", logger="lightning.pytorch"),
        pytest.raises(StaticGraphError, match=r"max_retraces=2") as error,
    ):
        _fit("mncore", TagChangesEveryStep, epochs=3, batches=2, strategy=strategy)
    line = _line_of(TagChangesEveryStep.training_step, "self.tag.endswith")
    assert ".tag == 'step" in str(error.value), str(error.value)
    assert f"test_dynamo_capture.py:{line} in training_step" in str(error.value), str(error.value)
    said = [r.getMessage() for r in caplog.records if "re-tracing training_step" in r.getMessage()]
    assert len(said) == 2 and all(".tag == 'step" in m for m in said), said
