"""Manual optimization captured by TorchDynamo: a whole `training_step` that calls
`self.manual_backward`, `opt.step()` and `opt.zero_grad()` itself is ONE device call.

Dynamo captures the user's Python (its reads guarded, `self.log` and list appends replayed),
but cannot trace a backward, and torch.optim's `step` and `zero_grad` graph-break on purpose.
While the step runs under Dynamo, those calls (and the ones that touch gradients or
`requires_grad`: `clip_gradients`, `toggle_optimizer`, `untoggle_optimizer`) are markers
(`mncore_device.capture.traced_call`): one graph node each, in the step's order. When the
device graph is traced (make_fx, of the replay), each marker does the real work there
(`MNCorePrecision.tracing_manual_step`): the backward with Lightning's
backward hooks, the update through the strategy's `optimizer_step` (with
`on_before_optimizer_step`), torch.optim's `zero_grad`.

What Lightning does around each `opt.step()` (the LightningOptimizer's `_on_before_step` and
`_on_after_step`: the optimizer-step progress, which is `trainer.global_step`) is traced by
Dynamo: the counts are graph inputs, written back after each call, and a read of
`self.global_step` after an update in the step sees it counted. Host code the step calls (a
scheduler's `step()`: the learning rate the next step reads; a profiler's `start`/`stop`)
is appended to a list while Dynamo runs the step; Dynamo replays the appends after each
call, with the values the graph computed (`ReduceLROnPlateau.step(loss)` gets each step's
loss), and the calls run on the host in the step's order, once per call.

Gradients are device state between calls, None where cpu's are (steps/manual_gradients.py): a
step that does not zero them (accumulation by hand, `if (batch_idx + 1) % n == 0:
opt.step()`) adds to the previous step's, as on cpu.

A step that one device call cannot run as cpu does (host code, a read of `p.grad`, a read of
what a scheduler's `step()` in the step changed) is found while Dynamo captures it, before
anything of it ran, and runs host-driven from then on (`ManualHook`, steps/manual_host.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch.core.optimizer import do_nothing_closure
from lightning.pytorch.profilers import PassThroughProfiler

from mncore_device import StaticGraphError
from mncore_device._source import user_frame
from mncore_device.capture import CapturedGraph, traced_call
from mncore_device.capture.autograd_graphs import DifferentiableGraph
from mncore_device.runtime import signature

from .hooks import CapturedHook
from .manual_gradients import ManualGradients
from .manual_host import HostDriven, HostManualSteps, readable
from .patches import Patches, patched


@dataclasses.dataclass(eq=False)
class _HostCall:
    """A host-side call a step makes, run after the device call (see the module docstring)."""

    call: Callable[..., Any] | None  # None: nothing to run (an update: its place only)
    optimizer: Any  # the (unwrapped) optimizer it concerns
    kind: str  # "update", "scheduler" or "profiler"


class ManualSteps:
    """The markers of one captured manual `training_step`, their work in the device graph,
    and the host calls replayed after each call (see the module docstring)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.module = module = strategy.lightning_module
        self.host_calls: list[tuple[_HostCall, tuple, dict]] = []
        self.calls: dict[Any, Callable[..., Any]] = {}  # marker -> its work (device graph)
        self._patches = Patches()
        self._received: tuple[TracedStep, Mapping[str, torch.Tensor]] | None = None
        # gradients are device state: registered before anything is compiled
        self._gradients = gradients = ManualGradients(strategy._gradient_buffers())
        lightning_optimizers = list(strategy._lightning_optimizers)
        pairs = [(lopt, lopt.optimizer) for lopt in lightning_optimizers]
        host_calls = self.host_calls

        def index_of(optimizer: Any) -> int:
            for index, (lopt, opt) in enumerate(pairs):
                if optimizer is lopt or optimizer is opt:
                    return index
            raise ValueError(f"{type(optimizer).__name__} is not one of the trainer's optimizers")

        toggles = [
            self._marker(f"toggle_optimizer_{i}", self._module_call("toggle_optimizer", lo))
            for i, (lo, _) in enumerate(pairs)
        ]
        untoggles = [
            self._marker(f"untoggle_optimizer_{i}", self._module_call("untoggle_optimizer", lo))
            for i, (lo, _) in enumerate(pairs)
        ]
        clips = [
            self._marker(f"clip_gradients_{i}", self._clip(lo)) for i, (lo, _) in enumerate(pairs)
        ]
        backward = self._marker("manual_backward", self._backward)

        def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            backward(loss, *args, _mncore_grads=gradients.key, **kwargs)

        def toggle_optimizer(optimizer: Any) -> None:
            toggles[index_of(optimizer)]()

        def untoggle_optimizer(optimizer: Any) -> None:
            untoggles[index_of(optimizer)]()

        def clip_gradients(
            optimizer: Any,
            gradient_clip_val: float | None = None,
            gradient_clip_algorithm: str | None = None,
        ) -> None:
            clips[index_of(optimizer)](
                gradient_clip_val, gradient_clip_algorithm, _mncore_grads=gradients.key
            )

        for name, function in (
            ("manual_backward", manual_backward),
            ("toggle_optimizer", toggle_optimizer),
            ("untoggle_optimizer", untoggle_optimizer),
            ("clip_gradients", clip_gradients),
        ):
            self._patches.add(module.__dict__, name, function)
        for index, (lopt, opt) in enumerate(pairs):
            zero = self._marker(f"zero_grad_{index}", self._zero_grad(opt))
            update = self._marker(f"optimizer_step_{index}", self._lightning_step(opt))
            raw_update = self._marker(f"raw_optimizer_step_{index}", self._raw_step(opt))
            update_call = _HostCall(None, opt, "update")
            patches = self._patches
            patches.add(
                lopt.__dict__, "step", _stepping(update, lopt, update_call, host_calls, gradients)
            )
            patches.add(lopt.__dict__, "zero_grad", _zeroing(zero))
            patches.add(
                opt.__dict__,
                "step",
                _stepping(raw_update, None, update_call, host_calls, gradients),
            )
            patches.add(opt.__dict__, "zero_grad", _zeroing(zero))
        stepped = self._marker("scheduler_step", self._scheduler_stepped)
        self._stale_reads: set[str] | None = None  # what the step had read at its first one
        for config in strategy.lr_scheduler_configs:
            scheduler = config.scheduler
            call = _HostCall(scheduler.step, getattr(scheduler, "optimizer", None), "scheduler")
            self._patches.add(scheduler.__dict__, "step", _on_host(call, host_calls, stepped))
        profiler = module.trainer.profiler
        if not isinstance(profiler, PassThroughProfiler):  # ("optimizer_step" around updates)
            for name in ("start", "stop"):
                call = _HostCall(getattr(profiler, name), None, "profiler")
                self._patches.add(profiler.__dict__, name, _on_host(call, host_calls))

    def check_capture(self, captured: CapturedGraph) -> None:
        """While Dynamo hands over a graph, what it read that a one-call manual step cannot
        give as cpu would; such a step runs host-driven instead (HostDriven, steps/manual_host.py),
        where the read gives cpu's value. Dynamo guards what the step read (or makes it a
        graph input):

        - a parameter's gradient (`p.grad`, to change or log it between backward and step):
          Dynamo read the host's, None; the gradients exist only in the device graph;
        - a learning rate, or a scheduler's state, first read after a scheduler's `step()`
          in the step: the scheduler steps on the host after the call, so the read gave the
          value before it (a value read before the scheduler's step is read as on cpu)."""
        read = _reads(captured)
        gradients = sorted(name for name in read if name.endswith(".grad"))
        if gradients:
            names = ", ".join(readable(name) for name in gradients[:3])
            raise HostDriven(f"reads gradients ({names})", _where(gradients))
        if self._stale_reads is not None:
            stale = sorted(
                name
                for name in read - self._stale_reads
                if ("param_groups" in name or "lr_scheduler_configs" in name)
                and ".step.__closure__" not in name  # the patched step's own cells
            )
            if stale:
                raise HostDriven(
                    f"reads {readable(stale[0])} after a scheduler's step()", _where(stale)
                )

    def gradients_to_host(self) -> None:
        """The gradients the device buffers hold (those that exist, as cpu's p.grad would),
        handed to the parameters: a step that runs host-driven from now on adds to them."""
        gradients = self._gradients
        if not gradients.present:
            return
        self.strategy.synchronize()
        for index in sorted(gradients.present):
            param = gradients.params[index]
            param.grad = gradients.buffers[param].detach().clone()

    def _marker(self, name: str, work: Callable[..., Any]) -> Callable[..., torch.Tensor]:
        marker = traced_call(f"mncore_manual_{name}", on_capture=self._captured_at)
        self.calls[marker] = work
        return marker

    def _captured_at(self, name: str) -> None:
        """Dynamo meets marker `name`: at the first scheduler step, note what the step has
        read so far (check_capture)."""
        if name.endswith("scheduler_step") and self._stale_reads is None:
            self._stale_reads = _reads(None)

    # --- the markers' work, while the device graph is traced ------------------------------------

    # (`_mncore_grads`: which gradients exist, passed so that Dynamo guards it: see
    # steps/manual_gradients.py; the work does not need it)

    def _scheduler_stepped(self) -> torch.Tensor:
        return torch.zeros(())  # the scheduler steps on the host, after the call

    def _backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("_mncore_grads")
        module = self.module
        with self._gradients.backward():
            type(module).manual_backward(module, loss, *args, **kwargs)
        return loss.detach()

    def _module_call(self, method: str, optimizer: Any) -> Callable[[], torch.Tensor]:
        """A marker's work: the LightningModule's own `method(optimizer)` (toggle_optimizer,
        untoggle_optimizer), as the class defines it."""
        module = self.module
        call = getattr(type(module), method)

        def run() -> torch.Tensor:
            call(module, optimizer)
            return torch.zeros(())

        return run

    def _clip(self, optimizer: Any) -> Callable[..., torch.Tensor]:
        module = self.module

        def clip(value: float | None, algorithm: str | None, _mncore_grads: str) -> torch.Tensor:
            self._gradients.read(optimizer)
            type(module).clip_gradients(
                module, optimizer, gradient_clip_val=value, gradient_clip_algorithm=algorithm
            )
            return torch.zeros(())

        return clip

    def _zero_grad(self, optimizer: Any) -> Callable[..., torch.Tensor]:
        def zero_grad(set_to_none: bool = True) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=set_to_none)
            self._gradients.zeroed(optimizer)
            return torch.zeros(())

        return zero_grad

    def _lightning_step(self, optimizer: Any) -> Callable[..., torch.Tensor]:
        """LightningOptimizer.step's update: the strategy's optimizer_step (precision plugin,
        on_before_optimizer_step, the optimizer's step); the closure ran in the step."""
        strategy = self.strategy

        def step(_mncore_grads: str, **kwargs: Any) -> torch.Tensor:
            self._gradients.read(optimizer)
            strategy.optimizer_step(optimizer, do_nothing_closure, **kwargs)
            return torch.zeros(())

        return step

    def _raw_step(self, optimizer: Any) -> Callable[..., torch.Tensor]:
        def step(_mncore_grads: str, **kwargs: Any) -> torch.Tensor:
            self._gradients.read(optimizer)
            optimizer.step(**kwargs)
            return torch.zeros(())

        return step

    # --- around each call -------------------------------------------------------------------------

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The markers stand in for the methods while the step runs (under Dynamo)."""
        self.host_calls.clear()
        self._stale_reads = None
        with self._patches.installed():
            yield

    @contextlib.contextmanager
    def tracing(self) -> Iterator[TracedStep]:
        """While the device graph is traced: the real methods, the gradients from their device
        buffers (steps/manual_gradients.py), and the precision plugin running backward and the
        update into the graph. The hooks that run there (`on_after_backward`,
        `on_before_optimizer_step`: they read gradients) log into the `TracedStep` yielded,
        whose tensors the device graph returns."""
        installed = self._patches.applied
        self._patches.uninstall()
        gradients = self._gradients
        gradients.start()
        precision = self.strategy.precision_plugin
        traced = TracedStep(self.module)
        logs = patched(self.module.__dict__, log=traced.log, log_dict=traced.log_dict)
        try:
            with (
                logs,
                precision.tracing_manual_step(after_backward=self.strategy._gradient_reduction()),
            ):
                yield traced
            traced.gradients = gradients.finish()
        finally:
            gradients.clear()
            if installed:
                self._patches.install()

    def received(self, traced: TracedStep, outputs: Mapping[str, torch.Tensor]) -> None:
        """A call of the graph traced as `traced` returned `outputs`: its logs are replayed
        by `replay`; which gradients exist after it is known now."""
        self._gradients.called(traced.gradients)
        self._received = (traced, outputs) if traced.calls else None

    def replay(self) -> None:
        """The host calls of the last call, in the step's order."""
        scheduled: set[int] = set()  # optimizers whose scheduler this step has stepped
        for host_call, args, kwargs in self.host_calls:
            if host_call.kind == "scheduler":
                scheduled.add(id(host_call.optimizer))
            elif host_call.kind == "update" and id(host_call.optimizer) in scheduled:
                raise StaticGraphError(
                    "the step calls opt.step() after stepping its LR scheduler. In a compiled "
                    "step a scheduler's new learning rate takes effect after the step, not for "
                    "the updates that follow it in the same step; step the scheduler after the "
                    "last opt.step(), or in a hook (on_train_batch_end)."
                )
            if host_call.call is not None:
                host_call.call(*args, **kwargs)
        self.host_calls.clear()
        if self._received is not None:
            logs, outputs = self._received
            self._received = None
            logs.replay(outputs)


class TracedStep:
    """What tracing one device graph recorded: `self.log` in the hooks that run there (a
    tensor logged is an output of the graph, logged after each call with its value, as the
    hook, `module._current_fx_name`, would; a Python number is logged as it was when traced),
    and which gradients exist after the graph (ManualGradients.finish)."""

    PREFIX = "manual_log/"

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: list[tuple[str, str | None, Any, tuple, dict, str | None]] = []
        self.outputs: dict[str, torch.Tensor] = {}
        self.gradients: dict[int, bool] = {}

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        key = None
        if isinstance(value, torch.Tensor):
            key = f"{self.PREFIX}{len(self.calls)}"
            self.outputs[key] = value.detach()
            signature.note_output(self.outputs[key], signature.OutputKind.LOG_VALUE, name)
            value = None
        fx = self.module._current_fx_name
        self.calls.append((name, key, value, args, kwargs, fx))

    def log_dict(self, dictionary: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, *args, **kwargs)

    def replay(self, outputs: Mapping[str, torch.Tensor]) -> None:
        module = self.module
        current = module._current_fx_name
        try:
            for name, key, value, args, kwargs, fx in self.calls:
                module._current_fx_name = fx
                module.log(name, outputs[key] if key is not None else value, *args, **kwargs)
        finally:
            module._current_fx_name = current


def _stepping(
    update: Callable[..., torch.Tensor],
    lightning_optimizer: Any,
    update_call: _HostCall,
    host_calls: list,
    gradients: ManualGradients,
) -> Callable[..., Any]:
    """`opt.step(closure=None, **kwargs)` under Dynamo: the closure (forward and backward)
    runs in the step, the update is a marker. A LightningOptimizer's hooks around it (the
    manual loop's: the optimizer-step progress, which is `trainer.global_step`) are traced:
    Dynamo writes the counters back after the call, and the step reads them counted, as on
    cpu (`_COUNTERS`: graph inputs, no re-compile per value)."""

    def step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if lightning_optimizer is not None:
            lightning_optimizer._on_before_step()
        host_calls.append((update_call, (), {}))  # where the update is, among host calls
        output = closure() if closure is not None else None
        update(_mncore_grads=gradients.key, **kwargs)
        if lightning_optimizer is not None:
            lightning_optimizer._on_after_step()
        return output

    return step


def _zeroing(zero: Callable[..., torch.Tensor]) -> Callable[..., None]:
    def zero_grad(set_to_none: bool = True) -> None:
        zero(set_to_none)

    return zero_grad


def _on_host(
    call: _HostCall, host_calls: list, marker: Callable[[], Any] | None = None
) -> Callable[..., None]:
    """A call recorded under Dynamo, run on the host after the device call (`replay`);
    `marker` notes where in the step it was called."""

    def record(*args: Any, **kwargs: Any) -> None:
        host_calls.append((call, args, kwargs))
        if marker is not None:
            marker()

    return record


def _where(names: list[str]) -> str | None:
    """The user's line where Dynamo first guarded one of `names` (while it captures)."""
    context = torch._guards.TracingContext.try_get()
    for guard in context.guards_context.dynamo_guards if context else ():
        if guard.name in names and guard.user_stack:
            where = user_frame(list(guard.user_stack))
            if where is not None:
                return where
    return None


def _reads(captured: CapturedGraph | None) -> set[str]:
    """What the step Dynamo is capturing has read so far: the sources of its guards and of
    its graph's inputs (`captured`'s, or the graph being built)."""
    context = torch._guards.TracingContext.try_get()
    read = {g.name for g in context.guards_context.dynamo_guards} if context else set()
    if captured is not None:
        read.update(spec.source for spec in captured.inputs)
    else:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        read.update(arg.source.name for arg in tx.output.graphargs if arg.source is not None)
    return read


class ManualHook(CapturedHook):
    """A manual-optimization `training_step`: ONE device call per step (ManualSteps' markers),
    until Dynamo finds something in it that only the host can run as cpu does (HostDriven:
    host code, a gradient read, a read after a scheduler's step); from then on, for the rest
    of the fit, a hook made with `host` (the reason) runs it host-driven (steps/manual_host.py).

    The one-call step is captured with Dynamo's fullgraph (nopython) mode: a graph break is an
    error before anything of the step ran (Dynamo runs nothing of a frame it could not
    capture whole), so the step can start again host-driven; with MNCoreStrategy(
    fullgraph=True) it is the frontend's error naming the line."""

    def __init__(self, strategy: Any, host: str | None = None) -> None:
        super().__init__(
            strategy,
            "training_step",
            manual=ManualSteps(strategy) if host is None else None,
            fullgraph=host is None,
            compile_options=strategy._compile_options("train"),
        )
        if host is None:
            self.frontend.fullgraph = strategy.fullgraph  # whether a break is the user's error
        else:
            self._manual = HostManualSteps(self, host)

    def __call__(self, *args: Any) -> Any:
        host = isinstance(self._manual, HostManualSteps)
        try:
            output = super().__call__(*args)
        except HostDriven as signal:
            return self._host_driven(signal)(*args)
        except _NOT_ONE_GRAPH as error:
            if host:
                raise
            stack = list(getattr(error, "real_stack", None) or [])
            kind = getattr(error, "gb_type", None) or str(error).strip().splitlines()[0]
            signal = HostDriven(f"cannot be one graph ({kind})", user_frame(stack))
            return self._host_driven(signal)(*args)
        if host:
            self._manual.report()
        return output

    def _compile_graph(self, captured: CapturedGraph) -> Any:
        manual = self._manual
        if isinstance(manual, HostManualSteps):  # a forward and a backward device call
            manual.note_reads(captured)
            return DifferentiableGraph(captured, self._split_compile, manual.stand_ins)
        return super()._compile_graph(captured)  # may find a read only the host can give

    def _host_driven(self, signal: HostDriven) -> ManualHook:
        """The hook that runs the step host-driven, in this one's place for the rest of the
        fit, with the gradients the device holds in p.grad; fullgraph=True refuses it."""
        if self.frontend.fullgraph:
            raise StaticGraphError(
                f"fullgraph=True: training_step {signal.reason}, at {signal.where}: it cannot be "
                "one device call (it would run host-driven, as several device calls with host "
                "code between them)"
            )
        self._manual.gradients_to_host()
        hook = ManualHook(self.strategy, host=f"{signal.reason} at {signal.where}")
        hook.batch_specs, hook.batch_shapes = self.batch_specs, self.batch_shapes
        captured = self.strategy._captured
        for key, value in list(captured.items()):
            if value is self:
                captured[key] = hook
        return hook


# what Dynamo raises, before running anything of the step, for a step it cannot capture as
# one graph (a graph break in fullgraph mode; a fake-tensor failure, say on a gradient that
# is None on the host)
_NOT_ONE_GRAPH = (torch._dynamo.exc.Unsupported, torch._dynamo.exc.TorchRuntimeError)


def captured_manual_step(strategy: Any) -> CapturedHook:
    """The strategy's `training_step` under manual optimization, captured by Dynamo."""
    return ManualHook(strategy)
