"""Tensor names: how a Context tells tensors, and several models, apart.

Names follow MLSDK's form `<prefix>@<path>`, e.g. `model@linear1/weight`. They live in a
weak identity map, so naming never changes a tensor or keeps it alive.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

_names: WeakIdKeyDictionary = WeakIdKeyDictionary()
_optimizer_prefixes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_tensor_name(tensor: torch.Tensor, name: str) -> None:
    """Give `tensor` the device name `name`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"set_tensor_name expects a torch.Tensor, got {type(tensor).__name__}")
    if not name or not isinstance(name, str):
        raise ValueError(f"a tensor name must be a non-empty string, got {name!r}")
    _names[tensor] = name


def get_tensor_name(tensor: torch.Tensor) -> str | None:
    """The device name of `tensor`, or None when it has none."""
    return _names.get(tensor)


def set_tensor_name_in_module(module: torch.nn.Module, prefix: str) -> None:
    """Name every parameter and buffer of `module` as `<prefix>@<dotted/path>`."""
    for qualname, tensor in _module_tensors(module):
        set_tensor_name(tensor, f"{prefix}@{qualname.replace('.', '/')}")


def set_buffer_name_in_optimizer(optimizer: torch.optim.Optimizer, prefix: str) -> None:
    """Name the optimizer's state tensors `<prefix>@<param name>/<state key>`.

    The prefix is remembered, so state that appears later is named on registration.
    """
    _optimizer_prefixes[optimizer] = prefix
    name_optimizer_state(optimizer)


def optimizer_name_prefix(optimizer: torch.optim.Optimizer) -> str | None:
    """The prefix given to `set_buffer_name_in_optimizer(optimizer, prefix)`, if any."""
    return _optimizer_prefixes.get(optimizer)


def name_optimizer_state(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Name (if needed) and return every tensor in `optimizer.state`, in a stable order."""
    prefix = _optimizer_prefixes.get(optimizer)
    if prefix is None:
        raise ValueError(
            "the optimizer's buffers have no names: call "
            "set_buffer_name_in_optimizer(optimizer, 'optimizer') before registering them"
        )
    named = []
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            param_name = get_tensor_name(param)
            base = param_name.replace("@", "/") if param_name else f"param{index}"
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    name = get_tensor_name(value) or f"{prefix}@{base}/{key}"
                    set_tensor_name(value, name)
                    named.append((name, value))
            index += 1
    return named


def _module_tensors(module: torch.nn.Module):
    yield from module.named_parameters(remove_duplicate=True)
    yield from module.named_buffers(remove_duplicate=True)
