"""Attention models with masks train on mncore exactly as on cpu.

torch's attention modules read their masks on the host (is the mask causal? is the padding
left-aligned?). Those reads are of masks computed only from constants and shapes, so they are
folded at trace time; checks that exist only for eager fast paths are skipped because
`torch.compiler.is_compiling()` is true during capture. The same seed and the same data give
the same losses and weights as accelerator="cpu", within ATOL.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import LightningTransformer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning.lightning_testing import (
    ATOL,
    assert_metrics_close,
    assert_state_close,
    fit_once,
)

VOCAB = 16
LENGTH = 6
WIDTH = 8


def _tokens(n: int, seed: int, pad: bool = True) -> torch.Tensor:
    """Random tokens in [1, VOCAB); with `pad`, a random tail of each row is padding (0)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (n, LENGTH + 1), generator=g)
    if pad:
        lengths = torch.randint(2, LENGTH + 2, (n, 1), generator=g)
        tokens = tokens.masked_fill(torch.arange(LENGTH + 1) >= lengths, 0)
    return tokens


def _next_token_loader(n: int, seed: int, pad: bool = True) -> DataLoader:
    tokens = _tokens(n, seed, pad)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


class LitAttention(L.LightningModule):
    """Next-token prediction through a causal TransformerEncoder or MultiheadAttention, with
    a causal mask built from torch.tril and a key-padding mask from the batch. Dropout acts on
    the (non-contiguous) output of batch_first attention: the masks must be drawn as on cpu."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        if kind == "encoder":
            layer = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.1, batch_first=True)
            self.body = nn.TransformerEncoder(layer, 2)
        else:
            self.body = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        causal = torch.tril(torch.ones(length, length)) == 0  # True: may not attend
        padding = tokens == 0
        x = self.embedding(tokens)
        if self.kind == "encoder":
            h = self.body(x, mask=causal, src_key_padding_mask=padding)
        else:
            h, _ = self.body(x, x, x, key_padding_mask=padding, attn_mask=causal)
        return self.head(self.dropout(h))

    def _loss(self, batch) -> torch.Tensor:
        tokens, target = batch
        return F.cross_entropy(self(tokens).flatten(0, 1), target.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


@pytest.mark.parametrize("kind", ["encoder", "attention"])
def test_masked_attention_matches_cpu(kind):
    def run(accelerator):
        return fit_once(
            accelerator,
            {"kind": kind},
            model_cls=LitAttention,
            train=_next_token_loader(12, seed=0),
            val=_next_token_loader(8, seed=1),
            max_epochs=2,
        )

    _, cpu_model, cpu = run("cpu")
    _, mn_model, mn = run("mncore")

    assert len(mn.losses) == len(cpu.losses) == 6
    torch.testing.assert_close(torch.stack(mn.losses), torch.stack(cpu.losses), atol=ATOL, rtol=0)
    assert_state_close(mn_model, cpu_model)
    for mn_metrics, cpu_metrics in zip(mn.epoch_metrics, cpu.epoch_metrics, strict=True):
        assert_metrics_close(mn_metrics, cpu_metrics)
    assert mn.losses[-1] < mn.losses[0]  # it learned


class SyntheticTokensTransformer(LightningTransformer):
    """Lightning's demo model as it is, trained on synthetic tokens (no WikiText2 download)."""

    def prepare_data(self) -> None:
        pass


def test_lightning_demo_transformer_matches_cpu():
    """lightning.pytorch.demos.transformer.LightningTransformer (nn.Transformer with a causal
    mask from torch.triu(torch.ones(t, t)), dropout 0.2) on synthetic tokens."""

    def run(accelerator):
        return fit_once(
            accelerator,
            {"vocab_size": VOCAB},
            model_cls=SyntheticTokensTransformer,
            train=_next_token_loader(12, seed=0, pad=False),
            max_epochs=1,
        )

    _, cpu_model, cpu = run("cpu")
    _, mn_model, mn = run("mncore")

    assert len(mn.losses) == len(cpu.losses) == 3
    torch.testing.assert_close(torch.stack(mn.losses), torch.stack(cpu.losses), atol=ATOL, rtol=0)
    assert_state_close(mn_model, cpu_model)
