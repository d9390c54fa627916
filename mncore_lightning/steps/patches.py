"""Names set in objects' instance dicts while a step runs, and put back after.

A captured step swaps some of the module's and the optimizers' methods for stand-ins while
it runs (a recorder for `self.log`, markers for `opt.step()`, host calls for a manual step's
methods): each is set in the instance's `__dict__`, which shadows the class's method for that
object only, and the previous entry (or its absence) is restored afterwards, in reverse order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

REMOVED: Any = object()  # as a value: the entry is removed (the class's attribute shows)


class Patches:
    """A list of (namespace, name, value) set by `install` and undone by `uninstall`."""

    def __init__(self) -> None:
        self._patches: list[tuple[dict, str, Any]] = []
        self._saved: list[tuple[dict, str, Any]] = []

    def add(self, namespace: dict, name: str, value: Any) -> None:
        self._patches.append((namespace, name, value))

    @property
    def applied(self) -> bool:
        return bool(self._saved)

    def install(self) -> None:
        for namespace, name, value in self._patches:
            self._saved.append((namespace, name, namespace.get(name, REMOVED)))
            _set(namespace, name, value)

    def uninstall(self) -> None:
        while self._saved:
            _set(*self._saved.pop())

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        self.install()
        try:
            yield
        finally:
            self.uninstall()


@contextlib.contextmanager
def patched(namespace: dict, **values: Any) -> Iterator[None]:
    """`values` set in `namespace` (REMOVED: taken out) while the body runs."""
    patches = Patches()
    for name, value in values.items():
        patches.add(namespace, name, value)
    with patches.installed():
        yield


def _set(namespace: dict, name: str, value: Any) -> None:
    if value is REMOVED:
        namespace.pop(name, None)
    else:
        namespace[name] = value
