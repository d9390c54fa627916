"""self.log / self.log_dict inside compiled steps behave as on cpu; loggers get the values.

Tolerance: ATOL = 1e-5 absolute (conftest) between cpu and mncore values; values written to
TensorBoard are compared to the module's own returned losses within 1e-6.
"""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.lightning.lightning_testing import (
    ATOL,
    LitClassifier,
    assert_metrics_close,
    fit_once,
    loader,
    mncore_env,
)


class LoggingModule(LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        self.log("train_loss", loss, prog_bar=True)  # on_step=True (training default)
        self.log_dict({"train_acc": acc, "train_double": loss * 2}, prog_bar=True)
        self.log("constant", 3.5)  # a Python float: a constant
        self.log("both", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("epoch_only", acc, on_step=False, on_epoch=True)
        self.log("max_loss", loss, on_step=False, on_epoch=True, reduce_fx="max")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("val_loss", loss, prog_bar=True)  # on_epoch=True (validation default)
        self.log_dict({"val_acc": (logits.argmax(-1) == y).float().mean(), "val_const": 2.0})
        self.log("val_step_loss", loss, on_step=True, on_epoch=False)


class MetricsRecorder(Callback):
    """Copies of the trainer's metric dicts after every batch and at every epoch end."""

    def __init__(self) -> None:
        self.steps: list[tuple[dict, dict]] = []
        self.epochs: list[tuple[dict, dict, dict]] = []

    @staticmethod
    def _copy(metrics):
        return {k: torch.as_tensor(v).clone() for k, v in metrics.items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(
            (self._copy(trainer.callback_metrics), self._copy(trainer.progress_bar_metrics))
        )

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epochs.append(
            (
                self._copy(trainer.callback_metrics),
                self._copy(trainer.progress_bar_metrics),
                self._copy(trainer.logged_metrics),
            )
        )


def _run(accelerator, **overrides):
    recorder = MetricsRecorder()
    trainer, _, collector = fit_once(
        accelerator,
        model_cls=LoggingModule,
        train=loader(n=64, batch_size=16, shuffle=True),
        val=loader(n=40, batch_size=16, drop_last=False, seed=1),
        max_epochs=2,
        callbacks=[recorder],
        **overrides,
    )
    return trainer, recorder, collector


@pytest.fixture(scope="module")
def runs():
    with mncore_env():  # module-scoped: the autouse (function) fixture is not active yet
        return {accelerator: _run(accelerator) for accelerator in ("cpu", "mncore")}


def test_metric_names(runs):
    trainer, _, _ = runs["mncore"]
    assert set(trainer.callback_metrics) == {
        "train_loss",
        "train_acc",
        "train_double",
        "constant",
        "both",  # Lightning keeps the plain name (the epoch value) in callback_metrics too
        "both_step",
        "both_epoch",
        "epoch_only",
        "max_loss",
        "val_loss",
        "val_acc",
        "val_const",
    }
    assert set(trainer.progress_bar_metrics) == {
        "train_loss",
        "train_acc",
        "train_double",
        "both_step",
        "both_epoch",
        "val_loss",
    }


def test_final_metrics_match_cpu(runs):
    cpu, mn = runs["cpu"][0], runs["mncore"][0]
    assert_metrics_close(mn.callback_metrics, cpu.callback_metrics)
    assert_metrics_close(mn.progress_bar_metrics, cpu.progress_bar_metrics)
    assert_metrics_close(mn.logged_metrics, cpu.logged_metrics)


def test_per_step_and_per_epoch_metrics_match_cpu(runs):
    cpu, mn = runs["cpu"][1], runs["mncore"][1]
    assert len(mn.steps) == len(cpu.steps) == 8
    for (mn_cb, mn_pb), (cpu_cb, cpu_pb) in zip(mn.steps, cpu.steps, strict=True):
        assert_metrics_close(mn_cb, cpu_cb)
        assert_metrics_close(mn_pb, cpu_pb)
    assert len(mn.epochs) == len(cpu.epochs) == 2
    for mn_epoch, cpu_epoch in zip(mn.epochs, cpu.epochs, strict=True):
        for ours, theirs in zip(mn_epoch, cpu_epoch, strict=True):
            assert_metrics_close(ours, theirs)


def test_logged_values_are_the_step_values(runs):
    _, recorder, collector = runs["mncore"]
    for (metrics, _), loss in zip(recorder.steps, collector.losses, strict=True):
        torch.testing.assert_close(metrics["train_loss"], loss)
        torch.testing.assert_close(metrics["both_step"], loss)
        torch.testing.assert_close(metrics["train_double"], loss * 2)
        assert metrics["constant"].item() == 3.5
    # both_epoch: the mean of the epoch's step losses (equal batch sizes)
    epoch0 = torch.stack(collector.losses[:4]).mean()
    torch.testing.assert_close(recorder.epochs[0][0]["both_epoch"], epoch0, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        recorder.epochs[0][0]["max_loss"], torch.stack(collector.losses[:4]).max()
    )
    assert recorder.epochs[-1][0]["val_const"].item() == 2.0


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_events_match_cpu_and_module_values(tmp_path):
    scalars, collectors = {}, {}
    for accelerator in ("cpu", "mncore"):
        logger = TensorBoardLogger(tmp_path, name=accelerator, default_hp_metric=False)
        _, _, collectors[accelerator] = _run(accelerator, logger=logger, log_every_n_steps=1)
        scalars[accelerator] = _scalars(logger.log_dir)
    ours, theirs = scalars["mncore"], scalars["cpu"]
    assert set(ours) == set(theirs)
    assert {"train_loss", "both_step", "both_epoch", "val_loss", "val_acc"} <= set(ours)
    for tag in ours:
        assert [s for s, _ in ours[tag]] == [s for s, _ in theirs[tag]], tag
        values = torch.tensor([v for _, v in ours[tag]])
        expected = torch.tensor([v for _, v in theirs[tag]])
        torch.testing.assert_close(values, expected, atol=ATOL, rtol=0, msg=tag)
    # one train_loss point per step, equal to the loss the step returned
    losses = torch.stack(collectors["mncore"].losses)
    assert [s for s, _ in ours["train_loss"]] == list(range(8))
    logged = torch.tensor([v for _, v in ours["train_loss"]])
    torch.testing.assert_close(logged, losses, atol=1e-6, rtol=0)
    assert len(ours["val_loss"]) == 2  # one per epoch


def test_csv_logger_has_every_step(tmp_path):
    logger = CSVLogger(tmp_path, name="csv")
    _, _, collector = _run("mncore", logger=logger, log_every_n_steps=1)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    logged = torch.tensor([float(r["train_loss"]) for r in rows])
    torch.testing.assert_close(logged, torch.stack(collector.losses), atol=1e-6, rtol=0)
