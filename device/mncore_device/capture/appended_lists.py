"""Lists a captured step appends to (`self.outputs.append(loss)`), without a re-compile a call.

Measured with torch 2.14.1: TorchDynamo wraps a list the step touches as a list of its
current items and guards its length (`not self.outputs` while it is empty, then
`len(self.outputs) == 1`, `== 2`, ...); an append is replayed after the graph by assigning
the whole new list (`self.outputs[:] = [old items..., new]`). A list that grows at every
call fails that guard at every call: one re-compile per step. A list subclass, a
`collections.deque` and a `UserList` are guarded the same way (on `.data` for the last), and
no Dynamo setting drops the guard.

`AppendedLists` takes such a list out of Dynamo's view instead: once its length guard has
failed twice (`adopt`, with Dynamo's guard expression), the attribute holds a fresh empty
list during each call (`swapped`), which Dynamo's guards see empty every time, and what the
call appended is added to the real list afterwards, in order. The step must not read such a
list (its length, its items): during a call it holds that call's appends only.

A module-level list the step appends to (`LOSSES.append(loss)` in the user's module) is
guarded as `len(G['__import_<module>'].LOSSES)`: `G` is the captured frame's globals, where
Dynamo keeps the user's module under that alias. Given those globals (`frame_globals`), the
list is taken out of view the same way, in the module's namespace.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

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

    def adopt(self, guard: str) -> bool:
        """Take the list whose length guard `guard` keeps failing out of Dynamo's view; False
        if it is not one attribute list of the modules or a module-level list (or is taken
        already)."""
        expression = length_guard(guard)
        if expression is None:
            return False
        found = self._module_level(expression)
        if found is None:
            name = _LAST_ATTRIBUTE.search(expression)
            if name is None:
                return False
            owners = [m for m in self._root.modules() if type(vars(m).get(name.group(1))) is list]
            if len(owners) != 1:
                return False
            found = owners[0], name.group(1)
        if any(o is found[0] and n == found[1] for o, n in self._found):
            return False
        self._found.append(found)
        return True

    def _module_level(self, expression: str) -> tuple[Any, str] | None:
        """(the module, the name) of a list `G['<alias>'].NAME` in the user's module."""
        match = _FRAME_GLOBAL.fullmatch(expression)
        if match is None or self.frame_globals is None:
            return None
        owner = self.frame_globals.get(match.group("key")[1:-1])
        name = match.group("name")
        if not isinstance(owner, types.ModuleType) or type(vars(owner).get(name)) is not list:
            return None
        return owner, name

    @property
    def names(self) -> list[str]:
        return [name for _, name in self._found]

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """During the call each adopted attribute holds an empty list; afterwards the real
        list gets what the call appended (unless the step assigned the attribute anew)."""
        if not self._found:
            yield
            return
        swaps = []
        for owner, name in self._found:
            real = vars(owner).get(name)
            if type(real) is list:
                fresh: list = []
                vars(owner)[name] = fresh
                swaps.append((owner, name, real, fresh))
        try:
            yield
        finally:
            for owner, name, real, fresh in swaps:
                if vars(owner).get(name) is fresh:
                    vars(owner)[name] = real
                    real.extend(fresh)
