"""Non-tensor batch elements (sample ids, file names) that a compiled step passes through.

A batch's tensors are graph inputs; its other leaves would be traced as constants, so a value
that changes per batch (a list of file names) would re-trace every batch. Most steps never
look at them, or only hand them on (return them from predict_step, append them to a list). So
a step is traced first with each string or number leaf replaced by a `PassedThrough` stand-in
that refuses every use of its value: comparing, hashing, formatting, truth, arithmetic,
attribute access and even isinstance raise `BatchValueRead` (and are remembered, should the
step catch the error). A trace that read none of them is the graph for any values; the
stand-ins that reach what the step returns, appends or passes to a metric are replaced on the
host, at every call, by the current batch's values. A trace that read one is traced again
with the values as constants, as before: then its graph holds this batch's value, and a batch
with another value is traced again, as it must be.
"""

from __future__ import annotations

from typing import Any

# Leaves passed through: immutable values a batch carries per sample or per batch. bool is
# left out (a flag is likelier to be read than an id); other objects stay constants.
_PASSABLE = (str, bytes, int, float)


def passable(value: Any) -> bool:
    """Whether a non-tensor batch leaf is tried as a pass-through value."""
    return isinstance(value, _PASSABLE) and not isinstance(value, bool)


class BatchValueRead(Exception):
    """The traced step used the value of a non-tensor batch element (a stand-in's use)."""


class BatchValues:
    """The pass-through leaves of the batch a compiled hook is being called with."""

    def __init__(self, values: dict[int, Any], names: dict[int, str]) -> None:
        self.values = values  # leaf position -> the current batch's value
        self.names = names  # leaf position -> "[2]", "['path'][0]": for messages
        self.read: str | None = None  # the first element the trace read, if any

    def stand_ins(self) -> dict[int, PassedThrough]:
        return {i: PassedThrough(self, i) for i in self.values}


def _read(self: PassedThrough, *args: Any, **kwargs: Any) -> Any:
    owner: BatchValues = object.__getattribute__(self, "_owner")
    name = owner.names[object.__getattribute__(self, "_position")]
    owner.read = owner.read or name
    raise BatchValueRead(f"the step reads batch{name}")


class PassedThrough:
    """Stands in for a non-tensor batch leaf while a step is traced; any use of its value
    raises BatchValueRead. `host_value()` is the current batch's value (side_effects.Packed
    resolves stand-ins with it on the host)."""

    __slots__ = ("_owner", "_position")

    def __init__(self, owner: BatchValues, position: int) -> None:
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_position", position)

    def host_value(self) -> Any:
        owner = object.__getattribute__(self, "_owner")
        return owner.values[object.__getattribute__(self, "_position")]

    # isinstance(x, str) looks at __class__ after type(x): a check of the value's type is a
    # use of it, not a silent False
    __class__ = property(_read)  # type: ignore[assignment]
    __getattr__ = _read


for _name in (
    "__eq__ __ne__ __lt__ __le__ __gt__ __ge__ __hash__ __bool__ __len__ __iter__ "
    "__reversed__ __contains__ __getitem__ __setitem__ __delitem__ __setattr__ __delattr__ "
    "__str__ __repr__ __format__ __bytes__ __fspath__ __int__ __float__ __complex__ "
    "__index__ __round__ __trunc__ __floor__ __ceil__ __neg__ __pos__ __abs__ __invert__ "
    "__call__ __enter__ __exit__ __add__ __sub__ __mul__ __matmul__ __truediv__ "
    "__floordiv__ __mod__ __divmod__ __pow__ __lshift__ __rshift__ __and__ __or__ __xor__ "
    "__radd__ __rsub__ __rmul__ __rmatmul__ __rtruediv__ __rfloordiv__ __rmod__ "
    "__rdivmod__ __rpow__ __rlshift__ __rrshift__ __rand__ __ror__ __rxor__ __dir__ "
    "__reduce__ __reduce_ex__ __copy__ __deepcopy__ __getstate__"
).split():
    setattr(PassedThrough, _name, _read)
del _name
