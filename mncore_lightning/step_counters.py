"""Step counters read inside a compiled step follow their live values.

`batch_idx`, `self.global_step` and `self.current_epoch` are Python ints that change every
batch or epoch, but a compiled step is traced once. While tracing, each is a `LiveCounter`:
arithmetic with it gives a tensor computed from a graph input that is fed the current value at
every call (so a warm-up factor `step / 1000` follows the step), and `self.log` of it logs the
current value. Python control flow on it (`if batch_idx == 0:`, `int(step)`) cannot follow the
value and raises StaticGraphError at the user's line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from mncore_device import StaticGraphError
from mncore_device._source import user_frame

COUNTER_PREFIX = "counter/"
COUNTERS = ("batch_idx", "global_step", "current_epoch")
# the counters that advance with every step of a multi-step graph (steps_per_call)
STEP_COUNTERS = ("batch_idx", "global_step")


_UNUSED = torch.zeros((), dtype=torch.int64)


def counter_inputs(
    values: dict[str, int], used: set[str] | frozenset[str] = frozenset(COUNTERS)
) -> dict[str, torch.Tensor]:
    """The graph inputs for one call: each counter as a 0-d int64 tensor, so that arithmetic
    on it has the dtypes arithmetic on a Python int would give a tensor (`step / 4` and
    `step * 0.5` in the default float dtype, `step // 2` an integer). A counter the graph never
    computed with (`used`) gets a shared placeholder instead of a new tensor."""
    return {
        COUNTER_PREFIX + name: torch.tensor(values[name]) if name in used else _UNUSED
        for name in COUNTERS
    }


class LiveCounter(int):
    """A step counter while a step is traced: arithmetic follows the live value; control flow
    on it raises."""

    def __new__(
        cls, value: int, name: str, tensor: torch.Tensor, used: set[str] | None = None
    ) -> LiveCounter:
        counter = super().__new__(cls, value)
        counter.name = name
        counter.tensor = tensor
        counter.used = used if used is not None else set()
        return counter

    def _static(self, *args: Any) -> Any:
        where = user_frame() or "<unknown location>"
        raise StaticGraphError(
            f"Python control flow on {self.name} (it was {int.__repr__(self)} when the step was "
            f"traced) at {where}. A compiled step is traced once, so a Python branch on a "
            "counter would be frozen. Compute with it instead (arithmetic on it gives a tensor "
            "that follows the live value: torch.where(step < n, a, b), "
            "torch.clamp(step / n, max=1.0)), or move the logic into a hook outside the step "
            "(on_train_batch_start)."
        )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        """A torch op given a counter (`loss * 2 + batch_idx`: the tensor's own arithmetic,
        which would otherwise take the counter as the plain int it was at trace time)
        computes with its live tensor."""
        return func(*tree_map(_live_tensor, args), **tree_map(_live_tensor, kwargs or {}))

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _static
    __bool__ = __index__ = __int__ = __float__ = _static
    __hash__ = int.__hash__


def _live_tensor(value: Any) -> Any:
    if isinstance(value, LiveCounter):
        value.used.add(value.name)  # the graph reads this counter: feed it at each call
        return value.tensor
    return value


def _arithmetic(name: str):
    def method(self: LiveCounter, *args: Any) -> Any:
        self.used.add(self.name)  # the graph reads this counter: feed its value at each call
        return getattr(self.tensor, name)(*args)

    method.__name__ = name
    return method


for _op in (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__rmod__",
    "__pow__",
    "__rpow__",
    "__neg__",
    "__abs__",
):
    setattr(LiveCounter, _op, _arithmetic(_op))


_LIVE_CLASSES: dict[type, type] = {}


def _live_class(cls: type) -> type:
    """`cls` with `global_step` and `current_epoch` read from the live counters."""
    if cls not in _LIVE_CLASSES:
        _LIVE_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "global_step": property(
                    lambda self: self.__dict__["_live_counters"]["global_step"]
                ),
                "current_epoch": property(
                    lambda self: self.__dict__["_live_counters"]["current_epoch"]
                ),
            },
        )
    return _LIVE_CLASSES[cls]


@contextlib.contextmanager
def live_counters(module: Any, counters: dict[str, LiveCounter]) -> Iterator[None]:
    """While tracing: `module.global_step` and `module.current_epoch` are live counters."""
    cls = type(module)
    module.__dict__["_live_counters"] = counters
    module.__class__ = _live_class(cls)
    try:
        yield
    finally:
        module.__class__ = cls
        del module.__dict__["_live_counters"]
