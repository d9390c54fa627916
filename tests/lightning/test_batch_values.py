"""Batches with strings that change per batch (sample ids, file names), on the Dynamo capture.

The step gets each string of its batch as a stand-in of one class (mncore_device.capture.
batch_leaves): a step that ignores them or only hands them on compiles once and hands on each
batch's own values; a step that reads one runs that read on the host (a graph break), with
this batch's value, as on cpu."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter
from torch.utils.data import DataLoader, Dataset

from mncore_device.capture.batch_leaves import BatchStandIns
from mncore_device.capture.dynamo import own_code
from tests.lightning.lightning_testing import LitClassifier, assert_state_close, make_dataset
from tests.lightning.lightning_testing import make_trainer as _make_trainer


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
    # one graph per stage (all batches full) although every batch's ids differ; test_step's
    # list costs its two re-compiles (its length guard fails twice: appended_lists)
    assert graphs.counts == {"sanity_check": 1, "validate": 1, "test": 3, "predict": 1}
    assert graphs.retraces == 2


class ReadsIds(LitClassifier):
    """Weighs each validation batch by a value read from its ids: traced for those values."""

    def validation_step(self, batch, batch_idx):
        x, y, ids = batch
        weight = 2.0 if int(ids[0].removeprefix("sample")) % 32 == 0 else 1.0
        self.log("weighted", F.cross_entropy(self(x), y) * weight)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch[:2], batch_idx)


def test_ids_the_step_reads_are_read_on_the_host_as_on_cpu():
    results = {}
    for accelerator in ("cpu", "mncore"):
        L.seed_everything(0, verbose=False)
        model = ReadsIds()
        graphs = _Graphs()
        trainer = make_trainer(
            accelerator, num_sanity_val_steps=0, max_epochs=1, callbacks=[graphs]
        )
        trainer.fit(model, _loader(), _loader(n=48, seed=1))
        results[accelerator] = trainer.callback_metrics["weighted"]
    torch.testing.assert_close(results["mncore"], results["cpu"], atol=1e-5, rtol=0)
    # the read is host code between two device calls; the number it gives (0, 16, 32) is
    # guarded once, then a graph input, and the branch on it guards `% 32 == 0`, which
    # flips once (2, 1, 2: the third batch uses the first graph again)
    assert graphs.retraces == 2


# --- every use of a string in the batch is the value's -------------------------------------

_USES = {
    "truth": lambda v: bool(v),
    "equality": lambda v: v == "sample0",
    "membership": lambda v: v in {"sample0"},
    "dict key": lambda v: {"sample0": 1, "sample1": 2}[v],
    "isinstance": lambda v: isinstance(v, str),
    "f-string": lambda v: f"{v}!",
    "str()": lambda v: str(v),
    "method": lambda v: v.startswith("sample1"),
    "len": lambda v: len(v),
    "index": lambda v: v[-1],
    "int()": lambda v: int(v.removeprefix("sample")),
    "concatenation": lambda v: v + "_x",
    "reflected": lambda v: "x_" + v,
    "arithmetic": lambda v: v + 1,
    "as slice bound": lambda v: [1, 2, 3][:v],
    "torch": lambda v: torch.full((2,), v),
    "attribute set": lambda v: setattr(v, "x", 1),
}


def _use_or_error(use, value):
    try:
        return use(value)
    except (TypeError, AttributeError, KeyError) as error:
        return type(error)


@pytest.mark.parametrize("use", list(_USES))
def test_every_use_of_a_string_in_the_batch_is_its_value(use):
    """Under Dynamo, with the batch's strings stood in for: each use gives what it gives on
    the string itself (or raises the same error), for two batches whose strings differ; a
    step that only passes a string on never re-compiles for its value."""
    counter = CompileCounter()

    def step(batch):
        x, name = batch
        return x + 1, _use_or_error(_USES[use], name)

    compiled = torch.compile(own_code(step), backend=counter)  # a code (and cache) of its own
    for name in ("sample0", "sample1"):
        batch = (torch.zeros(2), name)
        with BatchStandIns.standing_in((batch,)) as (call, stand_ins):
            _, result = stand_ins.resolve(compiled(*call))
        expected = _use_or_error(_USES[use], name)
        assert result == expected and type(result) is type(expected), (name, result, expected)


def test_a_string_handed_on_compiles_once_and_comes_back_as_itself():
    counter = CompileCounter()
    kept = []

    def step(batch):
        x, names = batch
        kept.append(names[0])  # a list outside the step: Dynamo replays the append
        return {"y": x * 2, "names": names}

    compiled = torch.compile(own_code(step), backend=counter)
    for index in range(3):
        batch = (torch.ones(2), (f"a{index}", f"b{index}"))
        with BatchStandIns.standing_in((batch,)) as (call, stand_ins):
            out = stand_ins.resolve(compiled(*call))
        assert out["names"] == batch[1] and type(out["names"][0]) is str
    assert kept == ["a0", "a1", "a2"] and {type(k) for k in kept} == {str}
    # the list kept outside grows (its length guard), the strings themselves never re-compile
    assert counter.frame_count == 3


def test_a_read_the_step_catches_runs_as_on_cpu():
    class CatchesTheRead(LitClassifier):
        def validation_step(self, batch, batch_idx):
            x, y, ids = batch
            try:
                weight = 2.0 if ids[0] == "sample16" else 1.0
            except Exception:  # noqa: BLE001 - on cpu nothing raises here
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
