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
and of the plain objects they hold (and their entries in plain dicts the modules hold), and
the LightningModule's hparams. On the LightningModule itself, only the attributes the step
read are guarded: hooks there keep plenty of bookkeeping (`self.best_val_acc`) that no step
reads. Lightning's own attributes and torchmetrics (which run on the host) are left out.

Tensors in the module-level globals of the files that define the LightningModule's classes
(`TOTAL = TOTAL + loss`, `HISTORY["loss"] = loss`, `LOSSES.append(loss)`) cannot be carried:
a step that rebinds, replaces, adds or changes one in place is refused the same way. So is a
step that draws from a Python or NumPy random generator object (`np.random.default_rng()`,
`random.Random()`) held by a module or a global: the draw would happen once.
"""

from __future__ import annotations

import contextlib
import pickle
import random
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule

from mncore_device import StaticGraphError
from mncore_device._source import user_frame

from .carried_state import LIBRARY_PACKAGES, state_owners

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
    for path, owner in state_owners(root):  # modules, and plain objects they hold
        prefix = f"self.{path}"
        for name, value in vars(owner).items():
            if name in _LIGHTNING_OWN and isinstance(owner, torch.nn.Module):
                continue
            if type(value) in _SCALARS:
                found[prefix + name] = (owner, name, value)
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


def _global_tensors(root: torch.nn.Module) -> dict[str, tuple[dict, str, Any, Any, dict]]:
    """`{name: (globals, name, value, contents, stamps)}` for the tensors, dicts and lists in
    the globals of the user's files that define the classes of `root`. `stamps` gives each
    tensor held (by dict key or list index) its identity and version; `contents` is a dict's
    or list's shallow copy, to restore."""
    found = {}
    for module_name, namespace in _user_namespaces(root):
        for name, value in namespace.items():
            if isinstance(value, torch.Tensor):
                items, contents = {None: value}, None
            elif type(value) is dict:
                items, contents = value, dict(value)
            elif type(value) is list:
                items, contents = dict(enumerate(value)), list(value)
            else:
                continue
            stamps = {
                k: (id(v), v._version) for k, v in items.items() if isinstance(v, torch.Tensor)
            }
            found[f"{module_name}.{name}"] = (namespace, name, value, contents, stamps)
    return found


def _generator_kinds() -> list[tuple[type, Callable[[Any], Any], Callable[[Any, Any], None]]]:
    """Python's and NumPy's random generator classes, with how to read and set a state."""
    kinds: list[tuple[type, Callable[[Any], Any], Callable[[Any, Any], None]]] = [
        (random.Random, lambda g: g.getstate(), lambda g, s: g.setstate(s))
    ]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kinds.append(
            (
                numpy.random.Generator,
                lambda g: g.bit_generator.state,
                lambda g, s: setattr(g.bit_generator, "state", s),
            )
        )
        kinds.append(
            (numpy.random.RandomState, lambda g: g.get_state(), lambda g, s: g.set_state(s))
        )
    return kinds


def _generators(root: torch.nn.Module, namespaces: list[tuple[str, dict]]) -> dict[str, tuple]:
    """`{name: (generator, state, pickled state, get_state, set_state)}` for the Python and
    NumPy random generators a step can reach: attributes of modules and of plain objects they
    hold, and globals of the user's files."""
    kinds = _generator_kinds()
    places = [(f"self.{path}", vars(owner)) for path, owner in state_owners(root)]
    places += [
        (f"the module-level global {prefix}.", namespace) for prefix, namespace in namespaces
    ]
    found = {}
    for prefix, namespace in places:
        for name, value in namespace.items():
            for cls, get_state, set_state in kinds:
                if isinstance(value, cls):
                    state = get_state(value)
                    found[prefix + name] = (
                        value,
                        state,
                        pickle.dumps(state),
                        get_state,
                        set_state,
                    )
    return found


def _user_namespaces(root: torch.nn.Module) -> list[tuple[str, dict]]:
    """(module name, globals) of the user's files that define the classes of `root`."""
    found = {}
    for cls in type(root).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and cls.__module__.partition(".")[0] not in LIBRARY_PACKAGES:
            found[cls.__module__] = vars(module)
    return list(found.items())


def _settle_generators(before: dict[str, tuple]) -> list[str]:
    """The generators the step drew from while it was traced, put back as they were."""
    drawn = []
    for name, (generator, state, pickled, get_state, set_state) in before.items():
        if pickle.dumps(get_state(generator)) != pickled:
            drawn.append(
                f"{name}, a random generator the step drew from (draw with torch.rand or "
                "torch.randn instead: the step carries torch's default generator)"
            )
            set_state(generator, state)
    return drawn


def _settle_globals(before: dict, after: dict) -> tuple[list[str], list[str]]:
    """What the step did to the tensors of module-level globals: changes to tensors that
    were there (rebound, replaced, changed in place, removed, or appended to a list) are put
    back and returned first; tensors added to a dict or to an unset global (a lazy cache of
    constants, as on cpu) are kept and returned second."""
    refused, kept = [], []
    for key in [*before, *(k for k in after if k not in before)]:
        old, new = before.get(key), after.get(key)
        was, now = (old[4] if old else {}), (new[4] if new else {})
        if was == now and (old is None or new is None or old[2] is new[2] or not was):
            continue
        grown = new is not None and type(new[2]) is list and len(now) > len(was)
        if grown or any(now.get(k) != stamp for k, stamp in was.items()):
            refused.append(f"the module-level global {key} (a tensor it holds)")
        else:
            kept.append(f"the module-level global {key}")
            continue
        namespace, name, value, contents, _ = old or new
        if old is None:
            del namespace[name]
            continue
        namespace[name] = value
        if type(value) is dict:
            value.clear()
            value.update(contents)
        elif type(value) is list:
            value[:] = contents
    return refused, kept


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
        # plain objects the modules hold: the user's own state, refused like the root's
        self.plain_objects = tuple(
            f"self.{path}"
            for path, owner in state_owners(root)
            if not isinstance(owner, torch.nn.Module)
        )
        self.read: set[str] = set()  # the LightningModule's own attributes the step read
        self.set_at: dict[str, str] = {}  # ... and the user's line that first set each one
        self.guarded: Entries = {}
        self.global_tensors = _global_tensors(root)
        self.generators = _generators(root, _user_namespaces(root))

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
            if _on_submodule(key) and not key.startswith(self.plain_objects):
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
        global_refused, global_kept = _settle_globals(
            self.global_tensors, _global_tensors(self.root)
        )
        refused += global_refused + _settle_generators(self.generators)
        kept += global_kept
        if kept:
            warnings.warn(
                "the compiled step changed Python values of submodules or module-level "
                f"globals while it was traced ({'; '.join(kept)}); they keep their new values "
                "(a cache filled on the first call, as on cpu). A compiled step runs its Python "
                "once: if they would change at every step on cpu, keep them in tensors on the "
                "module.",
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
