"""Shared tiny LightningModules, data and helpers for the mncore_lightning tests.

Every test runs MN-Core with preset O0 (the aten graph run op by op: no Inductor, compiles in
well under a second) on the emulated device, unless $MNCORE_DEVICE says otherwise.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mncore_lightning  # noqa: F401  (registers accelerator/strategy "mncore")

IN_FEATURES = 8
CLASSES = 3

# Parity tolerance between accelerator="cpu" and accelerator="mncore" (preset O0): the compiled
# graph runs the same aten ops, so results agree to float32 rounding.
ATOL = 1e-5


@contextlib.contextmanager
def mncore_env():
    """Preset O0; the emulated CPU device unless the environment chooses one."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("MNCORE_PRESET", "O0")
        if not os.environ.get("MNCORE_DEVICE"):
            monkeypatch.setenv("MNCORE_DEVICE", "pfvm:cpu")
        yield monkeypatch


# --- networks ---------------------------------------------------------------------------


def make_net(kind: str, dropout: float = 0.0) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(IN_FEATURES, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, CLASSES)
        )
    if kind == "bn":
        # bias=False before BatchNorm: that bias has an exactly-zero true gradient, and Adam
        # amplifies the float32 rounding noise of such a gradient to +-lr per step, so it
        # would differ between any two implementations (observed: 0.03 after 12 steps).
        return nn.Sequential(
            nn.Linear(IN_FEATURES, 16, bias=False),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Linear(16, CLASSES),
        )
    if kind == "cnn":
        # input (N, 8) viewed as (N, 1, 2, 4) images
        return nn.Sequential(
            nn.Unflatten(1, (1, 2, 4)),
            nn.Conv2d(1, 4, kernel_size=(2, 2), padding=1),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Flatten(),
            nn.Linear(4 * 3 * 5, CLASSES),
        )
    raise ValueError(kind)


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    if name == "lbfgs":
        return torch.optim.LBFGS(params, lr=lr)
    if name in TRACED_OPTIMIZER_KWARGS:  # torch.optim's own update, traced on MN-Core
        return getattr(torch.optim, name)(params, lr=lr, **TRACED_OPTIMIZER_KWARGS[name])
    raise ValueError(name)


# The torch.optim optimizers without a hand-written MN-Core class, by class name, with
# options that take their less common paths (momentum, centering, weight decay, ...).
TRACED_OPTIMIZER_KWARGS: dict[str, dict[str, Any]] = {
    "RMSprop": {"momentum": 0.9, "centered": True, "weight_decay": 0.01},
    "Adagrad": {"lr_decay": 0.01, "initial_accumulator_value": 0.1},
    "Adadelta": {"weight_decay": 0.01},
    "Adamax": {"weight_decay": 0.01},
    "NAdam": {"decoupled_weight_decay": True, "weight_decay": 0.01},
    "RAdam": {"weight_decay": 0.01},
    "ASGD": {"t0": 2, "weight_decay": 0.01},
    "Rprop": {},
    "Adafactor": {"weight_decay": 0.01},
}


class LitClassifier(L.LightningModule):
    """Cross-entropy classifier; logs train_loss (step), val_loss / val_acc (epoch)."""

    def __init__(
        self,
        net: str = "mlp",
        optimizer: str = "sgd",
        lr: float = 0.1,
        dropout: float = 0.0,
        scheduler: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = make_net(net, dropout)
        self.example_input_array = torch.zeros(2, IN_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def _evaluate(self, batch, stage: str):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        self.log(f"{stage}_loss", loss, prog_bar=True)
        self.log(f"{stage}_acc", acc)
        return loss

    def validation_step(self, batch, batch_idx):
        return self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        return self._evaluate(batch, "test")

    def predict_step(self, batch, batch_idx):
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x)

    def configure_optimizers(self):
        optimizer = make_optimizer(self.hparams.optimizer, self.parameters(), self.hparams.lr)
        if self.hparams.scheduler == "step":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": scheduler}
        return optimizer


# --- data -------------------------------------------------------------------------------


def make_dataset(n: int, seed: int = 0) -> TensorDataset:
    """A learnable classification set: labels from a fixed random linear map."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=g)
    w = torch.randn(IN_FEATURES, CLASSES, generator=g)
    y = (x @ w).argmax(-1)
    return TensorDataset(x, y)


def loader(
    n: int = 64, batch_size: int = 16, shuffle: bool = False, drop_last: bool = True, seed: int = 0
) -> DataLoader:
    return DataLoader(
        make_dataset(n, seed), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last
    )


# --- trainer helpers --------------------------------------------------------------------


class LossCollector(Callback):
    """Collects the loss each training step returned, and the metrics after each epoch."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.epoch_metrics: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach().clone())

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epoch_metrics.append({k: v.clone() for k, v in trainer.callback_metrics.items()})


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        max_epochs=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return kwargs


def make_trainer(accelerator: Any = "mncore", **overrides: Any) -> L.Trainer:
    return L.Trainer(accelerator=accelerator, **trainer_kwargs(**overrides))


def fit_once(
    accelerator: Any,
    model_kwargs: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    train: Any = None,
    val: Any = None,
    model_cls: type = LitClassifier,
    **overrides: Any,
):
    """Seed, build the model and loaders, fit. Returns (trainer, model, LossCollector)."""
    L.seed_everything(seed, verbose=False)
    model = model_cls(**(model_kwargs or {}))
    collector = LossCollector()
    callbacks = list(overrides.pop("callbacks", [])) + [collector]
    trainer = make_trainer(accelerator, callbacks=callbacks, **overrides)
    train = train if train is not None else loader(shuffle=True)
    trainer.fit(model, train, val)
    return trainer, model, collector


def assert_state_close(a: nn.Module, b: nn.Module, atol: float = ATOL) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], atol=atol, rtol=0, msg=key)


def assert_metrics_close(a: dict, b: dict, atol: float = ATOL) -> None:
    assert set(a) == set(b), (sorted(a), sorted(b))
    for key in a:
        torch.testing.assert_close(
            torch.as_tensor(a[key]).float(), torch.as_tensor(b[key]).float(), atol=atol, rtol=0
        )


def assert_optimizer_state_close(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    """torch.optim state_dicts agree (same keys, tensors within ATOL, same hyperparameters)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for index in sa["state"]:
        ta, tb = sa["state"][index], sb["state"][index]
        assert ta.keys() == tb.keys(), (index, sorted(ta), sorted(tb))
        for key in ta:
            torch.testing.assert_close(
                torch.as_tensor(ta[key]), torch.as_tensor(tb[key]), atol=ATOL, rtol=0
            )
    for ga, gb in zip(sa["param_groups"], sb["param_groups"], strict=True):
        assert ga["lr"] == pytest.approx(gb["lr"], abs=1e-12)
