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
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from torch import nn

_LENGTH = re.compile(r"(?:len\((?P<len>.+)\)|not (?P<not>.+))")
_LAST_ATTRIBUTE = re.compile(r"\.([A-Za-z_]\w*)$")


def length_guard(guard: str) -> str | None:
    """The list expression a length guard checks (`len(x) == 2` and `not x`), else None."""
    match = _LENGTH.fullmatch(guard.strip())
    if match is None:
        return None
    return (match.group("len") or match.group("not")).strip()


class AppendedLists:
    """The lists of `root`'s modules that a captured step appends to (see the module)."""

    def __init__(self, root: nn.Module) -> None:
        self._root = root
        self._found: list[tuple[nn.Module, str]] = []

    def adopt(self, guard: str) -> bool:
        """Take the list whose length guard `guard` keeps failing out of Dynamo's view; False
        if it is not one attribute list of the modules (or is taken already)."""
        expression = length_guard(guard)
        name = _LAST_ATTRIBUTE.search(expression) if expression else None
        if name is None:
            return False
        owners = [m for m in self._root.modules() if type(vars(m).get(name.group(1))) is list]
        if len(owners) != 1 or any(o is owners[0] and n == name.group(1) for o, n in self._found):
            return False
        self._found.append((owners[0], name.group(1)))
        return True

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
