"""A manual-optimization `training_step` driven from the host, as on cpu.

A manual step that has host code (a graph break: `print`, a NumPy draw, a logger call, a
branch on a tensor's value), reads gradients (`p.grad`: they would exist only in a one-call
device graph) or reads what a scheduler's `step()` in the step changed cannot be one device
call. It runs as on cpu instead, with Lightning's manual calls as host code that Dynamo
graph-breaks on (`torch.compiler.disable`), run as Lightning defines them:

- each Dynamo graph between them is a forward and a backward device call
  (mncore_device.capture.autograd_graphs, as an automatic step with host code runs), in which
  a parameter stands for itself: its gradient accumulates into `p.grad` as on cpu;
- `manual_backward(loss)`: Lightning's backward (`on_before_backward`, `on_after_backward`)
  on the host, which runs the backward device calls in reverse; gradients live on in `p.grad`
  between steps, None where cpu's are;
- `opt.step(closure)`: Lightning's bookkeeping (the optimizer-step count, `global_step`), the
  closure (captured as the step is), `on_before_optimizer_step` on the host, then one update
  device call taking that optimizer's current gradients;
- `zero_grad()`, `clip_gradients`, `toggle_optimizer` / `untoggle_optimizer`, a scheduler's
  `step()`: on the host, at once.

Host code reads this step's weights: the host is synchronized before the step and after each
update call, and a registered tensor host code changed is pushed to the device before each
update call and after the step.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.core.optimizer import do_nothing_closure
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from mncore_device._source import user_frame_from_stack_trace
from mncore_device.capture.autograd_graphs import StandIns
from mncore_device.capture.dynamo import GraphBreak, own_code

from .patches import REMOVED, Patches, patched

# the reason given to torch.compiler.disable for the manual calls run on the host: the graph
# breaks they make are this package's, not the user's host code
HOST_CALL = "mncore: a manual-optimization call run on the host"


class HostDriven(Exception):  # noqa: N818 - a signal, not an error the user sees
    """The manual step runs host-driven from now on: `reason` (what the step does that a
    one-call step cannot give as cpu would), `where` (the user's line). Raised while Dynamo
    captures the step, before anything of the call has run."""

    def __init__(self, reason: str, where: str | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.where = where


class Parameters(StandIns):
    """A parameter stands for itself in the device graphs' autograd: the backward calls'
    gradients accumulate into `p.grad`, as on cpu, and follow `requires_grad` (toggles).
    Other state (buffers, optimizer state) has a stand-in."""

    def of(self, state: torch.Tensor) -> torch.Tensor:
        if isinstance(state, torch.nn.Parameter):
            return state
        return super().of(state)


class HostManualSteps:
    """The host calls of a host-driven manual step (see the module docstring); the update
    device functions are compiled by `hook` (a CapturedHook)."""

    def __init__(self, hook: Any, reason: str) -> None:
        self.hook = hook
        self.strategy = strategy = hook.strategy
        self.module = module = hook.module
        self.reason = reason
        self.stand_ins = Parameters()
        self._gradients_read: str | None = None  # the first p.grad a graph reads, and where
        self._after_backward = strategy._gradient_reduction()  # data parallel: the average
        self._updates: dict[tuple, Any] = {}  # the update device functions
        self._patches = Patches()
        host = self._on_host
        for name in ("manual_backward", "toggle_optimizer", "untoggle_optimizer", "clip_gradients"):
            self._patch(module, name, host(name, _original(module, name)))
        for lopt in strategy._lightning_optimizers:
            opt = lopt.optimizer
            update = host("update", functools.partial(self._update, opt, _original(opt, "step")))
            self._patch(
                lopt,
                "step",
                _stepping(
                    host("optimizer.step", _original(lopt, "step")),
                    host("optimizer.step", functools.partial(_before_step, lopt)),
                    host("optimizer.step", functools.partial(_after_closure, strategy, lopt)),
                ),
            )
            self._patch(opt, "step", _stepping(None, None, update))
            for target in (lopt, opt):
                self._patch(target, "zero_grad", host("zero_grad", _original(target, "zero_grad")))
        for config in strategy.lr_scheduler_configs:
            scheduler = config.scheduler
            self._patch(scheduler, "step", host("scheduler.step", _original(scheduler, "step")))

    def _patch(self, target: Any, name: str, function: Any) -> None:
        self._patches.add(target.__dict__, name, function)

    def _on_host(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """`function` as host code: Dynamo graph-breaks on it; it runs with Lightning's own
        `self.log` (a hook logs as on cpu), and the precision plugin's backward and
        optimizer_step run eagerly (MNCorePrecision.tracing_manual_step)."""
        module, strategy = self.module, self.strategy

        def run(*args: Any, **kwargs: Any) -> Any:
            precision = strategy.precision_plugin
            with _lightning_logs(module), precision.tracing_manual_step(self._after_backward):
                return function(*args, **kwargs)

        run.__name__ = run.__qualname__ = f"mncore_host_{name.replace('.', '_')}"
        return torch.compiler.disable(run, reason=f"{HOST_CALL} ({name})")

    # --- around each step ---------------------------------------------------------------------

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The host calls stand in for the manual methods while the step runs; the host holds
        this step's weights."""
        self.strategy.synchronize()
        with self._patches.installed():
            yield
        self._push_host_edits()

    def note_reads(self, captured: Any) -> None:
        """A graph Dynamo captured: the first gradient it reads, for the report."""
        if self._gradients_read is not None:
            return
        for spec in captured.inputs:
            if spec.source.endswith(".grad"):
                nodes = captured.graph_module.graph.nodes
                users = next(n for n in nodes if n.name == spec.name).users
                traces = [u.meta.get("stack_trace") for u in users]
                where = next(filter(None, map(user_frame_from_stack_trace, traces)), None)
                self._gradients_read = f"{readable(spec.source)} at {where}"
                return

    def replay(self) -> None:
        """Nothing to replay: every host call ran in the step."""

    def report(self) -> None:
        """Say once how the step runs: what makes it host-driven, and its device calls."""
        if self.hook.device_calls_per_step is not None:
            return
        self.hook.device_calls_per_step = calls = self.hook._device_calls
        breaks = [str(b) for b in self.hook.frontend.breaks if not is_host_call(b)]
        found = [f"has host code ({'; '.join(breaks)})"] if breaks else []
        if self._gradients_read is not None:
            found.append(f"reads gradients ({self._gradients_read})")
        reason = " and ".join(found) or self.reason
        rank_zero_info(
            f"MN-Core: training_step {reason}; it runs as {calls} device calls per step: each "
            "graph's forward and backward, and one update per opt.step(), with manual_backward, "
            "opt.step(), zero_grad() and the other optimizer calls on the host between them"
        )

    # --- the update -------------------------------------------------------------------------------

    def _update(self, optimizer: Any, step: Callable[..., Any], **kwargs: Any) -> None:
        """One device call: `optimizer`'s step with the gradients its parameters hold now;
        then the host holds the new weights."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = {f"grad/{i}": p.grad.detach() for i, p in enumerate(params) if p.grad is not None}
        key = (id(optimizer), frozenset(grads), repr(sorted(kwargs.items())))
        self._push_host_edits()  # before a compile, which takes the host as the device's
        update = self._updates.get(key)
        if update is None:
            function = functools.partial(_apply_gradients, params, step, kwargs)
            update = self._updates[key] = self.hook._device_function(function, grads)
        update(grads)
        strategy = self.strategy
        strategy._device_is_newer = True
        strategy.synchronize()

    def _push_host_edits(self) -> None:
        """Registered tensors host code changed since host and device last agreed (an
        eager region's BatchNorm statistics, say): to the device, before it is read."""
        strategy = self.strategy
        changed = strategy._host_versions.changed()
        if changed:
            strategy.context.load_from_host(changed)
            strategy._host_versions.record()


def readable(source: str) -> str:
    """A source as Dynamo names it, from the module on: `self.net.0.weight.grad`."""
    source = re.sub(r"^.*\.__self__(?=\.|$)", "self", source)
    return re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", source)


def is_host_call(graph_break: GraphBreak) -> bool:
    """Whether a graph break is at one of the manual calls run on the host (not user code)."""
    return HOST_CALL in graph_break.reason


def _apply_gradients(
    params: list[torch.Tensor],
    step: Callable[..., Any],
    kwargs: dict[str, Any],
    inputs: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The update call, traced: the optimizer's step with the gradients given."""
    saved = [p.grad for p in params]
    for index, param in enumerate(params):
        param.grad = inputs.get(f"grad/{index}")
    try:
        step(**kwargs)
    finally:
        for param, grad in zip(params, saved, strict=True):
            param.grad = grad
    return {}


def _before_step(lightning_optimizer: Any) -> None:
    """What LightningOptimizer.step does first (the manual loop sets it for each batch)."""
    lightning_optimizer._on_before_step()


def _after_closure(strategy: Any, lightning_optimizer: Any, **kwargs: Any) -> None:
    """The rest of LightningOptimizer.step after a closure ran: the strategy's optimizer_step
    (on_before_optimizer_step, then the optimizer's step: the update call), then Lightning's
    count of the step."""
    strategy.optimizer_step(lightning_optimizer.optimizer, do_nothing_closure, **kwargs)
    lightning_optimizer._on_after_step()


def _stepping(
    whole: Callable[..., Any] | None,
    before: Callable[[], Any] | None,
    after: Callable[..., Any],
) -> Callable[..., Any]:
    """`opt.step(closure=None, **kwargs)`: without a closure, `whole` (LightningOptimizer's
    step, on the host) if given; with one, `before`, the closure under Dynamo (its forward on
    the device, as the step's), then `after` (the update). A code object of its own: Dynamo
    keeps what it compiles for a frame by code object, for the whole process."""

    def step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if closure is None and whole is not None:
            return whole(**kwargs)
        if before is not None:
            before()
        output = None
        if closure is not None:
            with torch.enable_grad():  # as torch.optim runs a closure
                output = closure()
        after(**kwargs)
        return output

    return own_code(step)


def _original(target: Any, name: str) -> Callable[..., Any]:
    """`target.name` as it is now (an instance's own attribute, or its class's method)."""
    own = target.__dict__.get(name)
    return own if own is not None else getattr(type(target), name).__get__(target)


def _lightning_logs(module: Any) -> contextlib.AbstractContextManager:
    """Lightning's `self.log` / `log_dict` while host code runs inside the captured step
    (whose recorder stands in for them on the instance)."""
    return patched(module.__dict__, log=REMOVED, log_dict=REMOVED)
