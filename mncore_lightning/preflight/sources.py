"""Dynamo's sources (where a step read a value: `L['function'].__closure__[2].cell_contents.
__self__._hparams['lr']`) as the names the user wrote (`self.hparams.lr`).

A source is named when it leads to something of the user's: an attribute of the module
(`self.scale`, `self.net.2.p`, `self.hparams.lr`), a batch element or hook argument
(`batch[2]`, `batch_idx`), a global of the user's modules (`TABLE['k']`), a class attribute
of the user's classes (`MyModule.FACTOR`), a closure cell of the user's functions
(`make.<locals>.scale`), or what the step reads through Lightning (`self.global_step`,
`self.optimizers().param_groups[0]['lr']`). Everything else is the framework's plumbing and
gets no name (None): the capture's own closures, Lightning's and torch's globals and class
attributes, private attributes that the user's classes do not assign (`self._fabric`),
Lightning's loop progress besides `global_step` and `current_epoch`, dict-key order, function
defaults, tensor sizes.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch._dynamo import source as dynamo_source
from torch._guards import ChainedSource, Source

from mncore_device._source import _is_library

_UNKNOWN = object()  # an object the name leads to, not known at report time
_STATE_DICTS = ("_modules", "_parameters", "_buffers")
# Lightning's counters and objects as a step reads them (after `self.trainer.` is rendered)
_LIGHTNING_NAMES = (
    (re.compile(r"^self\.trainer\._accelerator_connector\.strategy\b"), "self.trainer.strategy"),
    (
        re.compile(
            r"^self\.trainer\.fit_loop\.epoch_loop\.(?:automatic_optimization\.optim_progress"
            r"\.optimizer\.step|manual_optimization\.optim_step_progress)\.total\.completed$"
        ),
        "self.global_step",
    ),
    (
        re.compile(r"^self\.trainer\.fit_loop\.epoch_progress\.current\.completed$"),
        "self.current_epoch",
    ),
)
_OPTIMIZER = re.compile(
    r"^self\.trainer\.strategy\._lightning_optimizers\[(\d+)\](?:\._optimizer)?"
)
_SCHEDULER = re.compile(r"^self\.trainer\.strategy\.lr_scheduler_configs\[(\d+)\]\.scheduler")
_PRIVATE = re.compile(r"\.(_\w+)")
_PROGRESS = re.compile(r"^self\.trainer\.fit_loop\..*_progress\.")


@dataclass
class Namer:
    """Names the sources of one hook's graphs; `keys` maps a dict-key source's Dynamo name to
    the key (Dynamo guards each key it read, with its value)."""

    module: Any  # the LightningModule
    hook_name: str
    optimizers: int = 1
    schedulers: int = 1
    keys: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._assigned = assigned_attributes(type(self.module))
        function = getattr(type(self.module), self.hook_name, None)
        try:
            self._parameters = list(inspect.signature(function).parameters)[1:]
        except (TypeError, ValueError):
            self._parameters = []

    def name(self, source: Source, code: types.CodeType | None = None) -> str | None:
        """The user's name of `source`, read in a frame of `code` (the capture's own frame,
        or one of the user's functions after a graph break); None for the plumbing."""
        chain = []
        node: Any = source
        while isinstance(node, ChainedSource):
            if getattr(node, "_name_template", None) != "{0}":  # a wrapper: the same object
                chain.append(node)
            node = node.base
        chain.append(node)
        chain.reverse()
        user_frame = code is not None and not _is_library(code.co_filename)
        try:
            found = self._root(chain, user_frame)
            if found is None:
                return None
            text, obj, index = found
            name = self._path(text, obj, chain[index:])
        except _Plumbing:
            return None
        if name is None:
            return None
        for pattern, replacement in _LIGHTNING_NAMES:
            name = pattern.sub(replacement, name)
        name = _OPTIMIZER.sub(lambda m: _indexed("self.optimizers()", m, self.optimizers), name)
        name = _SCHEDULER.sub(lambda m: _indexed("self.lr_schedulers()", m, self.schedulers), name)
        if _PROGRESS.match(name):  # Lightning's loop bookkeeping, besides its counters
            return None
        for match in _PRIVATE.finditer(name):
            if not name.startswith("self.") or name[5 : match.end()] not in self._assigned:
                return None  # the framework's own attribute
        return name

    def _root(self, chain: list, user_frame: bool) -> tuple[str, Any, int] | None:
        """(name, object, index of the next source) of the chain's root."""
        root = chain[0]
        if isinstance(root, dynamo_source.LocalSource):
            if user_frame:  # a local of the user's function
                obj = self.module if root.local_name == "self" else _UNKNOWN
                return root.local_name, obj, 1
            if root.local_name == "args" and len(chain) > 1:
                item = chain[1]
                if not isinstance(item, dynamo_source.GetItemSource) or item.index_is_slice:
                    return None
                if item.index == 0:
                    return "batch", _UNKNOWN, 2
                if 0 < item.index < len(self._parameters):
                    return self._parameters[item.index], _UNKNOWN, 2
                return None
            # the capture's own frame: the hook is a bound method in a closure cell of its step
            for index, node in enumerate(chain[1:], 1):
                if isinstance(node, dynamo_source.AttrSource) and node.member == "__self__":
                    return "self", self.module, index + 1
                if isinstance(node, dynamo_source.AttrSource) and node.member == "__func__":
                    hook = getattr(self.module, self.hook_name, None)
                    return self.hook_name, getattr(hook, "__func__", _UNKNOWN), index + 1
                if not isinstance(
                    node,
                    (
                        dynamo_source.ClosureSource,
                        dynamo_source.GetItemSource,
                        dynamo_source.CellContentsSource,
                    ),
                ):
                    return None
            return None
        if isinstance(root, dynamo_source.GlobalSource):
            name = root.global_name
            if name.startswith("__import_"):  # a module Dynamo put in the frame's globals
                module = sys.modules.get(name.removeprefix("__import_").replace("_dot_", "."))
                if module is None or _is_library(getattr(module, "__file__", None) or "<"):
                    return None
                if len(chain) < 2 or not isinstance(chain[1], dynamo_source.AttrSource):
                    return None
                own = module.__name__ == type(self.module).__module__
                attr = chain[1].member
                text = attr if own else f"{module.__name__}.{attr}"
                return text, getattr(module, attr, _UNKNOWN), 2
            if user_frame and not name.startswith("__"):
                return name, _UNKNOWN, 1
        return None

    def _path(self, text: str, obj: Any, chain: list) -> str | None:
        """`text` followed by the rest of the chain, read from `obj` where it is known."""
        index = 0
        while index < len(chain):
            node = chain[index]
            nxt = chain[index + 1] if index + 1 < len(chain) else None
            if isinstance(node, dynamo_source.ClosureSource):
                text, obj = self._closure_cell(obj, chain[index + 1 : index + 3])
                index += 3
                continue
            if isinstance(node, dynamo_source.TypeSource):
                text, obj, used = self._class_attribute(obj, chain[index + 1 :])
                index += 1 + used
                continue
            if isinstance(node, (dynamo_source.AttrSource, dynamo_source.GenericAttrSource)):
                member = node.member
                if member.startswith("__"):
                    return None
                if member in _STATE_DICTS and _is_item(nxt):
                    key = self._key(nxt)
                    text, obj = f"{text}.{key}", _item(_attribute(obj, member), key)
                    index += 2
                    continue
                if member == "_hparams":
                    member = "hparams"
                elif member == "_trainer" and text == "self":
                    member = "trainer"
                text, obj = f"{text}.{member}", _attribute(obj, member)
            elif _is_item(node):
                key = self._key(node)
                dotted = text.endswith(".hparams") and isinstance(key, str) and key.isidentifier()
                text = f"{text}.{key}" if dotted else f"{text}[{key!r}]"
                obj = _item(obj, key)
            else:  # dict-key order, defaults, tensor sizes, ...: not a user's value
                return None
            index += 1
        return text

    def _key(self, node: Any) -> Any:
        index = node.index
        if isinstance(index, Source):  # a dict key Dynamo read: its guard holds the key
            if index.name not in self.keys:
                raise _Plumbing
            return self.keys[index.name]
        if getattr(node, "index_is_slice", False):
            raise _Plumbing
        return index

    def _closure_cell(self, function: Any, rest: list) -> tuple[str, Any]:
        """`<function>.__closure__[i].cell_contents`: the cell's name, `outer.<locals>.var`."""
        if len(rest) != 2 or not isinstance(rest[1], dynamo_source.CellContentsSource):
            raise _Plumbing
        code = getattr(function, "__code__", None)
        if code is None or _is_library(code.co_filename):
            raise _Plumbing
        position = rest[0].index
        var = rest[1].freevar_name or code.co_freevars[position]
        outer = function.__qualname__.rpartition(".<locals>.")[0] or function.__qualname__
        try:
            value = function.__closure__[position].cell_contents
        except (IndexError, ValueError, TypeError):
            value = _UNKNOWN
        return f"{outer}.<locals>.{var}", value

    def _class_attribute(self, obj: Any, rest: list) -> tuple[str, Any, int]:
        """`type(obj).__mro__[i].__dict__[name]` (or `type(obj).__dict__[name]`): a class
        attribute, named `Class.name` for the user's classes."""
        if obj is _UNKNOWN:
            raise _Plumbing
        cls, used = type(obj), 0
        if rest and isinstance(rest[0], dynamo_source.TypeMROSource):
            if len(rest) < 2 or not isinstance(rest[1], dynamo_source.GetItemSource):
                raise _Plumbing
            cls, used = cls.__mro__[rest[1].index], 2
        if len(rest) < used + 2 or not isinstance(rest[used], dynamo_source.TypeDictSource):
            raise _Plumbing
        item = rest[used + 1]
        if not _is_item(item) or not user_class(cls):
            raise _Plumbing
        key = self._key(item)
        return f"{cls.__qualname__}.{key}", vars(cls).get(key, _UNKNOWN), used + 2


class _Plumbing(Exception):  # noqa: N818 - a signal inside Namer: the source is not named
    pass


def _is_item(node: Any) -> bool:
    return isinstance(
        node,
        (
            dynamo_source.GetItemSource,
            dynamo_source.DictGetItemSource,
            dynamo_source.DictSubclassGetItemSource,
        ),
    )


def _attribute(obj: Any, name: str) -> Any:
    if obj is _UNKNOWN:
        return _UNKNOWN
    try:
        return getattr(obj, name)
    except Exception:  # noqa: BLE001 - a property that fails after the run: not needed
        return _UNKNOWN


def _item(obj: Any, key: Any) -> Any:
    if obj is _UNKNOWN:
        return _UNKNOWN
    try:
        return obj[key]
    except Exception:  # noqa: BLE001
        return _UNKNOWN


def _indexed(base: str, match: re.Match, count: int) -> str:
    return base if count == 1 else f"{base}[{match[1]}]"


def plain(value: Any) -> bool:
    """A value a guard shows as it is: a number, a string, None, or a tuple of those."""
    if isinstance(value, (tuple, frozenset)):
        return all(plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, complex, str, bytes))


def assigned_attributes(cls: type, skip: Iterable[str] = ()) -> dict[str, list[str]]:
    """`{"scale": [methods], "net.2.p": [...], "hparams.lr": [...]}`: the attributes that the
    methods of the user's classes (not Lightning's or torch's; not those named in `skip`)
    assign on `self`, with the methods' names."""
    skip = frozenset(skip)
    writers: dict[str, list[str]] = {}
    for klass in cls.__mro__:
        if not user_class(klass):
            continue
        for name, function in vars(klass).items():
            if name in skip or not inspect.isfunction(function):
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
            except (OSError, TypeError, SyntaxError):
                continue
            for node in ast.walk(tree):
                targets = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                for target in targets:
                    path = _self_path(target)
                    if path is not None and name not in writers.setdefault(path, []):
                        writers[path].append(name)
    return writers


def user_class(cls: type) -> bool:
    """Whether `cls` is defined in the user's code (not torch's, Lightning's or this package's)."""
    try:
        file = inspect.getsourcefile(cls)
    except TypeError:  # a builtin class
        return False
    return file is not None and not _is_library(file)


def _self_path(target: ast.expr) -> str | None:
    """`self.a.b = ...` -> "a.b"; `self.net[2].p` -> "net.2.p" (a submodule's name);
    `self.d["k"] = ...` -> "d['k']"; else None."""
    parts = []
    while True:
        if isinstance(target, ast.Attribute):
            parts.append(f".{target.attr}")
        elif isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
            key = target.slice.value
            parts.append(f".{key}" if isinstance(key, int) else f"[{key!r}]")
        else:
            break
        target = target.value
    if not parts or not (isinstance(target, ast.Name) and target.id == "self"):
        return None
    return "".join(reversed(parts)).removeprefix(".")
