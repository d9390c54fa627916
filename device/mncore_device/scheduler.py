"""`MNCoreLRScheduler(scheduler, context)`: a torch learning-rate scheduler whose steps reach
the device.

The optimizer's update runs inside the compiled step, so a rate changed on the host must be
copied to the device; `step()` steps the wrapped scheduler and then pushes the optimizer's
new rates (`Context.push_learning_rates`).
"""

from __future__ import annotations

from typing import Any

import torch

from .context import Context
from .errors import RegistrationError
from .registry import device_optimizer_for


class MNCoreLRScheduler:
    """Wrap `scheduler` (any torch.optim.lr_scheduler.LRScheduler) for `context`."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, context: Context) -> None:
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(
                f"MNCoreLRScheduler(scheduler, context): expected a torch LRScheduler, got "
                f"{type(scheduler).__name__}"
            )
        if not isinstance(context, Context):
            raise TypeError(
                f"MNCoreLRScheduler(scheduler, context): expected a Context, got "
                f"{type(context).__name__}"
            )
        params = [p for g in scheduler.optimizer.param_groups for p in g["params"]]
        if not any(context.is_registered(p) for p in params):
            raise RegistrationError(
                "MNCoreLRScheduler: none of the scheduler's optimizer's parameters is "
                "registered in this Context; register the model (context.register_param) first"
            )
        self.scheduler = scheduler
        self.context = context

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.scheduler.optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the scheduler on the host, then copy the new rates to the device."""
        self.scheduler.step(*args, **kwargs)
        replacement = device_optimizer_for(self.scheduler.optimizer)
        if replacement is not self.scheduler.optimizer:  # registry runs a converted copy
            for group, source in zip(
                replacement.param_groups, self.scheduler.optimizer.param_groups, strict=True
            ):
                group["lr"] = source["lr"]
        self.context.push_learning_rates()

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)
