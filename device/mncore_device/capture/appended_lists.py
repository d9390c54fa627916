"""Lists a captured step appends to (`self.outputs.append(loss)`), without a re-compile a call.

Measured with torch 2.14.1: TorchDynamo wraps a list the step touches as a list of its
current items and guards its length (`not self.outputs` while it is empty, then
`len(self.outputs) == 1`, `== 2`, ...); an append is replayed after the graph by assigning
the whole new list (`self.outputs[:] = [old items..., new]`). A list that grows at every
call fails that guard at every call: one re-compile per step. A list subclass, a
`collections.deque` and a `UserList` are guarded the same way (on `.data` for the last), and
no Dynamo setting drops the guard.

`AppendedLists` takes such a list out of Dynamo's view instead: once its length guard has
failed twice (`adopt`, with Dynamo's guard expression), the attribute holds a `CallAppends`
during each call (`swapped`, from the call that adopts it on): `append`, `extend` and `+=`
gather into a list of its own, fresh at every call, which Dynamo's guards see empty every
time, and what the call appended is added to the real list afterwards, in order.

A step that does more with the list must see all of it, as on cpu: a use that only reads
it (its length, its items, iterating it, `torch.stack(self.outputs)`) is host code (a graph
break) on the real list followed by the call's appends; one that changes it otherwise (a
sliding window's `self.window.pop(0)`, item assignment, `clear`) adds the call's appends to
the real list, puts the real list back in the attribute for the rest of the call and runs
there, and the list is not taken out of view again (`released`): Dynamo guards it as before,
which costs nothing more for a list that stops growing (the window).

The list is adopted before Dynamo traces the step again (`adopt`, from the frontend's guard
failure, within `swapped`), so that trace sees what the next calls see.
"""

from __future__ import annotations

import re
import types
from typing import Any

import torch
from torch import nn

from .batch_leaves import BatchStandIns

_LENGTH = re.compile(r"(?:len\((?P<len>.+)\)|not (?P<not>.+))")
_LAST_ATTRIBUTE = re.compile(r"\.([A-Za-z_]\w*)$")
_FRAME_GLOBAL = re.compile(r"G\[(?P<key>'[^']+'|\"[^\"]+\")\]\.(?P<name>[A-Za-z_]\w*)")


def length_guard(guard: str) -> str | None:
    """The list expression a length guard checks (`len(x) == 2` and `not x`), else None."""
    match = _LENGTH.fullmatch(guard.strip())
    if match is None:
        return None
    return (match.group("len") or match.group("not")).strip()


class AppendedLists:
    """The lists of `root`'s modules that a captured step appends to (see the module)."""

    def __init__(self, root: nn.Module, frame_globals: dict[str, Any] | None = None) -> None:
        self._root = root
        self.frame_globals = frame_globals  # the captured frame's globals (Dynamo's `G`)
        self._found: list[tuple[Any, str]] = []
        self.released: list[tuple[Any, str]] = []  # read by the step: never adopted again
        self._swaps: list[tuple[Any, str, list, CallAppends]] | None = None  # during a call
        self._this_call: list[tuple[Any, str]] = []  # adopted during the current call

    def adopt(self, guard: str) -> bool:
        """Take the list whose length guard `guard` keeps failing out of Dynamo's view; False
        if it is not one attribute list of the modules or a module-level list, or the step
        changed it (released), or it was taken at an earlier call. Taken during a call, it
        is swapped at once (before Dynamo traces the step again), and True again for the
        rest of that call."""
        expression = length_guard(guard)
        if expression is None:
            return False
        found = self._module_level(expression)
        if found is None:
            name = _LAST_ATTRIBUTE.search(expression)
            if name is None:
                return False
            owners = [m for m in self._root.modules() if _a_list(vars(m).get(name.group(1)))]
            if len(owners) != 1:
                return False
            found = owners[0], name.group(1)
        if _listed(found, self._found):
            return (
                self._swaps is not None
                and any(o is found[0] and n == found[1] for o, n, _, _ in self._swaps)
                and found in self._this_call
            )
        if _listed(found, self.released):
            return False
        self._found.append(found)
        if self._swaps is not None:
            self._this_call.append(found)
            self._swap(*found)
        return True

    def _module_level(self, expression: str) -> tuple[Any, str] | None:
        """(the module, the name) of a list `G['<alias>'].NAME` in the user's module."""
        match = _FRAME_GLOBAL.fullmatch(expression)
        if match is None or self.frame_globals is None:
            return None
        owner = self.frame_globals.get(match.group("key")[1:-1])
        name = match.group("name")
        if not isinstance(owner, types.ModuleType) or not _a_list(vars(owner).get(name)):
            return None
        return owner, name

    @property
    def names(self) -> list[str]:
        return [name for _, name in self._found]

    def swapped(self) -> AppendedLists:
        """During the call each adopted attribute holds a CallAppends; afterwards the real
        list gets what the call appended (unless the step assigned the attribute anew).
        (A context manager of its own rather than a generator's: entered at every step.)"""
        return self

    def __enter__(self) -> None:
        self._swaps, self._this_call = [], []
        for owner, name in self._found:
            self._swap(owner, name)

    def __exit__(self, *exc_info: Any) -> None:
        swaps, self._swaps = self._swaps, None
        for owner, name, real, fresh in swaps:
            if vars(owner).get(name) is fresh:
                vars(owner)[name] = real
            fresh.flush()

    def _swap(self, owner: Any, name: str) -> None:
        real = vars(owner).get(name)
        if type(real) is list:
            fresh = CallAppends(real, lambda: self._release(owner, name))
            vars(owner)[name] = fresh
            self._swaps.append((owner, name, real, fresh))

    def _release(self, owner: Any, name: str) -> None:
        """The step uses the list otherwise than by appending: the real list is back in the
        attribute for the rest of the call, and the list stays in Dynamo's view."""
        for swap in self._swaps or ():
            if swap[0] is owner and swap[1] == name and vars(owner).get(name) is swap[3]:
                vars(owner)[name] = swap[2]
        if (owner, name) in self._found:
            self._found.remove((owner, name))
            self.released.append((owner, name))


def _a_list(value: Any) -> bool:
    """A list, or an adopted one during a call."""
    return type(value) in (list, CallAppends)


def _listed(found: tuple[Any, str], listed: list[tuple[Any, str]]) -> bool:
    return any(owner is found[0] and name == found[1] for owner, name in listed)


def _reading(name: str) -> Any:
    """`list.<name>`, which only reads, on the real list followed by the call's appends:
    host code (a graph break)."""
    method = getattr(list, name)

    @torch.compiler.disable
    def host(self: CallAppends, *args: Any, **kwargs: Any) -> Any:
        return method(self._real + self.appended, *args, **kwargs)

    host.__name__ = host.__qualname__ = name
    return host


def _changing(name: str) -> Any:
    """`list.<name>`, which changes the list, on the real list, released (see the module
    docstring): host code."""
    method = getattr(list, name)

    @torch.compiler.disable
    def host(self: CallAppends, *args: Any, **kwargs: Any) -> Any:
        return method(self.release(), *args, **kwargs)

    host.__name__ = host.__qualname__ = name
    return host


class CallAppends:
    """What an adopted list attribute holds during one call (see the module docstring):
    appends gather in `appended`, which Dynamo sees; other uses run on the host."""

    def __init__(self, real: list, release: Any) -> None:
        self._real = real
        self._release = release
        self.appended: list = []  # fresh at every call: Dynamo guards it empty

    def append(self, item: Any) -> None:
        self.appended.append(item)

    def extend(self, items: Any) -> None:
        self.appended.extend(items)

    def __iadd__(self, items: Any) -> CallAppends:
        self.appended.extend(items)
        return self

    @torch.compiler.disable
    def flush(self) -> list:
        """Add the call's appends to the real list (host code, so Dynamo replays the
        appends before it); the real list."""
        self._real.extend(BatchStandIns.resolve_current(item) for item in self.appended)
        self.appended.clear()
        return self._real

    @torch.compiler.disable
    def release(self) -> list:
        """The real list, with the call's appends, back in the attribute (see the module)."""
        self._release()
        return self.flush()

    @classmethod
    @torch.compiler.disable
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """`torch.stack(self.outputs)` and the like: on the whole list."""

        def whole(value: Any) -> Any:
            return value._real + value.appended if isinstance(value, CallAppends) else value

        return func(*map(whole, args), **{k: whole(v) for k, v in (kwargs or {}).items()})

    __hash__ = None  # type: ignore[assignment]  # as a list's


for _name in (
    "__len__ __getitem__ __iter__ __reversed__ __contains__ __eq__ __ne__ __lt__ __le__ "
    "__gt__ __ge__ __add__ __mul__ __rmul__ __repr__ __str__ __format__ __reduce_ex__ "
    "copy count index"
).split():
    setattr(CallAppends, _name, _reading(_name))
for _name in "__setitem__ __delitem__ __imul__ insert pop remove clear sort reverse".split():
    setattr(CallAppends, _name, _changing(_name))
del _name
