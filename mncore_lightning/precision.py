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

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.trainer import call


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """`torch.set_default_dtype(dtype)` for the block (a step's update is traced under the
    default dtype outside its training_step, as cpu runs it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class MNCorePrecision(Precision):
    """Training where backward and the optimizer step are part of the compiled graph.

    32-bit by default. `MNCorePrecision(inner)` wraps Lightning's plugin for another precision
    the graph can capture ("bf16-mixed": autocast is recorded into the traced step, weights and
    optimizer state stay fp32; "bf16-true": the module is converted to bfloat16): its module
    conversion and step contexts are used as they are, while backward and the update still
    run inside the compiled step.

    When a gradient hook is overridden, the compiled step also returns the gradients, and the
    parameters hold them (`p.grad`) while `on_after_backward` and `on_before_optimizer_step` run.
    """

    precision = "32-true"
    _manual_trace = False  # a manual-optimization step is being traced
    _after_backward: Callable[[list[Any]], None] | None = None  # data parallel: average grads

    def __init__(self, inner: Precision | None = None) -> None:
        super().__init__()
        self.inner = inner
        if inner is not None:
            self.precision = inner.precision

    def convert_module(self, module: Any) -> Any:
        return self.inner.convert_module(module) if self.inner else module

    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data) if self.inner else data

    def tensor_init_context(self) -> Any:
        return self.inner.tensor_init_context() if self.inner else super().tensor_init_context()

    def module_init_context(self) -> Any:
        return self.inner.module_init_context() if self.inner else super().module_init_context()

    def forward_context(self) -> Any:
        """Entered around the hook inside the traced step: autocast is recorded into it."""
        return self.inner.forward_context() if self.inner else super().forward_context()

    def capture_context(self) -> contextlib.AbstractContextManager:
        """`forward_context()` as the context manager it enters (torch.autocast), for a step
        captured by TorchDynamo: Dynamo resumes autocast after a graph break inside it, but
        not Lightning's generator-based `forward_context` (measured with torch 2.14.1: a
        break in the step under autocast made Dynamo run the whole step eagerly, on the
        host). The default dtype of "bf16-true" is `default_dtype_context`'s instead."""
        inner = self.inner
        if isinstance(inner, MixedPrecision):
            return inner.autocast_context_manager()
        if inner is None or isinstance(inner, HalfPrecision):
            return contextlib.nullcontext()
        return self.forward_context()

    def default_dtype_context(self) -> contextlib.AbstractContextManager:
        """ "bf16-true"'s default dtype, entered around the captured step rather than inside
        the frame Dynamo captures: `torch.set_default_dtype` is global state, which Dynamo
        guards, but a graph break inside its context manager splits the step at the `with`
        (measured with torch 2.14.1: graphs holding only `set_default_dtype`, which a device
        graph cannot run), so host code in such a step could not run as on cpu."""
        inner = self.inner
        if isinstance(inner, HalfPrecision):
            return inner.tensor_init_context()
        return contextlib.nullcontext()

    @property
    def scaler(self) -> Any:
        """ "16-mixed"'s torch.amp.GradScaler, whose scaling runs inside the compiled step."""
        return getattr(self.inner, "scaler", None)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict() if self.inner else super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.inner:
            self.inner.load_state_dict(state_dict)

    @contextlib.contextmanager
    def tracing_manual_step(
        self, after_backward: Callable[[list[Any]], None] | None = None
    ) -> Iterator[None]:
        """While a manual step is traced, `manual_backward` and `opt.step()` run (into the
        graph) as they would eagerly; `after_backward` gets the gradients after each backward
        (data parallel averages them there, as DDP does in every backward)."""
        previous = self._manual_trace, self._after_backward
        self._manual_trace, self._after_backward = True, after_backward
        try:
            yield
        finally:
            self._manual_trace, self._after_backward = previous

    def backward(self, tensor: Any, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """The gradients were computed inside the compiled step: hand them to the params."""
        if self._manual_trace:
            tensor.backward(*args, **kwargs)
            if self._after_backward is not None:
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                self._after_backward(grads)
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
        # A call of steps_per_call steps ran that many updates; Lightning counts one.
        progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
        for _ in range(trainer.strategy.last_call_steps - 1):
            progress.optimizer.step.increment_ready()
            progress.optimizer.step.increment_completed()
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        trainer.strategy.check_gradients_untouched("on_before_optimizer_step")
        # configure_gradient_clipping ran inside the compiled step, once per update; the
        # profiler records it where Lightning calls it, so that its actions match cpu's
        action = f"[LightningModule]{type(model).__name__}.configure_gradient_clipping"
        for _ in range(trainer.strategy.last_call_steps):
            with trainer.profiler.profile(action):
                pass
        return result
