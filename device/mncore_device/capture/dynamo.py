"""Capture a Python step with TorchDynamo: every read guarded, host code between device calls.

`DynamoFrontend(function, compile_graph, is_state=...)` runs `function` under TorchDynamo with
a backend of its own. Dynamo reads the step's bytecode, so it sees every Python value the
step reads (attributes of any object, tuples, NumPy scalars, globals, closure cells), guards
each by its source, turns an int or float that changes into a graph input, replays list,
dict and attribute writes after the graph, and splits the step around code that cannot be in
a graph (a graph break: `print`, a NumPy draw, a logger call), which then runs on the host
between the device calls, as in eager.

Each graph Dynamo hands over becomes a `CapturedGraph`, with a typed signature: every
placeholder is device state (a registered tensor: the device holds it), a tensor passed at
every call, or a Python number. `compile_graph` turns it into a device function (it traces
`CapturedGraph.run` into a static graph, with whatever it adds around it: a backward and an
update, say); the frontend maps Dynamo's arguments to that function's inputs at every call.

What the frontend reports: each re-compile with Dynamo's reason (the guard that failed,
with the user's line), through `on_retrace`; each graph break with its reason and user line
(`breaks`); each graph's guards, with the values guarded, and its inputs' sources (`sources`,
for reports such as the preflight's). Re-compiles are bounded by `max_retraces`, after which
a `StaticGraphError` names the guard that keeps failing. `fullgraph=True` makes a graph break
an error.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from traceback import format_list
from typing import Any

import torch
from torch import fx
from torch._dynamo.variables.builder import _parse_source_entry

from .._source import user_frame
from ..errors import StaticGraphError
from ..runtime import signature
from ..runtime.frame_stack import on_a_roomy_frame_stack
from .as_tensor import as_tensor_follows_numbers
from .batch_leaves import isinstance_sees_the_value
from .host_random import existing_generators_are_host_code
from .markers import tagged_output
from .scalars import ScalarsAsTensors

# Dynamo's settings for a captured step: `.item()` stays in the graph as a value; an int
# attribute of a module that changes becomes a graph input, as one of any other object does,
# instead of re-compiling at every change; an nn.LSTM or GRU is traced as any module. They
# are set for the whole process when a frontend is made (setting them around every call would
# cost ~100 us a step); they let more of any torch.compile'd code into its graphs, and make a
# torch.compile'd region past its re-compile limit raise rather than run eagerly.
_DYNAMO_CONFIG = {
    "capture_scalar_outputs": True,
    "allow_unspec_int_on_nn_module": True,
    "allow_rnn": True,
    # past a re-compile limit Dynamo would run a frame eagerly, silently: for a captured step
    # that is the host instead of the device (and no update). It raises instead.
    "fail_on_recompile_limit_hit": True,
    # no profiler bookkeeping around the code Dynamo runs before each graph (two calls of
    # torch._disable_dynamo'd functions, ~5 us a step, for torch.profiler's traces)
    "record_runtime_overhead": False,
}


def _configure_dynamo() -> None:
    """Set _DYNAMO_CONFIG (once)."""
    _substitutions_reinstated()
    for key, value in _DYNAMO_CONFIG.items():
        if getattr(torch._dynamo.config, key) != value:
            setattr(torch._dynamo.config, key, value)


NumberOrTensor = torch.Tensor | int | float | bool
MUTATED_PREFIX = "mutated/"
DeviceFunction = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def _param_groups_of_any_dict_type() -> None:
    """Dynamo (torch 2.14.1) fails with an internal AttributeError ('UserDefinedDictVariable'
    object has no attribute 'items') when a step reads `optimizer.param_groups` whose groups
    are a dict subclass (as this package's optimizers' are: they mirror hyperparameters into
    device tensors). What it does there is mark each group "capturable" in its view of the
    groups, which matters only for CUDA graphs; groups of another type are left as they are.
    """
    from torch._dynamo.variables import optimizer

    set_capturable = optimizer.OptimizerVariable._set_capturable
    if getattr(set_capturable, "tolerates_dict_subclasses", False):
        return

    def tolerant(self: Any, tx: Any) -> None:
        groups = self.value.param_groups
        if all(type(group) is dict for group in groups):
            return set_capturable(self, tx)
        return None

    tolerant.tolerates_dict_subclasses = True
    optimizer.OptimizerVariable._set_capturable = tolerant


_param_groups_of_any_dict_type()
existing_generators_are_host_code()
as_tensor_follows_numbers()
isinstance_sees_the_value()


def _last_lr_is_a_read() -> Callable[[], None]:
    """Dynamo (torch 2.14.1) skips every function of torch/optim/lr_scheduler.py on purpose
    (trace_rules.FORCE_SKIP_FILES), so `scheduler.get_last_lr()` in a step is a graph break,
    although it only returns the list the scheduler's last `step()` stored. Dynamo reads that
    list instead: its floats are guarded, or graph inputs once they change, as any read.

    Returns what puts the substitution back in Dynamo's rules: `init_process_group` clears
    their caches (trace_rules.clear_lru_cache), which drops it (measured: after a DDP test,
    a later fit's `get_last_lr()` was a graph break again)."""
    from torch._dynamo.trace_rules import get_torch_obj_rule_map
    from torch._dynamo.variables import PolyfilledFunctionVariable
    from torch.optim.lr_scheduler import LRScheduler

    @torch._dynamo.substitute_in_graph(LRScheduler.get_last_lr)
    def get_last_lr(self: LRScheduler) -> list[float]:
        return self._last_lr

    def reinstate() -> None:
        rules = get_torch_obj_rule_map()
        if LRScheduler.get_last_lr not in rules:
            rules[LRScheduler.get_last_lr] = rules[get_last_lr] = PolyfilledFunctionVariable

    return reinstate


_substitutions_reinstated = _last_lr_is_a_read()


def _modules_by_name_follow_sys_modules() -> None:
    """Dynamo (torch 2.14.1) reads the globals of a function it inlines through the module
    they belong to (`sys.modules[f_globals["__name__"]]`, checked to be that dict), but looks
    the module up again by name through a process-wide cache that keeps the first module it
    ever found under that name. A name can stand for another module later: runpy (and
    `python -m`, notebooks, test runners) runs each script as a new module named `__main__`.
    The cached one is then another script's: the captured step would read, and guard, that
    script's globals (`module '__main__' has no attribute 'model'`). Looking the name up in
    sys.modules at each capture gives the module the check found, and costs a dict lookup.
    """
    import importlib
    import sys

    from torch._dynamo import symbolic_convert

    if getattr(symbolic_convert._import_module, "follows_sys_modules", False):
        return

    def import_module(name: str) -> types.ModuleType:
        module = sys.modules.get(name)
        return module if isinstance(module, types.ModuleType) else importlib.import_module(name)

    import_module.follows_sys_modules = True
    symbolic_convert._import_module = import_module


_modules_by_name_follow_sys_modules()


class InputKind(StrEnum):
    """What a captured graph's input is, by what the step read."""

    STATE = "state"  # a registered tensor (parameter, buffer, optimizer state): on the device
    TENSOR = "tensor"  # any other tensor (a batch, a tensor attribute): passed at every call
    NUMBER = "number"  # a Python int or float the graph computes with (a counter, an lr)
    CONSTANT = "constant"  # a number the graph needs as such (a shape): fixed, checked per call


@dataclasses.dataclass(frozen=True)
class GraphInput:
    name: str  # the placeholder's
    source: str  # where the step read it, as Dynamo names it (L['self'].lr, say)
    kind: InputKind


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """A place where the step left the graph: the code there ran on the host."""

    reason: str
    where: str  # the user's line: file, line, function and code
    stack: str = dataclasses.field(default="", compare=False)  # the whole traceback

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


# Dynamo's guards on a value (not on a type, an identity or a tensor's metadata)
_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH"})


@dataclasses.dataclass(frozen=True)
class CapturedGuard:
    """One of Dynamo's guards on a captured graph, for reports (the frontend does not use it)."""

    kind: str  # Dynamo's guard builder: CONSTANT_MATCH, EQUALS_MATCH, TYPE_MATCH, ...
    source: Any  # a torch._guards.Source: where the step read it (`.name`: Dynamo's expression)
    value: Any = None  # a value guard's value when the graph was captured
    has_value: bool = False  # whether `value` is that (a value guard, read back)

    def __str__(self) -> str:
        """`L['self'].scale == 0.5` for a value guard, else `TYPE_MATCH L['self'].scale`."""
        if self.has_value:
            return f"{self.source.name} == {self.value!r}"
        return f"{self.kind} {self.source.name}"


@dataclasses.dataclass(frozen=True)
class GraphSources:
    """Where one captured graph's values come from, for reports: the code of the frame Dynamo
    captured it from (the frontend's own step, or one of the user's functions after a graph
    break), its guards, and the source of each of its inputs (CapturedGraph.inputs' order)."""

    code: types.CodeType | None
    guards: tuple[CapturedGuard, ...]
    inputs: tuple[Any, ...]  # torch._guards.Source, or None

    @classmethod
    def of_current_trace(cls, graph_module: fx.GraphModule) -> GraphSources:
        """The sources of the graph Dynamo is handing over (called from its backend); empty
        where Dynamo's state says nothing (a report never fails a step)."""
        from torch._dynamo.guards import _get_closure_vars
        from torch._dynamo.symbolic_convert import InstructionTranslator

        try:
            output = InstructionTranslator.current_tx().output
        except AttributeError:  # no translator: not called from Dynamo's backend
            return cls(None, (), ())
        scope = {"L": output.local_scope, "G": output.global_scope}
        closure_vars, cache = _get_closure_vars(), {}
        context = torch._guards.TracingContext.try_get()
        found = []
        for guard in context.guards_context.dynamo_guards if context is not None else ():
            kind, source = guard.create_fn_name(), guard.originating_source
            try:
                if kind in _VALUE_GUARDS:
                    value = source.get_value(scope, closure_vars, cache)
                    found.append(CapturedGuard(kind, source, value, has_value=True))
                    continue
            except Exception:  # noqa: BLE001 - a value it cannot read back is left out
                pass
            found.append(CapturedGuard(kind, source))
        inputs = tuple(
            getattr(node.meta.get("grapharg"), "source", None)
            for node in graph_module.graph.nodes
            if node.op == "placeholder"
        )
        return cls(output.root_tx.f_code, tuple(found), inputs)


@dataclasses.dataclass
class CapturedGraph:
    """One Dynamo graph with a typed signature (see InputKind), ready to trace."""

    graph_module: fx.GraphModule
    inputs: list[GraphInput]
    examples: list[Any]  # what Dynamo gave for each input this time
    number_outputs: list[bool]  # which outputs are Python numbers (returned as such)
    index: int  # its position among the captured graphs
    guards: tuple[str, ...] = ()  # Dynamo's guards on values (CapturedGuard), for its signature

    @classmethod
    def of(
        cls,
        graph_module: fx.GraphModule,
        examples: Sequence[Any],
        is_state: Callable[[torch.Tensor], bool],
        index: int,
        guards: Sequence[CapturedGuard] = (),
    ) -> CapturedGraph:
        placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        inputs = []
        values = []
        for node, example in zip(placeholders, examples, strict=True):
            grapharg = node.meta.get("grapharg")
            source = grapharg.source.name if grapharg is not None else node.name
            if getattr(grapharg, "pass_arg_as_tensor", False):
                # a Python number (or NumPy scalar), passed as a 0-d tensor; a NumPy array
                # is passed as a tensor too, a new one at every call: a TENSOR input
                kind = InputKind.NUMBER if example.dim() == 0 else InputKind.TENSOR
                if kind is InputKind.NUMBER:
                    example = example.item()
            elif isinstance(example, torch.Tensor):
                kind = InputKind.STATE if is_state(example) else InputKind.TENSOR
            else:
                kind = InputKind.NUMBER
                example = _concrete(example)
            inputs.append(GraphInput(node.name, source, kind))
            values.append(example)
        output = next(n for n in graph_module.graph.nodes if n.op == "output")
        number_outputs = [
            isinstance(getattr(v, "meta", {}).get("example_value"), (torch.SymInt, torch.SymFloat))
            for v in output.args[0]
        ]
        # the Python values it was captured under (not Dynamo's type and identity checks)
        guard_lines = tuple(dict.fromkeys(str(g) for g in guards if g.has_value))
        return cls(graph_module, inputs, values, number_outputs, index, guard_lines)

    def sample(self) -> dict[str, torch.Tensor]:
        """The device function's inputs for the examples (what compile traces with)."""
        return self.device_inputs(self.examples)

    @functools.cached_property
    def _positions(self) -> dict[InputKind, list[tuple[int, str]]]:
        """(position, name) of the inputs of each kind: what every call maps."""
        positions: dict[InputKind, list[tuple[int, str]]] = {kind: [] for kind in InputKind}
        for index, spec in enumerate(self.inputs):
            positions[spec.kind].append((index, spec.name))
        return positions

    def device_inputs(self, args: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The device function's inputs for Dynamo's arguments of one call."""
        positions = self._positions
        inputs = {name: args[i] for i, name in positions[InputKind.TENSOR]}
        for i, name in positions[InputKind.NUMBER]:
            inputs[name] = _number_tensor(args[i])
        return inputs

    def constants_differ(self, args: Sequence[Any]) -> str | None:
        """Which fixed number this call gives another value (the graph must be traced again)."""
        for spec, value, example in zip(self.inputs, args, self.examples, strict=True):
            if spec.kind is InputKind.CONSTANT and _number(value) != example:
                return f"{spec.source} changed from {example} to {value}"
        return None

    def replaced_state(self, args: Sequence[Any]) -> list[tuple[GraphInput, Any]]:
        """The state inputs that are other tensors at this call (the step reads a tensor
        that was replaced: the device graph was built on the one it read before), each with
        the tensor it is now."""
        return [
            (spec, value)
            for spec, value, example in zip(self.inputs, args, self.examples, strict=True)
            if spec.kind is InputKind.STATE and value is not example
        ]

    def with_tensor_inputs(self, names: set[str]) -> CapturedGraph:
        """The same graph with the state inputs `names` passed at every call instead."""
        inputs = [
            dataclasses.replace(s, kind=InputKind.TENSOR) if s.name in names else s
            for s in self.inputs
        ]
        return dataclasses.replace(self, inputs=inputs)

    def run(
        self, inputs: Mapping[str, torch.Tensor], calls: Mapping[Any, Callable[..., Any]] = {}
    ) -> dict[str, torch.Tensor]:
        """Run the graph on `inputs` (its tensor and number inputs) and the device state; a
        traced step calls this, so the state is the registered tensors themselves.

        Returns the outputs as "0", "1", ..., and as "mutated/<input>" the new value of each
        tensor input the graph changed in place (a metric's running total, say), which the
        call writes back into the caller's tensor. `calls`: what to run for a marker node
        (see `traced_call`)."""
        values = []
        tensors = {}
        for spec, example in zip(self.inputs, self.examples, strict=True):
            if spec.kind in (InputKind.TENSOR, InputKind.NUMBER):
                value = inputs[spec.name]
                values.append(value)
                if spec.kind is InputKind.TENSOR:
                    tensors[spec.name] = (value, value._version, spec.source)
                    signature.note_input(value, signature.InputKind.BATCH, spec.source)
                else:
                    signature.note_input(value, signature.InputKind.SCALAR, spec.source)
            else:
                values.append(example)  # the registered tensor, or the fixed number
        numbers = {s.name for s in self.inputs if s.kind is InputKind.NUMBER}
        outputs = ScalarsAsTensors(self.graph_module, numbers, calls).run(*values)
        # a number computed only from fixed ones is a Python number: an output as a tensor
        result = {
            str(i): value if isinstance(value, torch.Tensor) else torch.tensor(value)
            for i, value in enumerate(outputs)
        }
        for index, (kind, name) in self._tagged_outputs.items():
            signature.note_output(result[str(index)], kind, name)
        for name, (tensor, version, source) in tensors.items():
            if tensor._version != version:
                result[MUTATED_PREFIX + name] = tensor
                signature.note_output(tensor, signature.OutputKind.INPUT_MUTATION, source)
        signature.note_guards(self.guards)
        return result

    @functools.cached_property
    def _tagged_outputs(self) -> dict[int, tuple[signature.OutputKind, str]]:
        """The outputs the step marked (`tagged_output`): their kind and name, by position."""
        output = next(n for n in self.graph_module.graph.nodes if n.op == "output")
        return {
            index: (signature.OutputKind(node.args[1]), str(node.args[2]))
            for index, node in enumerate(output.args[0])
            if getattr(node, "target", None) is tagged_output
        }

    def results(
        self, args: Sequence[Any], outputs: Mapping[str, torch.Tensor]
    ) -> list[NumberOrTensor]:
        """What Dynamo's code expects back (numbers as Python numbers), after writing the new
        value of each tensor input the graph changed in place into the caller's tensor."""
        if len(outputs) > len(self.number_outputs):  # some inputs were changed in place
            for i, name in self._positions[InputKind.TENSOR]:
                new = outputs.get(MUTATED_PREFIX + name)
                if new is not None:
                    with torch.no_grad():
                        args[i].copy_(new)
        return [
            outputs[str(i)].item() if number else outputs[str(i)]
            for i, number in enumerate(self.number_outputs)
        ]

    def with_constants(self, names: set[str]) -> CapturedGraph:
        """The same graph with the numbers `names` fixed (an op needs them as numbers)."""
        inputs = [
            dataclasses.replace(s, kind=InputKind.CONSTANT) if s.name in names else s
            for s in self.inputs
        ]
        return dataclasses.replace(self, inputs=inputs)

    def numbers_reaching(self, node_name: str | None) -> set[str]:
        """The number inputs that node `node_name` computes with (all of them if None)."""
        numbers = {s.name for s in self.inputs if s.kind is InputKind.NUMBER}
        nodes = {n.name: n for n in self.graph_module.graph.nodes}
        if node_name not in nodes:
            return numbers
        found, stack, seen = set(), [nodes[node_name]], set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node.op == "placeholder" and node.name in numbers:
                found.add(node.name)
            stack.extend(node.all_input_nodes)
        return found

    def with_examples(self, args: Sequence[Any]) -> CapturedGraph:
        examples = [
            _number(a) if s.kind in (InputKind.NUMBER, InputKind.CONSTANT) else _concrete(a)
            for s, a in zip(self.inputs, args, strict=True)
        ]
        return dataclasses.replace(self, examples=examples)


def _number(value: Any) -> Any:
    """A number Dynamo passes (as a 0-d tensor, for a float it does not specialize on)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def _concrete(value: Any) -> Any:
    """A SymInt or SymFloat Dynamo gave as an example, as the number it stands for."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.hint
    return value


class DynamoFrontend:
    """`function` run under TorchDynamo, each of its graphs compiled by `compile_graph`.

    compile_graph(captured) -> a device function taking `captured.device_inputs(...)` and
    returning what `captured.run` returns (traced into a static graph, say).
    is_state(tensor): whether a tensor the step reads is device state (registered).
    on_retrace(reason): called at each re-compile, with Dynamo's reason.
    on_guard_failure(reason): called with each failed guard before Dynamo traces the step
    again (what the step reads may still be changed for that trace).
    dynamic_sources: regular expressions of the sources (as Dynamo names them) of ints that
    change from call to call (step counters): graph inputs from the first capture on, rather
    than after a re-compile (the syntax of torch.compiler.config.dynamic_sources; in this
    frontend's captures only).
    """

    def __init__(
        self,
        function: Callable[..., Any],
        compile_graph: Callable[[CapturedGraph], DeviceFunction],
        *,
        is_state: Callable[[torch.Tensor], bool],
        fullgraph: bool = False,
        max_retraces: int = 8,
        on_retrace: Callable[[str], None] | None = None,
        dynamic_sources: Sequence[str] = (),
        on_guard_failure: Callable[[str], None] | None = None,
    ) -> None:
        self._compile_graph = compile_graph
        self._on_guard_failure = on_guard_failure
        _configure_dynamo()
        # as Dynamo's config holds them (pattern, dimension or None): see _dynamic_sources
        self.dynamic_sources = [_parse_source_entry(s) for s in dynamic_sources]
        self._is_state = is_state
        self._on_retrace = on_retrace or (lambda reason: None)
        self._failed_guard: str | None = None
        self.fullgraph = fullgraph
        self.max_retraces = max_retraces
        self.graphs: list[CapturedGraph] = []
        self.sources: list[GraphSources] = []  # of each of `graphs`, for reports
        self.retraces: list[str] = []
        self.breaks: list[GraphBreak] = []
        frontend = weakref.ref(self)

        def backend(graph_module: fx.GraphModule, examples: list[Any]) -> Callable[..., Any]:
            # the whole compile (capture passes, the device's compile) on one chunk of
            # CPython's frame stack: see runtime/frame_stack.py
            return on_a_roomy_frame_stack(frontend()._backend, graph_module, examples)

        def guard_failed(failure: Any) -> None:
            if frontend() is not None:
                frontend()._guard_failed(failure)

        # Dynamo keeps every backend it is given for the whole process (cached_backends):
        # this one (and the guard-failure hook, which the guards of every object they read
        # keep) holds the frontend weakly, so the frontend and its device functions (their
        # device memory, an MLSDK function's codegen directory) go when the caller drops it
        frame = _own_frame(function)
        self.frame_globals = frame.__globals__  # Dynamo's `G` in the guards it reports
        self._compiled = torch._dynamo.optimize(
            backend,
            nopython=fullgraph,
            guard_fail_fn=guard_failed,
            # past max_retraces, _backend raises; Dynamo's own limit (after which it would run
            # the step eagerly, on the host) is never reached
            recompile_limit=max_retraces + 2,
        )(frame)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _CALLING.append(self)  # whose breaks and dynamic sources Dynamo's capture sees now
        try:
            try:
                return self._compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as error:
                raise error.inner_exception.with_traceback(
                    error.inner_exception.__traceback__
                ) from None
            except torch._dynamo.exc.FailOnRecompileLimitHit as error:
                raise StaticGraphError(
                    f"the compiled step was traced again too often (more than max_retraces="
                    f"{self.max_retraces}); the guard that failed last: {self._failed_guard}. "
                    f"({error})"
                ) from None
            except torch._dynamo.exc.Unsupported as error:
                if not self.fullgraph:
                    raise
                stack = list(getattr(error, "real_stack", None) or [])
                where = user_frame(stack) if stack else None
                raise StaticGraphError(
                    "fullgraph=True: the step cannot be one graph"
                    + (f", at {where}" if where else "")
                    + f": {error}"
                ) from None
        finally:
            _CALLING.pop()

    @property
    def device_calls(self) -> int:
        """Device calls per step: one per graph of the latest capture (breaks + 1)."""
        return len(self.breaks) + 1

    def _guard_failed(self, failure: Any) -> None:
        """Dynamo checks the guards of each graph it has (newest first) before it compiles
        again: the reason reported is the newest graph's."""
        if self._on_guard_failure is not None:
            self._on_guard_failure(failure.reason)
        newest = _compile_id(self._failed_guard)
        if self._failed_guard is None or _compile_id(failure.reason) >= newest:
            self._failed_guard = failure.reason

    def _backend(self, graph_module: fx.GraphModule, examples: list[Any]) -> Callable[..., Any]:
        sources = GraphSources.of_current_trace(graph_module)
        captured = CapturedGraph.of(
            graph_module, examples, self._is_state, len(self.graphs), sources.guards
        )
        if self._failed_guard is not None:
            reason = self._failed_guard
            self._failed_guard = None
            self._retraced(
                reason,
                f"the guard that failed last: {reason}. A value the step reads changes at "
                "every call: make it a tensor, or raise max_retraces.",
            )
        self.graphs.append(captured)
        self.sources.append(sources)
        return _GraphCall(
            captured,
            _weakly(self._compile_graph),
            _weakly(self._on_retrace),
            _weakly(self._state_replaced),
        )

    def _state_replaced(self, reason: str) -> None:
        """A state input of a graph is another tensor at this call: its device graph is
        compiled again, counted and bounded as Dynamo's re-compiles are."""
        self._retraced(
            reason,
            f"the last time because {reason}. A parameter the step reads is replaced at every "
            "call: update it in place.",
        )

    def _retraced(self, reason: str, refusal: str) -> None:
        """Count one re-compile and report it; past max_retraces, an error ending `refusal`."""
        self.retraces.append(reason)
        if len(self.retraces) > self.max_retraces:
            raise StaticGraphError(
                f"the compiled step was traced again {len(self.retraces)} times, more than "
                f"max_retraces={self.max_retraces}; {refusal}"
            )
        self._on_retrace(reason)


# the frontends being called, innermost last (see _graph_breaks_noted, _dynamic_sources)
_CALLING: list[DynamoFrontend] = []


def _graph_breaks_noted() -> None:
    """Each graph break Dynamo logs while it traces a frontend's call is noted in that
    frontend's `breaks` (with the user's line). Installed once: patching Dynamo's class
    around every call cost ~2 us a step."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    log = InstructionTranslatorBase.log_graph_break
    if getattr(log, "notes_breaks", False):
        return

    def noting(translator: Any, code_options: Any, reason: str, exc: Any) -> None:
        if _CALLING and not getattr(exc, "logged", False):
            stack = list(getattr(exc, "real_stack", None) or [])
            where = user_frame(stack) or (
                f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "?"
            )
            found = GraphBreak(_break_reason(reason, exc), where, "".join(format_list(stack)))
            if found not in _CALLING[-1].breaks:
                _CALLING[-1].breaks.append(found)
        return log(translator, code_options, reason, exc)

    noting.notes_breaks = True
    InstructionTranslatorBase.log_graph_break = noting


_graph_breaks_noted()


def _dynamic_sources() -> None:
    """A frontend's `dynamic_sources` hold in the captures Dynamo makes while it is called,
    and in no other. Added to torch.compiler.config's for the whole process, a Lightning
    step's made the batch dimension of every later capture symbolic: an MLSDK-style step
    compiled after a fit took an extra input, and its saved codegen directory then failed to
    load in a fresh process. Dynamo reads the config's patterns through one function, at
    captures only; it returns the innermost frontend's too. Installed once (Dynamo's
    callbacks around each compile would be lost at torch._dynamo.reset())."""
    from torch._dynamo.variables import builder

    configured = builder.get_dynamic_sources
    if getattr(configured, "adds_the_frontends", False):
        return

    def get_dynamic_sources() -> list[tuple[str, int | None]]:
        if _CALLING and _CALLING[-1].dynamic_sources:
            return configured() + _CALLING[-1].dynamic_sources
        return configured()

    get_dynamic_sources.adds_the_frontends = True
    builder.get_dynamic_sources = get_dynamic_sources


_dynamic_sources()


def _weakly(function: Callable[..., Any]) -> Callable[..., Any]:
    """A bound method, called through a weak reference to its object. Dynamo keeps what it
    compiled (a _GraphCall) in a process-wide registry until the frame's code dies; through
    a strong reference to the frontend's owner, that code (the owner's) would never die."""
    if not isinstance(function, types.MethodType):
        return function
    method = weakref.WeakMethod(function)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = method()
        if bound is None:
            raise RuntimeError("the compiled function was garbage-collected")
        return bound(*args, **kwargs)

    return call


def _compile_id(reason: str | None) -> tuple[int, ...]:
    """The "frame/compile" id a guard failure's reason starts with ("0/3: x == 2")."""
    head = (reason or "").split(":", 1)[0]
    try:
        return tuple(int(part) for part in head.split("/"))
    except ValueError:
        return (-1,)


def own_code(function: types.FunctionType) -> types.FunctionType:
    """A copy of `function` with a code object of its own (see _own_frame): a function that
    many frontends call (a wrapper of the framework's) keeps what Dynamo learns apart."""
    return types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )


_FRAME_NUMBERS = itertools.count()


def _own_frame(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` called from a code object of its own: Dynamo keeps its compiled graphs, the
    count of re-compiles and what it learned about changing values per code object, so each
    frontend starts afresh, whatever else runs the same code."""

    def captured_step(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    # a name of its own too: Dynamo keeps what it learned of changing sizes and numbers
    # (automatic dynamic) for the whole process by file, line and name of the code
    name = f"captured_step_{next(_FRAME_NUMBERS)}"
    code = captured_step.__code__.replace(co_name=name, co_qualname=name)
    assert code is not captured_step.__code__
    # globals of its own too: Dynamo stores each compiled graph in the frame's globals
    # (__compiled_fn_*), which must go with this frontend, not stay in this module's forever
    own_globals = {"__builtins__": captured_step.__globals__["__builtins__"]}
    return types.FunctionType(code, own_globals, name, None, captured_step.__closure__)


def _break_reason(reason: str, exc: Any) -> str:
    """Dynamo's kind of graph break and its explanation, in one line."""
    lines = [line.strip() for line in str(getattr(exc, "msg", None) or reason).splitlines()]
    kind = getattr(exc, "gb_type", None) or next((line for line in lines if line), reason)
    explanation = next((line for line in lines if line.startswith("Explanation:")), "")
    return f"{kind} ({explanation.removeprefix('Explanation:').strip()})" if explanation else kind


class _GraphCall:
    """What Dynamo calls for one graph: its device function for the inputs' shapes (a
    dynamic dimension or a fixed number that changed compiles another), run on the device."""

    def __init__(
        self,
        captured: CapturedGraph,
        compile_graph: Callable[[CapturedGraph], DeviceFunction],
        on_retrace: Callable[[str], None],
        on_replaced_state: Callable[[str], None],
    ) -> None:
        self._compile_graph = compile_graph
        self._on_retrace = on_retrace
        self._on_replaced_state = on_replaced_state
        self._compiled: dict[tuple, tuple[CapturedGraph, DeviceFunction]] = {}
        self._captured = self._add(captured)[0]  # its input kinds select a device function

    def _add(self, captured: CapturedGraph) -> tuple[CapturedGraph, DeviceFunction]:
        """Compile `captured`; a number that an op needs as a Python number (dropout's p, a
        shape) is fixed instead, and the graph compiled again (checked at every call)."""
        while True:
            try:
                function = self._compile_graph(captured)
                break
            except Exception as error:
                names = captured.numbers_reaching(getattr(error, "number_node", None))
                if not names:
                    raise
                captured = captured.with_constants(names)
        entry = (captured, function)
        self._compiled[_key(captured, captured.examples)] = entry
        return entry

    def __call__(self, *args: Any) -> list[NumberOrTensor]:
        entry = self._compiled.get(_key(self._captured, args))
        if entry is None:
            entry = self._add_for(args)
        captured, function = entry
        return captured.results(args, function(captured.device_inputs(args)))

    def _add_for(self, args: Sequence[Any]) -> tuple[CapturedGraph, DeviceFunction]:
        base = self._captured
        replaced = base.replaced_state(args)
        if replaced:
            # as a number that changes becomes an input: a replaced tensor is passed at every
            # call from now on; a parameter (it trains) stays state, on the new tensor
            passed = {spec.name for spec, new in replaced if not new.requires_grad}
            self._on_replaced_state(
                "; ".join(
                    f"{spec.source} is another tensor than when the step was compiled"
                    + (" (an input of every call from now on)" if spec.name in passed else "")
                    for spec, _ in replaced
                )
            )
            if passed:
                base = self._captured = base.with_tensor_inputs(passed)
        changed = base.constants_differ(args)
        if changed:  # another shape is not reported: the caller knows which ones it expects
            self._on_retrace(changed)
        return self._add(base.with_examples(args))


_NUMBER_TENSORS: dict[tuple[type, Any], torch.Tensor] = {}


def _number_tensor(value: Any) -> torch.Tensor:
    """A number input as the 0-d tensor a device function takes; an int's made once per
    value (a batch size, a fixed count: `torch.tensor` cost ~3 us a call, every step). The
    graph never writes its number inputs, so one tensor serves every call with that value.
    (Floats are not kept: 0.0 and -0.0 are one key.)"""
    if type(value) not in (int, bool):
        return ScalarsAsTensors._as_number(value)
    key = (type(value), value)
    tensor = _NUMBER_TENSORS.get(key)
    if tensor is None:
        if len(_NUMBER_TENSORS) >= 1024:  # a counter: a value per step
            _NUMBER_TENSORS.clear()
        tensor = _NUMBER_TENSORS[key] = ScalarsAsTensors._as_number(value)
    return tensor


def _key(captured: CapturedGraph, args: Sequence[Any]) -> tuple:
    """What selects a device function: tensor shapes and dtypes, fixed numbers, and which
    tensors the state inputs are (the device graph reads the state it was built on)."""
    positions = captured._positions
    key = [(args[i].shape, args[i].dtype) for i, _ in positions[InputKind.TENSOR]]
    key += [_number(args[i]) for i, _ in positions[InputKind.CONSTANT]]
    key += [id(args[i]) for i, _ in positions[InputKind.STATE]]
    return tuple(key)
