"""Run a TorchDynamo graph whose Python numbers are tensors, so a static graph follows them.

Dynamo turns an int or float the step reads and that changes (a step counter, a learning
rate, a NumPy scalar) into a graph input, and the arithmetic on it (`(step + 1) / 4`,
`math.sqrt(lr)`, `min(1.0, x)`, `loss.item() * 3`) into graph nodes on SymInts and SymFloats.
A device graph has tensor inputs only: `ScalarsAsTensors` runs such a graph (under make_fx,
which records what it does) with each number as a 0-d tensor, and computes as Python would:

- ints are int64 tensors and floats float64 tensors (Python's double), `/` of ints is a
  float, `//` floors, `min`/`max`/`sqrt` compute in those dtypes, `.item()` of a tensor is
  its value as such a number;
- where a number meets a tensor op (`loss * w`), it is cast first to the dtype that op
  computes in (its floating tensor arguments', else the default float dtype), as a Python
  number there is: `loss * w` stays float32, as `loss * 0.25` does.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map

from .._source import replaying

_BINARY: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    operator.add: torch.add,
    operator.sub: torch.sub,
    operator.mul: torch.mul,
    operator.pow: torch.pow,
    operator.mod: torch.remainder,
}
_COMPARE: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    operator.eq: torch.eq,
    operator.ne: torch.ne,
    operator.lt: torch.lt,
    operator.le: torch.le,
    operator.gt: torch.gt,
    operator.ge: torch.ge,
}
_LOGICAL: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    operator.and_: torch.logical_and,
    operator.or_: torch.logical_or,
    operator.xor: torch.logical_xor,
}
_RANGE_HINTS = {
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}
_TENSOR_OF = (torch.tensor, torch._refs.tensor)  # Dynamo records torch.tensor(x) as the latter
_ROUNDING: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {
    math.floor: torch.floor,
    math.ceil: torch.ceil,
    math.trunc: torch.trunc,
}
_UNARY_FLOAT: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {
    # what Dynamo records for math.cos(n) and the like of a number that changes (a SymInt)
    **{
        getattr(torch, f"_sym_{name}"): getattr(torch, name)
        for name in (
            "sqrt",
            "cos",
            "sin",
            "tan",
            "cosh",
            "sinh",
            "tanh",
            "acos",
            "asin",
            "atan",
            "log2",
        )
    },
    math.sqrt: torch.sqrt,
    math.exp: torch.exp,
    math.log: torch.log,
    math.cos: torch.cos,
    math.sin: torch.sin,
    math.tanh: torch.tanh,
}


def _is_item(target: Any) -> bool:
    """Dynamo's `.item()` of a NumPy scalar (which it holds as a tensor): a number."""
    from torch._dynamo.utils import numpy_method_wrapper

    return isinstance(target, numpy_method_wrapper) and target.method == "item"


class ScalarsAsTensors(fx.Interpreter):
    """Run `graph_module` with numbers as 0-d tensors (see the module docstring).

    `numbers`: the placeholders that stand for Python numbers; their values are given as
    0-d int64 or float64 tensors. `calls`: a function to call instead of a node's target
    (a `traced_call` marker's host work)."""

    def __init__(
        self,
        graph_module: fx.GraphModule,
        numbers: set[str],
        calls: Mapping[Any, Callable[..., Any]] = {},
    ) -> None:
        super().__init__(graph_module, garbage_collect_values=True)
        self._numbers = numbers
        self._calls = calls
        self._scalar: set[int] = set()  # ids of the tensors that stand for Python numbers
        self._alive: list[torch.Tensor] = []  # those tensors, kept alive for the run

    # -- numbers -----------------------------------------------------------------------------

    def _is_number(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and id(value) in self._scalar

    def _number(self, value: torch.Tensor) -> torch.Tensor:
        self._scalar.add(id(value))
        self._alive.append(value)  # an id is unique only while its object lives
        return value

    @staticmethod
    def _as_number(value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value.double() if value.is_floating_point() else value.long()
        if isinstance(value, bool):
            return torch.tensor(value)
        return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)

    def placeholder(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = super().placeholder(target, args, kwargs)
        if self.current_node.name in self._numbers:
            return self._number(self._as_number(value))
        return value

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_anomaly_enabled():
            return super().run(*args, **kwargs)
        # anomaly mode records, for each op's backward, the stack of its forward; with the
        # nodes' meta preserved (the FX interpreter sets it per node) that stack is the line
        # Dynamo recorded for the node, not this interpreter's frames: an error in the
        # backward then names the user's forward line ("(its backward)"), as AOTAutograd does
        with fx.traceback.preserve_node_meta():
            return super().run(*args, **kwargs)

    def run_node(self, node: fx.Node) -> Any:
        self.current_node = node
        try:
            with replaying(node.meta.get("stack_trace")):  # errors name the user's line
                return super().run_node(node)
        except Exception as error:
            # which node failed, when numbers were among its arguments: the caller may give
            # those numbers as Python numbers instead (an op that needs one, like dropout's p)
            if not hasattr(error, "number_node"):
                args = [self.env.get(a) for a in node.all_input_nodes]
                if any(self._is_number(a) for a in args):
                    error.number_node = node.name
            raise

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target in self._calls:
            return self._calls[target](*args, **kwargs)
        numbers = [a for a in (*args, *kwargs.values()) if self._is_number(a)]
        if _is_item(target):
            return self._number(self._as_number(args[0]))
        if target is torch.select and len(args) == 3 and self._is_number(args[2]):
            # `table[step]` with a number that changes: an index the graph computes
            tensor, dim, index = args
            index = torch.where(index < 0, index + tensor.shape[dim], index).reshape(1)
            return torch.index_select(tensor, dim, index).squeeze(dim)
        if target is torch.scalar_tensor and self._is_number(args[0]):
            return args[0].to(kwargs.get("dtype") or torch.get_default_dtype())
        if target in _TENSOR_OF and len(args) == 1 and self._is_number(args[0]):
            # torch.tensor(a Python number): the default float dtype for a float
            number = args[0]
            dtype = kwargs.get("dtype") or (
                torch.get_default_dtype() if number.is_floating_point() else number.dtype
            )
            return number.detach().to(device=kwargs.get("device"), dtype=dtype, copy=True)
        if numbers and target is torch.ops.aten._assert_scalar.default:
            # Dynamo's runtime check on a number: checked in the graph, on the device
            return torch.ops.aten._assert_async.msg(args[0].bool(), args[1])
        if numbers and target in _RANGE_HINTS:
            return None  # what Dynamo assumes of a number's range: nothing to compute
        if numbers and self._only_numbers(args, kwargs):
            result = self._number_op(target, args)
            if result is not NotImplemented:
                return result
        if numbers:
            args, kwargs = self._cast_for_tensor_op(args, kwargs)
        return target(*args, **kwargs)

    def call_method(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target == "item" and isinstance(args[0], (int, float, bool)):
            return args[0]  # a number given as such (a fixed one)
        if target == "item" and isinstance(args[0], torch.Tensor):
            return self._number(self._as_number(args[0].detach()))  # a number has no grad
        if target == "detach" and self._is_number(args[0]):
            # Dynamo holds a Python random draw (`random.random()`) as a tensor, so
            # `x.detach() if isinstance(x, torch.Tensor) else x` detaches it: a number has
            # no grad, it stays the number
            return args[0]
        if target == "__round__" and self._is_number(args[0]):
            return self._round(args[0], args[1] if len(args) > 1 else None)
        if any(self._is_number(a) for a in (*args, *kwargs.values())):
            if self._is_number(args[0]):
                raise TypeError(f"a Python number has no method {target!r} in a compiled step")
            args, kwargs = self._cast_for_tensor_op(args, kwargs)
        return super().call_method(target, args, kwargs)

    def _round(self, value: torch.Tensor, ndigits: Any) -> torch.Tensor:
        """round(x) is an int and round(x, n) a float, halves to even, as in Python."""
        if not value.is_floating_point():
            return value
        if ndigits is None:
            return self._number(torch.round(value.double()).long())
        return self._number(torch.round(value.double(), decimals=int(ndigits)))

    def _only_numbers(self, args: tuple, kwargs: dict) -> bool:
        """No real tensor among the arguments: Python arithmetic on numbers."""
        return not kwargs and all(
            self._is_number(a) or isinstance(a, (int, float, bool)) for a in args
        )

    def _number_op(self, target: Any, args: tuple) -> Any:
        values = [self._as_number(a) for a in args]
        floating = any(v.is_floating_point() for v in values)
        if target in _BINARY:
            if floating:
                values = [v.double() for v in values]
            return self._number(_BINARY[target](*values))
        if target is operator.truediv:
            return self._number(torch.div(values[0].double(), values[1].double()))
        if target is operator.floordiv:
            if floating:
                return self._number(torch.floor(values[0].double() / values[1].double()))
            return self._number(torch.div(values[0], values[1], rounding_mode="floor"))
        if target in (operator.neg, operator.pos, operator.abs, abs):
            op = {operator.neg: torch.neg, operator.pos: torch.positive}.get(target, torch.abs)
            return self._number(op(values[0]))
        if target in (torch.sym_min, min, torch.sym_max, max) and len(values) == 2:
            if floating:
                values = [v.double() for v in values]
            op = torch.minimum if target in (torch.sym_min, min) else torch.maximum
            return self._number(op(*values))
        if target in _ROUNDING:  # math.floor(x) and the like: an int
            return self._number(
                _ROUNDING[target](values[0].double()).long() if floating else values[0]
            )
        if target in _UNARY_FLOAT:
            return self._number(_UNARY_FLOAT[target](values[0].double()))
        if target is torch.sym_float:
            return self._number(values[0].double())
        if target is torch.sym_int:
            return self._number(torch.trunc(values[0]).long() if floating else values[0])
        if target in _COMPARE:
            return self._number(_COMPARE[target](*values))
        if target is torch.sym_ite:  # `a if c else b` on a symbolic condition
            then, other = values[1:]
            if then.is_floating_point() or other.is_floating_point():
                then, other = then.double(), other.double()
            return self._number(torch.where(values[0].bool(), then, other))
        if target is torch.sym_not:
            return self._number(torch.logical_not(values[0]))
        if target in _LOGICAL:
            return self._number(_LOGICAL[target](values[0].bool(), values[1].bool()))
        return NotImplemented

    def _cast_for_tensor_op(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Numbers given to a tensor op take the dtype a Python number would compute in."""
        floating = [
            a
            for a in (*args, *kwargs.values())
            if isinstance(a, torch.Tensor) and not self._is_number(a) and a.is_floating_point()
        ]
        dtype = floating[0].dtype if floating else torch.get_default_dtype()

        def cast(value: Any) -> Any:
            if self._is_number(value) and (value.is_floating_point() or floating):
                return value.to(dtype)
            return value

        return tree_map(cast, args), tree_map(cast, kwargs)
