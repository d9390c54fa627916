"""A captured graph as a forward and a backward device call, differentiable on the host.

A training step with host code in it (a graph break: `print`, a NumPy draw, a logger call)
is several Dynamo graphs with Python between them, so no single device graph can hold its
backward. Each graph then becomes what AOTAutograd makes of a graph for torch.compile: a
forward device call that returns, besides the graph's outputs, what its backward needs (the
partitioner's saved tensors), and a backward device call that turns those and the outputs'
gradients into the inputs' gradients. `DifferentiableGraph` runs them as one autograd
function, so the host's `loss.backward()` after the step runs the backward calls in reverse,
through the host code between them, as on cpu.

Device state (parameters, buffers) stays the registered tensors: AOTAutograd sees a stand-in
per state tensor (`StandIns`, a leaf of the same shape, requires_grad as the parameter's),
and the device calls read the registered tensor where the stand-in is. A parameter's
gradient flows into its stand-in's `.grad` (summed over the graphs that use it, by the
autograd engine); the caller hands those to its own update call. An in-place update of
state (BatchNorm's running statistics) is kept in the forward graph (AOTAutograd's
keep_inference_input_mutations, for inputs that need no gradient): it is a write of the
registered tensor on the device, as in a one-call step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .dynamo import MUTATED_PREFIX, CapturedGraph, InputKind
from .scalars import ScalarsAsTensors

# compile_function(function, sample, label) -> a device function (inputs -> outputs dict)
CompileFunction = Callable[
    [Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]], dict, str],
    Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
]


class StandIns:
    """One host leaf per device-state tensor: what AOTAutograd sees as that input, and where
    the parameter's gradient accumulates (never the parameter's own `.grad`)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, state: torch.Tensor) -> torch.Tensor:
        entry = self._by_id.get(id(state))
        if entry is None or entry[0] is not state:
            stand_in = torch.empty_like(state, requires_grad=False)
            stand_in.requires_grad_(state.requires_grad)
            entry = self._by_id[id(state)] = (state, stand_in)
        return entry[1]

    def gradient(self, state: torch.Tensor) -> torch.Tensor | None:
        """The gradient the backward calls left for `state` since the last clear."""
        entry = self._by_id.get(id(state))
        return entry[1].grad if entry is not None and entry[0] is state else None

    def clear_gradients(self) -> None:
        for _, stand_in in self._by_id.values():
            stand_in.grad = None


class DifferentiableGraph:
    """`captured` as a forward and a backward device call (see the module docstring).

    Called as a device function is (`captured.device_inputs(...)` in, outputs "0", "1", ...
    out); its outputs carry autograd history to its tensor inputs and to the stand-ins.
    compile_function(function, sample, label): a device function for `function` traced on
    `sample` (label: "forward" or "backward"). calls: what runs for a marker node.
    """

    def __init__(
        self,
        captured: CapturedGraph,
        compile_function: CompileFunction,
        stand_ins: StandIns,
        calls: Mapping[Any, Callable[..., Any]] = {},
    ) -> None:
        from torch._functorch.aot_autograd import aot_function
        from torch._functorch.partitioners import default_partition

        self.captured = captured
        self._compile = compile_function
        self._stand_ins = stand_ins
        self._calls = dict(calls)
        kinds = [(s, e) for s, e in zip(captured.inputs, captured.examples, strict=True)]
        self._tensors = [s.name for s, _ in kinds if s.kind is InputKind.TENSOR]
        self._numbers = [s.name for s, _ in kinds if s.kind is InputKind.NUMBER]
        self._state = [e for s, e in kinds if s.kind is InputKind.STATE]
        self._arguments: list[Any] = []  # the current call's (while AOTAutograd compiles)
        self._function = aot_function(
            self._flat,
            fw_compiler=self._forward_compiler,
            bw_compiler=self._backward_compiler,
            partition_fn=default_partition,
            keep_inference_input_mutations=True,
        )

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        flat = [inputs[n] for n in self._tensors] + [inputs[n] for n in self._numbers]
        flat += [self._stand_ins.of(t) for t in self._state]
        self._arguments = flat  # the forward compiles with them (see _forward_compiler)
        try:
            outputs = self._function(*flat)
        finally:
            self._arguments = []
        return {str(i): value for i, value in enumerate(outputs)}

    def _flat(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The graph on flat tensors: its tensor inputs, its numbers (0-d), its state."""
        by_name = dict(zip(self._tensors + self._numbers, flat, strict=False))
        state = iter(flat[len(by_name) :])
        values = []
        for spec, example in zip(self.captured.inputs, self.captured.examples, strict=True):
            if spec.kind is InputKind.STATE:
                values.append(next(state))
            elif spec.kind is InputKind.CONSTANT:
                values.append(example)
            else:
                values.append(by_name[spec.name])
        numbers = set(self._numbers)
        outputs = ScalarsAsTensors(self.captured.graph_module, numbers, self._calls).run(*values)
        return tuple(v if isinstance(v, torch.Tensor) else torch.tensor(v) for v in outputs)

    def _forward_compiler(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        """AOTAutograd's forward graph: its last inputs are the state, read on the device."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        given = len(placeholders) - len(self._state)
        if given != len(self._tensors) + len(self._numbers):
            raise AssertionError(
                f"AOTAutograd's forward graph takes {len(placeholders)} inputs, not the "
                f"{given + len(self._state)} the captured graph was given"
            )
        if _only_aliases(gm, placeholders[given:]):
            return _HostCall(gm)
        call = _LazyDeviceCall(self._compile, gm, given, self._state, "forward")
        # compiled here, not at its first call: that runs inside AOTAutograd's autograd
        # function, where TorchInductor (presets O1 and up) cannot compile
        with unset_fake_temporarily():  # AOTAutograd calls its compilers in its fake mode
            call.compile(self._arguments[:given])
        return call

    def _backward_compiler(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        """AOTAutograd's backward graph: saved values and output gradients in, the inputs'
        gradients out (None where an input needs none)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return _LazyDeviceCall(self._compile, gm, len(placeholders), [], "backward")


class _LazyDeviceCall:
    """An AOTAutograd graph as a device function, compiled at its first call (the inputs are
    then real tensors: a sample to trace with). `given` inputs come from the caller, then
    `state` (registered tensors) in place of the stand-ins AOTAutograd passes."""

    def __init__(
        self,
        compile_function: CompileFunction,
        gm: fx.GraphModule,
        given: int,
        state: list[torch.Tensor],
        label: str,
    ) -> None:
        self._compile_function = compile_function
        self._gm = gm
        self._given = given
        self._state = state
        self._label = label
        self._names = [f"{label}_input{i}" for i in range(given)]
        self._compiled: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None
        self._compiled = None
        self._outputs: list[bool] = []  # which outputs are tensors (the others are None)

    _boxed_call = True  # AOTAutograd hands the arguments as one list (which it may free)

    def compile(self, args: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Compile for these arguments (a sample); returns the device function's inputs."""
        inputs = {}
        for name, value in zip(self._names, args[: self._given], strict=True):
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            inputs[name] = value.detach()
        if self._compiled is None:
            with torch.inference_mode(False), torch.enable_grad():
                self._compiled = self._compile_function(
                    self._device_function, dict(inputs), self._label
                )
        return inputs

    def _device_function(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        given = [inputs[name] for name in self._names]
        versions = [t._version for t in given]
        outputs = self._gm(*given, *self._state)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        self._outputs = [isinstance(o, torch.Tensor) for o in outputs]
        result = {str(i): o for i, o in enumerate(outputs) if isinstance(o, torch.Tensor)}
        # an input the graph changed in place (AOTAutograd keeps the mutation of an input
        # that needs no gradient in the graph: a tensor attribute's `+=`): its new value, which
        # the call writes into the caller's tensor, as CapturedGraph.run does
        for name, tensor, version in zip(self._names, given, versions, strict=True):
            if tensor._version != version:
                result[MUTATED_PREFIX + name] = tensor
        return result

    def __call__(self, args: list[Any]) -> list[torch.Tensor | None]:
        inputs = self.compile(args)
        args.clear()
        outputs = self._compiled(inputs)
        if len(outputs) > sum(self._outputs):
            with torch.no_grad():
                for name, tensor in inputs.items():
                    new = outputs.get(MUTATED_PREFIX + name)
                    if new is not None:
                        tensor.copy_(new)  # a view of the caller's tensor (detached)
        return [outputs[str(i)] if tensor else None for i, tensor in enumerate(self._outputs)]


_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _only_aliases(gm: fx.GraphModule, state: Sequence[fx.Node]) -> bool:
    """A graph that computes nothing (it hands its inputs on, detached: the graph Dynamo
    makes of the update marker's call after a break) and reads no state."""
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    return all(n.op == "call_function" and n.target in _ALIASES for n in calls) and not any(
        node.users for node in state
    )


class _HostCall:
    """A graph that computes nothing, run on the host: no device call for it."""

    _boxed_call = True

    def __init__(self, gm: fx.GraphModule) -> None:
        self._gm = gm

    def __call__(self, args: list[Any]) -> list[Any]:
        values = list(args)
        args.clear()
        outputs = self._gm(*values)
        return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
