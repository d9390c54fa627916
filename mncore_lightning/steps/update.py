"""What a compiled training step runs after its forward: Lightning's automatic optimization,
traced into the device graph (at the update marker of a captured step, or in the update call
of a step with host code or of a data-parallel split step).

This is the package's own code, traced by make_fx as it is: the backward, the gradients'
reduction across ranks, 16-mixed's unscaling and inf/NaN skip (GradScaler's, as static-graph
ops), `configure_gradient_clipping` and the optimizer's update.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mncore_device.naming import get_tensor_name
from mncore_device.runtime import signature

GRAD_PREFIX = "grad/"
# The preset whose executor checks every op for NaN (and inf reaching the step's results) and
# stops the step at the first op that made one: what Trainer(detect_anomaly=True) runs.
ANOMALY_PRESET = "debug"


def backward_and_update(
    module: Any,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor | None,
    scaler: Any,
    *,
    accumulate: tuple[int, dict[torch.Tensor, torch.Tensor]] | None,
    update: bool,
    reduce_gradients: Callable[[list[torch.Tensor]], None] | None,
    gradient_clipping: tuple[float | None, str | None],
    gradient_params: dict[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """What a compiled training step does after the forward, as Lightning's automatic
    optimization would: backward of `loss` (scaled, and divided over an accumulation window),
    the gradients' reduction across ranks, unscaling, clipping and the update (skipped where
    the scaled gradients are not finite). The gradients are set up by the caller (zeroed, or
    the accumulation buffers). Returns copies of the gradients as backward left them, by
    `gradient_params` key, when it is given (for Lightning's gradient hooks)."""
    if loss is not None:
        loss = loss if accumulate is None else loss / accumulate[0]
        module.backward(scaler.scale(loss) if scaler is not None else loss)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if reduce_gradients is not None and update:
        reduce_gradients([p.grad for p in params if p.grad is not None])
    found_inf = _unscale(optimizer, scaler) if scaler is not None and update else None
    gradients = {}
    if gradient_params is not None:  # copies: clipping and the update change the grads in place
        for index, param in enumerate(params):
            if param.grad is not None:
                gradient = gradients[f"{GRAD_PREFIX}{index}"] = param.grad.detach().clone()
                gradient_params[f"{GRAD_PREFIX}{index}"] = param
                name = get_tensor_name(param) or f"param_groups param {index}"
                signature.note_output(gradient, signature.OutputKind.GRADIENT, name)
    if update:
        # As Lightning: the hook is always called; its default clips only if asked to.
        clip_val, clip_algorithm = gradient_clipping
        module.configure_gradient_clipping(
            optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=clip_algorithm
        )
        if found_inf is None:
            optimizer.step()
        else:
            _step_unless_inf(optimizer, found_inf)
            torch._amp_update_scale_(
                scaler._scale,
                scaler._growth_tracker,
                found_inf,
                scaler._growth_factor,
                scaler._backoff_factor,
                scaler._growth_interval,
            )
    if accumulate is not None:
        if update:
            with torch.no_grad():
                for buffer in accumulate[1].values():
                    buffer.zero_()
        for param in accumulate[1]:
            param.grad = None
    return gradients


def _unscale(optimizer: torch.optim.Optimizer, scaler: Any) -> torch.Tensor:
    """torch.amp.GradScaler.unscale_, inside the graph: divide the gradients by the scale and
    return whether any of them is inf or NaN (a 0-d float tensor, as GradScaler keeps it)."""
    found_inf = torch.zeros((), dtype=torch.float32)
    inv_scale = scaler._scale.double().reciprocal().float()
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    return found_inf


def _step_unless_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """GradScaler.step, inside the graph: a step with inf/NaN gradients is skipped. A static
    graph cannot branch, so the update always runs and its results are discarded where
    `found_inf` is set: params and optimizer state keep their values, as if never stepped."""
    tensors = [p for g in optimizer.param_groups for p in g["params"]]
    tensors += [
        t
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    ]
    with torch.no_grad():
        before = [t.detach().clone() for t in tensors]
    optimizer.step()
    with torch.no_grad():
        skip = found_inf > 0
        for tensor, old in zip(tensors, before, strict=True):
            tensor.copy_(torch.where(skip, old, tensor))


def loss_of(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            "training_step must return the loss tensor (or a dict with a 'loss' tensor) under "
            f"MNCoreStrategy, got {type(output).__name__}: the compiled step always runs the "
            "backward and the optimizer update, so it cannot skip a batch by returning None"
        )
    return loss
