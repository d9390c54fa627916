"""Optimizer conversion: torch.optim's to MN-Core's (`from_torch`), and to MLSDK's.

The device layer runs whatever optimizer it is given (on MLSDK: MLSDK's own); which
optimizer replaces a torch.optim one on each backend is decided here, in one table each.
"""

from __future__ import annotations

import functools
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
from .traced import TRACED_TORCH_OPTIMIZERS, MNCoreTracedOptimizer

# Exact types: a subclass of torch.optim.SGD may change the update rule.
TORCH_EQUIVALENTS: Mapping[type[Optimizer], type[MNCoreOptimizer]] = MappingProxyType(
    {torch.optim.SGD: MNCoreSGD, torch.optim.Adam: MNCoreAdam, torch.optim.AdamW: MNCoreAdamW}
)

# torch.optim options that only choose kernels (the math is the same): dropped, reset to
# the values our groups carry.
_IGNORED_OPTIONS = {"foreach": None, "fused": None, "capturable": False}


def from_torch(optimizer: Optimizer) -> MNCoreOptimizer:
    """Build the MN-Core equivalent of a torch.optim optimizer.

    SGD, Adam and AdamW become MNCoreSGD, MNCoreAdam and MNCoreAdamW. The other optimizers
    that a static step can run (`TRACED_TORCH_OPTIMIZERS`: RMSprop, Adagrad, Adadelta,
    Adamax, NAdam, RAdam, ASGD, Rprop, Adafactor) become an instance of their own class with
    `MNCoreTracedOptimizer` mixed in (named as theirs): torch's update, traced.

    The result has the same param groups (every key, extra ones such as "initial_lr"
    included), the same hyperparameters and a copy of the state, so training continues as
    it would have with `optimizer`. An MN-Core optimizer is returned as is.

    Options that only pick kernels (foreach, fused, capturable) are dropped (the traced
    optimizers keep them in their groups, for torch's state_dict layout, and override them
    while the step is traced); differentiable
    (gradients through the update) cannot be honoured and is refused with a ValueError.
    Other optimizers, including subclasses of these, are refused with a TypeError; LBFGS
    with one that says why (its step re-evaluates the closure a data-dependent number of times).
    """
    if isinstance(optimizer, MNCoreOptimizer):
        return optimizer
    target = TORCH_EQUIVALENTS.get(type(optimizer))
    if target is None and type(optimizer) in TRACED_TORCH_OPTIMIZERS:
        target = _in_place_class(type(optimizer), MNCoreTracedOptimizer)
    if target is None:
        raise TypeError(_refusal(type(optimizer)))
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
    if not isinstance(converted, MNCoreTracedOptimizer):  # traced ones keep torch's options
        for group in converted.param_groups:
            for key, value in _IGNORED_OPTIONS.items():
                if key in group:
                    group[key] = value
    return converted


def _supported() -> str:
    names = [*TORCH_EQUIVALENTS, *sorted(TRACED_TORCH_OPTIMIZERS, key=lambda t: t.__name__)]
    return ", ".join(f"torch.optim.{t.__name__}" for t in names)


def _refusal(cls: type[Optimizer]) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}"
    if issubclass(cls, torch.optim.LBFGS):
        return (
            f"cannot convert {name} to an MN-Core optimizer: LBFGS re-evaluates its closure "
            "(forward and backward) a data-dependent number of times per step (line search, "
            "convergence tests read on the host), which a static compiled step cannot do. "
            f"Use one of {_supported()}, or accelerator='cpu' for LBFGS."
        )
    return (
        f"cannot convert {name} to an MN-Core optimizer: supported optimizers are "
        f"{_supported()} (exact classes: a subclass may change the update)"
    )


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


def convert_in_place(optimizer: Optimizer) -> Optimizer:
    """Make a torch.optim optimizer compute as its MN-Core equivalent, in place.

    The object stays the user's: every reference to it (a scheduler the module keeps, a
    callback), `isinstance(optimizer, torch.optim.SGD)` and its class name (which
    LearningRateMonitor puts in its keys) are what they were. Its class becomes a subclass of
    both (`SGD(MNCoreSGD, torch.optim.SGD)`, `RMSprop(MNCoreTracedOptimizer,
    torch.optim.RMSprop)`, named as the original), and its param groups and state become
    those `from_torch` builds. An MN-Core optimizer is returned as is.
    """
    if isinstance(optimizer, MNCoreOptimizer):
        return optimizer
    converted = from_torch(optimizer)  # validates, and builds the groups and the eager state
    original = type(optimizer)
    scheduler_step = optimizer.__dict__.pop("step", None)  # an LR scheduler's wrapper of torch's
    optimizer.__class__ = _in_place_class(original, type(converted))
    optimizer.defaults = converted.defaults
    optimizer.param_groups = converted.param_groups
    optimizer.state = converted.state
    optimizer._patch_step_function()
    if getattr(scheduler_step, "_wrapped_by_lr_sched", False):
        track_step_calls(optimizer)  # the scheduler's wrapper called torch's step: wrap ours
    return optimizer


_IN_PLACE_CLASSES: dict[type[Optimizer], type[Optimizer]] = {}


def _in_place_class(original: type[Optimizer], ours: type[MNCoreOptimizer]) -> type[Optimizer]:
    """`class SGD(MNCoreSGD, torch.optim.SGD)`: our step and state, torch's name and type."""
    if issubclass(ours, original):  # already the in-place class (traced torch optimizers)
        return ours
    if original not in _IN_PLACE_CLASSES:
        _IN_PLACE_CLASSES[original] = type(
            original.__name__,
            (ours, original),
            {
                "__module__": __name__,
                "__qualname__": original.__qualname__,
                "__doc__": ours.__doc__,
            },
        )
    return _IN_PLACE_CLASSES[original]


def track_step_calls(optimizer: Optimizer) -> None:
    """What torch's LRScheduler does to its optimizer's step(): mark calls, so that it does not
    warn that step() was overridden or skipped."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True
    optimizer.step = tracked_step


def device_optimizer(context: Context, optimizer: Optimizer) -> Optimizer:
    """The optimizer that `context` runs for `optimizer`.

    On the emulator, `optimizer` itself, converted in place to compute as its MN-Core
    equivalent (`convert_in_place`); on MLSDK, MLSDK's own optimizer (`to_mlsdk_optimizer`:
    a new object, since MLSDK's classes are its own). Scripts that call it run unchanged on
    both backends.
    """
    if context.backend is Backend.MLSDK:
        return to_mlsdk_optimizer(optimizer, context.sdk)
    return convert_in_place(optimizer)


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
