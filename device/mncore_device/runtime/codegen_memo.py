"""Inductor's C++ code generation, without redoing work whose result it already has.

Two costs of TorchInductor's code generation (torch 2.14.1) grow with a graph's kernels and
recompute a result from the same inputs. Measured on DenseNet-121 (batch 32, O1, one
compile of 215 s):

* Choosing the loop a kernel vectorizes (`select_tiling`, through
  `sizevars.stride_at_vec_range`) runs `sympy.simplify` on each index once per (index, loop
  variable) pair, its cache key; but the variable only decides which of the index's
  divisions are rewritten first, and an index with none along that variable reaches
  `sympy.simplify` unchanged. The indices of channels_last and concatenated buffers hold
  `Min` and `FloorDiv` terms, on which one simplify takes milliseconds: 2,833 calls on
  1,086 distinct indices took 12.3 s.
* `DtypePropagationOpsHandler` is a singleton whose `__init__` binds a rule for every op
  (~60 us), and Python runs that `__init__` at every construction: 52,907 of them, ~3.3 s.

Within `codegen_work_remembered()`, `sympy.simplify(expr)` (no options) returns the result it
returned before for an equal expression: sympy's expressions are immutable, equal ones are
interchangeable (their symbols' assumptions are part of equality), and simplify computes its
result from the expression alone. And the handler binds its rules again only when the
registered rules changed. Every caller gets what it would have computed: the same generated
code.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import sympy

_SIMPLIFY = sympy.simplify


@functools.lru_cache(maxsize=16384)
def _simplified(expr: sympy.Basic) -> Any:
    return _SIMPLIFY(expr)


def _simplify(expr: Any, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs or not isinstance(expr, sympy.Basic):
        return _SIMPLIFY(expr, *args, **kwargs)
    return _simplified(expr)


@contextlib.contextmanager
def codegen_work_remembered() -> Iterator[None]:
    """Within this context, sympy.simplify runs once per distinct expression and Inductor's
    dtype-propagation handler binds its rules once per set of rules (see the module's
    docstring)."""
    from torch._inductor import utils
    from torch._inductor.codegen import common
    from torch._inductor.dtype_propagation import DtypePropagationOpsHandler as handler

    bind_rules = handler.__init__

    def __init__(self) -> None:
        rules = (len(utils.op_dtype_propagation_rules), len(common.pointwise_overrides_data))
        if self.__dict__.get("_bound_rules") != rules:
            bind_rules(self)
            self._bound_rules = rules  # rules are only ever added (at import, by lowering.py)

    previous = sympy.simplify
    sympy.simplify = _simplify
    handler.__init__ = __init__
    try:
        yield
    finally:
        sympy.simplify = previous
        handler.__init__ = bind_rules
