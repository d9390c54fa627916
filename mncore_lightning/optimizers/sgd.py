"""MNCoreSGD: torch.optim.SGD, traceable into a static MN-Core step."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from . import _functional as F
from ._base import DEFAULT_LR, MNCoreOptimizer, check_hyperparameter, resolve_alias


def sgd_coefficients(group: Mapping[str, Any]) -> dict[str, float]:
    """The tensors MNCoreSGD's step reads, computed from a param group's floats."""
    return {
        "lr": float(group["lr"]),
        "momentum": float(group["momentum"]),
        "one_minus_dampening": 1.0 - group["dampening"],
        "weight_decay": float(group["weight_decay"]),
    }


class MNCoreSGD(MNCoreOptimizer):
    """Stochastic gradient descent (optionally with momentum), as torch.optim.SGD.

    Same arguments, in the same order, and the same results. MLSDK's `learning_rate=` is
    accepted for `lr`. Unlike torch.optim.SGD, the momentum buffers exist from construction
    (zeros), so a device can register them before the first step.

    Each buffer comes with a per-param step counter, `state[p]["step"]` (0-d float32), which
    makes the first update copy the gradient undampened, as torch does. It lives in
    `optimizer.state`, so a device registers and updates it with the buffer, but
    torch.optim.SGD has no such entry: `state_dict()` leaves it out, and also leaves out the
    buffers of params that never stepped (torch has none for them). `load_state_dict()`
    restores it: a loaded buffer means "has stepped". A checkpoint therefore moves either
    way between MNCoreSGD and torch.optim.SGD and training continues identically.
    """

    _coefficients = staticmethod(sgd_coefficients)

    def __init__(
        self,
        params: ParamsT,
        lr: float = DEFAULT_LR,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        learning_rate: float | None = None,
    ) -> None:
        lr = resolve_alias("lr", lr, DEFAULT_LR, "learning_rate", learning_rate)
        defaults = {
            "lr": check_hyperparameter("learning rate", lr),
            "momentum": check_hyperparameter("momentum value", momentum),
            "dampening": float(dampening),
            "weight_decay": check_hyperparameter("weight_decay value", weight_decay),
            "nesterov": nesterov,
            "maximize": maximize,
            # Kept only so that state_dict() matches torch.optim.SGD key for key.
            "foreach": None,
            "differentiable": False,
            "fused": None,
        }
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, defaults)

    def _init_state(self, param: Tensor, group: Mapping[str, Any]) -> None:
        if group["momentum"] == 0:
            return  # no state, as torch.optim.SGD; do not even create an empty entry
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)

    def _export_state(self, state: dict[str, Any]) -> dict[str, Any]:
        exported = {k: v for k, v in state.items() if k != "step"}
        step = state.get("step")
        if isinstance(step, Tensor) and step.item() == 0:
            exported.pop("momentum_buffer", None)  # never stepped: torch has no buffer yet
        return exported

    def _import_state(self, param: Tensor, loaded: dict[str, Any]) -> dict[str, Any]:
        if "step" not in loaded and isinstance(loaded.get("momentum_buffer"), Tensor):
            loaded["step"] = torch.ones((), dtype=torch.float32, device=param.device)
        return loaded

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimization step (traceable: see `_functional`)."""
        loss = self._evaluate_closure(closure)
        for group in self.param_groups:
            params = self._params_with_grad(group)
            has_momentum = group["momentum"] != 0
            states = [self.state[p] for p in params] if has_momentum else []
            t = group.tensors
            F.sgd(
                params,
                [p.grad for p in params],
                [s["momentum_buffer"] for s in states],
                [s["step"] for s in states],
                lr=t["lr"],
                momentum=t["momentum"] if has_momentum else None,
                one_minus_dampening=t["one_minus_dampening"],
                weight_decay=t["weight_decay"] if group["weight_decay"] != 0 else None,
                nesterov=group["nesterov"],
                maximize=group["maximize"],
            )
        return loss
