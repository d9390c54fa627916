"""`Context.compile_automap`: compile a function of any pytree of tensors.

MLSDK's `compile` takes a dict of tensors; `compile_automap(function, args, kwargs, ...)`
takes the function's own positional and keyword arguments (tuples, lists, dicts, and
dataclasses or namedtuples registered with `register_pytree_dataclass` /
`register_pytree_namedtuple`), flattens them into one dict of tensors for one static graph,
and rebuilds the function's own result structure on every call.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils import _pytree as pytree

from .errors import InputSpecError

if TYPE_CHECKING:
    from .context import Context

T = TypeVar("T", bound=type)


def register_pytree_dataclass(cls: T) -> T:
    """Let a dataclass of tensors be an argument or result of `compile_automap` (decorator)."""
    pytree.register_dataclass(cls)
    return cls


def register_pytree_namedtuple(cls: T) -> T:
    """Let a NamedTuple of tensors be an argument or result of `compile_automap` (decorator).

    torch's pytrees flatten every namedtuple already; this checks the class is one."""
    if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
        raise TypeError(f"register_pytree_namedtuple: {cls!r} is not a NamedTuple class")
    return cls


def _flatten(args: tuple, kwargs: Mapping[str, Any], what: str) -> tuple[list, Any]:
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what}: argument leaf {index} is a {type(leaf).__name__}, not a tensor; "
                "register custom containers with register_pytree_dataclass / "
                "register_pytree_namedtuple"
            )
    return leaves, spec


class AutomapFunction:
    """A compiled function called with the original function's arguments."""

    def __init__(self, compiled: Any, input_spec: Any, output_spec: Any, n_outputs: int) -> None:
        self.compiled = compiled
        self._input_spec = input_spec
        self._output_spec = output_spec
        self._output_keys = [f"output_{i}" for i in range(n_outputs)]

    @property
    def input_specs(self) -> dict[str, Any]:
        return self.compiled.input_specs

    @property
    def output_specs(self) -> dict[str, Any]:
        return self.compiled.output_specs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = _flatten(args, kwargs, "compile_automap call")
        if spec != self._input_spec:
            raise InputSpecError(
                "compile_automap: the arguments' structure differs from the sample's "
                f"(called with {spec}, compiled for {self._input_spec})"
            )
        outputs = self.compiled({f"input_{i}": leaf for i, leaf in enumerate(leaves)})
        return pytree.tree_unflatten([outputs[k] for k in self._output_keys], self._output_spec)


def compile_automap(
    context: Context,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    codegen_dir: str | os.PathLike[str] | None,
    **compile_kwargs: Any,
) -> AutomapFunction:
    """Compile `function(*args, **kwargs)` (see the module docstring)."""
    leaves, input_spec = _flatten(args, kwargs, "compile_automap")
    keys = [f"input_{i}" for i in range(len(leaves))]
    # the result's structure, noted while the step is captured or traced: written as an
    # attribute, which TorchDynamo replays without guarding on it (a list it would read and
    # guard, and capture the step again when the list is no longer empty)
    result = _ResultStructure()

    def step(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        call_args, call_kwargs = pytree.tree_unflatten([batch[k] for k in keys], input_spec)
        result_leaves, spec = pytree.tree_flatten(function(*call_args, **call_kwargs))
        result.spec = spec
        result.count = len(result_leaves)
        return {f"output_{i}": leaf for i, leaf in enumerate(result_leaves)}

    step.__name__ = getattr(function, "__name__", "function")
    compiled = context.compile(
        step, dict(zip(keys, leaves, strict=True)), codegen_dir, **compile_kwargs
    )
    return AutomapFunction(compiled, input_spec, result.spec, result.count)


class _ResultStructure:
    spec: Any = None
    count: int = 0
