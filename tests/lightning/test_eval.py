"""Validation with a ragged last batch: every sample once, metrics as on cpu, <= 2 graphs.

Tolerance: ATOL = 1e-5 absolute (conftest) on every metric.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning.lightning_testing import (
    LitClassifier,
    assert_metrics_close,
    fit_once,
    loader,
    make_trainer,
)


class CountingClassifier(LitClassifier):
    """Also logs, with reduce_fx="sum", how many samples and which indices it evaluated."""

    def validation_step(self, batch, batch_idx):
        x, y, index = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())
        self.log("val_samples", torch.ones_like(index).sum().float(), reduce_fx="sum")
        self.log("val_index_sum", index.sum().float(), reduce_fx="sum")


class BatchWatcher(Callback):
    """Host-side record of the validation batches and of the eval graphs compiled."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.indices: list[torch.Tensor] = []
        self.eval_graphs: list[int] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, *args):
        self.sizes.append(batch[0].shape[0])
        self.indices.append(batch[2].clone())

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        functions = getattr(trainer.strategy, "compiled_functions", None)
        if functions is not None:
            self.eval_graphs.append(len(functions(trainer.state.stage.value)))


def _val_loader(n: int = 70, batch_size: int = 32) -> DataLoader:
    x, y = loader(n=n, seed=3).dataset.tensors
    return DataLoader(TensorDataset(x, y, torch.arange(n)), batch_size=batch_size)


def _train_loader() -> DataLoader:
    x, y = loader(n=64).dataset.tensors
    return DataLoader(TensorDataset(x, y, torch.zeros(64, dtype=torch.long)), batch_size=16)


def test_validate_ragged_every_sample_once_and_weighted_mean():
    torch.manual_seed(0)
    model = CountingClassifier()
    watcher = BatchWatcher()
    trainer = make_trainer("mncore", callbacks=[watcher])
    (results,) = trainer.validate(model, _val_loader(), verbose=False)
    assert watcher.sizes == [32, 32, 6]
    assert sorted(torch.cat(watcher.indices).tolist()) == list(range(70))
    assert results["val_samples"] == 70
    assert results["val_index_sum"] == sum(range(70))
    # the epoch mean weights each batch by its size: it is the mean over all 70 samples
    x, y, _ = _val_loader().dataset.tensors
    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert results["val_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), abs=1e-5)
    expected_acc = (logits.argmax(-1) == y).float().mean().item()
    assert results["val_acc"] == pytest.approx(expected_acc, abs=1e-6)
    assert watcher.eval_graphs == [2]


def test_validate_ragged_matches_cpu():
    results = {}
    for accelerator in ("cpu", "mncore"):
        torch.manual_seed(0)
        trainer = make_trainer(accelerator)
        (results[accelerator],) = trainer.validate(
            CountingClassifier(), _val_loader(), verbose=False
        )
    assert_metrics_close(results["mncore"], results["cpu"])


class _TrainsWithIndex(CountingClassifier):
    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return super().training_step((x, y), batch_idx)


def test_fit_ragged_validation_matches_cpu_and_compiles_two_graphs():
    runs = {}
    for accelerator in ("cpu", "mncore"):
        watcher = BatchWatcher()
        _, _, collector = fit_once(
            accelerator,
            model_cls=_TrainsWithIndex,
            train=_train_loader(),
            val=_val_loader(),
            max_epochs=3,
            num_sanity_val_steps=2,  # sanity check: two full batches, then 3 epochs of 3
            callbacks=[watcher],
        )
        runs[accelerator] = (watcher, collector)
    watcher, collector = runs["mncore"]
    cpu_watcher, cpu_collector = runs["cpu"]
    assert watcher.sizes == cpu_watcher.sizes == [32, 32] + [32, 32, 6] * 3
    # sanity check + 3 epochs: the full-batch graph and the ragged-batch graph, never more
    assert watcher.eval_graphs == [1, 2, 2, 2]
    for metrics, cpu_metrics in zip(
        collector.epoch_metrics, cpu_collector.epoch_metrics, strict=True
    ):
        assert_metrics_close(metrics, cpu_metrics)
    assert collector.epoch_metrics[-1]["val_samples"] == 70


def test_test_and_predict_ragged():
    torch.manual_seed(0)
    model = CountingClassifier()
    trainer = make_trainer("mncore")
    x, y, _ = _val_loader().dataset.tensors
    data = DataLoader(TensorDataset(x, y), batch_size=32)
    (results,) = trainer.test(model, data, verbose=False)
    predictions = trainer.predict(model, DataLoader(TensorDataset(x), batch_size=32))
    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert results["test_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), abs=1e-5)
    assert [p.shape[0] for p in predictions] == [32, 32, 6]
    torch.testing.assert_close(torch.cat(predictions), logits, atol=1e-5, rtol=0)


def test_each_stage_has_its_own_compiled_function():
    """The sanity check, validation during fit, and test each compile their own graphs."""
    model = _TrainsWithIndex()
    stages = {}

    class Record(Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            for stage in ("sanity_check", "validate", "test"):
                if trainer.strategy.compiled_functions(stage):
                    stages[stage] = len(trainer.strategy.compiled_functions(stage))

        on_test_epoch_end = on_validation_epoch_end

    trainer = make_trainer("mncore", max_epochs=1, callbacks=[Record()], num_sanity_val_steps=1)
    trainer.fit(model, _train_loader(), _val_loader(n=64))
    assert stages == {"sanity_check": 1, "validate": 1}
    stages.clear()
    trainer.test(model, loader(n=64), verbose=False)
    assert stages == {"test": 1}
