"""The gradients of a captured manual step: device state between calls, None where cpu's are.

On cpu, `p.grad` lives on between training steps: a step that does not zero it (accumulation
by hand: `if (batch_idx + 1) % n == 0: opt.step(); opt.zero_grad()`) adds to it, and an
optimizer skips a parameter whose gradient is None. In a captured manual step the gradients
are registered buffers (`CompiledSteps._gradient_buffers`), which each device graph starts
from and writes back; which of them exist (are not None) is followed on the host, as cpu's
`p.grad is None` would be.

A graph is traced with the gradients that exist when it is first called. Whether they exist
matters to it only for the parameters whose gradient from before the step it uses (a backward
that adds to it, an update or clipping that reads it) before any `zero_grad()`: those are
"consumed". The graph is selected (a Dynamo guard, `key`) by which consumed gradients exist,
so a step that always zeroes first compiles once, and accumulation by hand compiles a graph
per kind of micro-batch (and start), not one per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch


class ManualGradients:
    """Which gradients exist between calls (`present`), and what each traced graph does to
    them (see the module docstring)."""

    def __init__(self, buffers: Mapping[torch.Tensor, torch.Tensor]) -> None:
        self.buffers = dict(buffers)
        self.params = list(self.buffers)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.present: set[int] = set()  # cpu's `p.grad is not None`, by index
        self.consumed: set[int] = set()  # by any graph traced so far
        self.key = ""  # the consumed gradients that exist: what selects a graph
        self._zeroed: set[int] = set()
        self._touched: set[int] = set()
        self._consumed_now: set[int] = set()

    def _indices(self, optimizer: Any) -> list[int]:
        return [
            self._index[id(p)]
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in self._index
        ]

    # --- while a graph is traced ----------------------------------------------------------------

    def start(self) -> None:
        """The gradients the graph starts from: the buffers of those that exist."""
        for index, param in enumerate(self.params):
            param.grad = self.buffers[param] if index in self.present else None
        self._zeroed, self._touched, self._consumed_now = set(), set(), set()

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """A backward: the gradients it changed; those not zeroed before were consumed."""
        before = [(p.grad, p.grad._version if p.grad is not None else 0) for p in self.params]
        yield
        for index, (param, (grad, version)) in enumerate(zip(self.params, before, strict=True)):
            if param.grad is not grad or (grad is not None and grad._version != version):
                if index not in self._zeroed:
                    self._consumed_now.add(index)
                self._touched.add(index)

    def zeroed(self, optimizer: Any) -> None:
        for index in self._indices(optimizer):
            self._zeroed.add(index)
            self._touched.add(index)

    def read(self, optimizer: Any) -> None:
        """An update or clipping reads the optimizer's gradients as the step left them."""
        for index in self._indices(optimizer):
            if index not in self._touched:
                self._consumed_now.add(index)

    def finish(self) -> dict[int, bool]:
        """Write the gradients back into their buffers (zeros for None); return whether each
        gradient the graph set or zeroed exists after it (the others are as before it)."""
        with torch.no_grad():
            for param, buffer in self.buffers.items():
                grad = param.grad
                if grad is None:
                    buffer.zero_()
                elif grad is not buffer:
                    buffer.copy_(grad)
        self.consumed |= self._consumed_now
        self._update_key()
        return {index: self.params[index].grad is not None for index in self._touched}

    def clear(self) -> None:
        """The host holds no gradient (the device does)."""
        for param in self.params:
            param.grad = None

    # --- after each call ------------------------------------------------------------------------

    def called(self, end: Mapping[int, bool]) -> None:
        """A call of a graph whose `finish` gave `end`."""
        for index, exists in end.items():
            if exists:
                self.present.add(index)
            else:
                self.present.discard(index)
        self._update_key()

    def _update_key(self) -> None:
        self.key = ",".join(map(str, sorted(self.present & self.consumed)))
