"""`MNCorePrecision`: backward and the optimizer update run inside the compiled step.

Lightning's automatic optimization calls `optimizer.step(closure)`; the closure runs
`Strategy.training_step`, which executes one compiled call holding zero_grad, forward,
backward, gradient clipping and the update. So Lightning's own backward and step must do
nothing (the pattern of the former IPU plugin and of DeepSpeed's precision plugin).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer import call


class MNCorePrecision(Precision):
    """32-bit training where backward and the optimizer step are part of the compiled graph.

    When a gradient hook is overridden, the compiled step also returns the gradients, and the
    parameters hold them (`p.grad`) while `on_after_backward` and `on_before_optimizer_step` run.
    """

    precision = "32-true"
    _manual_trace = False  # a manual-optimization step is being traced

    @contextlib.contextmanager
    def tracing_manual_step(self) -> Iterator[None]:
        """While a manual step is traced, `manual_backward` and `opt.step()` run (into the
        graph) as they would eagerly."""
        previous, self._manual_trace = self._manual_trace, True
        try:
            yield
        finally:
            self._manual_trace = previous

    def backward(self, tensor: Any, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """The gradients were computed inside the compiled step: hand them to the params."""
        if self._manual_trace:
            tensor.backward(*args, **kwargs)
            return
        model.trainer.strategy.install_gradients()

    def post_backward(self, tensor: Any, module: Any) -> Any:
        result = super().post_backward(tensor, module)  # on_after_backward hooks
        module.trainer.strategy.check_gradients_untouched("on_after_backward")
        return result

    def optimizer_step(
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Run the closure (the compiled step, update included); never call optimizer.step."""
        if self._manual_trace:  # the user's opt.step() inside a traced manual step
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        trainer = model.trainer
        with trainer.strategy.updating():  # this micro-batch ends an accumulation window
            result = closure()
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        trainer.strategy.check_gradients_untouched("on_before_optimizer_step")
        return result
