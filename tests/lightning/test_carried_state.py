"""Python state a step keeps between batches behaves as on cpu (carried, not frozen).

Same seed and data on accelerator="cpu" and "mncore" (O0); ATOL = 1e-5 absolute.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.lstm import LightningLSTM, SimpleLSTM
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning.lightning_testing import ATOL, LitClassifier, assert_state_close, fit_once


def _both(**kwargs):
    return [fit_once(accelerator, **kwargs) for accelerator in ("cpu", "mncore")]


def _assert_same_run(cpu, mn):
    (_, cpu_model, cpu_losses), (_, mn_model, mn_losses) = cpu, mn
    torch.testing.assert_close(
        torch.stack(cpu_losses.losses), torch.stack(mn_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu_model, mn_model)


class TinyLSTM(LightningLSTM):
    """Lightning's demo LSTM (hidden state carried across batches, reset each epoch) on
    synthetic tokens; the demo's WikiText2 download is not used."""

    def __init__(self) -> None:
        super().__init__(vocab_size=50)
        # the demo's training_step and hidden-state handling, on a small SimpleLSTM; no
        # dropout (nn.LSTM's fused kernel draws its inter-layer masks differently when traced)
        self.model = SimpleLSTM(vocab_size=50, ninp=16, nhid=16, nlayers=2, dropout=0.0)

    def prepare_data(self) -> None:
        pass


def _tokens() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (40, 6), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=10)


def test_lightning_lstm_demo_carries_its_hidden_state():
    cpu, mn = _both(model_cls=TinyLSTM, train=_tokens(), max_epochs=2)
    _assert_same_run(cpu, mn)
    strategy = mn[0].strategy
    # traced for "no hidden state" and for "(h, c)": once each, then reused every epoch
    assert strategy.retraces == 1
    assert isinstance(mn[1].hidden, tuple) or mn[1].hidden is None


class Counter(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.count = torch.zeros(())

    def training_step(self, batch, batch_idx):
        self.count = self.count + 1
        x, y = batch
        return F.cross_entropy(self(x), y) * (1.0 + 0.1 * self.count)


def test_a_rebound_tensor_attribute_is_carried():
    cpu, mn = _both(model_cls=Counter, max_epochs=2)
    _assert_same_run(cpu, mn)
    assert mn[1].count.item() == cpu[1].count.item() == 8


class LossEMA(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.ema = 0.9 * self.ema + 0.1 * loss.detach()
        self.log("ema", self.ema)
        return loss + 0.01 * self.ema


def test_a_reassigned_registered_buffer_is_updated_on_the_device():
    cpu, mn = _both(model_cls=LossEMA, max_epochs=2)
    _assert_same_run(cpu, mn)
    assert mn[1].ema.item() > 0
    torch.testing.assert_close(
        cpu[0].callback_metrics["ema"], mn[0].callback_metrics["ema"], atol=ATOL, rtol=0
    )


class InPlaceTotal(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.total = torch.zeros(())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.total.add_(loss.detach())
        return loss


def test_an_unregistered_tensor_updated_in_place_is_carried():
    cpu, mn = _both(model_cls=InPlaceTotal, max_epochs=2)
    _assert_same_run(cpu, mn)
    torch.testing.assert_close(cpu[1].total, mn[1].total, atol=ATOL, rtol=0)
    assert mn[1].total.item() > 0


class RebindsBatchNormStatistics(LitClassifier):
    """BatchNorm's running statistics are registered device state the graph updates in
    place; the step also reads them (a penalty on the running mean)."""

    def __init__(self) -> None:
        super().__init__(net="bn")

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 0.01 * self.net[1].running_mean.abs().sum()


def test_registered_buffers_read_by_the_step_are_device_state_as_on_cpu():
    cpu, mn = _both(model_cls=RebindsBatchNormStatistics, max_epochs=2)
    _assert_same_run(cpu, mn)
    (_, cpu_model, _), (_, mn_model, _) = cpu, mn
    torch.testing.assert_close(
        mn_model.net[1].running_mean, cpu_model.net[1].running_mean, atol=ATOL, rtol=0
    )


class RunningStats(LitClassifier):
    """Statistics kept by item assignment in dicts the module holds: a flat dict filled
    before fit, one that starts empty, and a nested one; the loss reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = {"sum": torch.zeros(()), "sq": torch.zeros(())}
        self.latest: dict[str, torch.Tensor] = {}
        self.nested = {"ema": {"loss": torch.ones(())}}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        detached = loss.detach()
        self.stats["sum"] = self.stats["sum"] + detached
        self.stats["sq"] = self.stats["sq"] + detached**2
        self.latest["loss"] = detached
        ema = self.nested["ema"]
        ema["loss"] = 0.5 * ema["loss"] + 0.5 * detached
        return loss * (1 + 0.1 * ema["loss"]) + 0.01 * self.stats["sum"]


def test_dict_entries_the_step_replaces_are_carried_like_attributes():
    cpu, mn = _both(model_cls=RunningStats, max_epochs=2)
    _assert_same_run(cpu, mn)
    (_, cpu_model, _), (_, mn_model, _) = cpu, mn
    for name in ("stats", "latest", "nested"):
        cpu_leaves, cpu_spec = torch.utils._pytree.tree_flatten(getattr(cpu_model, name))
        mn_leaves, mn_spec = torch.utils._pytree.tree_flatten(getattr(mn_model, name))
        assert cpu_spec == mn_spec, name
        torch.testing.assert_close(mn_leaves, cpu_leaves, atol=ATOL, rtol=0, msg=name)
    assert float(mn_model.stats["sum"]) > 0


class Totals:
    """A plain tracker object of the user's, holding tensors."""

    def __init__(self) -> None:
        self.total = torch.zeros(())
        self.in_place = torch.zeros(())
        self.scale = torch.ones(())


@dataclasses.dataclass
class Last:
    loss: torch.Tensor | None = None


class KeepsTotalsOnPlainObjects(LitClassifier):
    """Tensors kept on plain objects the module holds: rebound, changed in place, read (a
    scale a hook changes on the host) and set from None on a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.totals = Totals()
        self.namespace = SimpleNamespace(count=torch.zeros((), dtype=torch.int64))
        self.last = Last()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        detached = loss.detach()
        self.totals.total = self.totals.total + detached
        self.totals.in_place += detached
        self.namespace.count = self.namespace.count + 1
        self.last.loss = detached
        return loss * self.totals.scale

    def on_train_epoch_end(self) -> None:
        self.totals.scale = self.totals.scale * 0.5


def test_tensors_on_plain_objects_the_module_holds_are_carried():
    cpu, mn = _both(model_cls=KeepsTotalsOnPlainObjects, max_epochs=2)
    _assert_same_run(cpu, mn)
    (_, cpu_model, _), (_, mn_model, _) = cpu, mn
    for read in (
        lambda m: m.totals.total,
        lambda m: m.totals.in_place,
        lambda m: m.totals.scale,
        lambda m: m.namespace.count,
        lambda m: m.last.loss,
    ):
        torch.testing.assert_close(read(mn_model), read(cpu_model), atol=ATOL, rtol=0)
    assert int(mn_model.namespace.count) == mn_model.trainer.global_step > 1


class HoldsLibraryObjects(KeepsTotalsOnPlainObjects):
    """Besides its tracker, holds a LightningDataModule and a Dataset of its own classes,
    whose tensors are data, not state of the step."""

    def __init__(self) -> None:
        super().__init__()
        self.datamodule_ref = _TableDataModule()
        self.dataset_ref = TensorDataset(torch.randn(8, 4))


class _TableDataModule(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.randn(1000, 4)


def test_library_objects_the_module_holds_are_left_alone_as_on_cpu():
    """A LightningDataModule and a Dataset the module holds (their tensors are data the step
    never reads) are not device state: training matches cpu and leaves them as they were."""
    cpu, mn = _both(model_cls=HoldsLibraryObjects, max_epochs=2)
    _assert_same_run(cpu, mn)
    (_, cpu_model, _), (_, mn_model, _) = cpu, mn
    torch.testing.assert_close(mn_model.datamodule_ref.table, cpu_model.datamodule_ref.table)
    torch.testing.assert_close(
        mn_model.dataset_ref.tensors[0], cpu_model.dataset_ref.tensors[0], atol=0, rtol=0
    )
    torch.testing.assert_close(mn_model.totals.total, cpu_model.totals.total, atol=ATOL, rtol=0)
