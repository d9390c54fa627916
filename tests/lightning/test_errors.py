"""What MNCoreStrategy cannot run fails early, saying why and what to do instead."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from mncore_device import StaticGraphError
from mncore_lightning import MNCoreStrategy
from tests.lightning.lightning_testing import (
    ATOL,
    LitClassifier,
    assert_state_close,
    fit_once,
    loader,
    make_trainer,
)


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


def test_data_dependent_branch_points_at_the_line_with_fullgraph():
    """The branch is a graph break: by default it runs on the host, as on cpu
    (test_graph_breaks.py); a step that must be one device call is refused at the line."""
    strategy = MNCoreStrategy(device="pfvm:cpu", preset="O0", fullgraph=True)
    with pytest.raises(StaticGraphError, match="fullgraph=True") as e:
        _fit(Branching(), strategy=strategy)
    lines = Path(__file__).read_text().splitlines()
    lineno = next(i + 1 for i, line in enumerate(lines) if line.endswith(_BRANCH_LINE_MARKER))
    message = str(e.value)
    assert f"{__file__}:{lineno}" in message, message
    assert "if loss > 1" in message


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


def test_logging_a_non_tensor_object_raises_lightnings_error_as_on_cpu():
    """The recorded `self.log` call is replayed into Lightning's own `log`, whose check
    names the value as on cpu."""
    with pytest.raises(ValueError, match=r"self.log\(metric, .*MetricLike.*cannot be logged"):
        _fit(LogsObject(MetricLike()))


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


def test_batch_changing_structure_inside_an_epoch_trains_as_cpu():
    """From each epoch's second batch on the batch has a third tensor, which the step
    ignores: Dynamo guards the batch's length and compiles the step for each layout; it
    trains as on cpu."""

    class Structure(LitClassifier):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch[:2], batch_idx)

    class Wrap:
        def __init__(self, inner):
            self.inner = inner

        def __iter__(self):
            for i, (x, y) in enumerate(self.inner):
                yield (x, y) if i == 0 else (x, y, torch.zeros(1))

        def __len__(self):
            return len(self.inner)

    def data():
        ds = loader(n=32).dataset
        return Wrap(DataLoader(TensorDataset(*ds.tensors), batch_size=16))

    trainers, models = [], []
    for accelerator in ("cpu", "mncore"):
        L.seed_everything(0, verbose=False)
        models.append(Structure())
        trainers.append(make_trainer(accelerator, max_epochs=2))
        trainers[-1].fit(models[-1], data())
    assert_state_close(models[0], models[1])
    strategy = trainers[1].strategy
    # Dynamo's guard on the batch's length, at the first epoch's second batch; and the
    # strategy's batch check at the second epoch's first batch (laid out as the first)
    assert strategy.retraces == 2


def test_detect_anomaly_without_nan_trains_as_cpu():
    _, mn, _ = fit_once("mncore", detect_anomaly=True)
    _, cpu, _ = fit_once("cpu", detect_anomaly=True)
    assert_state_close(cpu, mn, atol=ATOL)


class NaNInBackward(LitClassifier):
    """The third batch's mask is zero: sqrt's backward at 0 is inf, and the mask's product
    turns it into NaN gradients (the forward stays finite)."""

    def training_step(self, batch, batch_idx):
        x, y, mask = batch
        logits = self(x)
        penalty = (logits.pow(2).sum(-1) * mask).sqrt().mean()
        return F.cross_entropy(logits, y) + 0.01 * penalty


def _nan_at_third_batch() -> DataLoader:
    x, y = loader(n=64).dataset.tensors
    mask = torch.ones(64)
    mask[32:48] = 0.0
    return DataLoader(TensorDataset(x, y, mask), batch_size=16)


@pytest.mark.parametrize("preset", ["O0", "O1"])
def test_detect_anomaly_stops_at_the_step_whose_backward_makes_nan_as_cpu(preset):
    """cpu raises PyTorch's anomaly error in the backward of the third step; mncore stops at
    that step too, naming the op, with the weights of the two steps before (none NaN)."""
    import lightning as L

    from tests.lightning.lightning_testing import ATOL, assert_state_close

    def fit(accelerator, **kwargs):
        L.seed_everything(0, verbose=False)
        model = NaNInBackward()
        trainer = make_trainer(accelerator, max_epochs=1, detect_anomaly=True, **kwargs)
        with pytest.raises(RuntimeError) as error:
            trainer.fit(model, _nan_at_third_batch())
        return trainer, model, str(error.value)

    cpu_trainer, cpu, cpu_error = fit("cpu")
    assert "returned nan values" in cpu_error
    from mncore_lightning import MNCoreStrategy

    trainer, mn, error = fit("mncore", strategy=MNCoreStrategy(preset=preset))
    assert "detect_anomaly=True" in error and "aten.mul" in error and "NaN" in error
    assert "(batch_idx=2, global_step=2)" in error
    # the backward op is named by the forward line it differentiates
    assert "in training_step (its backward): penalty = (logits.pow(2)" in error
    assert trainer.global_step == cpu_trainer.global_step == 2
    assert all(torch.isfinite(p).all() for p in mn.parameters())
    assert_state_close(cpu, mn, atol=ATOL)


def test_detect_anomaly_leaves_evaluation_unchecked_as_cpu():
    """Anomaly mode checks what backward computes: a NaN logged in validation is logged."""

    class NaNInValidation(LitClassifier):
        def validation_step(self, batch, batch_idx):
            self.log("val_nan", torch.log(-(batch[0].abs() + 1)).mean())

    metrics = {}
    for accelerator in ("cpu", "mncore"):
        trainer = make_trainer(accelerator, max_epochs=1, detect_anomaly=True)
        trainer.fit(NaNInValidation(), loader(), loader(n=32))
        metrics[accelerator] = trainer.callback_metrics["val_nan"]
    assert metrics["cpu"].isnan() and metrics["mncore"].isnan()


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
