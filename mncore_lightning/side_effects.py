"""Python side effects of a compiled step, recorded while tracing and replayed on the host.

A compiled step is traced once, so Python code in it runs once, at trace time. Two side
effects that Lightning users rely on are therefore recorded and replayed after every call,
with the values that call's graph computed, the way `self.log` is (see `LogRecorder`):

* Appending to a list that the module holds (Lightning's documented recipe
  `self.validation_step_outputs.append(preds)`, gathered in `on_validation_epoch_end`).
  While tracing, each such list is replaced by a recording list: the appended items (tensors,
  or pytrees of tensors and plain values) become graph outputs, the list keeps its contents,
  and after each call the host values are appended to the module's list, in order. Any
  other mutation of such a list inside a step (pop, clear, item assignment...) is refused:
  it belongs in a hook outside the step.
* torchmetrics: calls on a `Metric` or `MetricCollection` of the module (`metric(...)`,
  `update`, `compute`, `reset`) are not traced. Their tensor arguments become graph outputs,
  and after each call the metric runs for real on the host with them (so its input checks,
  `validate_args=True`, see host tensors). While tracing, a call returns a stand-in computed
  by a copy of the metric: it can be logged (`self.log` logs the host value after each call)
  or appended to a list, but not computed with. Logging the Metric object itself
  (`self.log("acc", self.acc)`) is replayed after the metric's own calls, as on cpu.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from mncore_device import StaticGraphError
from mncore_device._source import user_frame

from .batch_values import PassedThrough
from .step_counters import LiveCounter

EFFECT_PREFIX = "effect/"

_METRIC_METHODS = ("forward", "update", "compute", "reset")


@functools.cache
def metric_types() -> tuple[type, ...]:
    """torchmetrics' Metric and MetricCollection, or () when torchmetrics is not installed."""
    try:
        from torchmetrics import Metric, MetricCollection
    except ImportError:  # pragma: no cover - Lightning itself depends on torchmetrics
        return ()
    return (Metric, MetricCollection)


def is_metric(value: Any) -> bool:
    types = metric_types()
    return bool(types) and isinstance(value, types)


def metric_paths(root: torch.nn.Module) -> list[str]:
    """Module paths of the metrics under `root` (their state runs on the host, not carried)."""
    return [path for path, module in root.named_modules() if is_metric(module)]


def in_metric(path: str, paths: list[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in paths)


# --- values a traced call stands in for --------------------------------------------------


class MetricValue(torch.Tensor):
    """What a metric call returns while the step is traced: the value a copy of the metric
    computed at trace time. The real value exists only on the host, after each call, so this
    one may be logged or appended to a list (both replayed with the host value) but not
    computed with."""

    _call: _MetricCall
    _index: int

    @staticmethod
    def __new__(cls, value: torch.Tensor, call: _MetricCall, index: int) -> MetricValue:
        stand_in = torch.Tensor._make_subclass(cls, value)
        stand_in._call = call
        stand_in._index = index
        return stand_in

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _HARMLESS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        call = next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, MetricValue))._call
        raise StaticGraphError(
            f"the step computes with the value that {call.describe()} returned, at "
            f"{user_frame() or '<unknown location>'}. Under MNCoreStrategy torchmetrics run on "
            "the host after each compiled call, so their results exist only there: log them "
            "(self.log) or compute the loss from tensors of the step instead."
        )

    def host_value(self) -> Any:
        return self._call.result_leaves[self._index]


_HARMLESS = {
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.dim,
    torch.Tensor.size,
    torch.Tensor.numel,
}


class Packed:
    """A pytree recorded while tracing (a returned value, an appended item, a metric call's
    arguments): tensor leaves become graph outputs, step counters graph outputs that come back
    as Python ints (their value at each call), stand-ins (a metric's result, a batch value
    passed through) are resolved on replay, anything else is kept as a constant."""

    def __init__(self, tree: Any, prefix: str, outputs: dict[str, torch.Tensor]) -> None:
        leaves, self.spec = tree_flatten(tree)
        self.leaves: list[tuple[str, Any]] = []
        for i, leaf in enumerate(leaves):
            key = f"{prefix}{i}"
            if type(leaf) is PassedThrough or isinstance(leaf, MetricValue):
                self.leaves.append(("stand_in", leaf))
            elif isinstance(leaf, torch.Tensor):
                outputs[key] = leaf.detach()
                self.leaves.append(("output", key))
            elif isinstance(leaf, LiveCounter):
                outputs[key] = leaf.live().clone()
                self.leaves.append(("counter", key))
            else:
                self.leaves.append(("constant", leaf))

    def rebuild(self, outputs: Mapping[str, torch.Tensor]) -> Any:
        leaves = []
        for kind, value in self.leaves:
            if kind == "output":
                leaves.append(outputs[value])
            elif kind == "counter":
                leaves.append(int(outputs[value]))
            elif kind == "stand_in":
                leaves.append(value.host_value())
            else:
                leaves.append(value)
        return tree_unflatten(leaves, self.spec)


# --- torchmetrics ------------------------------------------------------------------------


class _MetricCall:
    """One call on a metric, made while tracing; `replay` makes it on the host metric.

    Lives in `LogRecorder.calls`, so metric calls and `self.log` calls replay in the order
    the step made them."""

    def __init__(self, name: str, metric: Any, method: str, args: Packed) -> None:
        self.name = name
        self.metric = metric
        self.method = method
        self.args = args
        self.result_leaves: list[Any] = []

    def describe(self) -> str:
        call = "" if self.method == "forward" else f".{self.method}"
        return f"self.{self.name}{call}(...)"

    def replay(self, outputs: Mapping[str, torch.Tensor]) -> None:
        args, kwargs = self.args.rebuild(outputs)
        function = self.metric if self.method == "forward" else getattr(self.metric, self.method)
        result = function(*args, **kwargs)
        self.result_leaves = tree_flatten(result)[0]


class _ListAppend:
    def __init__(self, module: torch.nn.Module, name: str, item: Packed) -> None:
        self.module = module
        self.name = name
        self.item = item


class _RecordingList(list):
    """Stands in for a module's list while the step is traced: records appends, refuses
    any other mutation."""

    def __init__(self, items: list, effects: SideEffects, module: Any, name: str) -> None:
        super().__init__(items)
        self._effects = effects
        self._module = module
        self._name = name

    def append(self, item: Any) -> None:
        super().append(item)
        self._effects._record_append(self._module, self._name, item)

    def extend(self, items: Any) -> None:
        for item in list(items):
            self.append(item)

    def __iadd__(self, items: Any) -> _RecordingList:
        self.extend(items)
        return self

    def _refuse(self, operation: str) -> Any:
        raise StaticGraphError(
            f"the step calls {operation} on the list self.{self._effects.path_of(self._module)}"
            f"{self._name} at {user_frame() or '<unknown location>'}. A compiled step is traced "
            "once; appending to a list the module holds is replayed after every call, but no "
            "other change to it is. Change the list in a hook outside the step (e.g. "
            "on_validation_epoch_end or on_train_batch_end)."
        )

    def _refuser(operation: str):  # noqa: N805 - builds the methods below
        def refuse(self, *args: Any, **kwargs: Any) -> Any:
            return self._refuse(operation)

        return refuse

    insert = _refuser("insert()")
    pop = _refuser("pop()")
    remove = _refuser("remove()")
    clear = _refuser("clear()")
    sort = _refuser("sort()")
    reverse = _refuser("reverse()")
    __setitem__ = _refuser("item assignment")
    __delitem__ = _refuser("del")
    __imul__ = _refuser("*=")
    del _refuser


class SideEffects:
    """The side effects of one compiled hook: recorded while tracing, replayed after calls."""

    def __init__(self, root: torch.nn.Module, recorder: Any) -> None:
        self.root = root
        self.recorder = recorder  # LogRecorder: metric calls are replayed among its log calls
        self.appends: list[_ListAppend] = []
        self.outputs: dict[str, torch.Tensor] = {}
        self._count = 0
        self._lists: list[tuple[Any, str, list, _RecordingList]] = []
        self._patched: list[tuple[Any, str, bool, Any]] = []
        self._copies: dict[int, Any] = {}
        self._paths = {id(m): p for p, m in root.named_modules()}

    def path_of(self, module: Any) -> str:
        path = self._paths.get(id(module), "")
        return f"{path}." if path else ""

    def _prefix(self) -> str:
        self._count += 1
        return f"{EFFECT_PREFIX}{self._count}/"

    # --- while tracing

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Around the user's hook while it is traced."""
        paths = metric_paths(self.root)
        try:
            for path, module in self.root.named_modules():
                if in_metric(path, paths):
                    continue
                for name, value in list(vars(module).items()):
                    if type(value) is list or isinstance(value, _RecordingList):
                        recording = _RecordingList(value, self, module, name)
                        object.__setattr__(module, name, recording)
                        self._lists.append((module, name, value, recording))
            for path in paths:
                self._patch(path, self.root.get_submodule(path))
            yield
            for module, name, _, recording in self._lists:
                if vars(module).get(name) is not recording:
                    raise StaticGraphError(
                        f"the step assigns a new value to self.{self.path_of(module)}{name}, a "
                        "list the module holds. A compiled step is traced once, so the "
                        "assignment would happen once; append to the list in the step and "
                        "replace or clear it in a hook outside the step."
                    )
        finally:
            self._unpatch()
            for module, name, original, recording in self._lists:
                if vars(module).get(name) is recording:
                    object.__setattr__(module, name, original)
            self._lists.clear()

    def _record_append(self, module: Any, name: str, item: Any) -> None:
        self.appends.append(_ListAppend(module, name, Packed(item, self._prefix(), self.outputs)))

    def _patch(self, name: str, metric: Any) -> None:
        for method in _METRIC_METHODS:
            had = method in vars(metric)
            original = vars(metric).get(method)
            stand_in = self._stand_in(name, metric, method)
            object.__setattr__(metric, method, stand_in)
            self._patched.append((metric, method, had, original, stand_in))

    def _unpatch(self) -> None:
        for metric, method, had, original, _ in reversed(self._patched):
            if had:
                object.__setattr__(metric, method, original)
            else:
                vars(metric).pop(method, None)
        self._patched.clear()

    def _stand_in(self, name: str, metric: Any, method: str):
        def call(*args: Any, **kwargs: Any) -> Any:
            recorded = _MetricCall(
                name, metric, method, Packed((args, kwargs), self._prefix(), self.outputs)
            )
            self.recorder.calls.append(recorded)
            # the trace-time value, from a copy that sees the same calls: the host metric's
            # state stays untouched
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes(), torch.no_grad():
                copied = self._copy(metric)
                args, kwargs = tree_map(_plain, (args, kwargs))
                function = copied if method == "forward" else getattr(copied, method)
                result = function(*args, **kwargs)
            if method in ("update", "reset"):
                return None
            leaves, spec = tree_flatten(result)
            leaves = [
                MetricValue(leaf, recorded, i) if isinstance(leaf, torch.Tensor) else leaf
                for i, leaf in enumerate(leaves)
            ]
            return tree_unflatten(leaves, spec)

        return call

    def _copy(self, metric: Any) -> Any:
        """A deep copy of the metric as it was before tracing (unpatched while copied)."""
        if id(metric) not in self._copies:
            patched = list(self._patched)
            self._unpatch()
            try:
                self._copies[id(metric)] = copy.deepcopy(metric)
            finally:
                for target, method, _, _, stand_in in patched:
                    object.__setattr__(target, method, stand_in)
                self._patched = patched
        return self._copies[id(metric)]

    def capture(self) -> dict[str, torch.Tensor]:
        """After the user's hook: the tensors the host replay needs, as graph outputs."""
        return dict(self.outputs)

    # --- after each call

    def replay(self, outputs: Mapping[str, torch.Tensor]) -> None:
        """Append this call's values to the module's lists (after the metric replays, which
        give stand-ins their host values)."""
        for append in self.appends:
            target = getattr(append.module, append.name, None)
            if not isinstance(target, list):
                raise StaticGraphError(
                    f"the compiled step appends to self.{self.path_of(append.module)}"
                    f"{append.name}, which is no longer a list ({type(target).__name__})"
                )
            target.append(append.item.rebuild(outputs))


def _plain(value: Any) -> Any:
    """A trace-time tensor as a plain host tensor (for the metric copy's eager call)."""
    if isinstance(value, MetricValue):
        with torch._C.DisableTorchFunctionSubclass():
            return value.detach().clone().as_subclass(torch.Tensor)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value
