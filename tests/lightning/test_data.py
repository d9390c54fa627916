"""Training loaders get drop_last=True (static batch size), with one warning saying the cost."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from tests.lightning.lightning_testing import (
    LitClassifier,
    assert_state_close,
    make_dataset,
    make_trainer,
)

N, BATCH = 70, 16  # 4 full batches, 6 samples skipped per epoch


class DataModule(L.LightningDataModule):
    def __init__(self, n: int = N, batch_size: int = BATCH, loader_cls=DataLoader) -> None:
        super().__init__()
        self.n, self.batch_size, self.loader_cls = n, batch_size, loader_cls

    def setup(self, stage: str) -> None:
        self.train_set = make_dataset(self.n)
        self.val_set = make_dataset(30, seed=1)

    def train_dataloader(self):
        return self.loader_cls(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=False
        )

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


class TaggedLoader(DataLoader):
    """A DataLoader subclass with an extra constructor argument."""

    def __init__(self, dataset, tag: str = "x", **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.tag = tag


class StepCounter(Callback):
    def __init__(self) -> None:
        self.per_epoch: dict[int, int] = {}
        self.sizes: set[int] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        epoch = trainer.current_epoch
        self.per_epoch[epoch] = self.per_epoch.get(epoch, 0) + 1
        first = batch[0]
        while isinstance(first, (list, tuple)):  # steps_per_call: a group of batches
            first = first[0]
        self.sizes.add(first.shape[0])

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        functions = getattr(strategy, "compiled_functions", None)
        self.graphs = len(functions("train")) if functions else 0


def _skip_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "samples per epoch are skipped" in str(w.message)]


@pytest.mark.parametrize("loader_cls", [DataLoader, TaggedLoader])
def test_datamodule_not_divisible_warns_once_and_drops_last(loader_cls):
    counter = StepCounter()
    trainer = make_trainer("mncore", max_epochs=2, callbacks=[counter])
    with pytest.warns(UserWarning, match=r"6 samples per epoch are skipped") as record:
        trainer.fit(LitClassifier(), datamodule=DataModule(loader_cls=loader_cls))
    assert len(_skip_warnings(record)) == 1
    assert "drop_last=True" in _skip_warnings(record)[0]
    assert counter.per_epoch == {0: N // BATCH, 1: N // BATCH}
    assert counter.sizes == {BATCH}
    assert trainer.global_step == 2 * (N // BATCH)
    if loader_cls is TaggedLoader:
        assert trainer.train_dataloader.tag == "x"


def test_datamodule_matches_cpu_with_drop_last():
    """The rebuilt loader keeps the shuffling: same batches as a cpu run with drop_last=True."""

    class DropLastOnCpu(DataModule):
        def train_dataloader(self):
            return DataLoader(self.train_set, batch_size=BATCH, shuffle=True, drop_last=True)

    models = {}
    for accelerator, datamodule in (("cpu", DropLastOnCpu()), ("mncore", DataModule())):
        L.seed_everything(0, verbose=False)
        models[accelerator] = LitClassifier()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_trainer(accelerator, max_epochs=2).fit(models[accelerator], datamodule=datamodule)
    assert_state_close(models["mncore"], models["cpu"])


def test_divisible_dataset_gives_no_warning(recwarn):
    make_trainer("mncore", max_epochs=1).fit(LitClassifier(), datamodule=DataModule(n=64))
    assert _skip_warnings(recwarn.list) == []


def test_loader_passed_to_fit_is_rebuilt_too():
    counter = StepCounter()
    data = DataLoader(make_dataset(N), batch_size=BATCH, shuffle=False)
    trainer = make_trainer("mncore", max_epochs=1, callbacks=[counter])
    with pytest.warns(UserWarning, match=r"6 samples per epoch are skipped"):
        trainer.fit(LitClassifier(), data)
    assert counter.per_epoch == {0: N // BATCH}


def test_custom_batch_sampler_warns_and_fails_with_a_clear_error():
    dataset = make_dataset(N)
    sampler = _CustomBatchSampler(SequentialSampler(dataset), BATCH, drop_last=False)
    data = DataLoader(dataset, batch_sampler=sampler)
    trainer = make_trainer("mncore", max_epochs=1)
    with (
        pytest.warns(UserWarning, match="custom batch sampler"),
        pytest.raises(ValueError, match=r"batch size differs \(6 vs 16\).*drop_last=True"),
    ):
        trainer.fit(LitClassifier(), data)


class _CustomBatchSampler(BatchSampler):
    pass


def test_validation_loader_is_not_rebuilt():
    """Only training needs full batches: the val loader keeps its ragged last batch."""
    seen: list[int] = []

    class ValSizes(Callback):
        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, *a):
            seen.append(batch[0].shape[0])

    val = DataLoader(TensorDataset(*make_dataset(20).tensors), batch_size=BATCH)
    trainer = make_trainer("mncore", max_epochs=1, callbacks=[ValSizes()])
    trainer.fit(LitClassifier(), DataLoader(make_dataset(32), batch_size=BATCH), val)
    assert seen == [16, 4]
    assert torch.is_tensor(trainer.callback_metrics["val_loss"])


class _Stream(torch.utils.data.IterableDataset):
    """70 samples, streamed: batches of 16 leave a short last batch of 6."""

    def __iter__(self):
        dataset = make_dataset(70)
        return iter([dataset[i] for i in range(len(dataset))])


def test_iterable_dataset_drops_its_short_last_batch_as_a_map_style_one():
    results = {}
    for accelerator in ("cpu", "mncore"):
        L.seed_everything(0, verbose=False)
        model = LitClassifier()
        trainer = make_trainer(accelerator, max_epochs=2)
        train = DataLoader(_Stream(), batch_size=16, drop_last=accelerator == "cpu")
        if accelerator == "mncore":
            with pytest.warns(UserWarning, match="IterableDataset.*short last batch"):
                trainer.fit(model, train)
        else:
            trainer.fit(model, train)
        results[accelerator] = (model, trainer.global_step)
    assert results["mncore"][1] == results["cpu"][1] == 8
    assert_state_close(results["cpu"][0], results["mncore"][0])


# --- MNCoreStrategy(last_batch="compile"): the short last batch trains, as on cpu -------------


def _ragged_fit(accelerator, strategy=None, **kwargs):
    """119 samples in batches of 20: five full batches and one of 19, every epoch."""
    from tests.lightning.lightning_testing import LossCollector

    L.seed_everything(0, verbose=False)
    model = LitClassifier(optimizer="adam", lr=0.01)
    collector, counter = LossCollector(), StepCounter()
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer = make_trainer(accelerator, max_epochs=2, callbacks=[collector, counter], **kwargs)
    train = DataLoader(make_dataset(119), batch_size=20, shuffle=True)
    trainer.fit(model, train)
    return trainer, model, collector, counter


def _assert_identical(a, b) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize(
    "kwargs", [{}, {"accumulate_grad_batches": 4}], ids=["plain", "accumulate4"]
)
def test_last_batch_compile_trains_the_short_last_batch_bit_identical_to_cpu(kwargs, recwarn):
    from mncore_lightning import MNCoreStrategy

    cpu_trainer, cpu, cpu_losses, cpu_counter = _ragged_fit("cpu", **kwargs)
    strategy = MNCoreStrategy(last_batch="compile")
    trainer, mn, losses, counter = _ragged_fit("mncore", strategy, **kwargs)
    assert _skip_warnings(recwarn.list) == []
    assert counter.per_epoch == cpu_counter.per_epoch == {0: 6, 1: 6}
    assert counter.sizes == {20, 19}
    assert trainer.global_step == cpu_trainer.global_step
    assert torch.equal(torch.stack(losses.losses), torch.stack(cpu_losses.losses))
    assert torch.equal(
        losses.epoch_metrics[-1]["train_loss"], cpu_losses.epoch_metrics[-1]["train_loss"]
    )
    _assert_identical(cpu, mn)
    # the full-batch graph and the short one (per kind of micro-batch), traced once each
    assert counter.graphs == (2 if not kwargs else 3)
    assert strategy.retraces == 0


def test_last_batch_compile_with_steps_per_call_groups_the_short_batch_too():
    from mncore_lightning import MNCoreStrategy

    _, cpu, cpu_losses, _ = _ragged_fit("cpu")
    strategy = MNCoreStrategy(last_batch="compile", steps_per_call=4)
    trainer, mn, _, counter = _ragged_fit("mncore", strategy)
    assert trainer.global_step == 12
    torch.testing.assert_close(
        trainer.callback_metrics["train_loss"], cpu_losses.epoch_metrics[-1]["train_loss"]
    )
    _assert_identical(cpu, mn)


def test_the_drop_warning_says_how_many_samples_and_names_the_option():
    with pytest.warns(UserWarning, match=r"19 samples per epoch are skipped") as record:
        _, _, _, counter = _ragged_fit("mncore")
    assert "last_batch='compile'" in _skip_warnings(record)[0]
    assert counter.sizes == {20}


def test_last_batch_takes_drop_or_compile_only():
    from mncore_lightning import MNCoreStrategy

    with pytest.raises(ValueError, match=r"last_batch must be one of 'drop', 'compile'"):
        MNCoreStrategy(last_batch="pad")


def test_last_batch_compile_trains_an_iterable_datasets_short_last_batch_as_cpu():
    from mncore_lightning import MNCoreStrategy

    results = {}
    for accelerator in ("cpu", "mncore"):
        L.seed_everything(0, verbose=False)
        model = LitClassifier()
        kwargs = {"strategy": MNCoreStrategy(last_batch="compile")} if accelerator != "cpu" else {}
        trainer = make_trainer(accelerator, max_epochs=2, **kwargs)
        trainer.fit(model, DataLoader(_Stream(), batch_size=16))  # 4 batches of 16, one of 6
        results[accelerator] = (model, trainer.global_step)
    assert results["mncore"][1] == results["cpu"][1] == 10
    _assert_identical(results["cpu"][0], results["mncore"][0])
