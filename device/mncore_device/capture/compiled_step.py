"""`Context.compile(function, inputs)`: an MLSDK step captured by TorchDynamo (the default).

MLSDK compiles a function once, from a sample, and every call runs that static graph: a
Python value the function reads (a global, a closure cell, a tuple or NumPy attribute,
`math.sqrt(group["lr"])`) is whatever it was when the function was traced. Traced by make_fx,
such a value is frozen silently. Captured by Dynamo, every read is guarded by its source, so
a call never runs a stale value:

- a read whose value changes between calls re-compiles: Dynamo captures the function again
  and the backend compiles a new device graph. Each re-compile is reported once
  (`RecompileWarning`, with Dynamo's reason: the guard that failed and the user's line) and
  counted (`retraces`); after `max_retraces` a StaticGraphError names the guard that keeps
  failing. An int or float that changes is made a graph input by Dynamo after its first
  change (automatic dynamic): one re-compile, then every value reaches the device as an input
  of the same graph (`mncore_read_*` inputs of the device function, filled at every call);
- `loss.backward()`, `optimizer.step()` and `zero_grad()` of torch.optim optimizers (and their
  subclasses) are graph nodes whose work runs when the replay is traced into the device
  graph (training_calls.py): the step stays ONE device call with the update inside. The
  Python numbers of a torch.optim optimizer's param groups are guarded the same way;
- a `.grad` read after `loss.backward()` is a graph node giving the backward's gradient
  (clipping by hand, an all-reduce of the gradients: run in the same device call, before
  the update);
- anything Dynamo cannot keep in one graph (host code, a `.item()` branch) is a
  StaticGraphError naming the user's line: a compiled function is one device call
  (fullgraph).

Every tensor the function reads besides its inputs is device state, as on MLSDK (and as a
step traced by make_fx has it): the replay reads the tensor itself, so a registered one is the
device's copy, and any other is captured by the backend's compile (a constant uploaded again
when the host changes it in place or, when the step updates it, trained on the device only,
with one warning naming it). A state input that is another tensor at a call (`t = new` on the
host) compiles the graph again on it, reported and bounded as a re-compile is.

Three things are part of the compiled function, as on MLSDK, rather than reads that change:

- the train/eval mode of the modules the function reaches (through its closure cells and the
  globals it names): a call runs in the mode they had at compile, whatever their mode at the
  call (PFN's scripts compile an evaluation function under `model.eval()`, then go back to
  `model.train()` and compile the training step);
- the grad mode at compile: a device call has no host autograd, so a training step called
  under `torch.no_grad()` still trains;
- gradients are not device state: every call starts from no gradients, as a step that calls
  `zero_grad()` first does.

Compiling changes nothing on the host: the dry run that captures the function runs no device
graph, writes no input back, and leaves Python's random generator as it was (Dynamo's code
draws the step's `random.random()` values before each call of the graph).

The backend (the emulator, or MLSDK) receives a function that replays the captured FX graph
(`CapturedGraph.run`), never the user's code, with the sample's input keys (plus the
`mncore_read_*` inputs) and the function's output keys.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import time
import warnings
import weakref
from ast import literal_eval
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import is_fake

from .._source import user_frame
from ..errors import StaticGraphError
from ..runtime.signature import OutputKind
from ..runtime.specs import TensorSpec, check_input_keys, check_real, conform_input
from ..runtime.tracing import _check_outputs
from .dynamo import MUTATED_PREFIX, CapturedGraph, DynamoFrontend, InputKind
from .markers import tagged_output
from .scalars import ScalarsAsTensors
from .training_calls import substituted

READ_PREFIX = "mncore_read_"  # a device input for a value the step reads besides `inputs`
OUTPUT_PREFIX = "mncore_output_"  # a device output the step's result does not name
MUTATED = "mncore_mutated_"  # the new value of an input the step changed in place
_INPUT_SOURCE = re.compile(r"^L\['args'\]\[0\]\[(.+)\]$")  # inputs[key], as Dynamo names it
ReplayCompiler = Callable[[Callable[..., Any], Mapping[str, torch.Tensor], Any], Any]


class RecompileWarning(UserWarning):
    """A value the compiled function reads changed: it was captured and compiled again."""


def is_replay(function: Any) -> bool:
    """Whether `function` is a replay of a captured graph (compiled as it is, by tracing)."""
    return getattr(function, "_mncore_replay", False)


class CapturedFunction:
    """A function compiled by `Context.compile` through Dynamo (see the module docstring).

    compile_replay(replay, sample, codegen_dir): the backend's compile of one captured graph.
    Called as the backend's compiled functions are: a dict of tensors with the sample's keys
    in, a dict of the function's outputs (the backend's tensors or proxies) out.
    """

    def __init__(
        self,
        function: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
        inputs: Mapping[str, torch.Tensor],
        compile_replay: ReplayCompiler,
        *,
        codegen_dir: Any = None,
        max_retraces: int = 8,
    ) -> None:
        start = time.perf_counter()
        self.name = getattr(function, "__name__", "function")
        self._compile_replay = compile_replay
        self._codegen_dir = codegen_dir
        self.functions: list[Any] = []  # the backend's compiled functions, newest last
        self._inputs: Mapping[str, torch.Tensor] = {}
        self._dry_run = False
        for key, value in inputs.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"compile: input {key!r} must be a torch.Tensor, got {type(value).__name__}"
                )
            check_real(key, value, "a sample input of compile")
        self._modes = [(m, m.training) for m in _modules_of(function)]
        self._grad_enabled = torch.is_grad_enabled()

        def step(inputs: Mapping[str, torch.Tensor]) -> Any:
            result = function(inputs)
            if isinstance(result, Mapping):
                return {
                    key: tagged_output(value, "user_output", key)  # a literal: no guard
                    if isinstance(value, torch.Tensor)
                    else value
                    for key, value in result.items()
                }
            return result

        self.frontend = DynamoFrontend(
            step,
            self._compile_graph,
            is_state=self._is_state,
            fullgraph=True,
            max_retraces=max_retraces,
            on_retrace=self._retraced,
        )
        self._dry_run = True  # capture and compile now; the device runs nothing yet
        try:
            # Dynamo's code runs once too, and draws what the step draws from Python's
            # random module (it draws before each call of the graph): compile draws nothing
            with _python_random_preserved():
                result = self._run(_as_device_inputs(inputs))
        finally:
            self._dry_run = False
        _check_outputs(result)
        first = self.functions[0]
        self.input_specs: dict[str, TensorSpec] = {
            k: s for k, s in first.input_specs.items() if not k.startswith(READ_PREFIX)
        }
        self._capture_seconds = time.perf_counter() - start - self._backend_seconds()

    # --- calls ------------------------------------------------------------------------------

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        check_input_keys(inputs, self.input_specs)
        if not all(isinstance(inputs[k], torch.Tensor) for k in self.input_specs):
            # device-side buffers (allocate_input_proxy): the latest graph, as it is
            return self.functions[-1](inputs)
        conformed = {k: conform_input(k, s, inputs[k]) for k, s in self.input_specs.items()}
        return self._run(_as_device_inputs(conformed))

    def _run(self, inputs: dict[str, torch.Tensor]) -> Any:
        self._inputs = inputs
        changed = [m for m, training in self._modes if m.training != training]
        for module in changed:  # the mode the function was compiled in (see the docstring)
            module.training = not module.training
        try:
            with self._grad_mode(), substituted():
                return self.frontend(inputs)
        except torch._dynamo.exc.UserError as error:  # a branch on a value, say
            stack = list(getattr(error, "real_stack", None) or [])
            where = user_frame(stack) if stack else None
            raise StaticGraphError(
                "the compiled function cannot be one static graph"
                + (f", at {where}" if where else "")
                + f": {str(error).strip().splitlines()[0]} "
                "(a compiled function is one device call: a value it computes cannot decide "
                "the host's control flow or become a host number; compute with torch.where or "
                "masks, or draw random numbers with torch)"
            ) from None
        finally:
            self._inputs = {}
            for module in changed:
                module.training = not module.training

    def _grad_mode(self) -> contextlib.AbstractContextManager:
        """The grad mode the function was compiled in, whatever the caller's (a device call
        has no host autograd: a training step called under torch.no_grad still trains)."""
        if torch.is_inference_mode_enabled():
            stack = contextlib.ExitStack()
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.set_grad_enabled(self._grad_enabled))
            return stack
        if torch.is_grad_enabled() != self._grad_enabled:
            return torch.set_grad_enabled(self._grad_enabled)
        return contextlib.nullcontext()

    def _is_state(self, tensor: torch.Tensor) -> bool:
        """Every tensor the function reads besides its inputs is device state: the replay
        reads the tensor itself, so the backend's compile treats it as a step traced by
        make_fx does (registered: the device's copy; not registered: captured, a device
        constant re-uploaded when the host changes it in place, or, if the step updates it,
        trained on the device only, with a warning naming it)."""
        return not any(tensor is value for value in self._inputs.values())

    @property
    def retraces(self) -> list[str]:
        """Dynamo's reason for each re-compile (the guard that failed, with the user's line)."""
        return list(self.frontend.retraces)

    @property
    def compile_seconds(self) -> float:
        return self._capture_seconds + self._backend_seconds()

    def _backend_seconds(self) -> float:
        return sum(getattr(f, "compile_seconds", 0.0) for f in self.functions)

    def __getattr__(self, name: str) -> Any:
        """What the latest device function has (output_specs, allocate_input_proxy, ...)."""
        functions = self.__dict__.get("functions")
        if name.startswith("_") or not functions:
            raise AttributeError(name)
        return getattr(functions[-1], name)

    def _retraced(self, reason: str) -> None:
        warnings.warn(
            f"compiled function {self.name!r} is captured and compiled again (re-compile "
            f"{len(self.frontend.retraces)} of at most {self.frontend.max_retraces}): a value it "
            f"reads changed. {reason}",
            RecompileWarning,
            stacklevel=2,
        )

    # --- one captured graph -----------------------------------------------------------------

    def _compile_graph(self, captured: CapturedGraph) -> Callable[[Mapping], Mapping]:
        """Compile the replay of `captured` with the backend; the run function of one call."""
        keys = _input_keys(captured)
        outputs = _output_keys(captured)
        sample = dict(self._inputs)
        for spec, example in zip(captured.inputs, captured.examples, strict=True):
            key = keys.get(spec.name)
            if key is not None and key not in sample:
                number = spec.kind is InputKind.NUMBER
                sample[key] = ScalarsAsTensors._as_number(example) if number else example
        traced: dict[str, torch.Tensor] = {}

        def replay(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            result = captured.run({name: inputs[key] for name, key in keys.items()})
            named = {key: result[str(i)] for i, key in enumerate(outputs)}
            for name, value in result.items():
                if name.startswith(MUTATED_PREFIX):
                    named[MUTATED + keys[name.removeprefix(MUTATED_PREFIX)]] = value
            traced.clear()
            traced.update(named)
            return named

        replay.__name__ = replay.__qualname__ = self.name
        replay._mncore_replay = True
        codegen_dir = self._codegen_dir
        if codegen_dir is not None and self.functions:
            codegen_dir = os.path.join(os.fspath(codegen_dir), f"recompile_{len(self.functions)}")
        self.functions.append(self._compile_replay(replay, sample, codegen_dir))
        index = len(self.functions) - 1

        # Dynamo keeps `run` in a process-wide registry (until the code it captured dies, which
        # the registry itself delays): `run` holds this object and its device functions weakly
        owner = weakref.ref(self)

        def run(device_inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
            this = owner()
            if this._dry_run:  # compile time: the values the trace computed, nothing runs
                # (nor is an input the step changes in place written back: compile changes
                # no host tensor)
                result = {k: _host_value(v) for k, v in traced.items() if not k.startswith(MUTATED)}
            else:
                call = dict(this._inputs)
                call.update((key, device_inputs[name]) for name, key in keys.items())
                result = this.functions[index](call)
            named = {str(i): result[key] for i, key in enumerate(outputs)}
            for name, key in keys.items():
                if MUTATED + key in result:
                    named[MUTATED_PREFIX + name] = result[MUTATED + key]
            return named

        return run


def _as_device_inputs(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A call's inputs as the device takes them: each its own contiguous tensor, with
    row-major strides (a size-1 dimension's too) and no autograd history, so that none of
    these at a call (the same tensor given for two keys, say) fails one of Dynamo's guards and
    captures the step again."""
    result: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in inputs.items():
        if value.requires_grad:
            value = value.detach()
        if not value.is_contiguous():
            value = value.contiguous()
        else:
            strides = make_contiguous_strides_for(value.shape)
            if value.stride() != strides:
                value = value.as_strided(value.shape, strides, value.storage_offset())
        if id(value) in seen:
            value = value.clone()
        seen.add(id(value))
        result[key] = value
    return result


@contextlib.contextmanager
def _python_random_preserved() -> Iterator[None]:
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


def _modules_of(function: Any, depth: int = 0) -> list[torch.nn.Module]:
    """The modules (and their submodules) `function` reaches through its closure cells, the
    globals it names, the object it is bound to, and the functions it reaches so (2 deep)."""
    code = getattr(function, "__code__", None)
    bound = getattr(function, "__self__", None)
    values = [bound] if bound is not None else []
    if code is not None:
        values += [cell.cell_contents for cell in function.__closure__ or () if _filled(cell)]
        names = getattr(function, "__globals__", {})
        values += [names[name] for name in code.co_names if name in names]
    found: dict[int, torch.nn.Module] = {}
    for value in values:
        if isinstance(value, torch.nn.Module):
            found.update((id(m), m) for m in value.modules())
        elif callable(value) and hasattr(value, "__code__") and depth < 2:
            found.update((id(m), m) for m in _modules_of(value, depth + 1))
    return list(found.values())


def _filled(cell: Any) -> bool:
    try:
        return cell.cell_contents is not _filled  # any value at all
    except ValueError:  # a cell not assigned yet
        return False


def _input_keys(captured: CapturedGraph) -> dict[str, str]:
    """The device input of each placeholder passed at every call: the sample's key for
    `inputs[key]`, a `mncore_read_` input for any other tensor or number the step reads."""
    keys = {}
    for spec in captured.inputs:
        if spec.kind not in (InputKind.TENSOR, InputKind.NUMBER):
            continue
        match = _INPUT_SOURCE.match(spec.source)
        key = None
        if match and spec.kind is InputKind.TENSOR:
            try:
                key = literal_eval(match.group(1))
            except (ValueError, SyntaxError):
                key = None
        keys[spec.name] = key if isinstance(key, str) else READ_PREFIX + spec.name
    return keys


def _output_keys(captured: CapturedGraph) -> list[str]:
    """The device output of each graph output: the key the function returns it under."""
    output = next(n for n in captured.graph_module.graph.nodes if n.op == "output")
    keys = []
    for index, value in enumerate(output.args[0]):
        target = getattr(value, "target", None)
        named = target is tagged_output and value.args[1] == OutputKind.USER_OUTPUT.value
        keys.append(value.args[2] if named else f"{OUTPUT_PREFIX}{index}")
    return keys


def _host_value(value: Any) -> Any:
    """A value the trace computed, as a host tensor (zeros where the tracer had no values)."""
    if isinstance(value, torch.Tensor):
        if is_fake(value) or value.device.type == "meta":
            return torch.zeros(value.shape, dtype=value.dtype)
        return value.detach().clone()
    return value


__all__ = ["CapturedFunction", "RecompileWarning", "is_replay"]
