"""Optimizer conversion: torch.optim's to MN-Core's (`from_torch`), and to MLSDK's.

The device layer runs whatever optimizer it is given (on MLSDK: MLSDK's own); which
optimizer replaces a torch.optim one on each backend is decided here, in one table each.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import MappingProxyType, ModuleType
from typing import Any

import torch
from torch.optim import Optimizer

from mncore_device import Backend, Context
from mncore_device.mlsdk_backend import import_mlsdk, mlsdk_optimizer_classes

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


# --- MLSDK's optimizers -------------------------------------------------------------------

# What MLSDK's optimizer of each family takes, and torch options it has no equivalent for.
_MLSDK_FAMILIES: Mapping[type[Optimizer], tuple[str, tuple[str, ...], tuple[str, ...]]] = (
    MappingProxyType(
        {
            torch.optim.SGD: (
                "MNCoreSGD",
                ("lr", "momentum", "dampening", "weight_decay"),
                ("nesterov", "maximize", "differentiable"),
            ),
            torch.optim.Adam: (
                "MNCoreAdam",
                ("lr", "betas", "eps", "weight_decay"),
                ("amsgrad", "maximize", "differentiable"),
            ),
            torch.optim.AdamW: (
                "MNCoreAdamW",
                ("lr", "betas", "eps", "weight_decay"),
                ("amsgrad", "maximize", "differentiable"),
            ),
        }
    )
)
_TORCH_OF = {ours: theirs for theirs, ours in TORCH_EQUIVALENTS.items()}


def device_optimizer(context: Context, optimizer: Optimizer) -> Optimizer:
    """The optimizer that `context` runs in place of `optimizer`.

    On the emulator, the MN-Core equivalent (`from_torch`); on MLSDK, MLSDK's own optimizer
    (`to_mlsdk_optimizer`). Scripts that call it run unchanged on both backends.
    """
    if context.backend is Backend.MLSDK:
        return to_mlsdk_optimizer(optimizer, context.sdk)
    return from_torch(optimizer)


def to_mlsdk_optimizer(optimizer: Optimizer, sdk: ModuleType | None = None) -> Optimizer:
    """MLSDK's optimizer (`mlsdk.MNCoreSGD`, `MNCoreAdam`, `MNCoreAdamW`) equivalent to a
    torch.optim SGD/Adam/AdamW or an MN-Core optimizer of this package.

    Same params, param groups and hyperparameters (extra group keys such as "initial_lr" are
    kept); state, if any, is loaded through load_state_dict. An MLSDK optimizer is returned as
    is. Options that MLSDK's optimizers do not document (nesterov, amsgrad, maximize) raise.
    """
    sdk = sdk or import_mlsdk()
    mlsdk_classes = mlsdk_optimizer_classes(sdk)
    if mlsdk_classes and isinstance(optimizer, mlsdk_classes):
        return optimizer
    family = _family(optimizer)
    class_name, keys, unsupported = _MLSDK_FAMILIES[family]
    for group in optimizer.param_groups:
        for option in unsupported:
            if group.get(option):
                raise ValueError(
                    f"cannot convert {type(optimizer).__name__}({option}=True) to "
                    f"mlsdk.{class_name}: MLSDK's optimizer has no such option"
                )
    groups = [
        {"params": list(g["params"]), **{k: _number(g[k]) for k in keys}}
        for g in optimizer.param_groups
    ]
    target = getattr(sdk, class_name)
    if len(groups) == 1:
        converted = target(groups[0].pop("params"), **groups[0])
    else:
        converted = target(groups, **{k: _number(optimizer.defaults[k]) for k in keys})
    for new, old in zip(converted.param_groups, optimizer.param_groups, strict=True):
        for key, value in old.items():
            if key not in new:
                new[key] = value
    state = optimizer.state_dict()["state"]
    if state:
        state_dict = converted.state_dict()
        state_dict["state"] = state
        converted.load_state_dict(state_dict)
    return converted


def _family(optimizer: Optimizer) -> type[Optimizer]:
    """torch.optim.SGD, Adam or AdamW; exact types only: a subclass may change the update."""
    kind = _TORCH_OF.get(type(optimizer), type(optimizer))
    if kind is torch.optim.Adam and optimizer.defaults.get("decoupled_weight_decay", False):
        return torch.optim.AdamW
    if kind not in _MLSDK_FAMILIES:
        raise TypeError(
            f"cannot convert {type(optimizer).__module__}.{type(optimizer).__qualname__} to an "
            "MLSDK optimizer: supported are torch.optim.SGD, Adam, AdamW and the MN-Core "
            "optimizers MNCoreSGD, MNCoreAdam, MNCoreAdamW"
        )
    return kind


def _number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return tuple(_number(v) for v in value)
    return value
