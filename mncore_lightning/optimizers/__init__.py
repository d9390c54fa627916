"""Optimizers for MN-Core: torch.optim's SGD, Adam and AdamW, traceable into a static step.

A compiled MN-Core training step is traced once and replayed, so these optimizers keep
their hyperparameters in 0-d tensors (a host-side `group["lr"] = x` refills them in place,
which the device notices), create their state at construction, never read a tensor back
to the host, and keep torch.optim's state_dict layout.
"""

from ._base import MNCoreOptimizer, ParamGroup
from ._convert import TORCH_EQUIVALENTS, from_torch
from .adam import MNCoreAdam, MNCoreAdamW
from .sgd import MNCoreSGD

__all__ = [
    "TORCH_EQUIVALENTS",
    "MNCoreAdam",
    "MNCoreAdamW",
    "MNCoreOptimizer",
    "MNCoreSGD",
    "ParamGroup",
    "from_torch",
]
