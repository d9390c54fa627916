"""`context.registry.register(name, obj)`: MLSDK's one-call naming and registration.

A module's parameters and buffers are named `<name>@<path>` and registered; an optimizer's
state is named `<name>@...` and registered. An optimizer whose state torch.optim creates
lazily (torch.optim.SGD with momentum, Adam) cannot be registered as it is; a converter
installed with `set_optimizer_converter` makes it one the context can run (the MN-Core
optimizers package installs its `device_optimizer`: on the emulator the same object,
converted in place; on MLSDK, MLSDK's own optimizer), and `compile(optimizers=[...])` then
runs that optimizer in place of the original.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .naming import set_buffer_name_in_optimizer, set_tensor_name_in_module

if TYPE_CHECKING:
    from .context import Context

OptimizerConverter = Callable[["Context", torch.optim.Optimizer], torch.optim.Optimizer]
_converter: list[OptimizerConverter | None] = [None]
# original optimizer -> the optimizer the device runs in its place
_replacements: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_optimizer_converter(converter: OptimizerConverter | None) -> None:
    """Install `converter(context, optimizer)`, which returns the optimizer `context` runs
    for a registered `optimizer` (None: register optimizers as they are)."""
    _converter[0] = converter


def device_optimizer_for(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer the device runs for `optimizer` (itself unless registry replaced it)."""
    return _replacements.get(optimizer, optimizer)


class Registry:
    """Registration by name, for one Context."""

    def __init__(self, context: Context) -> None:
        self._context = context

    def register(self, name: str, obj: torch.nn.Module | torch.optim.Optimizer) -> None:
        """Name `obj` with prefix `name` and register its tensors in the context."""
        if isinstance(obj, torch.nn.Module):
            set_tensor_name_in_module(obj, name)
            for param in obj.parameters():
                self._context.register_param(param)
            for buffer in obj.buffers():
                self._context.register_buffer(buffer)
        elif isinstance(obj, torch.optim.Optimizer):
            converter = _converter[0]
            device_optimizer = converter(self._context, obj) if converter is not None else obj
            if device_optimizer is not obj:
                _replacements[obj] = device_optimizer
            set_buffer_name_in_optimizer(device_optimizer, name)
            self._context.register_optimizer_buffers(device_optimizer)
        else:
            raise TypeError(
                f"registry.register({name!r}, ...): expected a torch.nn.Module or a "
                f"torch.optim.Optimizer, got {type(obj).__name__}"
            )
