"""Tensors a step keeps on its modules between calls (`self.hidden = out.detach()`).

A compiled step is traced once. A plain tensor attribute of a module (not a parameter or a
buffer) that the step reads would be frozen into the graph at its trace-time value, and one
that the step assigns (an LSTM's carried hidden state, a counter `self.count = self.count + 1`,
the weight that a pruning hook recomputes before each forward) would keep its trace-time value
on the host. So every such attribute is carried as state: the graph takes its current value as
an input at each call and returns the new value of each one the step assigns or changes in
place, which is set on the host module after the call, as the Python step would have left it.

Which attributes exist, and their shapes and dtypes, are part of what a compiled step was
traced for (`signature`); when they change (None before the first step, a tensor after it), the
strategy traces the step again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

CARRY_PREFIX = "carry/"

# Attributes of Lightning's own that hold tensors but are no state of the step.
_NOT_CARRIED = frozenset({"_example_input_array"})


def tensor_attributes(root: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, Any]]:
    """`{key: (module, attribute, value)}` for every plain tensor attribute under `root`."""
    found = {}
    for path, module in root.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and name not in _NOT_CARRIED:
                if isinstance(value, torch.nn.Parameter):
                    continue
                found[f"{CARRY_PREFIX}{path}{'.' if path else ''}{name}"] = (module, name, value)
    return found


def signature(root: torch.nn.Module) -> tuple:
    """What a trace depended on: the carried attributes, their shapes and dtypes."""
    return tuple(
        (key, tuple(value.shape), value.dtype)
        for key, (_, _, value) in tensor_attributes(root).items()
    )


class CarriedState:
    """The carried attributes of one compiled step: inputs before a call, replay after it."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.slots = tensor_attributes(root)
        self.signature = signature(root)
        self.assigned: dict[str, tuple[torch.nn.Module, str]] = {}  # filled while tracing
        self._bound: dict[str, tuple[torch.Tensor, int]] = {}

    def inputs(self) -> dict[str, torch.Tensor]:
        """The current host values, as graph inputs."""
        return {key: getattr(module, name) for key, (module, name, _) in self.slots.items()}

    def bind(self, graph_inputs: Mapping[str, torch.Tensor]) -> None:
        """While tracing: the modules' attributes are the graph's inputs."""
        self._before = {id(m): (m, dict(vars(m))) for m in self.root.modules()}
        for key, (module, name, _) in self.slots.items():
            value = graph_inputs[key]
            setattr(module, name, value)
            self._bound[key] = (value, value._version)

    def capture(self) -> dict[str, torch.Tensor]:
        """While tracing, after the step: the attributes it assigned or changed in place."""
        outputs = {}
        for key, (module, name, value) in tensor_attributes(self.root).items():
            bound = self._bound.get(key)
            if bound is not None and value is bound[0] and value._version == bound[1]:
                continue
            self.assigned[key] = (module, name)
            outputs[key] = value.detach()
        return outputs

    def restore(self) -> None:
        """After tracing: the trace was no step; the attributes get their values back."""
        for module, name in self.assigned.values():
            before = self._before[id(module)][1]
            if name in before:
                setattr(module, name, before[name])
            else:
                delattr(module, name)
        for module, name, value in self.slots.values():
            setattr(module, name, value)

    def replay(self, outputs: Mapping[str, torch.Tensor]) -> None:
        """After a call: the host modules hold what the step assigned."""
        for key, (module, name) in self.assigned.items():
            setattr(module, name, outputs[key])
