"""`MNCoreStrategy(steps_per_call=K)` on the TorchDynamo capture: K training steps, ONE device call.

Each of a group's K steps runs the user's `training_step` under Dynamo, as K calls would on cpu:
with its own batch, `batch_idx` and `global_step`, its guards checked (a branch on
`global_step` that flips inside a group takes the other graph from that step on), and its
Python side effects (attribute writes, list appends) replayed after it, once per step. What a
step's graph computes is deferred instead of run: Dynamo's code gets empty tensors of the
graph outputs' shapes (placeholders). After the K-th step, ONE device function runs the whole
group: it is traced as the K steps' graphs one after the other, each with the backward and the
update at its marker (`CapturedHook._backward_and_update`), so step i+1 reads the weights step
i left. Its outputs are written into the placeholders; then each step's `self.log` calls are
replayed into Lightning, in step order.

A step that reads a tensor an earlier step of its group left on the module (an attribute set
to a graph output) reads that step's output inside the device graph; a tensor the graph
changes in place (a metric's state) is handed from step to step there, and written back once.
A step that cannot wait for the group's call (a Python number computed on the device that the
step's own code uses at once, `self.log("loss", loss.item())`; host code in the step, a graph
break) is found when Dynamo hands over its graph, before anything of that step ran: the steps
deferred so far run as one device call, and that step and every later one run one by one, as
`steps_per_call=1` runs them (a split step for host code), said once in the log. Each step
still matches cpu; only the device calls per step grow.

The group's device function is compiled once per sequence of captured graphs (K, and the
graph each step took): the group length (a shorter last group of an epoch), a re-compile of
the step (a Python value changed between epochs) or a flipped branch add one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from mncore_device import StaticGraphError
from mncore_device.capture import CapturedGraph, InputKind, ScalarsAsTensors
from mncore_device.capture.dynamo import MUTATED_PREFIX

from ..host_sync import GRADIENT_HOOKS
from .hooks import CapturedHook, _leading_size
from .update import loss_of

# the key of the group hook among the strategy's captured hooks (stage, window, update, kind)
GROUP_KEY = ("train", 1, True, "steps_per_call")


@dataclasses.dataclass
class _Deferred:
    """One step's graph call, waiting for the group's device call."""

    captured: CapturedGraph
    inputs: dict[str, torch.Tensor]  # the device inputs Dynamo gave (tensors, numbers)
    outputs: dict[str, torch.Tensor]  # the placeholders Dynamo's code got


# where each tensor input of a step comes from in the group's device function:
# (name, "in", n): the group's n-th host tensor; (name, "out", step, key): an earlier step's
# output; (name, "number"): this step's number input
_Source = tuple


class _CannotDefer(Exception):  # noqa: N818 - a signal, not an error the user sees
    """This step's graph cannot wait for the group's device call (see the module docstring);
    raised when Dynamo hands it over, before anything of the step ran."""


class CapturedStepGroup(CapturedHook):
    """`training_step` for groups of K batches, each group ONE device call (module docstring)."""

    def __init__(self, strategy: Any, **kwargs: Any) -> None:
        super().__init__(strategy, "training_step", **kwargs)
        self._deferred: list[_Deferred] = []
        self.one_by_one: str | None = None  # why steps run one by one, once one could not wait
        # by sequence of (graph, sources) per step: (device function, the plan it was traced
        # for, which keeps the graphs alive while their ids are keys)
        self._groups: dict[tuple, tuple[Any, list]] = {}

    # --- the K steps, on the host --------------------------------------------------------------

    def run_group(self, batches: Sequence[Any], rest: tuple, steps_per_call: int) -> Any:
        """Run `batches` (one group) as K steps and one device call; returns the last step's
        output. `rest`: training_step's arguments after the batch (the group's index first)."""
        module = self.module
        trainer = module.trainer
        progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
        total = progress.optimizer.step.total
        completed = total.completed  # trainer.global_step: step i of the group sees it + i
        first_idx = rest[0] * steps_per_call if rest and isinstance(rest[0], int) else None
        ran: list[tuple[Any, list, int | None]] = []
        self._deferred = []
        alone = len(batches)  # the first step that runs on its own (one_by_one)
        steps = []
        for index, batch in enumerate(batches):
            args = (batch, *rest)
            if first_idx is not None:
                args = (batch, first_idx + index, *rest[1:])
            steps.append(args)
        try:
            for index, args in enumerate(steps):
                total.completed = completed + index
                if self.one_by_one is not None:
                    alone = index
                    break
                try:
                    output = self._run_step(args)
                except _CannotDefer as signal:
                    self.one_by_one = str(signal)
                    rank_zero_info(
                        f"MN-Core: steps_per_call={steps_per_call}: {signal}; from here on each "
                        "training step runs as its own device call(s)"
                    )
                    alone = index
                    break
                if len(self._deferred) != index + 1:
                    raise StaticGraphError(
                        f"training_step ran {len(self._deferred) - index} device graphs in step "
                        f"{index} of a group of steps_per_call={steps_per_call}; it must be one"
                    )
                loss_of(output)  # a step without a loss (None, say) ran no update: refused
                ran.append((output, list(self._logs.calls), _leading_size(args[0])))
        finally:
            total.completed = completed
            self._logs.calls.clear()
        if ran:
            self._run_deferred()
            for _, calls, size in ran:
                self._logs.calls[:] = calls
                self._logs.replay(module, size)
            self._logs.calls.clear()
        output = ran[-1][0] if ran else None
        try:
            for index in range(alone, len(steps)):  # as steps_per_call=1 runs them
                total.completed = completed + index
                output = self.strategy._captured_training_step(steps[index], False, 1, True)
        finally:
            total.completed = completed
        return output

    def _compile_graph(self, captured: CapturedGraph) -> Any:
        """Not compiled on its own: a function that defers the graph to the group's call and
        gives placeholders of its outputs' shapes (found by running it on fake tensors)."""
        self._refuse_host_code()  # fullgraph=True: an error at the line
        if self.frontend.breaks:
            breaks = "; ".join(map(str, self.frontend.breaks))
            raise _CannotDefer(f"training_step has host code ({breaks})")
        at_once = _numbers_read_at_once(captured)
        host_numbers = _on_the_host(captured, at_once)
        if host_numbers is None:
            raise _CannotDefer(
                "training_step computes a Python number on the device (a `.item()`, say) that "
                "the code after the graph uses at once, which a group of steps cannot give "
                "before the group's device call"
            )
        shapes = _output_shapes(captured, self._update)

        def deferred(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            outputs = {key: torch.empty(shape, dtype=dtype) for key, shape, dtype in shapes}
            with torch.no_grad():  # numbers computed from host numbers alone: known now
                for key, value in host_numbers(inputs).items():
                    outputs[key].copy_(value)
            self._deferred.append(_Deferred(captured, dict(inputs), outputs))
            return outputs

        return deferred

    # --- the group, on the device --------------------------------------------------------------

    def _run_deferred(self) -> None:
        """Run the deferred steps as one device call; fill their placeholders."""
        deferred, self._deferred = self._deferred, []
        produced = {id(t): (i, key) for i, d in enumerate(deferred) for key, t in d.outputs.items()}
        hosts: dict[int, int] = {}  # id of a host tensor input -> its group input index
        host_tensors: list[torch.Tensor] = []
        inputs: dict[str, torch.Tensor] = {}
        plan: list[tuple[CapturedGraph, tuple[_Source, ...]]] = []
        for index, step in enumerate(deferred):
            sources: list[_Source] = []
            for spec in step.captured.inputs:
                if spec.kind is InputKind.NUMBER:
                    inputs[f"{index}/{spec.name}"] = step.inputs[spec.name]
                    sources.append((spec.name, "number"))
                elif spec.kind is InputKind.TENSOR:
                    tensor = step.inputs[spec.name]
                    earlier = produced.get(id(tensor))
                    if earlier is not None and earlier[0] < index:
                        sources.append((spec.name, "out", *earlier))
                        continue
                    n = hosts.setdefault(id(tensor), len(hosts))
                    if n == len(host_tensors):
                        host_tensors.append(tensor)
                        inputs[f"in/{n}"] = tensor
                    sources.append((spec.name, "in", n))
            plan.append((step.captured, tuple(sources)))
        key = tuple((id(captured), sources) for captured, sources in plan)
        entry = self._groups.get(key)
        if entry is None:
            entry = self._groups[key] = (self._compile_group(plan, inputs), plan)
        outputs = self.strategy._to_host(entry[0](inputs))
        with torch.no_grad():
            for index, step in enumerate(deferred):
                for key_, placeholder in step.outputs.items():
                    placeholder.copy_(outputs[f"{index}/{key_}"])
            for n, tensor in enumerate(host_tensors):
                new = outputs.get(f"{MUTATED_PREFIX}in/{n}")
                if new is not None:
                    tensor.copy_(new)

    def _compile_group(
        self, plan: list[tuple[CapturedGraph, tuple[_Source, ...]]], sample: dict
    ) -> Any:
        """Trace the group's steps, one after the other, into one device function."""
        calls = {self._update: self._backward_and_update}

        def device_group(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            results: dict[str, torch.Tensor] = {}
            outputs: list[dict[str, torch.Tensor]] = []
            for index, (captured, sources) in enumerate(plan):
                step_inputs = {}
                for source in sources:
                    name, kind = source[0], source[1]
                    if kind == "in":
                        step_inputs[name] = inputs[f"in/{source[2]}"]
                    elif kind == "out":
                        step_inputs[name] = outputs[source[2]][source[3]]
                    else:
                        step_inputs[name] = inputs[f"{index}/{name}"]
                out = captured.run(step_inputs, calls)
                outputs.append(out)
                by_name = {s[0]: s for s in sources}
                for key, value in out.items():
                    if not key.startswith(MUTATED_PREFIX):
                        results[f"{index}/{key}"] = value
                        continue
                    source = by_name[key.removeprefix(MUTATED_PREFIX)]
                    if source[1] == "in":  # changed in place: later steps read it, too
                        results[f"{MUTATED_PREFIX}in/{source[2]}"] = value
            return results

        options = dict(self._compile_options)
        codegen_dir = options.pop("codegen_dir", None)
        codegen_dir = codegen_dir() if codegen_dir is not None else None
        self._update_traced = None
        try:
            with torch.inference_mode(False):
                compiled = self.context.compile(  # replays of captured graphs: traced as they are
                    device_group, sample, codegen_dir, capture="trace", **options
                )
        finally:  # tracing restores the host tensors it ran on, which bumps their versions
            self.strategy._host_versions.record()
        if self._update_traced is not None and self._update_traced.calls:
            names = ", ".join(repr(call[0]) for call in self._update_traced.calls)
            raise MisconfigurationException(
                f"MNCoreStrategy(steps_per_call={len(plan)}): configure_gradient_clipping logs "
                f"({names}) in the update of each step of a group, which the group's device "
                "call does not log step by step; use steps_per_call=1, or log in "
                "training_step."
            )
        self.compiled.append(compiled)
        return compiled


def _numbers_read_at_once(captured: CapturedGraph) -> list[int]:
    """The outputs Dynamo's code after the graph turns into Python numbers at once: a SymInt
    or SymFloat output, a float Dynamo returns as `torch.scalar_tensor(x)` and unwraps with
    `.item()` (torch/_dynamo/codegen.py), or a number input returned as such. A placeholder
    would give it the value of an empty tensor."""
    numbers = {s.name for s in captured.inputs if s.kind is not InputKind.TENSOR}
    output = next(n for n in captured.graph_module.graph.nodes if n.op == "output")
    found = []
    for index, value in enumerate(output.args[0]):
        if captured.number_outputs[index]:
            found.append(index)
        elif not isinstance(value, fx.Node):
            continue
        elif value.op == "call_function" and value.target is torch.scalar_tensor:
            found.append(index)
        elif value.op == "placeholder" and value.name in numbers:
            found.append(index)
    return found


def _on_the_host(captured: CapturedGraph, outputs: list[int]) -> Any:
    """A function of a call's device inputs computing `outputs` on the host, when each is
    computed from Python numbers alone (`self.global_step * 2.0 + batch_idx`, the learning
    rate): what Dynamo's code reads at once is then known before the group's call. None if
    one of them needs a tensor (`loss.item()`)."""
    if not outputs:
        return lambda inputs: {}
    graph = captured.graph_module.graph
    results = [next(n for n in graph.nodes if n.op == "output").args[0][i] for i in outputs]
    kinds = {s.name: s for s in captured.inputs}
    needed: set[fx.Node] = set()
    stack = [r for r in results if isinstance(r, fx.Node)]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        if node.op == "placeholder" and kinds[node.name].kind in (
            InputKind.TENSOR,
            InputKind.STATE,
        ):
            return None
        needed.add(node)
        stack.extend(node.all_input_nodes)
    host = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = []
    for node in graph.nodes:
        if node in needed:
            env[node] = host.node_copy(node, env.__getitem__)
            if node.op == "placeholder":
                placeholders.append(kinds[node.name])
    host.output(tuple(env[r] if isinstance(r, fx.Node) else r for r in results))
    module = fx.GraphModule(captured.graph_module, host)
    numbers = {s.name for s in placeholders if s.kind is InputKind.NUMBER}
    examples = dict(zip((s.name for s in captured.inputs), captured.examples, strict=True))

    def compute(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        values = [
            inputs[s.name] if s.kind is InputKind.NUMBER else examples[s.name] for s in placeholders
        ]
        computed = ScalarsAsTensors(module, numbers).run(*values)
        return {str(i): torch.as_tensor(v) for i, v in zip(outputs, computed, strict=True)}

    return compute


def _output_shapes(captured: CapturedGraph, marker: Any) -> list[tuple[str, tuple[int, ...], Any]]:
    """The shape and dtype of each output of `captured` (not the in-place changes), from a
    run on fake tensors with the marker's work left out (it returns the loss, detached)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(value: Any) -> Any:
        return mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    on_fakes = dataclasses.replace(captured, examples=[fake(e) for e in captured.examples])
    inputs = {name: fake(value) for name, value in captured.sample().items()}
    try:
        with mode, torch.inference_mode(False):
            outputs = on_fakes.run(inputs, {marker: lambda loss: loss.detach()})
    except Exception as error:
        if hasattr(error, "number_node"):  # a number an op needs as such: fixed by the caller
            raise
        raise _CannotDefer(
            f"training_step's graph could not be run on fake tensors to defer it ({error})"
        ) from error
    return [
        (key, tuple(value.shape), value.dtype)
        for key, value in outputs.items()
        if not key.startswith(MUTATED_PREFIX)
    ]


def run_captured_group(strategy: Any, batches: Sequence[Any], rest: tuple) -> Any:
    """One group of `strategy.steps_per_call` training batches through the Dynamo capture."""
    hook = strategy._captured.get(GROUP_KEY)
    if hook is None:
        trainer = strategy.lightning_module.trainer
        hook = CapturedStepGroup(
            strategy,
            optimizer=strategy.optimizers[0],
            update_options={
                "accumulate": None,
                "update": True,
                "reduce_gradients": strategy._gradient_reduction(),
                "gradient_clipping": (trainer.gradient_clip_val, trainer.gradient_clip_algorithm),
                "return_gradients": bool(strategy._user_hooks.intersection(GRADIENT_HOOKS)),
            },
            fullgraph=strategy.fullgraph,
            compile_options=strategy._compile_options("train"),
        )
        strategy._captured[GROUP_KEY] = hook
    result = hook.run_group(batches, rest, strategy.steps_per_call)
    strategy._device_is_newer = True
    strategy._gradients = []
    strategy.compiled_calls += 1
    strategy.last_call_steps = len(batches)
    return result
