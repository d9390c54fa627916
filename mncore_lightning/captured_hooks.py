"""A LightningModule hook run through the TorchDynamo capture frontend (mncore_device.capture).

`CapturedHook(strategy, "training_step", optimizer=...)` runs the user's hook under Dynamo:
every Python value it reads (attributes of any object, tuples, NumPy scalars, globals,
closures, step counters, the learning rate) is guarded or becomes a graph input, writes to
lists, dicts and attributes are replayed after the call, and re-compiles are reported with
Dynamo's reason and the user's line. Each graph Dynamo captures is compiled by the strategy's
device Context into one static graph.

A training step is ONE device call: Dynamo captures the forward up to a marker
(`traced_call`) where the step's loss is handed over; when the device graph is traced, the
marker runs the backward, clipping and the optimizer update (`backward_and_update`, as the
make_fx path does), which the device graph then holds. Evaluation hooks are forward-only and
may have graph breaks: their host code runs between the device calls, as on cpu.

`self.log` (and `log_dict`) are recorded while the hook runs (a per-hook recorder whose list
Dynamo appends to after each call, with the graph's values) and replayed into Lightning after
the call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule

from mncore_device import Context, StaticGraphError
from mncore_device.capture import CapturedGraph, DynamoFrontend, traced_call

from .compiled_hooks import _loss_of, backward_and_update

_LIGHTNING_LOG = LightningModule.log
# The ints that change every step: batch_idx and dataloader_idx (the hook's arguments), and
# whatever the step reads through the trainer (global_step, current_epoch, a scheduler's
# last_epoch). They are graph inputs from the start: no re-compile when they first change.
_COUNTERS = (r".*\['args'\]\[[12]\]$", r".*\._trainer\..*")


class _Logs:
    """`self.log` while a captured hook runs: Dynamo traces `log` and replays its appends."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, tuple, dict]] = []

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach()
        self.calls.append((name, value, args, kwargs))

    def log_dict(self, dictionary: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, *args, **kwargs)


class CapturedHook:
    """One hook of the strategy's LightningModule, captured by Dynamo and run on the device.

    optimizer: for `training_step`, the optimizer the device graph updates with (automatic
    optimization); None for forward-only hooks.
    update_options: the keywords of `backward_and_update` (accumulation, clipping, ...).
    """

    def __init__(
        self,
        strategy: Any,
        hook_name: str,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        update_options: Mapping[str, Any] | None = None,
        fullgraph: bool = False,
        compile_options: Mapping[str, Any],
    ) -> None:
        self.strategy = strategy
        self.hook_name = hook_name
        self.optimizer = optimizer
        self.module = module = strategy.lightning_module
        self.context: Context = strategy.context
        self._update_options = dict(update_options or {})
        self._return_gradients = self._update_options.pop("return_gradients", False)
        self._compile_options = dict(compile_options)
        self._logs = _Logs()
        self._log, self._log_dict = self._logs.log, self._logs.log_dict  # one object each
        self.gradient_params: dict[str, torch.Tensor] = {}
        self.gradients: dict[str, torch.Tensor] = {}  # the last call's, by gradient_params key
        self.compiled: list[Any] = []  # the device functions, one per graph
        self._update = traced_call(f"mncore_{hook_name}_update") if optimizer else None
        user_hook = getattr(module, hook_name)
        precision = strategy.precision_plugin
        update = self._update

        def step(*args: Any) -> Any:
            with precision.forward_context():  # as Lightning's step contexts: autocast, say
                output = user_hook(*args)
            if update is not None:
                loss = output.get("loss") if isinstance(output, Mapping) else output
                if isinstance(loss, torch.Tensor):
                    update(loss)
            return output

        self.frontend = DynamoFrontend(
            step,
            self._compile_graph,
            is_state=self.context.is_registered,
            fullgraph=fullgraph,
            max_retraces=strategy.max_retraces,
            on_retrace=lambda reason: strategy._retrace(hook_name, reason),
            dynamic_sources=_COUNTERS,
        )

    def __call__(self, *args: Any) -> Any:
        module = self.module
        self._logs.calls.clear()
        module.log, module.log_dict = self._log, self._log_dict
        try:
            output = self.frontend(*args)
        finally:
            del module.log, module.log_dict
        if self._update is not None:
            _loss_of(output)  # a step without a loss (None, say) ran no update: refused
        for name, value, log_args, log_kwargs in self._logs.calls:
            _LIGHTNING_LOG(module, name, value, *log_args, **log_kwargs)
        return output

    @property
    def compile_seconds(self) -> float:
        return sum(c.compile_seconds for c in self.compiled)

    def _compile_graph(self, captured: CapturedGraph) -> Callable[[Mapping], Mapping]:
        """Trace one captured graph (with the update, at the marker) into a device function."""
        if self._update is not None and self.frontend.breaks:
            raise StaticGraphError(
                f"{self.hook_name} has host code that cannot be in the compiled training step "
                f"({'; '.join(map(str, self.frontend.breaks))}). The forward, the backward "
                "and the update are one device call: move that code to a hook outside the step "
                "(on_train_batch_end, say)."
            )
        calls = {self._update: self._backward_and_update} if self._update is not None else {}

        def device_step(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            self.gradient_params.clear()
            outputs = captured.run(inputs, calls)
            return {**outputs, **self._traced_gradients}

        self._traced_gradients: dict[str, torch.Tensor] = {}
        options = dict(self._compile_options)
        codegen_dir = options.pop("codegen_dir", None)
        if codegen_dir is not None:
            codegen_dir = codegen_dir / f"graph_{len(self.compiled)}"
        try:
            with torch.inference_mode(False):
                compiled = self.context.compile(
                    device_step, captured.sample(), codegen_dir, **options
                )
        finally:  # tracing restores the host tensors it ran on, which bumps their versions
            self.strategy._host_versions.record()
        self.compiled.append(compiled)
        to_host = self.strategy._to_host

        def run(inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
            outputs = to_host(compiled(inputs))
            if self.gradient_params:
                self.gradients = {k: outputs[k] for k in self.gradient_params}
            return outputs

        return run

    def _backward_and_update(self, loss: torch.Tensor) -> torch.Tensor:
        """The marker's work while the device graph is traced: backward and update."""
        optimizer = self.optimizer
        accumulate = self._update_options.get("accumulate")
        if accumulate is None:
            optimizer.zero_grad(set_to_none=True)
        else:
            for param, buffer in accumulate[1].items():
                param.grad = buffer
        self._traced_gradients = backward_and_update(
            self.module,
            optimizer,
            loss,
            self.strategy.precision_plugin.scaler,
            gradient_params=self.gradient_params if self._return_gradients else None,
            **self._update_options,
        )
        return loss.detach()
