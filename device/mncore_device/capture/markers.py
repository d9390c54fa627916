"""Markers: calls Dynamo keeps in the graph as one node, whose work is done when the graph is
traced into a device graph.

A compiled training step is one device call: forward, backward and update. Dynamo cannot
trace a backward (`loss.backward()`) or a torch.optim `step` (which graph-breaks on purpose)
into its graph, but it need not: the step calls a marker at that point (`update(loss)`), and
when `CapturedGraph.run` meets the marker's node while the device graph is traced, it runs
the real backward and update there (`calls={update: ...}`), which make_fx records like any
other op. Dynamo only sees a call that takes the loss and returns a detached copy of it.

A marker may take no tensor (an optimizer's `zero_grad` or `step` in a manual step: their
work reads the parameters' gradients, which only the device graph has), or several, and
Python constants (a clipping threshold): its work gets them all, in the graph's order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from ..errors import StaticGraphError


def traced_call(
    name: str, on_capture: Callable[[str], None] | None = None
) -> Callable[..., torch.Tensor]:
    """A new marker named `name`: `marker(*args, **kwargs)` is one graph node with a side
    effect (never removed as unused), in the step's order. Dynamo runs it on fake tensors
    only (to learn its output: a detached copy of its first tensor argument, or a 0-d tensor
    when it has none), and then calls `on_capture(name)`, while it is still capturing the
    step up to that point; run on real tensors, the step ran eagerly, and it raises."""

    def marker(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        result = torch.zeros(()) if tensor is None else tensor.detach()
        if not is_fake(result):  # Dynamo ran the step eagerly, on the host: its work is lost
            raise StaticGraphError(
                f"{name} ran on the host instead of in a device graph: TorchDynamo ran the step "
                "eagerly (past its re-compile limit, or a graph break at this call), so its "
                "work (a backward, an optimizer update) would be skipped"
            )
        if on_capture is not None:
            on_capture(name)
        return result

    marker.__name__ = marker.__qualname__ = name
    torch.fx.node.has_side_effect(marker)
    return torch._dynamo.allow_in_graph(marker)


def tagged_output(value: torch.Tensor, kind: str, name: str) -> torch.Tensor:
    """`value`, marked in the captured graph as an output of `kind` (runtime.signature's
    OutputKind: "user_output", "log_value", ...) named `name`: one node Dynamo keeps, which
    `CapturedGraph.run` reads to type the device graph's output (it computes nothing)."""
    return value


tagged_output.__qualname__ = tagged_output.__name__ = "mncore_tagged_output"
torch._dynamo.allow_in_graph(tagged_output)
