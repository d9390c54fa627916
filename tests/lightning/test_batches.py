"""Batches that change between calls: re-traced at an epoch boundary with a reason; strings
that change inside an epoch are stand-ins the step reads on the host (mncore_device.capture.
batch_leaves). Same seed and data as cpu; ATOL = 1e-5 absolute."""

from __future__ import annotations

import logging

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from mncore_lightning import MNCoreStrategy
from tests.lightning.lightning_testing import (
    ATOL,
    LitClassifier,
    assert_state_close,
    fit_once,
    make_dataset,
    make_trainer,
)

# Lightning's rank-zero messages: "lightning.pytorch." or, once pytorch_lightning is imported
# (the two packages share the module that picks the logger), "pytorch_lightning."
RANK_ZERO_LOGGER = "utilities.rank_zero"


class BatchSizePerEpoch(LitClassifier):
    """A new DataLoader every epoch, with another batch size (as the batch-size tuner does)."""

    def train_dataloader(self):
        batch_size = 16 if self.current_epoch % 2 == 0 else 8
        return DataLoader(make_dataset(64), batch_size=batch_size)


def test_a_batch_size_changed_at_an_epoch_boundary_retraces_and_matches_cpu(caplog):
    models = {}
    with caplog.at_level(logging.INFO):
        for accelerator in ("cpu", "mncore"):
            L.seed_everything(0, verbose=False)
            models[accelerator] = BatchSizePerEpoch()
            trainer = make_trainer(accelerator, max_epochs=3, reload_dataloaders_every_n_epochs=1)
            trainer.fit(models[accelerator])
            assert trainer.global_step == 4 + 8 + 4
    assert_state_close(models["cpu"], models["mncore"], atol=ATOL)
    reasons = [
        r.getMessage() for r in caplog.records if "re-tracing training_step" in r.getMessage()
    ]
    assert reasons and "batch/0 changed from [16, 8]" in reasons[0], reasons


class Tagged(Dataset):
    """(x, y, tag): the tag, a string, changes with the batch."""

    def __init__(self, tags: list[str], batch_size: int = 16) -> None:
        self.data, self.tags, self.batch_size = make_dataset(64), tags, batch_size

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        x, y = self.data[index]
        return x, y, self.tags[index // self.batch_size % len(self.tags)]


def _collate(samples):
    xs, ys, tags = zip(*samples, strict=True)
    return torch.stack(xs), torch.stack(ys), tags[0]


class TaggedClassifier(LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return super().training_step((x, y), batch_idx)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        return super().validation_step((x, y), batch_idx)


class ReadsTheTag(TaggedClassifier):
    """Its loss depends on the tag's value: the step reads it (on the host)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * len(batch[2])

    def validation_step(self, batch, batch_idx):
        x, y, tag = batch
        return LitClassifier.validation_step(self, (x * len(tag), y), batch_idx)


class Recompiles(L.Callback):
    """The re-compiles of the mncore run."""

    def on_fit_end(self, trainer, module) -> None:
        self.retraces = trainer.strategy.retraces


def test_a_non_tensor_element_the_step_reads_changing_inside_an_epoch_as_on_cpu():
    """'first' and 'second' alternate: `len(tag)` runs on the host at every step (5, then
    6: guarded once, then a graph input), as on cpu."""

    def train():
        return DataLoader(Tagged(["first", "second"]), batch_size=16, collate_fn=_collate)

    _, cpu, cpu_losses = fit_once("cpu", model_cls=ReadsTheTag, train=train())
    recompiles = Recompiles()
    _, mn, mn_losses = fit_once(
        "mncore", model_cls=ReadsTheTag, train=train(), callbacks=[recompiles]
    )
    torch.testing.assert_close(
        torch.stack(mn_losses.losses), torch.stack(cpu_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu, mn)
    assert recompiles.retraces == 1


def test_a_non_tensor_element_the_step_ignores_may_change_and_trains_as_cpu():
    def train():
        return DataLoader(Tagged(["first", "second"]), batch_size=16, collate_fn=_collate)

    _, cpu, _ = fit_once("cpu", model_cls=TaggedClassifier, train=train())
    trainer, mn, _ = fit_once("mncore", model_cls=TaggedClassifier, train=train())
    assert_state_close(cpu, mn)
    assert trainer.strategy.retraces == 0


def test_eval_batches_with_changing_strings_compile_once_and_match_cpu():
    """A new string at every validation batch ('a' to 'd'), read by the step: no re-compile
    for its value, within max_retraces=2 (a value that really changes the step's Python at
    every call is refused past max_retraces: test_dynamo_capture.py)."""
    results = {}
    for accelerator in ("cpu", "mncore"):
        L.seed_everything(0, verbose=False)
        val = DataLoader(Tagged(["a", "b", "c", "d"]), batch_size=16, collate_fn=_collate)
        train = DataLoader(Tagged(["same"]), batch_size=16, collate_fn=_collate)
        kwargs = {"max_epochs": 1}
        if accelerator == "mncore":
            kwargs["strategy"] = MNCoreStrategy(device="pfvm:cpu", preset="O0", max_retraces=2)
        trainer = make_trainer(accelerator, **kwargs)
        model = ReadsTheTag()
        trainer.fit(model, train, val)
        results[accelerator] = (model, dict(trainer.callback_metrics), trainer)
    (cpu, cpu_metrics, _), (mn, mn_metrics, trainer) = results["cpu"], results["mncore"]
    assert_state_close(cpu, mn)
    assert cpu_metrics.keys() == mn_metrics.keys() and "val_loss" in mn_metrics
    for key in cpu_metrics:
        torch.testing.assert_close(mn_metrics[key], cpu_metrics[key], atol=ATOL, rtol=0)
    assert trainer.strategy.retraces == 0


def test_the_batch_layout_checked_every_step_is_pytrees_tensor_leaves():
    """The per-step check of a training batch's shapes walks lists, tuples and dicts itself;
    it must see the (shape, dtype) of the tensor leaves pytree sees, in pytree's order."""
    from collections import OrderedDict, namedtuple

    from torch.utils._pytree import tree_leaves

    from mncore_lightning.steps.hooks import tensor_layout

    pair = namedtuple("pair", "x y")
    x, y = torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
    batches = [
        (x, y),
        [x, {"b": y, "a": "id"}],
        {"z": x, "a": [y, 1]},
        pair(x, y),
        OrderedDict(y=y, x=x),
        ((x,), (y, "q"), []),
        x,
        "sample",
        3,
    ]
    for batch in batches:
        expected = [(t.shape, t.dtype) for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
        assert tensor_layout(batch) == expected, batch
    assert tensor_layout({"z": x, "a": y}) != tensor_layout({"z": x, "a": y.float()})
