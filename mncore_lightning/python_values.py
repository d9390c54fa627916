"""Python numbers and strings a compiled step depends on: guarded, never silently frozen.

A compiled step is traced once, so a Python value it reads (`self.scale`, `self.hparams.beta`,
a submodule's `dropout.p`) is baked into the graph, and one it changes (`self.n += 1`) changes
once, at trace time. On cpu both follow every step. So:

* the step may not change such a value: tracing raises StaticGraphError naming it (and puts
  the trace-time change back), and points to a tensor or a hook outside the step;
* the values it may have read are recorded with the graph (`PythonValues`). After user code
  ran outside the step (a hook or a callback), the strategy compares them, and a graph whose
  values changed is traced again, as on cpu the next step would compute with the new value.

What counts: bool, int, float and str attributes of every module under the LightningModule
(and their entries in plain dicts the modules hold), and the LightningModule's hparams. On
the LightningModule itself, only the attributes the step read are guarded: hooks there keep
plenty of bookkeeping (`self.best_val_acc`) that no step reads. Lightning's own attributes and
torchmetrics (which run on the host) are left out.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule

from mncore_device import StaticGraphError
from mncore_device._source import user_frame

from .side_effects import is_metric

_SCALARS = (bool, int, float, str)
_TRACKED = (*_SCALARS, dict)  # a dict read by the step: its Python entries are guarded
_MISSING = object()  # an attribute or dict key that is not there
# nn.Module's and Lightning's own attributes, and the hparams containers (read by key below)
_LIGHTNING_OWN = (
    frozenset(vars(torch.nn.Module()))
    | frozenset(vars(LightningModule()))
    | {"_hparams", "_hparams_initial", "_hparams_name"}
)

# key -> (holder, attribute or dict key, value); the holder is a module, a dict or hparams
Entries = dict[str, tuple[Any, Any, Any]]


def _entries(root: torch.nn.Module) -> Entries:
    """Every guarded Python value under `root`, by the name the user wrote it with."""
    found: Entries = {}
    for path, module in root.named_modules():
        if is_metric(module):
            continue
        prefix = f"self.{path}." if path else "self."
        for name, value in vars(module).items():
            if name in _LIGHTNING_OWN:
                continue
            if type(value) in _SCALARS:
                found[prefix + name] = (module, name, value)
            elif type(value) is dict:
                for key, item in value.items():
                    if type(item) in _SCALARS:
                        found[f"{prefix}{name}[{key!r}]"] = (value, key, item)
    hparams = vars(root).get("_hparams")
    if hparams:
        for key, item in hparams.items():
            if type(item) in _SCALARS:
                found[f"self.hparams.{key}"] = (hparams, key, item)
    return found


def _current(holder: Any, key: Any) -> Any:
    if isinstance(holder, dict):
        return holder.get(key, _MISSING)
    return vars(holder).get(key, _MISSING)


def _differs(old: Any, new: Any) -> bool:
    return type(old) is not type(new) or old != new


class PythonValues:
    """The Python values of a module when its step is traced, and which the step depends on."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.before = _entries(root)
        self.read: set[str] = set()  # the LightningModule's own attributes the step read
        self.set_at: dict[str, str] = {}  # ... and the user's line that first set each one
        self.guarded: Entries = {}

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """While tracing: record which of the LightningModule's attributes the step reads."""
        cls = type(self.root)
        self.root.__class__ = _reading_class(cls)
        _recording.append(self)
        try:
            yield
        finally:
            _recording.pop()
            self.root.__class__ = cls

    def settle(self) -> list[str]:
        """After tracing: what the step changed. Changes to the LightningModule's own values
        and hparams are put back and returned (the caller refuses them: the user's step
        keeps state in Python). A submodule's are kept, with a warning: a library module
        fills caches on its first call (a rotary embedding's length), as it would on cpu.
        Then the values the step depends on are recorded."""
        after = _entries(self.root)
        refused, kept = [], []
        for key in [*self.before, *(k for k in after if k not in self.before)]:
            old, new = self.before.get(key), after.get(key)
            if old is not None and new is not None and not _differs(old[2], new[2]):
                continue
            change = f"{key}: {_shown(old)} -> {_shown(new)}"
            where = self.set_at.get(key.removeprefix("self."))
            change += f" at {where}" if where else ""
            if _on_submodule(key):
                kept.append(change)
                continue
            refused.append(change)
            holder, name, _ = old or new
            if old is None:
                (holder.__delitem__ if isinstance(holder, dict) else holder.__delattr__)(name)
            elif isinstance(holder, dict):
                holder[name] = old[2]
            else:
                object.__setattr__(holder, name, old[2])
        if kept:
            warnings.warn(
                f"the compiled step changed Python values of submodules while it was traced "
                f"({'; '.join(kept)}); they keep their new values. A compiled step runs its "
                "Python once: if they would change at every step on cpu, keep them in tensors.",
                stacklevel=2,
            )
        self.guarded = {
            key: entry for key, entry in _entries(self.root).items() if _depends_on(key, self.read)
        }
        return refused

    def changed(self) -> str | None:
        """What changed since the trace among the values the step depends on (None: nothing)."""
        changes = [
            f"{key} changed {old!r} -> {new!r}"
            for key, (holder, name, old) in self.guarded.items()
            if _differs(old, new := _current(holder, name))
        ]
        return "; ".join(changes) if changes else None


def _on_submodule(key: str) -> bool:
    name = key.removeprefix("self.").split("[")[0]
    return "." in name and not name.startswith("hparams.")


def _depends_on(key: str, read: set[str]) -> bool:
    """Submodules' values and hparams always; the LightningModule's own, if the step read
    them."""
    name = key.removeprefix("self.").split("[")[0]
    return "." in name or name in read


def _shown(entry: tuple[Any, Any, Any] | None) -> str:
    return "(unset)" if entry is None else repr(entry[2])


_recording: list[PythonValues] = []  # the step being traced
_READING_CLASSES: dict[type, type] = {}


def _reading_class(cls: type) -> type:
    """`cls`, recording reads of its instances' Python values while a step is traced."""
    if cls not in _READING_CLASSES:

        def __getattribute__(self: Any, name: str) -> Any:
            value = cls.__getattribute__(self, name)
            if _recording and name not in _LIGHTNING_OWN and type(value) in _TRACKED:
                _recording[-1].read.add(name)
            return value

        def __setattr__(self: Any, name: str, value: Any) -> None:
            if _recording and type(value) in _SCALARS:
                _recording[-1].set_at.setdefault(name, user_frame() or "<unknown location>")
            cls.__setattr__(self, name, value)

        _READING_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__getattribute__": __getattribute__,
                "__setattr__": __setattr__,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            },
        )
    return _READING_CLASSES[cls]


def refuse_writes(hook_name: str, changes: list[str]) -> None:
    """The step changed Python values: say which, and what to do instead."""
    if changes:
        raise StaticGraphError(
            f"{hook_name} changes Python values while it is traced ({'; '.join(changes)}). A "
            "compiled step runs its Python once, at trace time, so on the device the change "
            "would happen once instead of at every step. Keep such state in a tensor "
            "(`self.n = torch.zeros(())` outside the step, `self.n = self.n + 1` in it: "
            "carried between steps) or a buffer, or change it in a hook outside the step "
            "(on_train_batch_end)."
        )
