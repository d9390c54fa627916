"""Strings in a step's batch (sample ids, file names), handed to the step as stand-ins.

TorchDynamo guards every string the step touches by its value (`args[0][2][0] ==
'sample0'`), so a batch whose ids or file names change at every batch would compile the step
again at every batch, even where the step only hands them on (returns them from
`predict_step`, appends them to a list). `BatchStandIns.standing_in(args)` gives the step its
batch with each `str` and `bytes` leaf replaced by a stand-in (`BatchStr`, `BatchBytes`), a
fresh object of one class at every call: Dynamo guards only the class, so a step that passes
them on compiles once.

Every use of a stand-in's value (comparing, hashing, formatting, `len`, indexing, a method
such as `.startswith`, `int(...)`, `open(...)`) is host code, a graph break: it runs on the
host with this batch's value and returns what the value would; a string a method returns
(`ids[0]`, `name.removeprefix("sample")`) as a stand-in again, a number or a bool as such
(Dynamo guards it, or makes it a graph input once it changes), and `str()`, `repr()`,
`f"{name}"` a plain string (which Dynamo guards by its value).

After the call the stand-ins are replaced by their values where the step left them
(`resolve`): in what it returns, in a list it appends to at every call
(appended_lists.CallAppends), and anywhere else through the garbage collector's referrers
(slow, but rare: a stand-in kept in an attribute, or in a list before it is adopted).
Inside the traced step `isinstance(value, str)` of a stand-in is what it is of the value
(`isinstance_sees_the_value`); `type(value) is str` is False, and a C function that needs a
real string (`ord`, `re.match`, `"".join`) needs `str(value)`.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from typing import Any

import torch

_LEAVES = (str, bytes)
_NOT_FORWARDED = {
    "__class__",
    "__new__",
    "__init__",
    "__getattribute__",
    "__getattr__",
    "__setattr__",
    "__delattr__",
    "__init_subclass__",
    "__subclasshook__",
    "__dir__",
    "__doc__",
    "__sizeof__",
    "__getnewargs__",
    "__getstate__",
    "__reduce__",
}


# what Python requires to be a str (or an int) of its own type: never a stand-in
_PLAIN_RESULTS = {"__format__", "__repr__", "__str__", "__hash__", "__len__", "__index__"}


def _value(item: Any) -> Any:
    return object.__getattribute__(item, "_value") if isinstance(item, BatchValue) else item


class BatchValue:
    """Stands in for a `str` or `bytes` batch leaf during one call (see the module)."""

    __slots__ = ("_value", "__weakref__")

    def __init__(self, value: str | bytes) -> None:
        object.__setattr__(self, "_value", value)


class BatchStr(BatchValue):
    """A stand-in for a `str` (Dynamo guards the class: a leaf's type is part of the step)."""

    __slots__ = ()


class BatchBytes(BatchValue):
    """A stand-in for a `bytes`."""

    __slots__ = ()


_STAND_IN = {str: BatchStr, bytes: BatchBytes}


def _forwarded(name: str) -> Any:
    """The value's method `name`, on the host; a string it returns (`.removeprefix(...)`,
    `[0]`, `.split()`'s items) is a stand-in again, so what the step derives from a batch's
    strings does not re-compile it either."""

    @torch.compiler.disable
    def host(self: BatchValue, *args: Any, **kwargs: Any) -> Any:
        value = object.__getattribute__(self, "_value")
        args = tuple(_value(a) for a in args)
        kwargs = {k: _value(v) for k, v in kwargs.items()}
        result = getattr(value, name)(*args, **kwargs)
        current = BatchStandIns._current
        if current is None or name in _PLAIN_RESULTS:
            return result
        return current._mirror(result)

    host.__name__ = host.__qualname__ = name
    return host


def _reflected(operator: Any, name: str) -> Any:
    @torch.compiler.disable
    def host(self: BatchValue, other: Any) -> Any:
        return operator(_value(other), object.__getattribute__(self, "_value"))

    host.__name__ = host.__qualname__ = name
    return host


def _conversion(convert: Any, name: str) -> Any:
    @torch.compiler.disable
    def host(self: BatchValue, *args: Any) -> Any:
        return convert(object.__getattribute__(self, "_value"), *args)

    host.__name__ = host.__qualname__ = name
    return host


for _name in sorted(set(dir(str)) | set(dir(bytes))):
    if _name not in _NOT_FORWARDED and callable(getattr(str, _name, getattr(bytes, _name, None))):
        setattr(BatchValue, _name, _forwarded(_name))
BatchValue.__radd__ = _reflected(lambda a, b: a + b, "__radd__")
BatchValue.__bool__ = _conversion(bool, "__bool__")
BatchValue.__int__ = _conversion(int, "__int__")
BatchValue.__float__ = _conversion(float, "__float__")
BatchValue.__fspath__ = _conversion(lambda v: v, "__fspath__")
BatchValue.__str__ = _conversion(str, "__str__")
BatchValue.__reduce_ex__ = _conversion(lambda v, protocol: (type(v), (v,)), "__reduce_ex__")
BatchValue.__getattr__ = _conversion(getattr, "__getattr__")
del _name


def isinstance_sees_the_value() -> None:
    """`isinstance(stand_in, str)` in a captured step is what it is of the value: Dynamo
    (torch 2.14.1) computes isinstance from the object's class, BatchStr, which it guards,
    so the answer for the value's class (str for a BatchStr) holds at every call. Patched
    once, into Dynamo's isinstance."""
    from torch._dynamo.variables.builtin import BuiltinVariable
    from torch._dynamo.variables.user_defined import UserDefinedObjectVariable

    original = BuiltinVariable.call_isinstance
    if getattr(original, "_mncore_batch_values", False):
        return

    def call_isinstance(self: Any, tx: Any, arg: Any, isinstance_type_var: Any) -> Any:
        if isinstance(arg, UserDefinedObjectVariable) and isinstance(arg.value, BatchValue):
            from torch._dynamo.variables import VariableTracker

            try:
                classes = isinstance_type_var.as_python_constant()
            except NotImplementedError:  # not a constant: Dynamo's own way
                return original(self, tx, arg, isinstance_type_var)
            value = object.__getattribute__(arg.value, "_value")
            return VariableTracker.build(tx, isinstance(value, classes))
        return original(self, tx, arg, isinstance_type_var)

    call_isinstance._mncore_batch_values = True
    BuiltinVariable.call_isinstance = call_isinstance


class BatchStandIns:
    """The stand-ins of one call: what each stands for, by identity (see the module)."""

    _current: BatchStandIns | None = None  # the call in progress

    def __init__(self) -> None:
        self._originals: dict[int, tuple[Any, Any]] = {}  # id(stand-in) -> (it, original)
        self._parents: dict[int, int] = {}  # id(stand-in) -> mirrored containers holding it

    @classmethod
    def standing_in(cls, args: tuple) -> contextlib.AbstractContextManager[tuple[list, Any]]:
        """The arguments to call the step with (a list: `step(*call)`), the batch's (the
        first argument's) leaves stood in for; afterwards the stand-ins left anywhere are
        replaced by their values. (A batch of tensors only, the common case, enters nothing.)"""
        stand_ins = cls()
        call = [stand_ins._mirror(args[0]), *args[1:]] if args else []
        if not stand_ins._originals:
            return contextlib.nullcontext((call, stand_ins))
        return stand_ins._current_for(call)

    @contextlib.contextmanager
    def _current_for(self, call: list) -> Iterator[tuple[list, BatchStandIns]]:
        cls = type(self)
        previous, cls._current = cls._current, self
        try:
            yield call, self
        finally:
            cls._current = previous
            call.clear()
            self._resolve_escaped()

    def _mirror(self, value: Any) -> Any:
        kind = type(value)
        if kind in _LEAVES:
            stand_in = _STAND_IN[kind](value)
            self._originals[id(stand_in)] = (stand_in, value)
            return stand_in
        if kind in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
            items = [self._mirror(item) for item in value]
            if all(a is b for a, b in zip(items, value, strict=True)):
                return value
            mirrored = kind(*items) if kind not in (tuple, list) else kind(items)
        elif kind is dict:
            mirrored = {key: self._mirror(item) for key, item in value.items()}
            items = list(mirrored.values())
            if all(mirrored[key] is item for key, item in value.items()):
                return value
        else:
            return value
        for item in items:
            if id(item) in self._originals:
                self._parents[id(item)] = self._parents.get(id(item), 0) + 1
        self._originals[id(mirrored)] = (mirrored, value)
        return mirrored

    def resolve(self, value: Any) -> Any:
        """`value` with every stand-in (and mirrored container) in it as what it stands for,
        through the lists, tuples and dicts the step built around them."""
        if not self._originals:
            return value
        found = self._originals.get(id(value))
        if found is not None and found[0] is value:
            return found[1]
        kind = type(value)
        if kind in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
            items = [self.resolve(item) for item in value]
            if all(a is b for a, b in zip(items, value, strict=True)):
                return value
            return kind(*items) if kind not in (tuple, list) else kind(items)
        if kind is dict:
            items = {key: self.resolve(item) for key, item in value.items()}
            if all(items[key] is item for key, item in value.items()):
                return value
            return items
        return value

    @classmethod
    def resolve_current(cls, value: Any) -> Any:
        """`resolve` for the call in progress, if any (appended_lists.CallAppends.flush)."""
        return cls._current.resolve(value) if cls._current is not None else value

    def _resolve_escaped(self) -> None:
        """The stand-ins (and mirrored containers) something still refers to: replaced
        there. One that stayed in the call is referred to only by its entry in
        `_originals`, the mirrored containers holding it, and here (`item` and
        getrefcount's argument)."""
        escaped = []
        for item, _ in list(self._originals.values()):
            if sys.getrefcount(item) > 3 + self._parents.get(id(item), 0):
                escaped.append(item)
        for item in escaped:
            self._replace(item, self._originals[id(item)][1], depth=0)
        self._originals.clear()
        self._parents.clear()

    def _replace(self, item: Any, original: Any, depth: int) -> None:
        for referrer in gc.get_referrers(item):
            if referrer is self._originals or depth > 8:
                continue
            if type(referrer) is list:
                for index, value in enumerate(referrer):
                    if value is item:
                        referrer[index] = original
            elif type(referrer) is dict:
                for key, value in list(referrer.items()):
                    if value is item:
                        referrer[key] = original
            elif type(referrer) is tuple and id(referrer) not in self._originals:
                # a tuple the step built: replaced, with the item resolved, where it is
                self._replace(referrer, self.resolve(referrer), depth + 1)
