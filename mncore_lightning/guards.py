"""The Python facts a compiled step was traced for, and how to say which one changed.

A step is traced once; what it depends on in Python is recorded here and compared at batch
boundaries: the module's structure (its parameters and buffers, their names, forward hooks and
parametrizations), which parameters are trainable and how the optimizers group them, which
optimizer options the update branched on (a zero weight decay, nesterov), which submodules are
frozen in another mode than the module (`backbone.eval()`), and the carried tensors
(carried_state.py). A change makes the strategy trace again, and the reason is reported in
these words.
"""

from __future__ import annotations

from typing import Any

import torch


def structure_of(module: torch.nn.Module, optimizers: list[Any]) -> dict[str, Any]:
    """The structural facts a traced step depends on, by name."""
    return {
        "tensors": tuple((n, id(t)) for n, t in module.named_parameters())
        + tuple((n, id(t)) for n, t in module.named_buffers()),
        "trainable parameters": tuple(n for n, p in module.named_parameters() if p.requires_grad),
        # relative to the root, which Lightning switches for evaluation and back
        "submodules not in the root's mode": tuple(
            n for n, m in module.named_modules() if m.training != module.training
        ),
        "forward hooks": sum(
            len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules()
        ),
        "optimizer param groups": tuple(
            tuple(id(p) for p in group["params"])
            for optimizer in optimizers
            for group in optimizer.param_groups
        ),
        "optimizer options": tuple(
            f"optimizer {i} group {j}: {option}"
            for i, optimizer in enumerate(optimizers)
            for j, group in enumerate(optimizer.param_groups)
            for option in _options(group)
        ),
    }


def _options(group: dict[str, Any]) -> list[str]:
    """What an optimizer's update branches on while it is traced: its flags (nesterov,
    maximize, amsgrad) and which numeric hyperparameters are zero (a term such as weight
    decay or momentum is left out of the graph when it is). Their values (other than zero)
    are graph inputs: changing them needs no new trace."""
    options = []
    for key, value in group.items():
        if isinstance(value, bool):
            options.append(f"{key}={value}")
        elif isinstance(value, (int, float)) and key not in ("lr", "initial_lr"):
            options.append(f"{key}{'=0' if value == 0 else '!=0'}")
    return sorted(options)


def describe_change(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Which facts changed, in words ("trainable parameters: + backbone.0.weight")."""
    parts = []
    for fact, old in before.items():
        new = after[fact]
        if new == old:
            continue
        if fact == "tensors":
            old, new = {n for n, _ in old}, {n for n, _ in new}
        if isinstance(old, (set, tuple)) and all(isinstance(x, str) for x in (*old, *new)):
            added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
            change = [f"+ {n}" for n in added] + [f"- {n}" for n in removed]
            parts.append(f"{fact}: {', '.join(change) or 'replaced'}")
        elif fact == "optimizer param groups":
            parts.append(f"{fact}: {len(old)} -> {len(new)} groups or their parameters")
        else:
            parts.append(f"{fact}: {old} -> {new}")
    return "; ".join(parts)


def carried_change(traced_for: tuple, now: tuple) -> str:
    """How a module's carried tensors differ from those a step was traced for."""
    old = {key: spec for key, *spec in traced_for}
    new = {key: spec for key, *spec in now}
    parts = [f"{key} appeared" for key in new if key not in old]
    parts += [f"{key} is no longer a tensor" for key in old if key not in new]
    parts += [
        f"{key} changed shape, dtype or structure"
        for key in new
        if key in old and old[key] != new[key]
    ]
    return "carried tensors changed: " + "; ".join(parts)
