"""`torch.as_tensor` of Python numbers that change is traced as `torch.tensor` is.

TorchDynamo (torch 2.14.1) traces `torch.tensor(n)` of a number that is a graph input (a
step counter, `self.global_step / 4`, `[batch_idx, 2.0]`) symbolically, through
`torch._refs.tensor`; `torch.as_tensor` of the same numbers has no such handler, so Dynamo
calls it on the number's current value and guards that value: the step re-compiles at every
call (measured: `warm = torch.clamp(torch.as_tensor(self.global_step / 4), max=1.0)`).
For data that is not a tensor, `as_tensor(data, dtype, device)` is `tensor(data, dtype=...,
device=...)` (both copy Python numbers into a new tensor), so `as_tensor_follows_numbers()`
hands such a call to Dynamo's handler of `torch.tensor`.
"""

from __future__ import annotations

from typing import Any

import torch


def as_tensor_follows_numbers() -> None:
    """Register the handler once (see the module docstring)."""
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    handlers = TorchInGraphFunctionVariable._get_handlers()  # cached: one dict per process
    if torch.as_tensor in handlers:
        return
    tensor = handlers[torch.tensor]

    def handle_as_tensor(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        if not args or len(args) > 3:
            return None
        data, positional = args[0], args[1:]
        for name, value in zip(("dtype", "device"), positional, strict=False):
            if name in kwargs:
                return None
            kwargs = {**kwargs, name: value}
        return tensor(self, tx, data, **kwargs)  # None where the data is a tensor or fixed

    handlers[torch.as_tensor] = handle_as_tensor
