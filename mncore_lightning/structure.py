"""The module's and optimizers' structure the device state was registered for, and how to
say what changed.

Registration follows the module: its parameters and buffers (their names, identities,
parametrizations), which are trainable and how the optimizers group them. The update, this
package's code traced into each training graph, branches on optimizer options (a zero weight
decay, nesterov) that Dynamo never reads, and a frozen submodule's mode decides which of
its ops the graph holds. They are compared after each user hook (a callback pruning or
unfreezing layers); a change re-registers the module and compiles its steps again, and the
reason is reported in these words.
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
