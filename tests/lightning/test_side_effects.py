"""Side effects of a step (list appends, torchmetrics calls) behave as on cpu.

The step is captured by TorchDynamo, which replays what it writes (list appends, a metric's
states, attributes) on the host after every call with that call's values; a list the step
appends to at every call is taken out of Dynamo's view (mncore_device.capture.appended_lists).
Same seed and data on accelerator="cpu" and "mncore" (O0); ATOL = 1e-5 absolute.
"""

from __future__ import annotations

import csv

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torchmetrics import MetricCollection
from torchmetrics.classification import Accuracy, F1Score

from tests.lightning.lightning_testing import (
    ATOL,
    CLASSES,
    LitClassifier,
    assert_metrics_close,
    assert_state_close,
    fit_once,
    loader,
)


def _both(**kwargs):
    return [fit_once(accelerator, **kwargs) for accelerator in ("cpu", "mncore")]


def _max_diff(a, b) -> float:
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


class Recipe(LitClassifier):
    """Lightning's documented recipe: validation_step appends its predictions to a list the
    module holds; on_validation_epoch_end uses and clears them. training_step appends too."""

    def __init__(self) -> None:
        super().__init__()
        self.validation_step_outputs = []
        self.train_outputs = []
        self.epoch_preds = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.train_outputs.append({"loss": loss.detach(), "labels": y, "tag": "train"})
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = self(x)
        self.validation_step_outputs.append(preds)

    def on_validation_epoch_end(self):
        all_preds = torch.stack(self.validation_step_outputs)
        self.log("val_mean", all_preds.mean())
        self.epoch_preds.append(all_preds.clone())
        self.validation_step_outputs.clear()


def test_lightning_recipe_validation_step_outputs_as_on_cpu():
    (cpu_trainer, cpu, _), (mn_trainer, mn, _) = _both(
        model_cls=Recipe, val=loader(n=48, batch_size=16, seed=1), max_epochs=3
    )
    assert_state_close(cpu, mn)
    # each list's length guard fails twice (empty, one item), then the list is appended to
    # after each call: two re-compiles for training_step, two for validation_step
    assert mn_trainer.strategy.retraces == 4
    # one entry per validation epoch, each with every validation batch of that epoch
    assert len(mn.epoch_preds) == len(cpu.epoch_preds) == 3
    assert [p.shape for p in mn.epoch_preds] == [p.shape for p in cpu.epoch_preds]
    diff = max(_max_diff(a, b) for a, b in zip(cpu.epoch_preds, mn.epoch_preds, strict=True))
    assert diff <= ATOL, diff
    assert mn.validation_step_outputs == []
    assert_metrics_close(cpu_trainer.callback_metrics, mn_trainer.callback_metrics)
    # training_step's appends: one per batch, pytrees rebuilt with their plain values
    assert len(mn.train_outputs) == len(cpu.train_outputs) == 12
    for a, b in zip(cpu.train_outputs, mn.train_outputs, strict=True):
        assert b["tag"] == "train"
        assert torch.equal(a["labels"], b["labels"])
        assert _max_diff(a["loss"], b["loss"]) <= ATOL


class WithMetrics(LitClassifier):
    """torchmetrics as the field uses them (default validate_args=True): forward in
    training_step, the Metric object and forward's value logged; a MetricCollection updated
    in validation_step and computed at epoch end."""

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = Accuracy(task="multiclass", num_classes=CLASSES)
        self.val_metrics = MetricCollection(
            {
                "acc": Accuracy(task="multiclass", num_classes=CLASSES),
                "f1": F1Score(task="multiclass", num_classes=CLASSES, average="macro"),
            },
            prefix="val_",
        )
        self.val_computed = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        batch_acc = self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_batch_acc", batch_acc)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_metrics.update(self(x), y)

    def on_validation_epoch_end(self):
        values = self.val_metrics.compute()
        self.log_dict(values)
        self.val_computed.append({k: v.clone() for k, v in values.items()})
        self.val_metrics.reset()


def _csv_rows(trainer) -> list[dict[str, str]]:
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        return list(csv.DictReader(f))


def test_torchmetrics_metric_and_collection_as_on_cpu(tmp_path):
    runs = [
        fit_once(
            accelerator,
            model_cls=WithMetrics,
            val=loader(n=48, batch_size=16, seed=1),
            logger=CSVLogger(tmp_path / accelerator),
            log_every_n_steps=1,
        )
        for accelerator in ("cpu", "mncore")
    ]
    (cpu_trainer, cpu, _), (mn_trainer, mn, _) = runs
    assert_state_close(cpu, mn)
    cpu_metrics, mn_metrics = cpu_trainer.callback_metrics, mn_trainer.callback_metrics
    assert {"train_acc_step", "train_acc_epoch", "train_batch_acc", "val_acc", "val_f1"} <= set(
        mn_metrics
    )
    assert_metrics_close(cpu_metrics, mn_metrics)
    # every logged value of every step, as the logger wrote it
    cpu_rows, mn_rows = _csv_rows(cpu_trainer), _csv_rows(mn_trainer)
    assert len(cpu_rows) == len(mn_rows) > 8
    diff = 0.0
    for a, b in zip(cpu_rows, mn_rows, strict=True):
        assert {k for k, v in a.items() if v} == {k for k, v in b.items() if v}
        for key, value in a.items():
            if value:
                diff = max(diff, abs(float(value) - float(b[key])))
    assert diff <= ATOL, diff
    assert len(mn.val_computed) == 2
    for a, b in zip(cpu.val_computed, mn.val_computed, strict=True):
        assert_metrics_close(a, b)
    # the host metrics hold what cpu's hold (epoch-end compute sees every step's update)
    assert mn.train_acc.update_count == cpu.train_acc.update_count


class ComputeInStep(LitClassifier):
    """update + compute inside the step, the computed value logged; validate_args=True
    checks run on the host (a float target would be refused there, as on cpu)."""

    def __init__(self) -> None:
        super().__init__()
        self.acc = Accuracy(task="multiclass", num_classes=CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.acc.update(logits, y)
        self.log("running_acc", self.acc.compute())
        return F.cross_entropy(logits, y)


def test_update_and_compute_inside_the_step_as_on_cpu():
    (cpu_trainer, cpu, _), (mn_trainer, mn, _) = _both(model_cls=ComputeInStep)
    assert_metrics_close(cpu_trainer.callback_metrics, mn_trainer.callback_metrics)
    assert mn.acc.update_count == cpu.acc.update_count == 8
    torch.testing.assert_close(mn.acc.compute(), cpu.acc.compute(), atol=ATOL, rtol=0)


class LossFromMetric(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.acc = Accuracy(task="multiclass", num_classes=CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y) * (2 - self.acc(logits, y))


def test_computing_with_a_metric_result_in_the_step_as_on_cpu():
    """The metric's forward (its update and the batch's value) is traced with the step: the
    loss computed with its result, and the metric's states, are cpu's."""
    (cpu_trainer, cpu, cpu_losses), (mn_trainer, mn, mn_losses) = _both(
        model_cls=LossFromMetric, max_epochs=2
    )
    torch.testing.assert_close(
        torch.stack(mn_losses.losses), torch.stack(cpu_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu, mn)
    assert mn.acc.update_count == cpu.acc.update_count == 8
    torch.testing.assert_close(mn.acc.compute(), cpu.acc.compute(), atol=ATOL, rtol=0)
    assert mn_trainer.strategy.retraces == 1  # the update count: a graph input after a change


class KeepsAWindow(LitClassifier):
    """A sliding window of the last two batches' values, in training and validation: the
    step appends, reads the list's length and items, and pops its first item."""

    def __init__(self) -> None:
        super().__init__()
        self.window: list[torch.Tensor] = []
        self.val_window: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.window.append(loss.detach())
        if len(self.window) > 2:
            self.window.pop(0)
        self.log("window_mean", torch.stack(self.window).mean())
        self.log("window_length", float(len(self.window)))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_window.append(self(x).mean())
        del self.val_window[:-2]
        self.log("val_window_mean", sum(self.val_window) / len(self.val_window))


def test_a_list_the_step_reads_and_changes_other_than_by_appending_as_on_cpu(tmp_path):
    """Once the list is appended to after each call (its length guard failed twice), the
    step's reads and pops run on the host, on the whole list: the window holds cpu's items
    at every step."""
    runs = [
        fit_once(
            accelerator,
            model_cls=KeepsAWindow,
            val=loader(n=48, batch_size=16, seed=1),
            max_epochs=3,
            logger=CSVLogger(tmp_path / accelerator),
            log_every_n_steps=1,
        )
        for accelerator in ("cpu", "mncore")
    ]
    (cpu_trainer, cpu, _), (mn_trainer, mn, _) = runs
    assert_state_close(cpu, mn)
    assert_metrics_close(cpu_trainer.callback_metrics, mn_trainer.callback_metrics)
    assert len(mn.window) == len(cpu.window) == 2
    assert len(mn.val_window) == len(cpu.val_window) == 2
    for a, b in zip(cpu.window + cpu.val_window, mn.window + mn.val_window, strict=True):
        assert _max_diff(a, b) <= ATOL
    cpu_rows, mn_rows = _csv_rows(cpu_trainer), _csv_rows(mn_trainer)
    assert len(cpu_rows) == len(mn_rows) > 12
    for a, b in zip(cpu_rows, mn_rows, strict=True):
        assert {k for k, v in a.items() if v} == {k for k, v in b.items() if v}
        for key, value in a.items():
            if value:
                assert abs(float(value) - float(b[key])) <= ATOL, (key, a, b)


class CollectionForwardInEval(LitClassifier):
    """A MetricCollection's forward in validation_step: its returned dict logged with
    log_dict and appended to a list, both with the host values."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics = MetricCollection(
            {"acc": Accuracy(task="multiclass", num_classes=CLASSES)}, prefix="v_"
        )
        self.batch_values = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        values = self.metrics(self(x), y)
        self.log_dict(values)
        self.batch_values.append(values)


def test_metric_collection_forward_logged_and_appended_in_eval_as_on_cpu():
    (cpu_trainer, cpu, _), (mn_trainer, mn, _) = _both(
        model_cls=CollectionForwardInEval, val=loader(n=48, batch_size=16, seed=1)
    )
    assert_metrics_close(cpu_trainer.callback_metrics, mn_trainer.callback_metrics)
    assert len(mn.batch_values) == len(cpu.batch_values) == 6
    for a, b in zip(cpu.batch_values, mn.batch_values, strict=True):
        assert type(b["v_acc"]) is torch.Tensor
        assert_metrics_close(a, b)


class RecordsDuringBackwardAndUpdate(LitClassifier):
    """A tensor hook appends each step's output gradient norm during backward, and a custom
    configure_gradient_clipping logs the norm it clipped (both run inside the compiled step)."""

    def __init__(self) -> None:
        super().__init__()
        self.output_grad_norms: list[torch.Tensor] = []
        self.clipped: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        logits.register_hook(lambda grad: self.output_grad_norms.append(grad.norm()))
        return F.cross_entropy(logits, y)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, **kwargs):
        self.log("clipped_norm", torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5))

    def on_train_batch_end(self, *args) -> None:
        self.clipped.append(float(self.trainer.callback_metrics["clipped_norm"]))


def test_appends_and_logs_in_backward_and_gradient_clipping_are_replayed_every_step():
    cpu, mn = _both(model_cls=RecordsDuringBackwardAndUpdate, max_epochs=2)
    (_, cpu_model, _), (_, mn_model, _) = cpu, mn
    assert_state_close(cpu_model, mn_model)
    steps = cpu_model.trainer.global_step
    assert len(mn_model.output_grad_norms) == len(cpu_model.output_grad_norms) == steps
    assert _max_diff(mn_model.output_grad_norms, cpu_model.output_grad_norms) <= ATOL
    assert len(mn_model.clipped) == steps and len(set(mn_model.clipped)) > 1
    assert _max_diff(mn_model.clipped, cpu_model.clipped) <= ATOL


class LogsInGradientClipping(RecordsDuringBackwardAndUpdate):
    """Only the clipping hook's log: the step is one device call, whose update logs."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)


class TrainBreaks(Callback):
    """The captured training step's graph breaks, read before teardown forgets it."""

    def on_train_end(self, trainer, module) -> None:
        hooks = [h for key, h in trainer.strategy._captured.items() if key[0] == "train"]
        self.breaks = [b for hook in hooks for b in hook.frontend.breaks]


def test_a_log_in_gradient_clipping_of_a_one_call_step_is_replayed_every_step():
    """The update is traced into the step's one device call (no graph break); the norm it
    logs is an output of that call, logged after each call as on cpu."""
    cpu = fit_once("cpu", model_cls=LogsInGradientClipping, max_epochs=2)
    breaks = TrainBreaks()
    mn = fit_once("mncore", model_cls=LogsInGradientClipping, max_epochs=2, callbacks=[breaks])
    (_, cpu_model, _), (_, mn_model, _) = cpu, mn
    assert breaks.breaks == []
    assert_state_close(cpu_model, mn_model)
    steps = cpu_model.trainer.global_step
    assert len(mn_model.clipped) == steps and len(set(mn_model.clipped)) > 1
    assert _max_diff(mn_model.clipped, cpu_model.clipped) <= ATOL
    assert mn_model.output_grad_norms == []
