"""What the device-layer benchmarks share: an MLSDK-style training step and its registration.

Imported by the `bench_*.py` scripts next to it (run as scripts, so this folder is on
`sys.path`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def registered(context: Any, model: Any, optimizer: Any) -> None:
    """Name and register the model's parameters and buffers and the optimizer's state, as an
    MLSDK script does before its first compile."""
    from mncore_device import set_buffer_name_in_optimizer, set_tensor_name_in_module

    set_tensor_name_in_module(model, "model")
    for p in model.parameters():
        context.register_param(p)
    for b in model.buffers():
        context.register_buffer(b)
    set_buffer_name_in_optimizer(optimizer, "optimizer")
    context.register_optimizer_buffers(optimizer)


def make_step(model: Any, optimizer: Any) -> Callable[[dict], dict]:
    """One classification training step on `{"x": inputs, "t": targets}`: zero_grad, cross
    entropy, backward, update; returns `{"loss": loss}`."""
    import torch.nn.functional as F

    def step(batch: dict) -> dict:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["t"])
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    return step


def tutorial_mlp() -> Any:
    """The MLSDK tutorial's MLP 1024-256-10, initialized from seed 0."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))
