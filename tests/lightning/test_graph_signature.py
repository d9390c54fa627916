"""The device graph of a Lightning training step has a typed signature: parameters and
optimizer state, the batch, the step counters as scalar inputs, the loss, each `self.log`
value (by its name), the gradients the gradient hooks read, the state the update writes,
and the Python values the step was captured under."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from mncore_device.runtime.signature import InputKind, OutputKind
from mncore_lightning.optimizers import MNCoreSGD
from tests.lightning.lightning_testing import CLASSES, IN_FEATURES, loader, make_trainer


class Logged(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(IN_FEATURES, CLASSES)
        self.temperature = 0.5  # a Python float the step reads: a guard
        self.grad_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        warmup = min(1.0, (self.global_step + 1) / 4)  # a counter: a scalar input
        loss = F.cross_entropy(self.net(x) / self.temperature, y) * warmup
        self.log("train_loss", loss)
        self.log("warmup", torch.tensor(warmup))
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:  # reads the gradients
        self.grad_norms.append(float(self.net.weight.grad.norm()))

    def configure_optimizers(self):
        return MNCoreSGD(self.parameters(), lr=0.1, momentum=0.9)


class Signatures(L.Callback):
    def __init__(self) -> None:
        self.signatures = []

    def on_train_end(self, trainer, pl_module) -> None:
        self.signatures = [f.signature for f in trainer.strategy.compiled_functions("train")]


def test_training_step_signature():
    L.seed_everything(0, verbose=False)
    found = Signatures()
    model = Logged()
    make_trainer(callbacks=[found], max_epochs=1).fit(model, loader())
    (signature,) = found.signatures  # one graph for the whole fit

    params = signature.inputs_of(InputKind.PARAMETER)
    assert sorted(params) == ["model@net/bias", "model@net/weight"]
    assert len(signature.inputs_of(InputKind.OPTIMIZER_STATE)) >= 2  # momentum buffers
    batch = [s for s in signature.inputs if s.kind is InputKind.BATCH]
    assert [s.source for s in batch] == ["L['args'][0][0]", "L['args'][0][1]"]
    scalars = [s.source or "" for s in signature.inputs if s.kind is InputKind.SCALAR]
    # global_step is Lightning's count of optimizer steps
    assert any(s.endswith("optim_progress.optimizer.step.total.completed") for s in scalars)

    logged = [s.target for s in signature.outputs if s.kind is OutputKind.LOG_VALUE]
    assert logged == ["train_loss", "warmup"]
    assert len(signature.outputs_of(OutputKind.USER_OUTPUT)) == 1  # the loss
    gradients = [s.target for s in signature.outputs if s.kind is OutputKind.GRADIENT]
    assert sorted(gradients) == ["model@net/bias", "model@net/weight"]
    assert len(model.grad_norms) == 4  # one per step, from those outputs
    updated = set(signature.outputs_of(OutputKind.STATE_MUTATION))
    assert set(params) <= updated
    assert any(g.endswith(".temperature == 0.5") for g in signature.guards)
    # the counter is an input, not a guard: no re-compile per step
    assert not any("step.total.completed" in g for g in signature.guards)
    assert torch.isfinite(torch.tensor(model.grad_norms)).all()
