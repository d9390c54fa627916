"""Python control flow on batch_idx follows its value: never frozen at trace time.

TorchDynamo guards the comparison (`batch_idx % 2 == 0`), not the value: the step compiles
once for each outcome, and trains as on cpu (same seed and data).
"""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import mncore_lightning


class _IndexUser(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        if batch_idx % 2 == 0:  # a guard on the comparison: one graph for each outcome
            loss = loss * 2
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _IndexPassthrough(_IndexUser):
    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).pow(2).mean()


class _Graphs(L.Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        self.train = len(trainer.strategy.compiled_functions("train"))


def _fit(module: L.LightningModule, accelerator: str = "mncore", **kwargs) -> L.Trainer:
    strategy = {"strategy": mncore_lightning.MNCoreStrategy(device="pfvm:cpu", preset="O0")}
    trainer = L.Trainer(
        accelerator=accelerator,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **(strategy if accelerator == "mncore" else {}),
        **kwargs,
    )
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4))
    return trainer


def test_control_flow_on_batch_idx_follows_it_as_on_cpu():
    torch.manual_seed(0)
    cpu = _IndexUser()
    mncore = _IndexUser()
    mncore.load_state_dict(cpu.state_dict())
    torch.manual_seed(1)
    _fit(cpu, "cpu")
    torch.manual_seed(1)
    graphs = _Graphs()
    trainer = _fit(mncore, callbacks=[graphs])
    torch.testing.assert_close(mncore.layer.weight, cpu.layer.weight, atol=1e-6, rtol=0)
    # one graph for even batches and one for odd ones: the second is the only re-compile
    assert graphs.train == 2
    assert trainer.strategy.retraces == 1


def test_a_step_that_ignores_batch_idx_trains():
    module = _IndexPassthrough()
    before = module.layer.weight.detach().clone()
    trainer = _fit(module)
    assert trainer.global_step == 3
    assert not torch.equal(module.layer.weight, before)
