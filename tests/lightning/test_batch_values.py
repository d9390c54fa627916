"""Batches with non-tensor elements that change per batch (sample ids, file names): a step
that ignores them or only hands them on is compiled once, and hands on each batch's own
values; a step that reads them is traced for their values (as constants), never frozen."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from mncore_lightning.batch_values import BatchValueRead, BatchValues
from tests.lightning.lightning_testing import LitClassifier, assert_state_close, make_dataset
from tests.lightning.lightning_testing import make_trainer as _make_trainer

pytestmark = pytest.mark.usefixtures("make_fx_capture")


class Named(Dataset):
    """(x, y, "sample<i>"): collated into a list of 16 strings per batch."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        self.data = make_dataset(n, seed)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        return x, y, f"sample{i}"


def _loader(n: int = 64, seed: int = 0, shuffle: bool = False) -> DataLoader:
    return DataLoader(Named(n, seed), batch_size=16, shuffle=shuffle)


class PassesIdsThrough(LitClassifier):
    """Ignores the ids in training and validation, appends them in test, returns them from
    predict."""

    def __init__(self) -> None:
        super().__init__()
        self.tested: list = []

    def training_step(self, batch, batch_idx):
        return super().training_step(batch[:2], batch_idx)

    def validation_step(self, batch, batch_idx):
        return super().validation_step(batch[:2], batch_idx)

    def test_step(self, batch, batch_idx):
        x, y, ids = batch
        self.tested.append(ids)
        return super().test_step((x, y), batch_idx)

    def predict_step(self, batch, batch_idx):
        x, _, ids = batch
        return {"logits": self(x), "ids": ids}


def make_trainer(accelerator, **kwargs):
    kwargs = {"max_epochs": 2, "num_sanity_val_steps": 2, **kwargs}
    return _make_trainer(accelerator, **kwargs)


def _graphs(trainer) -> dict[str, int]:
    strategy = trainer.strategy
    if not hasattr(strategy, "compiled_functions"):
        return {}
    stages = ("sanity_check", "validate", "test", "predict")
    graphs = {stage: len(strategy.compiled_functions(stage)) for stage in stages}
    return {stage: n for stage, n in graphs.items() if n}


class _Graphs(L.Callback):
    """How many graphs each stage compiled, read before teardown clears them."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def _read(self, trainer, *args) -> None:
        self.counts.update(_graphs(trainer))
        self.retraces = getattr(trainer.strategy, "retraces", 0)

    on_validation_end = on_test_end = on_predict_end = on_train_end = _read


def _run(accelerator):
    L.seed_everything(0, verbose=False)
    model = PassesIdsThrough()
    graphs = _Graphs()
    trainer = make_trainer(accelerator, callbacks=[graphs])
    trainer.fit(model, _loader(shuffle=True), _loader(n=48, seed=1))
    metrics = dict(trainer.callback_metrics)
    tested = trainer.test(model, _loader(n=48, seed=1), verbose=False)
    predicted = trainer.predict(model, _loader(n=48, seed=1))
    return model, metrics, tested, predicted, graphs


def test_ids_that_the_step_ignores_or_hands_on_compile_once_and_match_cpu():
    cpu, cpu_metrics, cpu_tested, cpu_predicted, _ = _run("cpu")
    mn, metrics, tested, predicted, graphs = _run("mncore")
    assert_state_close(cpu, mn)
    for key in cpu_metrics:
        torch.testing.assert_close(metrics[key], cpu_metrics[key], atol=1e-5, rtol=0)
    assert tested == cpu_tested
    expected = [tuple(f"sample{i}" for i in range(b, b + 16)) for b in (0, 16, 32)]
    assert mn.tested == cpu.tested == expected
    for ours, theirs in zip(predicted, cpu_predicted, strict=True):
        assert ours["ids"] == theirs["ids"]  # each batch's own ids, not the traced batch's
        torch.testing.assert_close(ours["logits"], theirs["logits"], atol=1e-5, rtol=0)
    # one graph per stage (all batches full), no re-trace although every batch's ids differ
    assert graphs.counts == {"sanity_check": 1, "validate": 1, "test": 1, "predict": 1}
    assert graphs.retraces == 0


class ReadsIds(LitClassifier):
    """Weighs each validation batch by a value read from its ids: traced for those values."""

    def validation_step(self, batch, batch_idx):
        x, y, ids = batch
        weight = 2.0 if int(ids[0].removeprefix("sample")) % 32 == 0 else 1.0
        self.log("weighted", F.cross_entropy(self(x), y) * weight)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch[:2], batch_idx)


def test_ids_the_step_reads_are_traced_as_constants_never_frozen():
    results = {}
    for accelerator in ("cpu", "mncore"):
        L.seed_everything(0, verbose=False)
        model = ReadsIds()
        trainer = make_trainer(accelerator, num_sanity_val_steps=0, max_epochs=1)
        trainer.fit(model, _loader(), _loader(n=48, seed=1))
        results[accelerator] = trainer.callback_metrics["weighted"]
        if accelerator == "mncore":
            assert trainer.strategy.retraces == 2  # traced for each batch's weight
    torch.testing.assert_close(results["mncore"], results["cpu"], atol=1e-5, rtol=0)


# --- what counts as reading a passed-through value ------------------------------------------

_USES = {
    "truth": lambda v: bool(v),
    "equality": lambda v: v == "sample0",
    "membership": lambda v: v in {"sample0"},
    "dict key": lambda v: {"sample0": 1}[v],
    "isinstance": lambda v: isinstance(v, str),
    "f-string": lambda v: f"{v}",
    "str()": lambda v: str(v),
    "method": lambda v: v.startswith("s"),
    "len": lambda v: len(v),
    "index": lambda v: v[0],
    "int()": lambda v: int(v),
    "arithmetic": lambda v: v + 1,
    "reflected": lambda v: 1 + v,
    "as slice bound": lambda v: [1, 2, 3][:v],
    "torch": lambda v: torch.full((2,), v),
    "attribute set": lambda v: setattr(v, "x", 1),
}


@pytest.mark.parametrize("use", list(_USES))
def test_every_use_of_a_passed_through_value_is_a_read(use):
    values = BatchValues({2: "sample0"}, {2: "[2]"})
    stand_in = values.stand_ins()[2]
    with pytest.raises((BatchValueRead, TypeError)):
        _USES[use](stand_in)
    assert values.read == "[2]"  # remembered even where torch turns it into a TypeError


def test_a_read_the_step_catches_still_traces_the_values_as_constants():
    class CatchesTheRead(LitClassifier):
        def validation_step(self, batch, batch_idx):
            x, y, ids = batch
            try:
                weight = 2.0 if ids[0] == "sample16" else 1.0
            except Exception:  # noqa: BLE001 - the user's code swallows the stand-in's error
                weight = 5.0
            self.log("weighted", F.cross_entropy(self(x), y) * weight)

        def training_step(self, batch, batch_idx):
            return super().training_step(batch[:2], batch_idx)

    results = {}
    for accelerator in ("cpu", "mncore"):
        L.seed_everything(0, verbose=False)
        trainer = make_trainer(accelerator, num_sanity_val_steps=0, max_epochs=1)
        trainer.fit(CatchesTheRead(), _loader(), _loader(n=48, seed=1))
        results[accelerator] = trainer.callback_metrics["weighted"]
    torch.testing.assert_close(results["mncore"], results["cpu"], atol=1e-5, rtol=0)
