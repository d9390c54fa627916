"""`self.log` in a captured step: recorded while the step runs, replayed into Lightning after
the device call with the values the graph computed.

Dynamo traces `RecordedLogs.log` (the module's `log` while the hook runs) and replays its list
appends after the graph, with the graph's values, as it replays any side effect; the strategy
then hands each recorded call to Lightning, in order.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule

from mncore_device.capture.markers import tagged_output

_LIGHTNING_LOG = LightningModule.log


class RecordedLogs:
    """`self.log` / `self.log_dict` while a captured hook runs, and their replay."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, tuple, dict]] = []
        # what Lightning derived from each scalar log call the first time, by (position in
        # the step, name, batch size): see DerivedLog
        self._derived: dict[tuple[int, str, int | None], tuple[DerivedLog | None, Any]] = {}

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor):  # a log value in the device graph's signature
            value = tagged_output(value.detach(), "log_value", name)  # a literal: no guard
        self.calls.append((name, value, args, kwargs))

    def log_dict(self, dictionary: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, *args, **kwargs)

    def replay(self, module: Any, size: int | None) -> None:
        """Each recorded call, into Lightning. A scalar tensor logged by the same call as at
        the last step, with the same options, goes straight to its result-collection entry
        (DerivedLog: ~0.1 ms a value instead of ~0.8 ms through `LightningModule.log`'s
        checks); options the step computes (`batch_size=n`) may differ from call to call.
        `size`: the batch's leading size (Lightning weighs by the batch size)."""
        user_log = getattr(type(module), "log", _LIGHTNING_LOG)  # the module's override, if any
        direct = user_log is _LIGHTNING_LOG
        for index, (name, value, args, kwargs) in enumerate(self.calls):
            if direct and isinstance(value, torch.Tensor) and value.numel() == 1:
                key = (index, name, size)
                derived, options = self._derived.get(key, (None, None))
                if (
                    derived is None
                    or not _same_options(options, (args, kwargs))
                    or not derived.replay(module, value)
                ):
                    log = functools.partial(_LIGHTNING_LOG, module)
                    derived = DerivedLog.record(module, log, name, value, args, kwargs)
                    self._derived[key] = derived, (args, kwargs)
                continue
            user_log(module, name, value, *args, **kwargs)


def _same_options(recorded: Any, options: tuple[tuple, dict]) -> bool:
    """Whether a log call's options are those its DerivedLog was recorded with."""
    if recorded is None:
        return False
    try:
        return bool(recorded[0] == options[0] and recorded[1] == options[1])
    except (RuntimeError, TypeError):  # an option that does not compare (a tensor, say)
        return False


@dataclass
class DerivedLog:
    """Where Lightning stores a replayed tensor log (its result-collection entry) and the
    batch size it weighs it with, recorded from one full `LightningModule.log` call.

    `LightningModule.log` validates its arguments, builds and compares the entry's metadata
    and moves the entry to the value's device at every call: ~70 µs per logged value, every
    step, re-deriving what a compiled step's log call fixes once. Later replays of the same
    call hand the value straight to that entry, as `log` would after its checks.
    """

    fx: str
    results: Any  # Lightning's result collection the entry belongs to
    entry: Any
    key: str
    batch_size: int
    # the collection's own `update_metrics` without its torch.compiler.disable wrapper (~5 µs
    # a call, every step; nothing here runs under Dynamo)
    update: Callable[..., None]

    @staticmethod
    def record(
        module: Any, log: Callable[..., None], name: str, value: Any, args: tuple, kwargs: dict
    ) -> DerivedLog | None:
        """Log `value` through `log`, and return what it derived (None if it stored nothing)."""
        results = module.trainer._results
        seen: list[tuple[str, int]] = []
        update = results.update_metrics

        def recording(key: str, value: Any, batch_size: int) -> None:
            seen.append((key, batch_size))
            update(key, value, batch_size)

        results.update_metrics = recording
        try:
            log(name, value, *args, **kwargs)
        finally:
            del results.update_metrics
        if len(seen) != 1:
            return None
        key, batch_size = seen[0]
        unwrapped = inspect.unwrap(type(results).update_metrics)
        return DerivedLog(
            module._current_fx_name, results, results[key], key, batch_size, unwrapped
        )

    def replay(self, module: Any, value: torch.Tensor) -> bool:
        """Store `value` as `log` would; False if the entry is no longer Lightning's current
        one (another loop's result collection, a reset), so the call must go through `log`."""
        trainer = module.trainer
        results = trainer._results
        if (
            results is not self.results
            or module._current_fx_name != self.fx
            or results.get(self.key) is not self.entry
        ):
            return False
        connector = trainer._logger_connector
        if connector.should_reset_tensors(self.fx):
            results.reset(metrics=False, fx=self.fx)
        # `log` stores a squeezed copy; the entry keeps none of what it is given (it clones
        # the step's value and adds into new tensors), so the device's output goes as it is
        if value.requires_grad:
            value = value.detach()
        self.update(results, self.key, value.squeeze() if value.dim() else value, self.batch_size)
        connector._current_fx = self.fx
        return True
