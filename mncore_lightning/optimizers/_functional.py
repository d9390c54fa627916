"""The update rules, as functions over tensors (cf. torch.optim.sgd.sgd / adam.adam).

They are written to be traced once by make_fx and replayed: every number comes from a
tensor (hyperparameters are 0-d tensors, Adam's step count is a tensor), nothing reads a
value back to the host, and all updates are in place on params and state. The only Python
decisions are structural ones (is there momentum, weight decay, AMSGrad), fixed at trace
time. Call them under `torch.no_grad()`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sgd(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    steps: list[Tensor],
    *,
    lr: Tensor,
    momentum: Tensor | None,
    one_minus_dampening: Tensor,
    weight_decay: Tensor | None,
    nesterov: bool,
    maximize: bool,
) -> None:
    """SGD as torch.optim.SGD computes it; `momentum=None` / `weight_decay=None`: no term.

    torch starts a momentum buffer as an undampened copy of the first gradient. Here the
    buffer exists from the start, filled with zeros, and `steps` (one 0-d counter per
    param) tells the first update: `0 * momentum + 1 * grad` is then exactly torch's copy.
    """
    for i, param in enumerate(params):
        grad = grads[i].neg() if maximize else grads[i]
        if weight_decay is not None:
            grad = grad.addcmul(param, weight_decay)
        if momentum is not None:
            buf, step = momentum_buffers[i], steps[i]
            scale = torch.where(step > 0, one_minus_dampening, 1.0)
            buf.mul_(momentum).addcmul_(grad, scale)
            step.add_(1)
            grad = grad.addcmul(buf, momentum) if nesterov else buf
        param.addcmul_(grad, lr, value=-1)


def adam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    one_minus_beta1: Tensor,
    one_minus_beta2: Tensor,
    eps: Tensor,
    weight_decay: Tensor | None,
    decay: Tensor | None,
    amsgrad: bool,
    maximize: bool,
) -> None:
    """Adam / AdamW as torch.optim.Adam computes it (its default, single-tensor path).

    `weight_decay` adds an L2 term to the gradient (Adam); `decay` multiplies the params by
    `1 - lr * weight_decay` first (AdamW); None skips either. The bias corrections come from
    the step tensor, not from a Python int; with float64 hyperparameter tensors they are
    computed in double, exactly as torch computes them in Python.
    """
    for i, param in enumerate(params):
        grad = grads[i].neg() if maximize else grads[i]
        exp_avg, exp_avg_sq, step = exp_avgs[i], exp_avg_sqs[i], steps[i]
        step.add_(1)
        if decay is not None:
            param.mul_(decay)
        if weight_decay is not None:
            grad = grad.addcmul(param, weight_decay)
        exp_avg.lerp_(grad, one_minus_beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad * one_minus_beta2)

        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2.sqrt()
        if amsgrad:
            max_exp_avg_sqs[i].copy_(torch.maximum(max_exp_avg_sqs[i], exp_avg_sq))
            second_moment = max_exp_avg_sqs[i]
        else:
            second_moment = exp_avg_sq
        denom = (second_moment.sqrt() / bias_correction2_sqrt).add_(eps)
        # torch: param.addcdiv_(exp_avg, denom, value=-step_size); `value` must be a number.
        param.addcdiv_(exp_avg * step_size.neg(), denom)
