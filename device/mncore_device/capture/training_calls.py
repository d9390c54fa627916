"""`loss.backward()`, `optimizer.step()` and `optimizer.zero_grad()` in a step captured for
`Context.compile`: one graph node each, whose work runs when the graph is replayed.

PFN's MLSDK scripts train inside the compiled function: `optimizer.zero_grad()`, the forward,
`loss.backward()`, `optimizer.step()`. TorchDynamo cannot keep that in one graph: it breaks the
graph at `Tensor.backward()` (unless `trace_autograd_ops`, which still breaks here), and
torch.optim's `step` breaks on purpose. A compiled MLSDK step must be ONE device call, so while
`substituted()` is active (only around the calls of a function compiled by `Context.compile`)
Dynamo records each of these calls as a node whose target does the real work: `_backward`
runs `loss.backward()`, an optimizer's `step` node runs its `step()`. Dynamo runs none of them;
`CapturedGraph.run` calls them in program order when the backend traces the replay into the
device graph (make_fx records the backward and the update like any other op).

What Dynamo does not see, it cannot guard, so the substitution adds what it must:

- the hyperparameters of a torch.optim optimizer (plain-dict param groups: `lr`, `momentum`,
  `betas`, ...) are Python numbers that its `step` bakes into the device graph: each is
  guarded by its source, so changing one re-compiles (reported), never runs a stale value.
  Optimizers whose groups are of another dict type (the MN-Core optimizers) keep them in
  device tensors that every call reads: nothing to guard;
- `.grad` read after `loss.backward()` (clipping by hand, an all-reduce of the gradients)
  would be Dynamo's pre-backward view of the gradient (None, on the host): it is a graph node
  too, whose work gives the gradient the backward computed, so the reads, and in-place
  changes of it, are in the device graph in program order, before the optimizer's step.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from ..errors import StaticGraphError
from ..registry import device_optimizer_for

_installed: list[bool] = []  # whether _install ran
_active = [0]  # > 0 while a Context.compile'd step is called (Dynamo may trace it then)
_works: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> {name: work}
_BACKWARD_DONE = "_mncore_backward_done"  # set on Dynamo's OutputGraph after a backward node


@contextlib.contextmanager
def substituted() -> Iterator[None]:
    """Dynamo records backward, step and zero_grad as nodes (see the module docstring)."""
    if not _installed:
        _install()
        _installed.append(True)
    _active[0] += 1
    try:
        yield
    finally:
        _active[0] -= 1


def _backward(loss: torch.Tensor, gradient: torch.Tensor | None = None) -> None:
    """The work of a `loss.backward()` node: the real backward, on the replayed graph."""
    loss.backward(gradient)


_backward.__qualname__ = _backward.__name__ = "mncore_backward"
torch.fx.node.has_side_effect(_backward)


def _gradient(tensor: torch.Tensor) -> torch.Tensor:
    """The work of a `.grad` read after a `loss.backward()` node: in the replay, the gradient
    that backward computed, the tensor itself (an in-place change of it, `p.grad.mul_(s)`,
    is a change of the gradient the optimizer's step reads next). Dynamo runs it on fake
    tensors only, to learn the gradient's shape: the tensor's own."""
    if is_fake(tensor):
        return torch.empty_like(tensor, requires_grad=False)
    if tensor.grad is None:
        raise StaticGraphError(
            f"a compiled step reads the gradient of a tensor of shape {list(tensor.shape)} "
            "after loss.backward(), which gave it none (it does not reach the loss, or does "
            "not require grad): its .grad is None, as on eager; skip it"
        )
    return tensor.grad


_gradient.__qualname__ = _gradient.__name__ = "mncore_gradient"


def _work(optimizer: torch.optim.Optimizer, name: str) -> Callable[..., None]:
    """The function an optimizer's `name` node calls (one per optimizer and method)."""
    works = _works.setdefault(optimizer, {})
    work = works.get(name)
    if work is None:
        reference = weakref.ref(optimizer)

        def work(*args: Any, **kwargs: Any) -> None:
            # the optimizer the device runs in its place, if registry.register converted it
            getattr(device_optimizer_for(reference()), name)(*args, **kwargs)

        work.__qualname__ = work.__name__ = f"mncore_{type(optimizer).__name__}_{name}"
        torch.fx.node.has_side_effect(work)
        works[name] = work
    return work


def _install() -> None:
    """Add the substitutions to Dynamo's classes (once; inactive outside `substituted`)."""
    from torch._dynamo.variables.base import GetSet, Method
    from torch._dynamo.variables.optimizer import OptimizerVariable
    from torch._dynamo.variables.tensor import TensorVariable

    methods = TensorVariable.__dict__["tp_methods"]
    if getattr(methods["backward"].handler, "_mncore", False):
        return
    original_backward = methods["backward"].handler
    original_grad = TensorVariable.method_attr_grad

    def backward(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        # TensorVariable calls its tp_methods handlers with the method's own arguments
        gradient = args[0] if args else None
        if not _active[0] or len(args) > 1 or kwargs:
            return original_backward(self, tx, *args, **kwargs)
        from torch._dynamo.variables import ConstantVariable

        node_args = (self.as_proxy(),)
        if gradient is not None and not gradient.is_python_constant():
            node_args += (gradient.as_proxy(),)
        tx.output.create_proxy("call_function", _backward, node_args, {})
        setattr(tx.output, _BACKWARD_DONE, True)
        return ConstantVariable.create(None)

    def method_attr_grad(self: Any, tx: Any) -> Any:
        if _active[0] and getattr(tx.output, _BACKWARD_DONE, False):
            from torch._dynamo.variables.builder import wrap_fx_proxy

            proxy = tx.output.create_proxy("call_function", _gradient, (self.as_proxy(),), {})
            return wrap_fx_proxy(tx, proxy)
        return original_grad(self, tx)

    backward._mncore = True
    TensorVariable.tp_methods = {**methods, "backward": Method(backward)}
    TensorVariable.method_attr_grad = method_attr_grad

    def optimizer_method(name: str) -> GetSet:
        def getter(self: Any, tx: Any) -> Any:
            if not _active[0]:
                return None
            from torch._dynamo.variables import ConstantVariable
            from torch._dynamo.variables.misc import LambdaVariable

            _guard_hyperparameters(self)
            work = _work(self.value, name)

            def call(*args: Any, **kwargs: Any) -> Any:
                values = [a.as_python_constant() for a in args]
                named = {k: v.as_python_constant() for k, v in kwargs.items()}
                if name == "step" and (any(v is not None for v in values) or named):
                    from torch._dynamo.exc import unimplemented

                    unimplemented(
                        gb_type="optimizer.step(closure) in a compiled step",
                        context=f"{type(self.value).__name__}.step{tuple(values)}",
                        explanation="A compiled step calls optimizer.step() without a "
                        "closure: the closure's forward and backward would run on the host.",
                        hints=[],
                    )
                tx.output.create_proxy("call_function", work, tuple(values), named)
                return ConstantVariable.create(None)

            return LambdaVariable(call)

        return GetSet(getter)

    table = dict(OptimizerVariable.__dict__.get("tp_getset", {}))
    table["step"] = optimizer_method("step")
    table["zero_grad"] = optimizer_method("zero_grad")
    OptimizerVariable.tp_getset = table


def _guard_hyperparameters(variable: Any) -> None:
    """Guard every Python number of a torch.optim optimizer's param groups by its source: its
    `step`, which Dynamo does not see, reads them as constants of the device graph."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import AttrSource, DictGetItemSource, GetItemSource

    optimizer = variable.value
    if variable.source is None:
        return
    groups = AttrSource(variable.source, "param_groups")
    for index, group in enumerate(optimizer.param_groups):
        if type(group) is not dict:  # the MN-Core optimizers: numbers live in device tensors
            continue
        for key, value in group.items():
            if key != "params" and _is_number_like(value):
                source = DictGetItemSource(GetItemSource(groups, index), key)
                install_guard(source.make_guard(GuardBuilder.CONSTANT_MATCH))


def _is_number_like(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, tuple) and all(_is_number_like(v) for v in value)
