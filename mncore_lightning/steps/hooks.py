"""A LightningModule hook run through the TorchDynamo capture frontend (mncore_device.capture).

`CapturedHook(strategy, "training_step", optimizer=...)` runs the user's hook under Dynamo:
every Python value it reads (attributes of any object, tuples, NumPy scalars, globals,
closures, step counters, the learning rate) is guarded or becomes a graph input, writes to
lists, dicts and attributes are replayed after the call, and re-compiles are reported with
Dynamo's reason and the user's line. Each graph Dynamo captures is compiled by the strategy's
device Context into one static graph.

A training step is ONE device call: Dynamo captures the forward up to a marker
(`traced_call`) where the step's loss is handed over; when the device graph is traced, the
marker runs the backward, clipping and the optimizer update (`backward_and_update`), which the
device graph then holds. Evaluation hooks are forward-only and
may have graph breaks: their host code runs between the device calls, as on cpu.

A training step with host code (a graph break: `print`, a NumPy draw, a logger call) runs it
between device calls too: each Dynamo graph is a forward and a backward device call wrapped
as one autograd function (mncore_device.capture.autograd_graphs), the host's backward after
the step runs the backward calls in reverse, and the update (accumulation, clipping, the
optimizer) is one more device call built by the same `backward_and_update`
(`_split_update`); the marker then does nothing. It is reported once, with the breaks' lines
and the device calls per step; `fullgraph=True` refuses it at the line.

`self.log` (and `log_dict`) are recorded while the hook runs (a per-hook recorder whose list
Dynamo appends to after each call, with the graph's values) and replayed into Lightning after
the call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils._pytree import tree_leaves

from mncore_device import Context, StaticGraphError
from mncore_device.capture import CapturedGraph, DynamoFrontend, traced_call
from mncore_device.capture.appended_lists import AppendedLists, length_guard
from mncore_device.capture.autograd_graphs import DifferentiableGraph, StandIns
from mncore_device.capture.batch_leaves import BatchStandIns
from mncore_device.capture.dynamo import own_code

from ..precision import default_dtype
from .logs import RecordedLogs
from .update import backward_and_update, loss_of
from .update_logs import recording_update_logs


def _requirement_checks_are_constants() -> None:
    """torchmetrics and Lightning check optional packages lazily (`if _XLA_AVAILABLE:`, a
    lightning_utilities RequirementCache): the first check inside a captured step would be
    traced into importlib.metadata, whose PackageNotFoundError (caught by the cache) Dynamo
    of torch 2.14.1 fails on (InternalTorchDynamoError). The answer does not change while
    the process runs: Dynamo calls the check and uses its answer as a constant."""
    from lightning_utilities.core.imports import RequirementCache

    if not getattr(RequirementCache.__bool__, "_mncore_constant", False):
        constant = torch._dynamo.assume_constant_result(RequirementCache.__bool__)
        constant._mncore_constant = True
        RequirementCache.__bool__ = constant


_requirement_checks_are_constants()


def _summary_writer_calls_are_host_code() -> None:
    """torch.utils.tensorboard is part of torch, so Dynamo traces into a SummaryWriter's
    `add_*` calls (TensorBoardLogger's `experiment`), whose event bookkeeping fails a guard at
    every step. They are host code: a graph break, where they run as on cpu."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is not installed: no writer to call
        return
    for name, method in list(vars(SummaryWriter).items()):
        if name.startswith("add_") and callable(method) and not hasattr(method, "_mncore_host"):
            host = torch.compiler.disable(method)
            host._mncore_host = True
            setattr(SummaryWriter, name, host)


_summary_writer_calls_are_host_code()

# The ints that change every step: batch_idx and dataloader_idx (the hook's arguments), and
# whatever the step reads through the trainer (global_step, current_epoch, a scheduler's
# last_epoch) or counts itself (a manual step's optimizer steps). They are graph inputs from
# the start: no re-compile when they first change.
# So is the batch size (the first dimension of the batch's tensors): a short last batch
# compiles another device graph, without a re-compile of the Python step.
_COUNTERS = (
    r".*\['args'\]\[[12]\]$",
    # the same, as the user's hook names them, in a frame of its own (after a graph break,
    # Dynamo captures the rest of the hook and its caller as frames of their own)
    r"^L\['(batch_idx|dataloader_idx)'\]$",
    r".*\._trainer\..*",
    r".*\['args'\]\[0\].*:0",
    r".*\.optim_step_progress\..*",  # a manual step's optimizer-step count (steps/manual.py)
)


class CapturedHook:
    """One hook of the strategy's LightningModule, captured by Dynamo and run on the device.

    optimizer: for `training_step`, the optimizer the device graph updates with (automatic
    optimization); None for forward-only hooks.
    update_options: the keywords of `backward_and_update` (accumulation, clipping, ...).
    manual: for a manual-optimization `training_step`, its markers and host calls
    (steps/manual.py's ManualSteps); the step is then one device call, as with `optimizer`;
    or its host calls when it runs host-driven (manual_host.HostManualSteps).
    compile_options: the keywords of `Context.compile` for each graph; "codegen_dir" is a
    function giving the folder of the next graph (or None).
    """

    def __init__(
        self,
        strategy: Any,
        hook_name: str,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        update_options: Mapping[str, Any] | None = None,
        manual: Any = None,
        fullgraph: bool = False,
        compile_options: Mapping[str, Any],
    ) -> None:
        self.strategy = strategy
        self.hook_name = hook_name
        self.optimizer = optimizer
        self._manual = manual
        self.module = module = strategy.lightning_module
        self.context: Context = strategy.context
        self._update_options = dict(update_options or {})
        self._return_gradients = self._update_options.pop("return_gradients", False)
        self._compile_options = dict(compile_options)
        self._logs = RecordedLogs()
        self._log, self._log_dict = self._logs.log, self._logs.log_dict  # one object each
        self.gradient_params: dict[str, torch.Tensor] = {}
        self.gradients: dict[str, torch.Tensor] = {}  # the last call's, by gradient_params key
        self.compiled: list[Any] = []  # the device functions, one per graph
        self._failed_guards: set[str] = set()  # the guards that failed so far
        self._lists = AppendedLists(module)  # the lists the hook appends to, once they grow
        self.batch_specs: dict[str, Any] | None = None
        self.batch_shapes: list[Any] | None = (
            None  # the last batch's, to compare cheaply  # the last batch's (the strategy's)
        )
        self._update = traced_call(f"mncore_{hook_name}_update") if optimizer else None
        # a training step with host code: each graph a forward and a backward device call,
        # the update one more (see _split_update); the gradients gather in the stand-ins
        self._stand_ins = StandIns()
        # self.log in configure_gradient_clipping: the TracedStep of the update being traced,
        # and the last call's (TracedStep, outputs), replayed after the step's own logs
        self._update_traced: Any = None
        self._update_logs: tuple[Any, Mapping[str, torch.Tensor]] | None = None
        self._updates: dict[frozenset[str], Any] = {}  # the update's device function, by grads
        self._fused_ran = False  # whether this call's device graph ran the backward and update
        self._dtype_outside = torch.get_default_dtype()  # the step's caller's (_run_step)
        self._device_calls = 0  # device calls this call made
        self.device_calls_per_step: int | None = None  # measured at the first split step
        user_hook = getattr(module, hook_name)
        precision = strategy.precision_plugin
        update = self._update

        def step(*args: Any) -> Any:
            with precision.capture_context():  # as Lightning's step contexts: autocast, say
                output = user_hook(*args)
            if update is not None:
                loss = output.get("loss") if isinstance(output, Mapping) else output
                if isinstance(loss, torch.Tensor):
                    update(loss)
            return output

        self.frontend = DynamoFrontend(
            own_code(step),  # a frame Dynamo may compile on its own: its cache is this hook's
            self._compile_graph,
            is_state=self.context.is_registered,
            fullgraph=fullgraph,
            max_retraces=strategy.max_retraces,
            on_retrace=self._retraced,
            dynamic_sources=_COUNTERS,
            on_guard_failure=self._adopt_list,
        )
        self._lists.frame_globals = self.frontend.frame_globals  # module-level lists too

    def __call__(self, *args: Any) -> Any:
        manual = self._manual
        self._fused_ran, self._device_calls = False, 0
        if self._update is not None and (self.frontend.breaks or not self.frontend.graphs):
            # host code in the step (a logger's histogram of a weight, say) reads the
            # parameters as they are on the device before this step's update, as on cpu;
            # what it computes with them adds to their .grad (see _split_update)
            self.strategy.synchronize()
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
        with manual.installed() if manual is not None else contextlib.nullcontext():
            output = self._run_step(args)
        if self._update is not None:
            loss = loss_of(output)  # a step without a loss (None, say) ran no update: refused
            if not self._fused_ran:  # host code in the step: backward and update follow
                self._split_update(loss)
                output = _with_detached_loss(output, loss)
                self._report_split()
        if manual is not None:
            manual.replay()  # Lightning's bookkeeping of each opt.step(), scheduler steps
        self._logs.replay(self.module, _leading_size(args[0]) if args else None)
        if self._update_logs is not None:  # logged in configure_gradient_clipping
            traced, outputs = self._update_logs
            self._update_logs = None
            traced.replay(outputs)
        return output

    def _run_step(self, args: tuple) -> Any:
        """The hook under Dynamo, its `self.log` calls recorded in `self._logs.calls`."""
        self._logs.calls.clear()
        state = self.module.__dict__  # not nn.Module.__setattr__: this runs every step
        state["log"], state["log_dict"] = self._log, self._log_dict
        self._dtype_outside = torch.get_default_dtype()  # the update's, as on cpu
        try:
            # the batch's strings as stand-ins (one class for any value: no re-compile per
            # batch), their values back where the step left them
            with (
                self.strategy.precision_plugin.default_dtype_context(),
                BatchStandIns.standing_in(args) as (call, stand_ins),
                self._lists.swapped(),
            ):
                return stand_ins.resolve(self.frontend(*call))
        finally:
            del state["log"], state["log_dict"]

    def _retraced(self, reason: str) -> None:
        """Report a re-compile, counted against max_retraces (past it an error names the
        guard); a value that changes is re-compiled for, as torch.compile would (a list the
        step appends to is taken out of Dynamo's view first: _adopt_list)."""
        self._failed_guards.add(_guard_of(reason))
        self.strategy._retrace(self.hook_name, reason)

    def _adopt_list(self, reason: str) -> None:
        """A list's length guard failing again (a list the step appends to at every call):
        the list is taken out of Dynamo's view (AppendedLists) before the step is traced
        again, so that trace is the one the next calls use."""
        guard = _guard_of(reason)
        if guard in self._failed_guards:
            self._lists.adopt(guard)

    @property
    def logged(self) -> list[str]:
        """The names the last call passed to `self.log` / `self.log_dict`, in call order."""
        return [name for name, *_ in self._logs.calls]

    @property
    def compile_seconds(self) -> float:
        return sum(c.compile_seconds for c in self.compiled)

    def _compile_graph(self, captured: CapturedGraph) -> Callable[[Mapping], Mapping]:
        """Trace one captured graph (with the update, at the marker) into a device function."""
        if self._update is not None and self.frontend.breaks:
            self._refuse_host_code()
            # each graph a forward and a backward device call; the marker does nothing
            calls = {self._update: torch.Tensor.detach}
            return DifferentiableGraph(captured, self._split_compile, self._stand_ins, calls)
        calls = {self._update: self._backward_and_update} if self._update is not None else {}
        manual = self._manual
        if manual is not None:
            manual.check_capture(captured)
            calls = manual.calls

        traced_steps: list[Any] = []  # a manual step's record of its trace (TracedStep)

        def device_step(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            self.gradient_params.clear()
            if manual is None:
                outputs = captured.run(inputs, calls)
            else:
                with manual.tracing() as traced:
                    outputs = captured.run(inputs, calls)
                traced_steps[:] = [traced]
                outputs.update(traced.outputs)
            return {**outputs, **self._traced_gradients}

        self._traced_gradients: dict[str, torch.Tensor] = {}
        run = self._device_function(device_step, captured.sample(), gradients=True)
        if manual is not None:

            def manual_run(inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
                outputs = run(inputs)
                manual.received(traced_steps[0], outputs)  # its host calls, with their values
                return outputs

            return manual_run
        if self._update is None:
            return run

        def fused(inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
            self._fused_ran = True
            return run(inputs)

        return fused

    def _device_function(
        self,
        function: Callable[[Mapping], Mapping],
        sample: Mapping[str, torch.Tensor],
        gradients: bool = False,
    ) -> Callable[[Mapping], Mapping]:
        """`function` traced on `sample` and compiled by the context; its outputs on the host.
        gradients: it returns the gradients Lightning's gradient hooks see (gradient_params)."""
        options = dict(self._compile_options)
        codegen_dir = options.pop("codegen_dir", None)  # a function giving the folder
        codegen_dir = codegen_dir() if codegen_dir is not None else None
        self._update_traced = None
        try:
            # anomaly mode records the forward's lines for the backward's ops (the device
            # graph's check names them); its own NaN check would run on the trace's values
            anomaly = torch.is_anomaly_enabled()
            with (
                torch.inference_mode(False),
                torch.autograd.set_detect_anomaly(anomaly, check_nan=False),
            ):
                # a captured graph's replay, or this package's own code around one (a split
                # step's forward or backward, its update): traced as it is
                compiled = self.context.compile(
                    function, dict(sample), codegen_dir, capture="trace", **options
                )
        finally:  # tracing restores the host tensors it ran on, which bumps their versions
            self.strategy._host_versions.record()
        self.compiled.append(compiled)
        to_host = self.strategy._to_host
        traced_update = self._update_traced  # its update's logs (recording_update_logs)
        update_logged = traced_update is not None and bool(traced_update.calls)

        def run(inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
            self._device_calls += 1
            outputs = to_host(compiled(inputs))
            if gradients and self.gradient_params:
                self.gradients = {k: outputs[k] for k in self.gradient_params}
            if update_logged:
                self._update_logs = traced_update, outputs
            return outputs

        return run

    def _refuse_host_code(self) -> None:
        """fullgraph=True: a training step with a graph break (host code between device
        calls around its backward) is an error at the break's line."""
        if self._update is not None and self.frontend.breaks and self.frontend.fullgraph:
            breaks = "; ".join(map(str, self.frontend.breaks))
            raise StaticGraphError(
                f"fullgraph=True: {self.hook_name} has host code ({breaks}). Where the "
                f"first one is:\n{self.frontend.breaks[0].stack}"
            )

    def _split_compile(
        self, function: Callable[[Mapping], Mapping], sample: dict, label: str
    ) -> Callable[[Mapping], Mapping]:
        """A forward or backward device call of a step with host code (DifferentiableGraph)."""
        return self._device_function(function, sample)

    def _split_update(self, loss: torch.Tensor) -> None:
        """After a step with host code: the backward on the host (through each graph's
        backward device call, in reverse), then one device call that takes the gradients and
        runs what a one-call step runs after its backward (backward_and_update: accumulation,
        clipping, the update). The gradients are the stand-ins' (never the parameters')."""
        accumulate = self._update_options.get("accumulate")
        scaler = self.strategy.precision_plugin.scaler
        with torch.enable_grad():
            if loss.requires_grad:
                loss = loss if accumulate is None else loss / accumulate[0]
                # 16-mixed: the loss scale as the device holds it (the host was synchronized
                # before the step); the update call unscales with the same, on the device
                self.module.backward(scaler.scale(loss) if scaler is not None else loss)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grads = {}
        for index, param in enumerate(params):
            # the device calls' gradient, plus the host's where host code (a module Dynamo
            # runs eagerly) computed with the parameter itself
            grad, host = self._stand_ins.gradient(param), param.grad
            param.grad = None
            if grad is not None or host is not None:
                both = grad + host if grad is not None and host is not None else None
                grads[f"grad/{index}"] = (
                    both if both is not None else grad if host is None else host
                )
        self._stand_ins.clear_gradients()
        key = frozenset(grads)
        update = self._updates.get(key)
        if update is None:
            update = self._updates[key] = self._device_function(
                functools.partial(self._apply_gradients, params), grads, gradients=True
            )
        update(grads)

    def _apply_gradients(
        self, params: list[torch.Tensor], inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The update call, traced: the gradients given (added to the accumulation buffers
        in a window), then backward_and_update without a loss."""
        accumulate = self._update_options.get("accumulate")
        for index, param in enumerate(params):
            grad = inputs.get(f"grad/{index}")
            if accumulate is not None and param in accumulate[1]:
                buffer = accumulate[1][param]
                if grad is not None:
                    with torch.no_grad():
                        buffer.add_(grad)
                grad = buffer
            param.grad = grad
        self.gradient_params.clear()
        try:
            with recording_update_logs(self.module) as traced:
                gradients = backward_and_update(
                    self.module,
                    self.optimizer,
                    None,
                    self.strategy.precision_plugin.scaler,
                    gradient_params=self.gradient_params if self._return_gradients else None,
                    **self._update_options,
                )
            self._update_traced = traced
            return {**gradients, **traced.outputs}
        finally:
            for param in params:
                param.grad = None

    def _report_split(self) -> None:
        """Say once how a step with host code runs (its breaks, its device calls a step)."""
        if self.device_calls_per_step is not None:
            return
        self.device_calls_per_step = self._device_calls
        breaks = "; ".join(map(str, self.frontend.breaks))
        rank_zero_info(
            f"MN-Core: {self.hook_name} has host code ({breaks}); it runs as "
            f"{self._device_calls} device calls per step: each graph's forward and backward, "
            "and the update"
        )

    def _backward_and_update(self, loss: torch.Tensor) -> torch.Tensor:
        """The marker's work while the device graph is traced: backward and update."""
        optimizer = self.optimizer
        accumulate = self._update_options.get("accumulate")
        if accumulate is None:
            optimizer.zero_grad(set_to_none=True)
        else:
            for param, buffer in accumulate[1].items():
                param.grad = buffer
        with default_dtype(self._dtype_outside), recording_update_logs(self.module) as traced:
            gradients = backward_and_update(
                self.module,
                optimizer,
                loss,
                self.strategy.precision_plugin.scaler,
                gradient_params=self.gradient_params if self._return_gradients else None,
                **self._update_options,
            )
        self._update_traced = traced
        self._traced_gradients = {**gradients, **traced.outputs}
        return loss.detach()


def _with_detached_loss(output: Any, loss: torch.Tensor) -> Any:
    """The step's output with its loss detached: its backward ran already."""
    if isinstance(output, Mapping):
        return {**output, "loss": loss.detach()}
    return loss.detach()


def _guard_of(reason: str) -> str:
    """A failed guard's expression, without Dynamo's compile id and the values compared."""
    first = reason.split("\n", 1)[0]
    first = first.split(": ", 1)[-1]  # "3/2: len(x) == 4  # ..." -> "len(x) == 4  # ..."
    guard = first.split("#", 1)[0].split("==", 1)[0].split("<", 1)[0].split(">", 1)[0].strip()
    listed = length_guard(guard)  # `not x` (an empty list) is the same guard as `len(x)`
    return f"len({listed})" if listed is not None else guard


def tensor_layout(batch: Any) -> list[tuple[torch.Size, torch.dtype]]:
    """The (shape, dtype) of each tensor leaf of `batch`, in pytree order: what tells a
    batch of other shapes apart, at every step. Lists, tuples and dicts are walked here
    (pytree's generic flatten costs a few µs a call); other containers by pytree."""
    kind = type(batch)
    if kind is torch.Tensor or isinstance(batch, torch.Tensor):
        return [(batch.shape, batch.dtype)]
    if kind is list or kind is tuple:
        return [layout for item in batch for layout in tensor_layout(item)]
    if kind is dict:
        return [layout for item in batch.values() for layout in tensor_layout(item)]
    leaves = tree_leaves(batch)
    if len(leaves) == 1 and leaves[0] is batch:  # a leaf that is no tensor
        return []
    return [(t.shape, t.dtype) for t in leaves if isinstance(t, torch.Tensor)]


def _leading_size(batch: Any) -> int | None:
    """The first dimension of the batch's first tensor (what tells a short batch apart)."""
    while isinstance(batch, (list, tuple, dict)) and batch:
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return batch.shape[0] if isinstance(batch, torch.Tensor) and batch.dim() else None
