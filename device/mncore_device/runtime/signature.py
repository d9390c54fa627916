"""`GraphSignature`: what each input and output of a traced device graph is, and its guards.

A traced step is `graph(*state, *inputs) -> (*outputs, *new_values_of_mutated_state)`
(runtime/tracing.py). Positions alone do not say what a tensor is to the model, and every
backend (the interpreter, Inductor, MLSDK, a codegen dir read back) needs the same answer:
which inputs are parameters the optimizer trains, which are the batch, which are Python
numbers the step read (a counter, a learning rate) fed at every call, which outputs are the
user's, which are logged values, gradients, or new values of state. As torch.export's graph
signature does, each position gets a typed spec; the guards are the Python premises the
graph was captured under (TorchDynamo's, by source).

What the state tensors are comes from their registration (`Context.register_param`, ...).
What the other inputs and the outputs are is said by the code that builds the traced
function (the capture frontend, the Lightning steps), while it is traced: `note_input` and
`note_output` tag a tensor, and `trace_step` reads the tags of the tensors it was given and
got back (`recording`). A tensor nobody tagged is a batch input or a user output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch


class InputKind(StrEnum):
    """What one input of a device graph is."""

    PARAMETER = "parameter"  # registered with register_param: trained on the device
    BUFFER = "buffer"  # registered with register_buffer (BatchNorm statistics)
    OPTIMIZER_STATE = "optimizer_state"  # registered with register_optimizer_buffers
    CONSTANT = "constant"  # an unregistered tensor the step only reads: uploaded
    PRIVATE_STATE = "private_state"  # an unregistered tensor the step updates: device-only
    BATCH = "batch"  # a tensor passed at every call
    SCALAR = "scalar"  # a Python number the step reads, passed at every call as a 0-d tensor


class OutputKind(StrEnum):
    """What one output of a device graph is."""

    USER_OUTPUT = "user_output"  # what the step returns
    LOG_VALUE = "log_value"  # a value the step logs (`self.log`)
    GRADIENT = "gradient"  # a gradient the host's hooks read (on_before_optimizer_step)
    INPUT_MUTATION = "input_mutation"  # the new value of an input the step changed in place
    STATE_MUTATION = "state_mutation"  # the new value of a state input


STATE_KINDS = {  # a registered tensor's role (Context.Role) -> its kind
    "param": InputKind.PARAMETER,
    "buffer": InputKind.BUFFER,
    "optimizer": InputKind.OPTIMIZER_STATE,
}


@dataclass(frozen=True)
class InputSpec:
    kind: InputKind
    name: str  # the state's registered name, or the input's key
    source: str | None = None  # where the step read it (Dynamo's source: L['self'].lr)

    def to_json(self) -> dict:
        return {"kind": self.kind.value, "name": self.name, "source": self.source}


@dataclass(frozen=True)
class OutputSpec:
    kind: OutputKind
    name: str  # the output's key, or the state's name for a state mutation
    target: str | None = None  # what it belongs to: the logged name, a parameter, an input

    def to_json(self) -> dict:
        return {"kind": self.kind.value, "name": self.name, "target": self.target}


@dataclass(frozen=True)
class GraphSignature:
    """The typed inputs and outputs of a device graph, in the graph's order, and its guards."""

    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    guards: tuple[str, ...] = ()  # the Python premises it was captured under, by source

    def inputs_of(self, *kinds: InputKind) -> list[str]:
        return [s.name for s in self.inputs if s.kind in kinds]

    def outputs_of(self, *kinds: OutputKind) -> list[str]:
        return [s.name for s in self.outputs if s.kind in kinds]

    def to_json(self) -> dict:
        return {
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "guards": list(self.guards),
        }

    @classmethod
    def from_json(cls, data: Mapping) -> GraphSignature:
        inputs = tuple(
            InputSpec(InputKind(e["kind"]), str(e["name"]), e.get("source")) for e in data["inputs"]
        )
        outputs = tuple(
            OutputSpec(OutputKind(e["kind"]), str(e["name"]), e.get("target"))
            for e in data["outputs"]
        )
        return cls(inputs, outputs, tuple(str(g) for g in data.get("guards", ())))

    def __str__(self) -> str:
        lines = [
            f"  {s.kind.value:<16} {s.name}" + (f"  <- {s.source}" if s.source else "")
            for s in self.inputs
        ]
        lines += [
            f"  -> {s.kind.value:<16} {s.name}"
            + (f"  ({s.target})" if s.target not in (None, s.name) else "")
            for s in self.outputs
        ]
        lines += [f"  guard {g}" for g in self.guards]
        return "GraphSignature(\n" + "\n".join(lines) + "\n)"


@dataclass
class Notes:
    """The tags given while one function is traced (see the module docstring)."""

    inputs: dict[int, tuple[torch.Tensor, InputKind, str | None]] = field(default_factory=dict)
    outputs: dict[int, tuple[torch.Tensor, OutputKind, str | None]] = field(default_factory=dict)
    guards: list[str] = field(default_factory=list)

    def input(self, key: str, tensor: torch.Tensor) -> InputSpec:
        """The spec of the input `key` given as `tensor` (a batch input, if not tagged)."""
        found = self.inputs.get(id(tensor))
        if found and found[0] is tensor:
            return InputSpec(found[1], key, found[2])
        return InputSpec(InputKind.BATCH, key)

    def output(self, key: str, tensor: torch.Tensor) -> OutputSpec:
        """The spec of the output `key` returned as `tensor` (a user output, if not tagged)."""
        found = self.outputs.get(id(tensor))
        if found and found[0] is tensor:
            return OutputSpec(found[1], key, found[2])
        return OutputSpec(OutputKind.USER_OUTPUT, key)


_recording: list[Notes] = []  # the innermost trace's notes last


@contextlib.contextmanager
def recording() -> Iterator[Notes]:
    """Collect the tags given while the body runs (a trace)."""
    notes = Notes()
    _recording.append(notes)
    try:
        yield notes
    finally:
        _recording.remove(notes)


def note_input(tensor: torch.Tensor, kind: InputKind, source: str | None = None) -> None:
    """Tag an input of the function being traced (nothing outside a trace)."""
    if _recording:
        _recording[-1].inputs[id(tensor)] = (tensor, kind, source)


def note_output(tensor: torch.Tensor, kind: OutputKind, target: str | None = None) -> None:
    """Tag a tensor the function being traced returns (nothing outside a trace)."""
    if _recording:
        _recording[-1].outputs[id(tensor)] = (tensor, kind, target)


def note_guards(guards: Iterable[str]) -> None:
    """The guards of the graph the function being traced replays."""
    if _recording:
        _recording[-1].guards.extend(g for g in guards if g not in _recording[-1].guards)


def signature_of(
    state: Sequence[tuple[str, InputKind, bool]],
    inputs: Sequence[InputSpec],
    outputs: Sequence[OutputSpec],
    guards: Sequence[str] = (),
) -> GraphSignature:
    """The signature of `graph(*state, *inputs) -> (*outputs, *mutated state)`.
    state: (name, kind, mutated) of each state input, in order."""
    mutations = tuple(
        OutputSpec(OutputKind.STATE_MUTATION, name, name) for name, _, mutated in state if mutated
    )
    specs = tuple(InputSpec(kind, name) for name, kind, _ in state) + tuple(inputs)
    return GraphSignature(specs, tuple(outputs) + mutations, tuple(guards))


__all__ = [
    "GraphSignature",
    "InputKind",
    "InputSpec",
    "OutputKind",
    "OutputSpec",
    "note_guards",
    "note_input",
    "note_output",
    "recording",
]
