"""MLSDK's legacy training compile: `compile(f, inputs, dir, optimizers=[opt],
options={"backprop": True})`.

`f` returns the loss (key "loss", or its only output) and does no backward itself; the
compiler adds the backward and each optimizer's update. The compiled function then takes,
besides the sample's inputs, the ones MLSDK's scripts feed on every call:

* `<optimizer name>@<group index>@mncore_learning_rate`: the group's learning rate (a 0-d
  float32 tensor), used by this call's update;
* `<optimizer name>@<group index>@mncore_global_step`: the step number (0-d int64); the
  emulated optimizers count steps in their own registered state, so it is accepted, not read;
* `mncore_grad_scale_factor` (0-d int64): the loss is multiplied by it before the backward
  and the gradients divided by it before the update (loss scaling, exact for powers of 2).

The optimizer name is the one given to `set_buffer_name_in_optimizer` or
`context.registry.register`. An optimizer takes a learning-rate input if it has
`learning_rates_from(rates)`, a context manager during which its step reads `rates` (one
0-d tensor per param group); the MN-Core optimizers have it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .context import StepFunction
from .naming import optimizer_name_prefix
from .registry import device_optimizer_for

LEARNING_RATE = "mncore_learning_rate"
GLOBAL_STEP = "mncore_global_step"
GRAD_SCALE = "mncore_grad_scale_factor"


def backprop_step(
    function: StepFunction,
    inputs: Mapping[str, torch.Tensor],
    optimizers: Sequence[torch.optim.Optimizer],
) -> tuple[StepFunction, dict[str, torch.Tensor]]:
    """The whole training step (forward, backward, update) and its sample inputs."""
    runners = [device_optimizer_for(o) for o in optimizers]
    rate_keys: list[list[str]] = []
    sample = dict(inputs)
    for original, runner in zip(optimizers, runners, strict=True):
        prefix = optimizer_name_prefix(runner)
        if prefix is None:
            raise ValueError(
                f"compile(optimizers=[...]): the {type(original).__name__} has no name; name "
                "it with set_buffer_name_in_optimizer(optimizer, 'optimizer0') or "
                "context.registry.register('optimizer0', optimizer) and register its buffers"
            )
        if getattr(runner, "learning_rates_from", None) is None:
            raise TypeError(
                f"compile(optimizers=[...]): {type(runner).__name__} cannot take its learning "
                "rate as an input of the step; use an MN-Core optimizer (MNCoreSGD, MNCoreAdam, "
                "MNCoreAdamW) or register the optimizer with context.registry.register"
            )
        keys = []
        for index, group in enumerate(runner.param_groups):
            key = f"{prefix}@{index}@{LEARNING_RATE}"
            keys.append(key)
            sample.setdefault(key, torch.tensor(float(group["lr"])))
            sample.setdefault(f"{prefix}@{index}@{GLOBAL_STEP}", torch.tensor(0))
        rate_keys.append(keys)
    sample.setdefault(GRAD_SCALE, torch.tensor(1))
    own_keys = list(inputs)

    def training_step(batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        for runner in runners:
            runner.zero_grad()
        outputs = function({k: batch[k] for k in own_keys})
        loss = _loss_of(outputs)
        scale = batch[GRAD_SCALE]
        (loss * scale).backward()
        with torch.no_grad():
            for runner in runners:
                for group in runner.param_groups:
                    for param in group["params"]:
                        if param.grad is not None:
                            param.grad.div_(scale)
        for runner, keys in zip(runners, rate_keys, strict=True):
            with runner.learning_rates_from([batch[k] for k in keys]):
                runner.step()
        return outputs

    training_step.__name__ = getattr(function, "__name__", "training_step")
    return training_step, sample


def _loss_of(outputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    if "loss" in outputs:
        return outputs["loss"]
    if len(outputs) == 1:
        return next(iter(outputs.values()))
    raise ValueError(
        "options={'backprop': True}: the function must return the loss as 'loss' (or as its "
        f"only output); it returned {sorted(outputs)}"
    )
