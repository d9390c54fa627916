"""`from_torch`: the MN-Core equivalent of a torch.optim optimizer."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch.optim import Optimizer

from ._base import MNCoreOptimizer
from .adam import MNCoreAdam, MNCoreAdamW
from .sgd import MNCoreSGD

# Exact types: a subclass of torch.optim.SGD may change the update rule.
TORCH_EQUIVALENTS: Mapping[type[Optimizer], type[MNCoreOptimizer]] = MappingProxyType(
    {torch.optim.SGD: MNCoreSGD, torch.optim.Adam: MNCoreAdam, torch.optim.AdamW: MNCoreAdamW}
)

# torch.optim options that only choose kernels (the math is the same): dropped, reset to
# the values our groups carry.
_IGNORED_OPTIONS = {"foreach": None, "fused": None, "capturable": False}


def from_torch(optimizer: Optimizer) -> MNCoreOptimizer:
    """Build the MN-Core equivalent of a torch.optim SGD, Adam or AdamW.

    The result has the same param groups (every key, extra ones such as "initial_lr"
    included), the same hyperparameters and a copy of the state, so training continues as
    it would have with `optimizer`. An MN-Core optimizer is returned as is.

    Options that only pick kernels (foreach, fused, capturable) are dropped; differentiable
    (gradients through the update) cannot be honoured and is refused with a ValueError.
    Other optimizers, including subclasses of these three, are refused with a TypeError.
    """
    if isinstance(optimizer, MNCoreOptimizer):
        return optimizer
    target = TORCH_EQUIVALENTS.get(type(optimizer))
    if target is None:
        supported = ", ".join(f"torch.optim.{t.__name__}" for t in TORCH_EQUIVALENTS)
        raise TypeError(
            f"cannot convert {type(optimizer).__module__}.{type(optimizer).__qualname__} to an "
            f"MN-Core optimizer: supported optimizers are {supported}"
        )
    for group in (optimizer.defaults, *optimizer.param_groups):
        if group.get("differentiable"):
            raise ValueError(
                f"cannot convert {type(optimizer).__name__}(differentiable=True): MN-Core "
                "optimizers update parameters outside autograd"
            )
    accepted = inspect.signature(target).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [{**group, "params": list(group["params"])} for group in optimizer.param_groups]
    converted = target(groups, **kwargs)
    converted.load_state_dict(optimizer.state_dict())  # copies: nothing is shared
    for group in converted.param_groups:
        for key, value in _IGNORED_OPTIONS.items():
            if key in group:
                group[key] = value
    return converted
