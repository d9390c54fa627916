"""What MNCoreStrategy cannot run fails early, saying why and what to do instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, TensorDataset

from mncore_device import StaticGraphError
from tests.lightning.lightning_testing import LitClassifier, fit_once, loader, make_trainer


def _fit(model, **overrides):
    make_trainer("mncore", max_epochs=1, **overrides).fit(model, loader())


def test_unsupported_optimizer_lists_supported_ones():
    with pytest.raises(TypeError, match="LBFGS") as e:
        _fit(LitClassifier(optimizer="lbfgs"))
    for name in ("torch.optim.SGD", "torch.optim.Adam", "torch.optim.AdamW", "torch.optim.RMSprop"):
        assert name in str(e.value)
    assert "re-evaluates its closure" in str(e.value)  # why LBFGS cannot run in a static step


class TwoOptimizers(LitClassifier):
    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.net[0].parameters(), lr=0.1),
            torch.optim.SGD(self.net[-1].parameters(), lr=0.1),
        ]


def test_two_optimizers_raise():
    # Lightning itself refuses several optimizers with automatic optimization; either
    # message must say that only one optimizer can be used.
    with pytest.raises(RuntimeError, match="multiple optimizers"):
        _fit(TwoOptimizers())


_BRANCH_LINE_MARKER = "# <- the data-dependent branch"


class Branching(LitClassifier):
    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        if loss > 1:  # <- the data-dependent branch
            loss = loss * 0.5
        return loss


def test_data_dependent_branch_points_at_the_line():
    with pytest.raises(StaticGraphError) as e:
        _fit(Branching())
    lines = Path(__file__).read_text().splitlines()
    lineno = next(i + 1 for i, line in enumerate(lines) if line.endswith(_BRANCH_LINE_MARKER))
    message = str(e.value)
    assert f"{__file__}:{lineno}" in message, message
    assert "if loss > 1" in message
    assert "torch.where" in message


class MetricLike:
    """Quacks like a torchmetrics Metric (update/compute), but is no tensor."""

    def update(self, preds, target) -> None:
        pass

    def compute(self) -> torch.Tensor:
        return torch.tensor(0.0)


class LogsObject(LitClassifier):
    def __init__(self, metric) -> None:
        super().__init__()
        self.metric = metric

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("metric", self.metric)
        return loss


def test_logging_a_non_tensor_object_raises_type_error():
    with pytest.raises(TypeError, match=r"self.log\('metric', ...\).*MetricLike") as e:
        _fit(LogsObject(MetricLike()))
    assert "torchmetrics" in str(e.value)


def test_logging_a_torchmetrics_metric_object_behaves_as_on_cpu():
    """Logged but never updated: whatever Lightning does with it on cpu (the replayed log call
    gets the Metric object itself, see test_side_effects for metrics that are updated)."""
    torchmetrics = pytest.importorskip("torchmetrics")
    outcomes = []
    for accelerator in ("cpu", "mncore"):
        metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        try:
            fit_once(accelerator, model_cls=LogsObject, model_kwargs={"metric": metric})
            outcomes.append(None)
        except Exception as error:  # noqa: BLE001 - compared with cpu's below
            outcomes.append((type(error), str(error)))
    assert outcomes[0] == outcomes[1]


class ReturnsNone(LitClassifier):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        return None


def test_training_step_returning_none_raises():
    with pytest.raises(TypeError, match="must return the loss tensor") as e:
        _fit(ReturnsNone())
    assert "cannot skip a batch by returning None" in str(e.value)


class ReturnsDict(LitClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return {"loss": loss, "double": loss * 2, "tag": "constant"}


def test_training_step_returning_a_dict_works():
    outputs = []

    class Keep(Callback):
        def on_train_batch_end(self, trainer, pl_module, out, batch, batch_idx) -> None:
            outputs.append(out)

    _fit(ReturnsDict(), callbacks=[Keep()])
    assert len(outputs) == 4
    for out in outputs:
        assert out["tag"] == "constant"
        torch.testing.assert_close(out["double"], out["loss"] * 2)


def test_item_in_training_step_raises_static_graph_error():
    class Item(LitClassifier):
        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self(batch[0]), batch[1])
            self.log("loss_float", loss.item())
            return loss

    with pytest.raises(StaticGraphError, match=r"\.item\(\)"):
        _fit(Item())


def test_batch_changing_structure_raises():
    class Structure(LitClassifier):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch[:2], batch_idx)

    ds = loader(n=32).dataset
    data = DataLoader(TensorDataset(*ds.tensors), batch_size=16)

    class Wrap:
        def __init__(self, inner):
            self.inner = inner

        def __iter__(self):
            for i, (x, y) in enumerate(self.inner):
                yield (x, y) if i == 0 else (x, y, torch.zeros(1))

        def __len__(self):
            return len(self.inner)

    with pytest.raises(
        MisconfigurationException, match="training batch changed.*structure changed"
    ):
        make_trainer("mncore", max_epochs=1).fit(Structure(), Wrap(data))


def test_detect_anomaly_traces_without_it_and_warns_once_pointing_at_the_debug_preset():
    from tests.lightning.lightning_testing import ATOL, assert_state_close, fit_once

    with pytest.warns(UserWarning, match=r"detect_anomaly.*preset='debug'"):
        _, mn, _ = fit_once("mncore", detect_anomaly=True)
    _, cpu, _ = fit_once("cpu", detect_anomaly=True)
    assert_state_close(cpu, mn, atol=ATOL)


def test_a_torch_compiled_module_trains_as_the_module_itself():
    # Lightning unwraps torch.compile's OptimizedModule; the compiled step is ours
    import lightning as L

    from tests.lightning.lightning_testing import assert_state_close

    _, cpu, _ = fit_once("cpu")
    L.seed_everything(0, verbose=False)
    model = LitClassifier()
    trainer = make_trainer(max_epochs=2)
    trainer.fit(torch.compile(model), loader(shuffle=True))
    assert_state_close(cpu, model)
