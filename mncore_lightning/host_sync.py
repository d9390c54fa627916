"""Host and device memory stay coherent around the user's hooks.

Compiled steps train the device's copy of the weights. Before a hook that the module or a
callback overrides runs, the host tensors are refreshed from the device, so the hook reads the
weights it would read on cpu; edits it makes on the host (an in-place change, a `.data`
assignment, `load_state_dict`, a weight swap by SWA or EMA) are found by their version
counters and data pointers and pushed to the device before the next compiled call. Hooks
nobody overrides cost nothing: a plain loop never synchronizes between steps.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import (
    Callback,
    DeviceStatsMonitor,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    OnExceptionCheckpoint,
    ProgressBar,
    ThroughputMonitor,
    Timer,
)
from lightning.pytorch.core import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden

# Every hook that runs user code while the device may hold newer weights. Checkpoint hooks
# are left out: a checkpoint reads the weights through the strategy, which synchronizes.
HOOKS = tuple(
    name
    for name in vars(Callback)
    if name.startswith("on_") and name not in ("on_save_checkpoint", "on_load_checkpoint")
)
GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")

# Lightning's callbacks that never read or write weight values themselves: their hooks need no
# synchronization (ModelCheckpoint saves through the strategy, which synchronizes).
_WEIGHT_BLIND = (
    DeviceStatsMonitor,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    OnExceptionCheckpoint,
    ProgressBar,
    ThroughputMonitor,
    Timer,
)


def overridden_hooks(module: LightningModule, callbacks: list[Callback]) -> set[str]:
    """The hooks in HOOKS that the module or a callback (other than Lightning's weight-blind
    ones, unless a subclass overrides a hook of its own) implements."""
    found = {h for h in HOOKS if hasattr(LightningModule, h) and is_overridden(h, module)}
    for callback in callbacks:
        if isinstance(callback, HostSync):
            continue
        base = next((b for b in _WEIGHT_BLIND if isinstance(callback, b)), Callback)
        found.update(h for h in HOOKS if is_overridden(h, callback, parent=base))
    return found


class HostSync(Callback):
    """Put first among the Trainer's callbacks by MNCoreStrategy: before each hook in
    `hooks`, the host tensors are refreshed from the device (a no-op when they are current).
    On an exception the host is always refreshed, before any callback's `on_exception`."""

    def __init__(self, strategy: Any, hooks: set[str]) -> None:
        self.strategy = strategy
        self.hooks = hooks

    def _before(self, hook: str) -> None:
        if hook in self.hooks:
            self.strategy.synchronize()
            self.strategy.user_hook_ran = True

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.strategy.synchronize()


def _make_hook(name: str):
    def hook(self: HostSync, *args: Any, **kwargs: Any) -> None:
        self._before(name)

    hook.__name__ = name
    return hook


for _name in HOOKS:
    if _name != "on_exception":
        setattr(HostSync, _name, _make_hook(_name))


class HostVersions:
    """Which registered host tensors changed since the host and the device last agreed."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.record()

    def record(self) -> None:
        """Host and device hold the same values now."""
        self._seen = [(t._version, t.data_ptr()) for t in self.tensors]

    def changed(self) -> list[torch.Tensor]:
        now = [(t._version, t.data_ptr()) for t in self.tensors]
        if now == self._seen:  # every step: one comparison of the lists
            return []
        return [t for t, a, b in zip(self.tensors, now, self._seen, strict=True) if a != b]
