"""Lightning's own LSTM demo (lightning.pytorch.demos.LightningLSTM) at the default preset.

The demo's model (SimpleLSTM: embedding, dropout, a 2-layer LSTM with dropout between the
layers, a decoder) with its hidden state carried from step to step, made small, on a tiny
synthetic corpus instead of WikiText-2 (no download). At O1 (TorchInductor) it trains as
accelerator="cpu" does: the same losses and weights, dropout masks included.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.demos import LightningLSTM, SequenceSampler, SimpleLSTM
from torch.utils.data import DataLoader, Dataset

from mncore_lightning import MNCoreStrategy
from tests.lightning.lightning_testing import ATOL, LossCollector, assert_state_close

VOCAB, SEQUENCE, BATCH = 13, 6, 4


class TinyCorpus(Dataset):
    """(input, target) token sequences, the target the input shifted by one, as WikiText2."""

    def __init__(self, sequences: int = 12) -> None:
        generator = torch.Generator().manual_seed(3)
        self.tokens = torch.randint(0, VOCAB, (sequences * SEQUENCE + 1,), generator=generator)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // SEQUENCE

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * SEQUENCE
        return self.tokens[start : start + SEQUENCE], self.tokens[start + 1 : start + SEQUENCE + 1]


class TinyLSTMDemo(LightningLSTM):
    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = SimpleLSTM(vocab_size=VOCAB, ninp=8, nhid=8, nlayers=2, dropout=0.2)

    def prepare_data(self) -> None:  # the demo downloads WikiText-2
        pass

    def train_dataloader(self) -> DataLoader:
        dataset = TinyCorpus()
        return DataLoader(dataset, batch_sampler=SequenceSampler(dataset, batch_size=BATCH))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(accelerator: str, **kwargs):
    L.seed_everything(0, verbose=False)
    model = TinyLSTMDemo()
    collector = LossCollector()
    trainer = L.Trainer(
        accelerator=accelerator,
        max_epochs=2,
        callbacks=[collector],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )
    trainer.fit(model)
    return model, collector


@pytest.mark.filterwarnings("error::mncore_device.InductorFallbackWarning")
def test_lightnings_lstm_demo_trains_at_o1_as_on_cpu():
    """Inductor compiles and runs the LSTM graphs (no fallback to the interpreter)."""
    cpu_model, cpu = _fit("cpu")
    mn_model, mn = _fit("mncore", strategy=MNCoreStrategy(preset="O1"))
    assert len(mn.losses) == len(cpu.losses) == 2 * 3
    torch.testing.assert_close(torch.stack(mn.losses), torch.stack(cpu.losses), atol=ATOL, rtol=0)
    assert_state_close(mn_model, cpu_model)
