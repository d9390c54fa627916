"""Turn a LightningModule hook into one compiled device-layer function.

`training_step` becomes zero_grad + training_step + backward + clipping + optimizer.step;
`validation_step`, `test_step` and `predict_step` become forward-only graphs. Batches of any
pytree structure are flattened into the dict of tensors the device layer takes.

`self.log` cannot run inside a traced graph (Lightning stores and accumulates the value on
the host). While tracing, `LogRecorder` stands in for `module.log`: logged tensors become
graph outputs, and after every call the recorded `self.log` calls are replayed with the
values the graph produced.
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils._pytree import (
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)

from mncore_device import CompiledFunction, Context, NonFiniteError, StaticGraphError
from mncore_device._source import user_frame

from .batch_values import BatchValues, passable
from .carried_state import CarriedState
from .optimizers import LiveHyperparameter, live_hyperparameters
from .python_values import PythonValues, refuse_writes
from .side_effects import MetricValue, Packed, SideEffects, is_metric
from .step_counters import (
    COUNTER_PREFIX,
    STEP_COUNTERS,
    LiveCounter,
    counter_inputs,
    live_counters,
    scheduler_stepped,
)

_LIGHTNING_LOG = LightningModule.log
LOG_PREFIX = "log/"
OUTPUT_PREFIX = "out/"
BATCH_PREFIX = "batch/"
GRAD_PREFIX = "grad/"
HOSTCALL_PREFIX = "hostcall/"  # tensors a replayed host call is given (a scheduler's metric)


@dataclass
class _LogCall:
    name: str
    key: str | None  # graph output holding the value, or None for a host value
    constant: Any  # the value, or a callable giving the live value at replay
    args: tuple
    kwargs: dict
    # what Lightning derived from this call the first time (see _DerivedLog), for the replays
    derived: Any = None


@dataclass
class _DerivedLog:
    """Where Lightning stores a replayed tensor log (its result-collection entry) and the
    batch size it weighs it with, recorded from one full `LightningModule.log` call.

    `LightningModule.log` validates its arguments, builds and compares the entry's metadata
    and moves the entry to the value's device at every call: ~70 µs per logged value, every
    step, re-deriving what a compiled step's log call fixes once. Later replays of the same
    call hand the value straight to that entry, as `log` would after its checks.
    """

    fx: str
    results: Any  # Lightning's result collection the entry belongs to
    entry: Any
    key: str
    batch_size: int

    @staticmethod
    def record(module: Any, log: Callable[..., None], call: _LogCall, value: Any) -> Any:
        """Log `value` through `log`, and return what it derived (None if it stored nothing)."""
        results = module.trainer._results
        seen: list[tuple[str, int]] = []
        update = results.update_metrics

        def recording(key: str, value: Any, batch_size: int) -> None:
            seen.append((key, batch_size))
            update(key, value, batch_size)

        results.update_metrics = recording
        try:
            log(call.name, value, *call.args, **call.kwargs)
        finally:
            del results.update_metrics
        if len(seen) != 1:
            return None
        key, batch_size = seen[0]
        return _DerivedLog(module._current_fx_name, results, results[key], key, batch_size)

    def replay(self, module: Any, value: torch.Tensor) -> bool:
        """Store `value` as `log` would; False if the entry is no longer Lightning's current
        one (another loop's result collection, a reset), so the call must go through `log`."""
        trainer = module.trainer
        results = trainer._results
        if (
            results is not self.results
            or module._current_fx_name != self.fx
            or results.get(self.key) is not self.entry
        ):
            return False
        connector = trainer._logger_connector
        if connector.should_reset_tensors(self.fx):
            results.reset(metrics=False, fx=self.fx)
        results.update_metrics(self.key, value.detach().clone().squeeze(), self.batch_size)
        connector._current_fx = self.fx
        return True


class LogRecorder:
    """Records `self.log` calls made while a hook is traced; replays them after each call.

    A compiled hook has a static batch size, so replays pass it to Lightning instead of
    letting Lightning search the batch for it on every call (same value, less work).
    """

    def __init__(self, batch_size: int | None = None) -> None:
        self.calls: list[Any] = []  # _LogCall, or a metric call to replay (side_effects)
        self.tensors: dict[str, torch.Tensor] = {}
        self.batch_size = batch_size
        self.step = 0  # which of a multi-step graph's steps is being traced

    def start_step(self, step: int) -> None:
        """The calls recorded from now on belong to step `step` of a multi-step graph: their
        values are outputs of their own, and logged counters read `step` batches later."""
        self.step = step

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        options = [*args, *kwargs.values()]
        if any(isinstance(option, (torch.Tensor, LiveCounter)) for option in options):
            raise StaticGraphError(
                f"self.log({name!r}, ...) passes an option (such as batch_size) computed in "
                f"the step or from a step counter, at {user_frame()}. The logging options are "
                "fixed when the step is traced: pass a Python number that does not change "
                "between steps, or log from a hook outside the step."
            )
        if self.batch_size is not None and not args:
            kwargs.setdefault("batch_size", self.batch_size)
        if isinstance(value, LiveHyperparameter) and value.reader is None:
            # computed from one (`lr * 10`): its tensor, as a Python float would be logged
            value = float(value) if value.tensor is None else value.tensor.to(torch.float32)
        if isinstance(value, MetricValue) or is_metric(value):
            # a metric's result or the Metric itself: logged after the metric's host replay
            self.calls.append(_LogCall(name, None, value, args, kwargs))
        elif isinstance(value, torch.Tensor):
            key = LOG_PREFIX + (f"{self.step}/" if self.step else "") + name
            self.tensors[key] = value.detach()
            self.calls.append(_LogCall(name, key, None, args, kwargs))
        elif isinstance(value, LiveCounter):  # the counter's value at each call
            reader = _counter_reader(value, self.step)
            self.calls.append(_LogCall(name, None, reader, args, kwargs))
        elif isinstance(value, LiveHyperparameter):  # e.g. the learning rate, as it is now
            self.calls.append(_LogCall(name, None, value.reader, args, kwargs))
        elif isinstance(value, numbers.Number):
            warnings.warn(
                f"self.log({name!r}, {value!r}) inside a compiled step logs the value the step "
                "was traced with at every step. Log a tensor computed in the step, or log this "
                "value from a hook outside the step.",
                stacklevel=2,
            )
            self.calls.append(_LogCall(name, None, value, args, kwargs))
        else:
            raise TypeError(
                f"self.log({name!r}, ...) inside a compiled step got a {type(value).__name__}. "
                "MNCoreStrategy logs tensors, Python numbers and torchmetrics Metrics."
            )

    def replay(
        self, module: Any, outputs: Mapping[str, torch.Tensor], counters: Mapping[str, int]
    ) -> None:
        log = module.log
        # a module that overrides log() sees every call
        direct = getattr(type(module), "log", None) is _LIGHTNING_LOG
        for call in self.calls:
            if not isinstance(call, _LogCall):  # a metric call (side_effects), in step order
                call.replay(outputs)
                continue
            if call.key is not None:
                value = outputs[call.key]
                if direct and value.numel() == 1:
                    if call.derived is None or not call.derived.replay(module, value):
                        call.derived = _DerivedLog.record(module, log, call, value)
                    continue
            elif isinstance(call.constant, MetricValue):
                value = call.constant.host_value()
            elif callable(call.constant) and not is_metric(call.constant):
                value = call.constant(counters)
            else:
                value = call.constant
            log(call.name, value, *call.args, **call.kwargs)


def _plain_log(call: Any) -> bool:
    """A `self.log` of a tensor, counter, hyperparameter or number (no metric)."""
    return (
        isinstance(call, _LogCall)
        and not isinstance(call.constant, MetricValue)
        and not is_metric(call.constant)
    )


def _counter_reader(counter: LiveCounter, step: int = 0) -> Callable[[Mapping[str, int]], int]:
    name = counter.name
    offset = (step if name in STEP_COUNTERS else 0) + counter.offset
    return lambda counters: counters[name] + offset


@contextlib.contextmanager
def recording_logs(module: Any, recorder: LogRecorder) -> Iterator[None]:
    """Route `module.log` (and so `module.log_dict`) to `recorder` while tracing."""
    module.log = recorder.log
    try:
        yield
    finally:
        del module.log


@dataclass(frozen=True)
class BatchLayout:
    """A batch's pytree structure; tensor leaves are graph inputs, others are fixed, except
    those a compiled step passes through (`free`: batch_values.py), whose values may change."""

    spec: TreeSpec
    tensor_positions: tuple[int, ...]
    fixed: tuple[tuple[int, Any], ...]
    free: frozenset[int] = frozenset()

    @classmethod
    def of(cls, batch: Any) -> tuple[BatchLayout, dict[str, torch.Tensor]]:
        leaves, spec = tree_flatten(batch)
        positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        fixed = tuple(
            (i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)
        )
        inputs = {f"{BATCH_PREFIX}{i}": leaves[i] for i in positions}
        return cls(spec, positions, fixed), inputs

    def passing_through(self) -> BatchLayout:
        """This layout with its string and number leaves free (tried as pass-through)."""
        free = frozenset(i for i, value in self.fixed if passable(value))
        return BatchLayout(self.spec, self.tensor_positions, self.fixed, free)

    def batch_values(self) -> BatchValues:
        """The free leaves' values in this batch, for a step that passes them through."""
        names = _leaf_names(self.spec) if self.free else []
        values = {i: value for i, value in self.fixed if i in self.free}
        return BatchValues(values, {i: names[i] for i in values})

    def difference(self, other: BatchLayout) -> str | None:
        """How `other` differs from this layout, naming the element ("batch[2]") and both
        values; None when they are the same (free leaves may hold any value)."""
        if self.spec != other.spec:
            return f"its structure changed from {self.spec} to {other.spec}"
        if self.tensor_positions != other.tensor_positions:
            moved = sorted(set(self.tensor_positions) ^ set(other.tensor_positions))
            name = _leaf_names(self.spec)[moved[0]]  # named only when reported: once
            return f"batch{name} is a tensor in one batch and not in the other"
        for (i, mine), (_, theirs) in zip(self.fixed, other.fixed, strict=True):
            if i not in self.free and mine is not theirs and mine != theirs:
                return f"batch{_leaf_names(self.spec)[i]} changed from {mine!r} to {theirs!r}"
        return None

    def rebuild(
        self, inputs: Mapping[str, torch.Tensor], stand_ins: Mapping[int, Any] | None = None
    ) -> Any:
        """The batch, from the graph's inputs; free leaves are `stand_ins` where given."""
        leaves: list[Any] = [None] * (len(self.tensor_positions) + len(self.fixed))
        for i in self.tensor_positions:
            leaves[i] = inputs[f"{BATCH_PREFIX}{i}"]
        for i, value in self.fixed:
            leaves[i] = value
        for i, value in (stand_ins or {}).items():
            leaves[i] = value
        return tree_unflatten(leaves, self.spec)


def _leaf_names(spec: TreeSpec) -> list[str]:
    """The path of each leaf of a batch with this structure, as `[0]`, `['x']`, ..."""
    paths, _ = tree_flatten_with_path(tree_unflatten(list(range(spec.num_leaves)), spec))
    return [keystr(path) for path, _ in paths]


def shape_change(compiled: Any, inputs: Mapping[str, torch.Tensor]) -> str | None:
    """Which batch tensor has another shape or dtype than the step was compiled for."""
    specs = compiled.input_specs
    for key, value in inputs.items():
        spec = specs[key]
        if spec.shape != tuple(value.shape) or spec.dtype != value.dtype:
            return f"{key} changed from {list(spec.shape)} {spec.dtype} to {list(value.shape)} {value.dtype}"
    return None


class _Returned:
    """What a hook returned, as graph outputs and the rest (side_effects.Packed)."""

    def __init__(self) -> None:
        self.packed: Packed | None = None

    def capture(self, value: Any) -> dict[str, torch.Tensor]:
        outputs: dict[str, torch.Tensor] = {}
        self.packed = Packed(value, OUTPUT_PREFIX, outputs)
        return outputs

    def rebuild(self, outputs: Mapping[str, torch.Tensor]) -> Any:
        return self.packed.rebuild(outputs)


class CompiledHook:
    """One compiled hook for one batch layout; calling it runs the graph and replays logs."""

    def __init__(
        self,
        compiled: CompiledFunction,
        layout: BatchLayout,
        recorder: LogRecorder,
        returned: _Returned,
        to_host: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
        gradient_params: dict[str, torch.Tensor],
        carried: CarriedState,
        extra_args: tuple,
        effects: SideEffects,
        used_counters: frozenset[str],
        counter_names: tuple[str, ...],
        python_values: PythonValues,
        detects_anomaly: bool = False,
        batch_values: BatchValues | None = None,
    ) -> None:
        self.compiled = compiled
        # the batch elements it passes through: their values are set at every call
        self.batch_values = batch_values or BatchValues({}, {})
        self.detects_anomaly = detects_anomaly  # compiled for Trainer(detect_anomaly=True)
        self.python_values = python_values  # the Python values the graph was traced for
        self.effects = effects
        self.used_counters = used_counters  # the counters the graph computes with
        self.counter_names = counter_names  # the counters it was traced with (its inputs)
        self.carried = carried
        self.extra_args = extra_args[1:]  # what follows batch_idx (dataloader_idx), fixed
        self.layout = layout
        self.recorder = recorder
        self.returned = returned
        self.to_host = to_host
        self.gradient_params = gradient_params
        # (param, the gradient the last call computed, 0): see MNCoreStrategy.install_gradients
        self.gradients: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def __call__(
        self,
        module: Any,
        inputs: dict[str, torch.Tensor],
        counters: dict[str, int],
        layout: BatchLayout | None = None,
    ) -> Any:
        """Run the graph on `inputs` and replay its host side; `layout`: the batch's, whose
        passed-through elements (its non-tensor leaves the step only hands on) this call's
        returned values, appends and metric calls get."""
        if layout is not None and self.batch_values.values:
            free = self.layout.free
            self.batch_values.values = {i: v for i, v in layout.fixed if i in free}
        inputs = {**inputs, **counter_inputs(counters, self.used_counters)}
        if self.carried.slots:
            inputs.update(self.carried.inputs())
        try:
            outputs = self.to_host(self.compiled(inputs))
        except NonFiniteError as error:
            if not self.detects_anomaly:
                raise
            where = ", ".join(
                f"{k}={counters[k]}" for k in ("batch_idx", "global_step") if k in counters
            )
            raise NonFiniteError(
                f"Trainer(detect_anomaly=True) stopped the compiled training step ({where}): "
                f"{error}. Nothing of this step was applied: the weights are those before it."
            ) from error
        self.carried.replay(outputs)
        self.recorder.replay(module, outputs, counters)
        self.effects.replay(outputs)
        if self.gradient_params:
            self.gradients = [(p, outputs[k], 0) for k, p in self.gradient_params.items()]
        return self.returned.rebuild(outputs)


def compile_hook(
    context: Context, module: Any, hook_name: str, batch: Any, extra_args: tuple, **kwargs: Any
) -> tuple[CompiledHook, dict[str, torch.Tensor]]:
    """Trace `module.<hook_name>(batch, *extra_args)` into a compiled function (see
    `_compile_hook` for the keywords), passing the batch's string and number elements
    through when the step does not read them (batch_values.py), else as constants."""
    layout, _ = BatchLayout.of(batch)
    passing = layout.passing_through()
    if passing.free:
        try:
            hook, inputs = _compile_hook(
                context, module, hook_name, batch, extra_args, passing, **kwargs
            )
        except Exception:  # noqa: BLE001 - a use of a stand-in; any other error comes again
            pass
        else:
            if hook.batch_values.read is None:  # not read, not even in a caught error
                return hook, inputs
    return _compile_hook(context, module, hook_name, batch, extra_args, layout, **kwargs)


def _compile_hook(
    context: Context,
    module: Any,
    hook_name: str,
    batch: Any,
    extra_args: tuple,
    layout: BatchLayout,
    *,
    optimizer: torch.optim.Optimizer | None,
    gradient_clipping: tuple[float | None, str | None] = (None, None),
    return_gradients: bool = False,
    manual: bool = False,
    accumulate: tuple[int, dict[torch.Tensor, torch.Tensor]] | None = None,
    update: bool = True,
    forward: bool = True,
    reduce_gradients: Callable[[list[torch.Tensor]], None] | None = None,
    steps: int | None = None,
    counters: Mapping[str, int],
    options: Mapping[str, Any],
    codegen_dir: Any = None,
    cache_options: Any = None,
    to_host: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> tuple[CompiledHook, dict[str, torch.Tensor]]:
    """Trace `module.<hook_name>(batch, *extra_args)` into a compiled function.

    With `optimizer`, the graph is a whole training step (update included). With
    `accumulate=(n, buffers)`, gradients of the loss / n accumulate into `buffers` (one
    registered tensor per parameter, device state between micro-batches), and the update runs
    only when `update` (the graph that ends an accumulation window, zeroing them). With
    `return_gradients`, it also returns each parameter's gradient as backward left it (before
    clipping, as Lightning's gradient hooks see it). `reduce_gradients` is called inside the
    traced step on the gradients backward left (in place), before the update and before any
    other use of them: data parallel averages them across ranks there. With `forward=False`
    the graph is the update alone, on the gradients accumulated in `buffers` (a step split
    around a host all-reduce). With `steps`, `batch` is a list of that many batches and the
    graph holds that many training steps, one after the other, each with its own batch,
    counters and logged values (MNCoreStrategy(steps_per_call=...)). Returns the hook and
    the inputs of this batch.
    """
    _, inputs = BatchLayout.of(batch)
    batch_values = layout.batch_values()
    stand_ins = batch_values.stand_ins()
    recorder = LogRecorder(_static_batch_size(batch if steps is None else batch[0]))
    returned = _Returned()
    gradient_params: dict[str, torch.Tensor] = {}
    carried = CarriedState(module)
    values = PythonValues(module)
    effects = SideEffects(module, recorder)
    used: set[str] = set()  # the counters the graph computes with
    user_hook = getattr(module, hook_name)
    precision = module.trainer.strategy.precision_plugin

    def hook(*args: Any) -> Any:
        with precision.forward_context():  # as Lightning's step contexts: autocast, say
            return user_hook(*args)

    def step(graph_inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch = layout.rebuild(graph_inputs, stand_ins)
        carried.bind(graph_inputs)
        if steps is None:
            return one_step(batch, graph_inputs, 0)
        outputs: dict[str, torch.Tensor] = {}
        for index, each in enumerate(batch):  # unrolled: the graph holds every step
            recorder.start_step(index)
            outputs = one_step(each, graph_inputs, index)  # log outputs accumulate
        recorder.start_step(0)
        return outputs

    def one_step(
        batch: Any, graph_inputs: Mapping[str, torch.Tensor], index: int
    ) -> dict[str, torch.Tensor]:
        live = {}
        for name in counters:
            offset = index if name in STEP_COUNTERS else 0
            tensor = graph_inputs[COUNTER_PREFIX + name]
            tensor = tensor + offset if offset else tensor
            live[name] = LiveCounter(counters[name] + offset, name, tensor, used)
        # batch_idx follows the batch; dataloader_idx is fixed per compiled hook
        args = (live["batch_idx"], *extra_args[1:]) if extra_args else ()
        with live_counters(module, live), live_hyperparameters():
            if manual:
                return manual_step(batch, args)
            if optimizer is None:
                with torch.no_grad(), recording_logs(module, recorder), effects.recording():
                    output = hook(batch, *args)
                return {
                    **recorder.tensors,
                    **returned.capture(output),
                    **carried.capture(),
                    **effects.capture(),
                }
            return train(batch, args)

    def manual_step(batch: Any, args: tuple) -> dict[str, torch.Tensor]:
        """Manual optimization: the user's step calls backward and the updates itself; all of
        it is traced, and the host-side bookkeeping around each update is replayed."""
        with (
            recording_logs(module, recorder),
            effects.recording(),
            recording_host_calls(module, recorder),
            precision.tracing_manual_step(after_backward=reduce_gradients),
        ):
            output = hook(batch, *args)
        return {
            **recorder.tensors,
            **returned.capture(output),
            **carried.capture(),
            **effects.capture(),
        }

    def train(batch: Any, args: tuple) -> dict[str, torch.Tensor]:
        # logs and list appends are recorded through the backward (a tensor hook) and the
        # update (configure_gradient_clipping), not only in the user's step
        with recording_logs(module, recorder), effects.recording():
            output, gradients = train_and_update(batch, args)
        return {
            **recorder.tensors,
            **returned.capture(output),
            **gradients,
            **carried.capture(),
            **effects.capture(),
        }

    def train_and_update(batch: Any, args: tuple) -> tuple[Any, dict[str, torch.Tensor]]:
        if accumulate is None:
            optimizer.zero_grad(set_to_none=True)
        else:
            for param, buffer in accumulate[1].items():
                param.grad = buffer
        output = hook(batch, *args) if forward else None
        gradients = backward_and_update(
            module,
            optimizer,
            _loss_of(output) if forward else None,
            precision.scaler if not manual else None,
            accumulate=accumulate,
            update=update,
            reduce_gradients=reduce_gradients,
            gradient_clipping=gradient_clipping,
            gradient_params=gradient_params if return_gradients else None,
        )
        return output, gradients

    if steps is not None and carried.slots:
        raise MisconfigurationException(
            f"MNCoreStrategy(steps_per_call={steps}) cannot run a step that keeps tensors on its "
            f"modules between steps ({', '.join(carried.slots)}); use steps_per_call=1."
        )
    options = dict(options)
    # Trainer(detect_anomaly=True) checks the values backward makes: a training graph is run
    # by the executor that checks every op (forward-only graphs, as on cpu, are not checked)
    anomaly = torch.is_anomaly_enabled() and (optimizer is not None or manual)
    if anomaly:
        options["option_json"] = ANOMALY_PRESET
    try:
        # Anomaly mode checks values on the host, which a static graph cannot do; the debug
        # preset's executor checks every op for NaN instead. Tracing keeps its record of each
        # forward op's line, by which the graph names the forward line of a backward op.
        with (
            torch.inference_mode(False),
            torch.autograd.set_detect_anomaly(anomaly, check_nan=False),
            values.reading(),
        ):
            compiled = context.compile(
                step,
                {**inputs, **counter_inputs(counters), **carried.inputs()},
                codegen_dir,
                options=options,
                cache_options=cache_options,
                capture="trace",  # this path's interception sites need make_fx's real run
            )
    finally:
        carried.restore()
        written = values.settle()
    refuse_writes(hook_name, written)
    if steps is not None and (effects.appends or not all(map(_plain_log, recorder.calls))):
        raise MisconfigurationException(
            f"MNCoreStrategy(steps_per_call={steps}) cannot run a training_step that updates "
            "torchmetrics metrics or appends to a list of the module: their host replay "
            "would run once per call. Update metrics in validation, or use steps_per_call=1."
        )
    compiled_hook = CompiledHook(
        compiled,
        layout,
        recorder,
        returned,
        to_host,
        gradient_params,
        carried,
        extra_args,
        effects,
        frozenset(used),
        tuple(counters),
        values,
        anomaly,
        batch_values,
    )
    return compiled_hook, inputs


def backward_and_update(
    module: Any,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor | None,
    scaler: Any,
    *,
    accumulate: tuple[int, dict[torch.Tensor, torch.Tensor]] | None,
    update: bool,
    reduce_gradients: Callable[[list[torch.Tensor]], None] | None,
    gradient_clipping: tuple[float | None, str | None],
    gradient_params: dict[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """What a compiled training step does after the forward, as Lightning's automatic
    optimization would: backward of `loss` (scaled, and divided over an accumulation window),
    the gradients' reduction across ranks, unscaling, clipping and the update (skipped where
    the scaled gradients are not finite). The gradients are set up by the caller (zeroed, or
    the accumulation buffers). Returns copies of the gradients as backward left them, by
    `gradient_params` key, when it is given (for Lightning's gradient hooks)."""
    if loss is not None:
        loss = loss if accumulate is None else loss / accumulate[0]
        module.backward(scaler.scale(loss) if scaler is not None else loss)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if reduce_gradients is not None and update:
        reduce_gradients([p.grad for p in params if p.grad is not None])
    found_inf = _unscale(optimizer, scaler) if scaler is not None and update else None
    gradients = {}
    if gradient_params is not None:  # copies: clipping and the update change the grads in place
        for index, param in enumerate(params):
            if param.grad is not None:
                gradients[f"{GRAD_PREFIX}{index}"] = param.grad.detach().clone()
                gradient_params[f"{GRAD_PREFIX}{index}"] = param
    if update:
        # As Lightning: the hook is always called; its default clips only if asked to.
        clip_val, clip_algorithm = gradient_clipping
        module.configure_gradient_clipping(
            optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=clip_algorithm
        )
        if found_inf is None:
            optimizer.step()
        else:
            _step_unless_inf(optimizer, found_inf)
            torch._amp_update_scale_(
                scaler._scale,
                scaler._growth_tracker,
                found_inf,
                scaler._growth_factor,
                scaler._backoff_factor,
                scaler._growth_interval,
            )
    if accumulate is not None:
        if update:
            with torch.no_grad():
                for buffer in accumulate[1].values():
                    buffer.zero_()
        for param in accumulate[1]:
            param.grad = None
    return gradients


def _unscale(optimizer: torch.optim.Optimizer, scaler: Any) -> torch.Tensor:
    """torch.amp.GradScaler.unscale_, inside the graph: divide the gradients by the scale and
    return whether any of them is inf or NaN (a 0-d float tensor, as GradScaler keeps it)."""
    found_inf = torch.zeros((), dtype=torch.float32)
    inv_scale = scaler._scale.double().reciprocal().float()
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    return found_inf


def _step_unless_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """GradScaler.step, inside the graph: a step with inf/NaN gradients is skipped. A static
    graph cannot branch, so the update always runs and its results are discarded where
    `found_inf` is set: params and optimizer state keep their values, as if never stepped."""
    tensors = [p for g in optimizer.param_groups for p in g["params"]]
    tensors += [
        t
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    ]
    with torch.no_grad():
        before = [t.detach().clone() for t in tensors]
    optimizer.step()
    with torch.no_grad():
        skip = found_inf > 0
        for tensor, old in zip(tensors, before, strict=True):
            tensor.copy_(torch.where(skip, old, tensor))


class _HostCall:
    """A host-side call a traced step made (Lightning's optimizer-step bookkeeping, an LR
    scheduler's step), replayed after each call in step order, like `self.log`, with the
    values that call computed (`ReduceLROnPlateau.step(loss)` gets each step's loss)."""

    def __init__(self, call: Callable[..., Any], arguments: Packed | None = None) -> None:
        self.call = call
        self.arguments = arguments

    def replay(self, outputs: Mapping[str, torch.Tensor]) -> None:
        if self.arguments is None:
            self.call()
            return
        args, kwargs = self.arguments.rebuild(outputs)
        self.call(*args, **kwargs)


@contextlib.contextmanager
def recording_host_calls(module: Any, recorder: LogRecorder) -> Iterator[None]:
    """While a manual step is traced, what each `opt.step()` and `sch.step()` does on the host
    is recorded instead of done: Lightning counts optimizer steps (global_step) around each
    update, and a scheduler changes learning rates, at every call on cpu, not once."""
    strategy = module.trainer.strategy
    patched: list[tuple[Any, str, Any]] = []

    def record(owner: Any, name: str, call: Callable[..., Any]) -> None:
        patched.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, call)

    scheduled: set[int] = set()  # optimizers whose scheduler this step has stepped

    def before_update(optimizer: Any, replay: _HostCall) -> None:
        if id(optimizer.optimizer) in scheduled:
            raise StaticGraphError(
                f"the step calls opt.step() after stepping its LR scheduler, at {user_frame()}. "
                "In a compiled step a scheduler's new learning rate takes effect after the "
                "step, not for the updates that follow it in the same step; step the "
                "scheduler after the last opt.step(), or in a hook (on_train_batch_end)."
            )
        recorder.calls.append(replay)

    for optimizer in strategy._lightning_optimizers:
        for name in ("_on_before_step", "_on_after_step"):
            replay = _HostCall(lambda o=optimizer, n=name: getattr(o, n)())
            if name == "_on_before_step":
                record(optimizer, name, lambda o=optimizer, r=replay: before_update(o, r))
            else:
                record(optimizer, name, lambda r=replay: recorder.calls.append(r))
    for config in strategy.lr_scheduler_configs:
        scheduler = config.scheduler

        def record_step(
            *args: Any, _step: Any = scheduler.step, _scheduler: Any = scheduler, **kwargs: Any
        ) -> None:
            scheduled.add(id(getattr(_scheduler, "optimizer", None)))
            scheduler_stepped(_scheduler)
            prefix = f"{HOSTCALL_PREFIX}{len(recorder.calls)}/"
            arguments = Packed((args, kwargs), prefix, recorder.tensors)
            recorder.calls.append(_HostCall(_step, arguments))

        record(scheduler, "step", record_step)
    try:
        yield
    finally:
        for owner, name, previous in reversed(patched):
            if previous is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


_ABSENT = object()
# The preset whose executor checks every op for NaN (and inf reaching the step's results) and
# stops the step at the first op that made one: what Trainer(detect_anomaly=True) runs.
ANOMALY_PRESET = "debug"


def _static_batch_size(batch: Any) -> int | None:
    """The batch size Lightning would extract from this batch (None if it cannot tell)."""
    try:
        return extract_batch_size(batch)
    except Exception:  # Lightning warns and falls back on its own when it cannot tell
        return None


def _loss_of(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            "training_step must return the loss tensor (or a dict with a 'loss' tensor) under "
            f"MNCoreStrategy, got {type(output).__name__}: the compiled step always runs the "
            "backward and the optimizer update, so it cannot skip a batch by returning None"
        )
    return loss
