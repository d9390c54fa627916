"""Markers: calls Dynamo keeps in the graph as one node, whose work is done when the graph is
traced into a device graph.

A compiled training step is one device call: forward, backward and update. Dynamo cannot
trace a backward (`loss.backward()`) or a torch.optim `step` (which graph-breaks on purpose)
into its graph, but it need not: the step calls a marker at that point (`update(loss)`), and
when `CapturedGraph.run` meets the marker's node while the device graph is traced, it runs
the real backward and update there (`calls={update: ...}`), which make_fx records like any
other op. Dynamo only sees a call that takes the loss and returns a detached copy of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from ..errors import StaticGraphError


def traced_call(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A new marker named `name`: `marker(tensor)` is one graph node with a side effect
    (never removed as unused). Dynamo runs it on fake tensors only (to learn its output, a
    detached copy); run on a real tensor, the step ran eagerly, and it raises."""

    def marker(tensor: torch.Tensor) -> torch.Tensor:
        if not is_fake(tensor):  # Dynamo ran the step eagerly, on the host: its work is lost
            raise StaticGraphError(
                f"{name} ran on the host instead of in a device graph: TorchDynamo ran the step "
                "eagerly (past its re-compile limit, or a graph break at this call), so its "
                "backward and update would be skipped"
            )
        return tensor.detach()

    marker.__name__ = marker.__qualname__ = name
    torch.fx.node.has_side_effect(marker)
    return torch._dynamo.allow_in_graph(marker)
