"""SyncBatchNorm inside a traced data-parallel step, with torch's functional collectives.

torch's SyncBatchNorm runs on GPUs only, and its collectives (`dist.all_gather`,
`dist.all_reduce`) are not ones a traced graph can hold. While MNCoreDDPStrategy traces a step,
each SyncBatchNorm's forward is replaced by `_forward` below: in training mode with more than
one rank it normalizes with the statistics of the global batch and its backward reduces
sum(dy) and sum(dy * (x - mean)) across ranks, as torch's does; otherwise it is BatchNorm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.nn.modules.batchnorm import _BatchNorm


@contextlib.contextmanager
def traced_sync_batchnorm(model: torch.nn.Module) -> Iterator[None]:
    """While tracing, every SyncBatchNorm of `model` runs `_forward` (an instance attribute,
    removed afterwards: the user's module is unchanged outside the trace)."""
    modules = [m for m in model.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    before = [m.__dict__.get("forward") for m in modules]
    for module in modules:
        module.forward = _forward.__get__(module)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module, forward in zip(modules, before, strict=True):
            del module.forward
            if forward is not None:
                module.forward = forward


def _forward(self: torch.nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
    """SyncBatchNorm.forward with the synchronization traceable on any device."""
    group = self.process_group or dist.group.WORLD
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    if not self.training or world_size == 1:
        return _BatchNorm.forward(self, input)  # eval, or one rank: BatchNorm
    self._check_input_dim(input)
    self._check_non_zero_input_channels(input)
    running_mean = self.running_mean if self.track_running_stats else None
    running_var = self.running_var if self.track_running_stats else None
    momentum: float | torch.Tensor = 0.0 if self.momentum is None else self.momentum
    if self.track_running_stats:
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average: a tensor, read in the graph
            momentum = 1.0 / self.num_batches_tracked
    mean, invstd, count = _global_statistics(
        input, running_mean, running_var, momentum, self.eps, group
    )
    return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean, invstd, count, group)


def _channels_view(input: torch.Tensor) -> tuple[list[int], list[int]]:
    """The dimensions reduced over (all but the channels), and the shape that broadcasts a
    per-channel vector against `input`."""
    dims = [d for d in range(input.dim()) if d != 1]
    shape = [1] * input.dim()
    shape[1] = input.shape[1]
    return dims, shape


@torch.no_grad()
def _global_statistics(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float | torch.Tensor,
    eps: float,
    group: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, 1/std and element count per channel over every rank's batch; updates the running
    statistics with the global mean and unbiased variance, as torch's SyncBatchNorm does.

    Each rank contributes its count, mean and sum of squared deviations from its own mean
    (gathered with one functional all_gather), combined as in Chan et al.'s parallel variance:
    stable where a raw sum of squares would cancel, and any per-rank batch size works.
    """
    dims, shape = _channels_view(input)
    x = input.float()
    channels = input.shape[1]
    count = torch.full((1,), input.numel() // channels, dtype=torch.float32, device=x.device)
    mean = x.mean(dims)
    m2 = (x - mean.view(shape)).square().sum(dims)
    local = torch.cat([count, mean, m2])
    gathered = funcol.wait_tensor(funcol.all_gather_single(local, 0, group))
    counts, means, m2s = gathered.view(-1, 2 * channels + 1).split([1, channels, channels], 1)
    total = counts.sum()
    global_mean = (counts * means).sum(0) / total
    global_m2 = m2s.sum(0) + (counts * (means - global_mean).square()).sum(0)
    invstd = torch.rsqrt(global_m2 / total + eps)
    if running_mean is not None and running_var is not None:
        unbiased = global_m2 / (total - 1)
        running_mean.copy_(running_mean * (1 - momentum) + global_mean * momentum)
        running_var.copy_(running_var * (1 - momentum) + unbiased * momentum)
    return global_mean, invstd, total


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = (x - mean) * invstd * weight + bias with the global `mean`/`invstd`; backward
    all-reduces sum(dy) and sum(dy * (x - mean)) so that the input gradient accounts for every
    rank's outputs (torch's SyncBatchNorm backward). The weight and bias gradients stay local:
    the gradient all-reduce of the step averages them with the others."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        count: torch.Tensor,
        group: Any,
    ) -> torch.Tensor:
        _, shape = _channels_view(input)
        out = (input.float() - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.float().view(shape)
        if bias is not None:
            out = out + bias.float().view(shape)
        ctx.save_for_backward(input, weight, mean, invstd, count)
        ctx.group = group
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, mean, invstd, count = ctx.saved_tensors
        dims, shape = _channels_view(input)
        dy = grad_output.float()
        xmu = input.float() - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            channels = sum_dy.shape[0]
            combined = funcol.wait_tensor(
                funcol.all_reduce(torch.cat([sum_dy, sum_dy_xmu]), "sum", ctx.group)
            )
            total_dy, total_dy_xmu = combined.split(channels)
            scale = invstd if weight is None else invstd * weight.float()
            grad_input = (
                dy
                - (total_dy / count).view(shape)
                - xmu * (invstd.square() * total_dy_xmu / count).view(shape)
            ) * scale.view(shape)
            grad_input = grad_input.to(input.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None
