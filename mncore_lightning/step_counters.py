"""Step counters read inside a compiled step follow their live values.

`batch_idx`, `self.global_step` and `self.current_epoch` (and the trainer's `global_step` and
`current_epoch`, and each LR scheduler's `last_epoch`) are Python ints that change every batch
or epoch, but a compiled step is traced once. While tracing, each is a `LiveCounter`:
arithmetic with it, on either side of a Python number or a tensor, gives a tensor computed
from a graph input that is fed the current value at every call (so a warm-up factor
`step / 1000` or `1.0 + 0.1 * epoch` follows the step), indexing a tensor with it reads the
live row, `torch.tensor(counter)` and `torch.as_tensor(counter)` give the live value (as they
do for the learning rate read from a param group), and `self.log` of it logs the current
value. A scheduler's `get_last_lr()` gives its optimizer's live learning rates
(optimizers/_base.py: LiveHyperparameter), which it equals between steps. Whatever needs the
Python int itself (`if batch_idx == 0:`, `int(step)`, `range(epoch)`, `math.sqrt(step)`)
cannot follow the value and raises StaticGraphError at the user's line.

A LiveCounter is deliberately not an `int` subclass: Python's own float and int arithmetic,
and C code that reads an int's value directly, would take an int subclass as the plain number
it was at trace time, silently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.utils._pytree import tree_map

from mncore_device import StaticGraphError
from mncore_device._source import called_from_user_code, user_frame

from .optimizers._base import ARITHMETIC, LiveHyperparameter, operator_methods

COUNTER_PREFIX = "counter/"
# the counters that advance with every step of a multi-step graph (steps_per_call)
STEP_COUNTERS = ("batch_idx", "global_step")


_UNUSED = torch.zeros((), dtype=torch.int64)


def scheduler_counters(schedulers: Sequence[Any]) -> dict[str, int]:
    """The `last_epoch` of each LR scheduler that counts with a Python int, by position."""
    return {
        _scheduler_counter(index): scheduler.last_epoch
        for index, scheduler in enumerate(schedulers)
        if type(getattr(scheduler, "last_epoch", None)) is int
    }


def _scheduler_counter(index: int) -> str:
    return f"lr_schedulers()[{index}].last_epoch"


def counter_inputs(
    values: Mapping[str, int], used: set[str] | frozenset[str] | None = None
) -> dict[str, torch.Tensor]:
    """The graph inputs for one call: each counter as a 0-d int64 tensor, so that arithmetic
    on it has the dtypes arithmetic on a Python int would give a tensor (`step / 4` and
    `step * 0.5` in the default float dtype, `step // 2` an integer). A counter the graph never
    computed with (not in `used`, when given) gets a shared placeholder instead of a new
    tensor."""
    return {
        COUNTER_PREFIX + name: torch.tensor(value) if used is None or name in used else _UNUSED
        for name, value in values.items()
    }


class LiveCounter:
    """A step counter while a step is traced: arithmetic follows the live value; anything
    that needs the Python int raises."""

    def __init__(
        self,
        value: int,
        name: str,
        tensor: torch.Tensor,
        used: set[str] | None = None,
        offset: int = 0,
    ) -> None:
        self.value = value  # at trace time: what printing it shows
        self.name = name
        self.tensor = tensor
        self.used = used if used is not None else set()
        self.offset = offset  # how far it is ahead of the value the call was fed

    def advanced(self) -> LiveCounter:
        """This counter after the host code that counts it runs once more (a scheduler's
        step recorded inside a manual step)."""
        return LiveCounter(self.value + 1, self.name, self.tensor + 1, self.used, self.offset + 1)

    def live(self) -> torch.Tensor:
        """The graph input that holds this counter's value at each call."""
        self.used.add(self.name)  # the graph reads this counter: feed its value at each call
        return self.tensor

    def _static(self, *args: Any) -> Any:
        where = user_frame() or "<unknown location>"
        raise StaticGraphError(
            f"Python code needs the value of {self.name} (it was {self.value} when the step "
            f"was traced) at {where}. A compiled step is traced once, so a Python branch or "
            "conversion on a counter would be frozen. Compute with it instead (arithmetic on "
            "it gives a tensor that follows the live value: torch.where(step < n, a, b), "
            "torch.clamp(step / n, max=1.0)), or move the logic into a hook outside the step "
            "(on_train_batch_start)."
        )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        """A torch op given a counter (`loss * 2 + batch_idx`, `table[step]`) computes with
        its live tensor."""
        if func is torch.Tensor.__getitem__ and isinstance(args[1], LiveCounter):
            # a 0-d index tensor would be read as a Python int: select the row instead
            return args[0].index_select(0, args[1].live().reshape(1)).squeeze(0)
        return func(*tree_map(_live_tensor, args), **tree_map(_live_tensor, kwargs or {}))

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _static
    __bool__ = __index__ = __int__ = __float__ = __complex__ = __round__ = _static
    __trunc__ = __floor__ = __ceil__ = _static

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def _live_tensor(value: Any) -> Any:
    return value.live() if isinstance(value, LiveCounter) else value


def _arithmetic(name: str):
    def method(self: LiveCounter, *args: Any) -> Any:
        return getattr(self.live(), name)(*tree_map(_live_tensor, args))

    method.__name__ = name
    return method


for _op in (
    *operator_methods((*ARITHMETIC, "floordiv", "mod")),
    "__neg__",
    "__pos__",
    "__abs__",
):
    setattr(LiveCounter, _op, _arithmetic(_op))


def _holds_live_value(data: Any) -> bool:
    """Whether `data` holds a counter or a live hyperparameter (the learning rate)."""
    if isinstance(data, (list, tuple)):
        return any(_holds_live_value(item) for item in data)
    return isinstance(data, LiveCounter) or (
        isinstance(data, LiveHyperparameter) and data.tensor is not None
    )


def _live_data(data: Any) -> torch.Tensor:
    """`data` for torch.tensor, with each counter or hyperparameter its live tensor (a list
    of numbers holding one: one tensor, in the dtype torch.tensor would give the numbers)."""
    if isinstance(data, LiveCounter):
        return data.live()
    if isinstance(data, LiveHyperparameter):
        return data.tensor.to(torch.get_default_dtype())
    items = [_live_data(item) if _holds_live_value(item) else torch.tensor(item) for item in data]
    dtype = items[0].dtype
    for item in items[1:]:
        dtype = torch.promote_types(dtype, item.dtype)
    return torch.stack([item.to(dtype) for item in items])


def _counter_aware(factory: Callable[..., torch.Tensor], copy: bool) -> Callable:
    """torch.tensor / torch.as_tensor, which read a Python number's value directly: given a
    counter or a live learning rate (or a list holding one), the live tensor instead."""

    def wrapper(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not _holds_live_value(data):
            return factory(data, *args, **kwargs)
        tensor = _live_data(data)
        dtype = kwargs.get("dtype", args[0] if args else None)
        tensor = tensor.to(dtype=dtype, device=kwargs.get("device"))
        if kwargs.get("requires_grad"):
            raise StaticGraphError(
                f"torch.tensor(counter, requires_grad=True) at {user_frame()}: a step counter "
                "has no gradient"
            )
        return tensor.clone() if copy else tensor

    wrapper.__wrapped__ = factory
    return wrapper


_LIVE_CLASSES: dict[type, type] = {}


def _live_class(cls: type, names: tuple[str, ...]) -> type:
    """`cls` with the attributes `names` read from its live counters (and, for an LR
    scheduler, `get_last_lr()` from its optimizer's live learning rates)."""
    if cls not in _LIVE_CLASSES:
        members: dict[str, Any] = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        for name in names:
            members[name] = property(
                lambda self, _name=name: self.__dict__["_live_counters"][_name],
                lambda self, value, _name=name: _refuse_write(self, _name),
            )
        if issubclass(cls, LRScheduler):
            members["get_last_lr"] = _live_last_lr
        last_batch = getattr(cls, "is_last_batch", None)
        if isinstance(last_batch, property):  # the Trainer
            members["is_last_batch"] = property(_last_batch_refused(last_batch))
        _LIVE_CLASSES[cls] = type(cls.__name__, (cls,), members)
    return _LIVE_CLASSES[cls]


def _last_batch_refused(original: property) -> Callable[[Any], bool]:
    def is_last_batch(self: Any) -> bool:
        """Refused to the user's step: it is False at every batch but an epoch's last."""
        if called_from_user_code():
            raise StaticGraphError(
                f"the step reads trainer.is_last_batch at {user_frame()}. A compiled step is "
                "traced once, so it would read the traced batch's value (False, but for a "
                "one-batch epoch) at every step. Do the last batch's work in "
                "on_train_batch_end, which may read it, or in on_train_epoch_end."
            )
        return original.fget(self)

    return is_last_batch


def _refuse_write(owner: Any, name: str) -> None:
    raise StaticGraphError(
        f"the step sets {type(owner).__name__}.{name} at {user_frame()}. A compiled step is "
        "traced once, so the change would happen only once; Lightning and the scheduler own "
        "this counter."
    )


def _live_last_lr(self: LRScheduler) -> list[Any]:
    """The scheduler's last learning rates, as its optimizer's groups hold them now: live."""
    rates = [group["lr"] for group in self.optimizer.param_groups]
    if rates != list(self.__dict__["_last_lr"]):
        raise StaticGraphError(
            f"{type(self).__name__}.get_last_lr() at {user_frame()} is {self._last_lr}, but "
            f"its optimizer's learning rates are {[float(r) for r in rates]} (set outside the "
            "scheduler): a compiled step cannot follow both. Read "
            "optimizer.param_groups[i]['lr'], which the step follows."
        )
    return rates


@contextlib.contextmanager
def live_counters(module: Any, counters: dict[str, LiveCounter]) -> Iterator[None]:
    """While tracing: `global_step` and `current_epoch` of the module and of its trainer, and
    each LR scheduler's `last_epoch`, are live counters, and torch.tensor / torch.as_tensor
    take a counter's live value."""
    trainer = getattr(module, "_trainer", None)
    owners: list[tuple[Any, dict[str, LiveCounter]]] = []
    steps = {name: counters[name] for name in ("global_step", "current_epoch")}
    owners += [(owner, steps) for owner in (module, trainer) if owner is not None]
    configs = trainer.lr_scheduler_configs if trainer is not None else ()
    for index, config in enumerate(configs):
        counter = counters.get(_scheduler_counter(index))
        if counter is not None:
            owners.append((config.scheduler, {"last_epoch": counter}))
    classes = [type(owner) for owner, _ in owners]
    factories = torch.tensor, torch.as_tensor
    for (owner, live), cls in zip(owners, classes, strict=True):
        owner.__dict__["_live_counters"] = dict(live)
        owner.__class__ = _live_class(cls, tuple(live))
    torch.tensor = _counter_aware(factories[0], copy=True)
    torch.as_tensor = _counter_aware(factories[1], copy=False)
    try:
        yield
    finally:
        torch.tensor, torch.as_tensor = factories
        for (owner, _), cls in zip(owners, classes, strict=True):
            owner.__class__ = cls
            del owner.__dict__["_live_counters"]


def scheduler_stepped(scheduler: Any) -> None:
    """A scheduler's step recorded while a step is traced: its `last_epoch` reads one more
    from here on, as it would on the host."""
    live = scheduler.__dict__.get("_live_counters")
    if live is not None and "last_epoch" in live:
        live["last_epoch"] = live["last_epoch"].advanced()
