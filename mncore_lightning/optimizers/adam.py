"""MNCoreAdam and MNCoreAdamW: torch.optim.Adam / AdamW, traceable into a static MN-Core step."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from . import _functional as F
from ._base import (
    DEFAULT_BETAS,
    DEFAULT_LR,
    MNCoreOptimizer,
    check_hyperparameter,
    resolve_alias,
)

DEFAULT_EPS = 1e-8


def adam_coefficients(group: Mapping[str, Any]) -> dict[str, float]:
    """The tensors MNCoreAdam's step reads, computed from a param group's floats."""
    lr, (beta1, beta2), weight_decay = group["lr"], group["betas"], group["weight_decay"]
    return {
        "lr": float(lr),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "one_minus_beta1": 1.0 - beta1,
        "one_minus_beta2": 1.0 - beta2,
        "eps": float(group["eps"]),
        "weight_decay": float(weight_decay),
        "decay": 1.0 - lr * weight_decay,  # AdamW's decoupled decay factor
    }


class MNCoreAdam(MNCoreOptimizer):
    """Adam, as torch.optim.Adam: same arguments in the same order, same results.

    MLSDK's `learning_rate=`, `beta1=` and `beta2=` are accepted for `lr` and `betas`, and
    so are the Chainer-style names MLSDK's examples pass: `alpha=` (beta1), `beta=` (beta2),
    `epsilon=` (eps) and `norm_coefficient=` (weight_decay). `chainer_use_torch` chooses
    MLSDK's implementation: True is torch's update, which is the one this class computes;
    False (Chainer's, where eps is added before the bias correction) warns that torch's
    update runs instead.
    The state (`step`, a 0-d float32 tensor as torch stores it, `exp_avg`, `exp_avg_sq`,
    and `max_exp_avg_sq` with AMSGrad) exists from construction, filled as torch.optim
    would fill it lazily, so a device can register it before the first step.
    `decoupled_weight_decay=True` makes it AdamW, as in torch.optim.Adam.
    """

    _coefficients = staticmethod(adam_coefficients)

    def _rate_dependent(self, group: Any, lr: Tensor) -> dict[str, Tensor]:
        return {"lr": lr, "decay": 1.0 - lr * group.tensors["weight_decay"]}

    def __init__(
        self,
        params: ParamsT,
        lr: float = DEFAULT_LR,
        betas: tuple[float, float] = DEFAULT_BETAS,
        eps: float = DEFAULT_EPS,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
        learning_rate: float | None = None,
        beta1: float | None = None,
        beta2: float | None = None,
        alpha: float | None = None,
        beta: float | None = None,
        epsilon: float | None = None,
        norm_coefficient: float | None = None,
        chainer_use_torch: bool = True,
    ) -> None:
        lr = resolve_alias("lr", lr, DEFAULT_LR, "learning_rate", learning_rate)
        beta1 = resolve_alias("beta1", beta1, None, "alpha", alpha)
        beta2 = resolve_alias("beta2", beta2, None, "beta", beta)
        eps = resolve_alias("eps", eps, DEFAULT_EPS, "epsilon", epsilon)
        weight_decay = resolve_alias(
            "weight_decay", weight_decay, 0, "norm_coefficient", norm_coefficient
        )
        if not chainer_use_torch:
            warnings.warn(
                "MNCoreAdam(chainer_use_torch=False): MLSDK's Chainer-style Adam is not "
                "emulated; torch.optim.Adam's update (eps after the bias correction) runs",
                UserWarning,
                stacklevel=2,
            )
        if beta1 is not None or beta2 is not None:
            if betas is not DEFAULT_BETAS:
                raise TypeError("got both 'betas' and its aliases 'beta1'/'beta2': give only one")
            betas = (betas[0] if beta1 is None else beta1, betas[1] if beta2 is None else beta2)
        defaults = {
            "lr": check_hyperparameter("learning rate", lr),
            "betas": (
                check_hyperparameter("beta parameter at index 0", betas[0], below=1.0),
                check_hyperparameter("beta parameter at index 1", betas[1], below=1.0),
            ),
            "eps": check_hyperparameter("epsilon value", eps),
            "weight_decay": check_hyperparameter("weight_decay value", weight_decay),
            "amsgrad": amsgrad,
            "maximize": maximize,
            # Kept only so that state_dict() matches torch.optim.Adam key for key.
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        super().__init__(params, defaults)

    def _init_state(self, param: Tensor, group: Mapping[str, Any]) -> None:
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        for key in keys:
            if key not in state:
                state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimization step (traceable: see `_functional`)."""
        loss = self._evaluate_closure(closure)
        for group in self.param_groups:
            params = self._params_with_grad(group)
            states = [self.state[p] for p in params]
            amsgrad = group["amsgrad"]
            has_decay = group["weight_decay"] != 0
            decoupled = group["decoupled_weight_decay"]
            t = group.tensors
            F.adam(
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
                [s["step"] for s in states],
                lr=t["lr"],
                beta1=t["beta1"],
                beta2=t["beta2"],
                one_minus_beta1=t["one_minus_beta1"],
                one_minus_beta2=t["one_minus_beta2"],
                eps=t["eps"],
                weight_decay=t["weight_decay"] if has_decay and not decoupled else None,
                decay=t["decay"] if has_decay and decoupled else None,
                amsgrad=amsgrad,
                maximize=group["maximize"],
            )
        return loss


class MNCoreAdamW(MNCoreAdam):
    """AdamW (decoupled weight decay), as torch.optim.AdamW: weight_decay defaults to 1e-2."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = DEFAULT_LR,
        betas: tuple[float, float] = DEFAULT_BETAS,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        learning_rate: float | None = None,
        beta1: float | None = None,
        beta2: float | None = None,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            decoupled_weight_decay=True,
            learning_rate=learning_rate,
            beta1=beta1,
            beta2=beta2,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        # As torch.optim.AdamW: whatever state is loaded, the decay stays decoupled.
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
