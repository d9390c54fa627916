"""Tensors a step keeps on its modules between calls (`self.hidden = out.detach()`).

A compiled step is traced once. A plain tensor attribute of a module (not a parameter or a
buffer) that the step reads would be frozen into the graph at its trace-time value, and one
that the step assigns (an LSTM's carried hidden state, a counter `self.count = self.count + 1`,
the weight that a pruning hook recomputes before each forward) would keep its trace-time value
on the host. So every such attribute is carried as state: the graph takes its current value as
an input at each call and returns the new value of each one the step assigns or changes in
place, which is set on the host module after the call, as the Python step would have left it.
The same holds for the tensor attributes of plain Python objects a module holds (a tracker of
running totals, a SimpleNamespace, a dataclass): `self.tracker.total += loss.detach()`.

Which attributes exist, and their shapes and dtypes, are part of what a compiled step was
traced for (`signature`); when they change (None before the first step, a tensor after it), the
strategy traces the step again.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from .side_effects import is_metric

CARRY_PREFIX = "carry/"
_MISSING = object()

# nn.Module's own bookkeeping (its _buffers dict holds tensors, but they are registered
# state), and attributes of Lightning's own that hold tensors but are no state of the step.
_NOT_CARRIED = frozenset(vars(torch.nn.Module())) | {"_example_input_array"}


def _is_state_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)


def _tensor_tree(value: Any) -> tuple[list[torch.Tensor], TreeSpec] | None:
    """A tensor, or a tuple/dict (nested or not) of tensors (an LSTM's (h, c), running
    statistics by name): leaves and spec. Lists are not carried: appending to them is a side
    effect, replayed (side_effects).

    Checked for every attribute of every module when the carried signature is scanned, so
    the common cases (not a tensor, not a tuple or dict, an empty one) return before any
    flattening.
    """
    if isinstance(value, torch.Tensor):
        return ([value], tree_flatten(value)[1]) if _is_state_tensor(value) else None
    if type(value) not in (dict, tuple) or not value:
        return None
    leaves, spec = tree_flatten(value)
    if not all(_is_state_tensor(leaf) for leaf in leaves):
        return None
    return leaves, spec


# Classes of these packages, and the user's classes derived from them (the Trainer, a
# LightningDataModule, a Dataset, a Callback, functions), are no state of the user's step:
# only plain objects of the user's own classes are.
LIBRARY_PACKAGES = frozenset(
    {"builtins", "functools", "types", "torch", "torchmetrics", "numpy"}
    | {"lightning", "lightning_fabric", "pytorch_lightning", "mncore_lightning", "mncore_device"}
)
_plain_types: dict[type, bool] = {}


def _is_plain_object(value: Any) -> bool:
    """A plain Python object of the user's (its own `__dict__`, no base class from a
    library), or a SimpleNamespace."""
    cls = type(value)
    plain = _plain_types.get(cls)
    if plain is None:
        plain = cls is SimpleNamespace or (
            isinstance(getattr(value, "__dict__", None), dict)
            and all(
                base is object or base.__module__.partition(".")[0] not in LIBRARY_PACKAGES
                for base in cls.__mro__
            )
        )
        _plain_types[cls] = plain
    return plain


def state_owners(root: torch.nn.Module) -> list[tuple[str, Any]]:
    """(path, owner) for every module under `root` and every plain object one of them holds
    in an attribute: the objects whose tensor attributes a step may keep.

    torchmetrics' state tensors are not carried: metrics run on the host (side_effects)."""
    owners = []
    stack = [("", root)]
    while stack:
        path, module = stack.pop()
        if is_metric(module):
            continue
        owners.append((path, module))
        owners.extend(
            (f"{path}{name}.", value)
            for name, value in vars(module).items()
            if name not in _NOT_CARRIED and _is_plain_object(value)
        )
        stack.extend(
            (f"{path}{child_name}.", child)
            for child_name, child in module._modules.items()
            if child is not None
        )
    return owners


def tensor_attributes(root: torch.nn.Module) -> dict[str, tuple[Any, str, Any]]:
    """`{key: (owner, attribute, value)}` for every plain attribute of a module under `root`,
    or of a plain object one of them holds, that holds a tensor or a tuple or dict of tensors
    (not a parameter or a buffer)."""
    return {
        f"{CARRY_PREFIX}{path}{name}": (owner, name, value)
        for path, owner in state_owners(root)
        for name, value in vars(owner).items()
        if name not in _NOT_CARRIED and _tensor_tree(value) is not None
    }


def signature(root: torch.nn.Module) -> tuple:
    """What a trace depended on: the carried attributes, their structure, shapes and dtypes."""
    result = []
    for key, (_, _, value) in tensor_attributes(root).items():
        leaves, spec = _tensor_tree(value)
        result.append((key, spec, tuple((t.shape, t.dtype) for t in leaves)))
    return tuple(sorted(result, key=lambda entry: entry[0]))


class CarriedState:
    """The carried attributes of one compiled step: inputs before a call, replay after it."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.slots = tensor_attributes(root)
        self.signature = signature(root)
        # filled while tracing: what the step assigned, and the pytree spec of each value
        self.assigned: dict[str, tuple[torch.nn.Module, str, TreeSpec, int]] = {}
        self._bound: dict[str, tuple[Any, list[int]]] = {}

    def inputs(self) -> dict[str, torch.Tensor]:
        """The current host values, as graph inputs (one per tensor leaf)."""
        inputs = {}
        for key, (module, name, _) in self.slots.items():
            leaves, _ = tree_flatten(getattr(module, name))
            inputs.update((f"{key}/{i}", t) for i, t in enumerate(leaves))
        return inputs

    def bind(self, graph_inputs: Mapping[str, torch.Tensor]) -> None:
        """While tracing: the modules' attributes are the graph's inputs."""
        owners = [owner for _, owner in state_owners(self.root)]
        self._before = {id(owner): dict(vars(owner)) for owner in owners}
        # a dict the step fills in place (`self.stats["loss"] = ...`): its contents, to restore
        self._dict_contents = [
            (value, dict(value))
            for owner in owners
            for name, value in vars(owner).items()
            if type(value) is dict and name not in _NOT_CARRIED
        ]
        self._buffers = {
            (id(m), name): (m, name, b)
            for m in self.root.modules()
            for name, b in m._buffers.items()
            if b is not None
        }
        for key, (module, name, value) in self.slots.items():
            leaves, spec = tree_flatten(value)
            bound = tree_unflatten([graph_inputs[f"{key}/{i}"] for i in range(len(leaves))], spec)
            object.__setattr__(module, name, bound)
            self._bound[key] = (bound, [(t, t._version) for t in tree_flatten(bound)[0]])

    def capture(self) -> dict[str, torch.Tensor]:
        """While tracing, after the step: the attributes it assigned or changed in place.

        A registered buffer that the step reassigns (`self.ema = 0.9 * self.ema + ...`) keeps
        its tensor, which the device knows: the new value is copied into it, an update of
        device state like any other.
        """
        for module, name, original in self._buffers.values():
            value = module._buffers.get(name)
            if value is not original and isinstance(value, torch.Tensor):
                with torch.no_grad():
                    original.copy_(value)
                module._buffers[name] = original
        outputs = {}
        for key, (module, name, value) in tensor_attributes(self.root).items():
            leaves, spec = tree_flatten(value)
            bound = self._bound.get(key)
            if bound is not None and value is bound[0] and len(leaves) == len(bound[1]):
                # the same container: unchanged only if it holds the same tensors, unchanged
                # (`self.stats["sum"] = self.stats["sum"] + x` replaces a leaf)
                same = zip(leaves, bound[1], strict=True)
                if all(t is old and t._version == v for t, (old, v) in same):
                    continue
            self.assigned[key] = (module, name, spec, len(leaves))
            outputs.update((f"{key}/{i}", t.detach()) for i, t in enumerate(leaves))
        return outputs

    def restore(self) -> None:
        """After tracing: the trace was no step; the attributes get their values back."""
        for container, contents in self._dict_contents:  # tensors put into dicts
            for key in [*container.keys() - contents.keys(), *contents]:
                old, new = contents.get(key, _MISSING), container.get(key, _MISSING)
                if old is not new and (_is_state_tensor(old) or _is_state_tensor(new)):
                    if old is _MISSING:
                        del container[key]
                    else:
                        container[key] = old
        for module, name, _, _ in self.assigned.values():
            before = self._before[id(module)]
            if name in before:
                object.__setattr__(module, name, before[name])
            else:
                delattr(module, name)
        for module, name, value in self.slots.values():
            object.__setattr__(module, name, value)

    def replay(self, outputs: Mapping[str, torch.Tensor]) -> None:
        """After a call: the host modules hold what the step assigned."""
        for key, (module, name, spec, n) in self.assigned.items():
            value = tree_unflatten([outputs[f"{key}/{i}"] for i in range(n)], spec)
            object.__setattr__(module, name, value)
