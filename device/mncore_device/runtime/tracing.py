"""Trace a step function once into ONE functional aten graph with explicit state.

The function may call `optimizer.zero_grad()`, a model, `loss.backward()` and
`optimizer.step()`. It is traced with make_fx in real mode, with the registered tensors
themselves as graph inputs, so the forward, the backward and the in-place update are all
recorded. A second pass, on fake tensors (shapes only), functionalizes the graph: every
in-place update of state becomes a new value that the graph returns. The result has the signature

    graph(*state, *inputs) -> (*outputs, *new_values_of_mutated_state)

Real-mode tracing executes the step once; every tensor it touched is restored afterwards,
and so is the random number generator, so tracing leaves no trace on the host.

Host reads (`.item()`, `if t:`, torch.equal) are folded at trace time when the tensor read is
computed only from constants and shapes (a causal mask from torch.ones); a read of a value that
depends on the batch or on state raises StaticGraphError at the user's line. While the step is
traced, `torch.compiler.is_compiling()` is true, so libraries take their tracing-safe paths.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import operator
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.fx as fx
from torch._decomp import decompositions
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.fx import traceback as fx_traceback
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_mode,
    get_proxy_slot,
    make_fx,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from .._source import (
    backward_frame_summary,
    called_from_user_code,
    user_frame,
    user_frame_summary,
)
from ..errors import StaticGraphError
from ..naming import get_tensor_name
from . import signature
from .signature import STATE_KINDS, GraphSignature, OutputSpec
from .specs import TensorSpec, check_real

aten = torch.ops.aten


class StateKind(Enum):
    """What one state input of a traced graph is to the device."""

    REGISTERED = "registered"  # Context state: shared by compiled functions, synchronized
    PRIVATE = "private"  # updated by the step but never registered: device-only, never synced
    CONSTANT = "constant"  # read but never written: copied to the device, refreshed on host change


_DATA_DEPENDENT_OPS = {
    aten._local_scalar_dense.default: "reads a tensor's value on the host (.item(), float(t), "
    "int(t), bool(t), `if t:`)",
    aten.is_nonzero.default: "branches on a tensor's value (`if t:`, `while t:`)",
    aten.equal.default: "compares tensors on the host (torch.equal)",
    aten.nonzero.default: "produces a value-dependent shape (nonzero)",
    aten.masked_select.default: "produces a value-dependent shape (masked_select)",
    aten._unique2.default: "produces a value-dependent shape (unique)",
    aten.unique_consecutive.default: "produces a value-dependent shape (unique_consecutive)",
}
_BOOLEAN_MASK_HINT = "indexes with a boolean mask (x[mask]): the result's shape depends on the mask"
# native_batch_norm updates running stats in place in a way functionalization leaves alone.
# torch's own rewrite for functionalization calls _native_batch_norm_legit instead: the same
# CPU/CUDA kernels eager runs (so BatchNorm rounds as eager does, bit for bit), with a schema
# that declares the running-stat updates, which functionalization turns into new values.
# (get_decompositions would give the math decomposition, var_mean and rsqrt, which rounds
# differently and drifts from eager over steps.)
_DECOMPOSITIONS = {aten.native_batch_norm.default: decompositions.native_batch_norm_decomposition}
# The same kernels' schemas do not declare that they write the running stats (arguments 3 and
# 4) when training (argument 5): what the trace guard must snapshot before they run.
_UNDECLARED_WRITES = {
    op: lambda args: [a for a in args[3:5] if a is not None] if len(args) > 5 and args[5] else []
    for op in (
        aten.native_batch_norm.default,
        aten.cudnn_batch_norm.default,
        aten.miopen_batch_norm.default,
    )
}
_PROFILER_OPS = ("_record_function_enter", "_record_function_exit")


@dataclass
class StateBinding:
    """One state input of a traced graph."""

    name: str
    kind: StateKind
    tensor: torch.Tensor  # the host tensor (or, after loading a codegen dir, its saved value)
    mutated: bool = False
    role: str | None = None  # a registered tensor's: "param", "buffer" or "optimizer"

    @property
    def input_kind(self) -> signature.InputKind:
        """What this state is in the graph's signature."""
        if self.kind is StateKind.CONSTANT:
            return signature.InputKind.CONSTANT
        if self.kind is StateKind.PRIVATE:
            return signature.InputKind.PRIVATE_STATE
        if self.role in STATE_KINDS:
            return STATE_KINDS[self.role]
        return (
            signature.InputKind.PARAMETER
            if self.tensor.requires_grad
            else signature.InputKind.BUFFER
        )


@dataclass
class TracedStep:
    """A functional graph plus what its inputs and outputs mean."""

    graph_module: fx.GraphModule
    state: list[StateBinding]
    input_specs: dict[str, TensorSpec]
    output_specs: dict[str, TensorSpec]
    # what each input and output is (None: untyped, a codegen dir of an older version)
    signature: GraphSignature | None = None

    @property
    def mutated_state(self) -> list[int]:
        return [i for i, s in enumerate(self.state) if s.mutated]

    @property
    def outputs_aliasing_state(self) -> list[int]:
        """Indices of the step's outputs that share memory with device state: a state input
        returned as is or through a view, or the very value that becomes a state's new
        value. The caller gets copies of these, so editing one never edits the device."""
        graph = self.graph_module.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        output = next(n for n in graph.nodes if n.op == "output")
        values = list(output.args[0])
        n = len(self.output_specs)
        aliasing = set(placeholders[: len(self.state)]) | set(values[n:])
        for node in graph.nodes:
            if node.op == "call_function" and _is_view_of(node, aliasing):
                aliasing.add(node)
        return [i for i, value in enumerate(values[:n]) if value in aliasing]


def trace_step(
    function: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
    sample: Mapping[str, torch.Tensor],
    registered: Mapping[str, torch.Tensor],
    optimizers: list[torch.optim.Optimizer] = (),
    autocast_dtype: torch.dtype | None = None,
    roles: Mapping[str, str] = {},
) -> TracedStep:
    """Trace `function(sample)` into a functional graph over `registered` state.

    autocast_dtype: run the function under torch.autocast with this dtype (float_dtype
    "mixed"): the casts autocast inserts are recorded, so the graph computes as eager
    autocast does.
    roles: each registered tensor's role ("param", "buffer", "optimizer"), by name, for the
    graph's signature (the other inputs and the outputs are typed by what the function
    tagged while it ran: runtime/signature.py)."""
    input_keys = list(sample)
    for key in input_keys:
        if not isinstance(sample[key], torch.Tensor):
            raise TypeError(
                f"compile: input {key!r} must be a torch.Tensor, got {type(sample[key]).__name__}"
            )
        check_real(key, sample[key], "a sample input of compile")
    reg_names = list(registered)
    reg_tensors = [registered[n] for n in reg_names]
    inputs = [sample[k].detach().clone() for k in input_keys]
    output_specs: dict[str, TensorSpec] = {}
    output_kinds: list[OutputSpec] = []
    guard = _TraceGuard()

    def flat_step(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch = dict(zip(input_keys, args[len(reg_tensors) :], strict=True))
        with (
            _compiling(),
            _TracingSafeFunctions(guard),
            guard,
            _autocast(args, autocast_dtype),
            _host_random_refused(),
            _prints_noted(),
        ):
            result = function(batch)
        result = _check_outputs(result)
        output_kinds[:] = [notes.output(k, v) for k, v in result.items()]
        result = _outputs_in_host_dtype(result, args, autocast_dtype)
        output_specs.update((k, TensorSpec.of(v)) for k, v in result.items())
        return tuple(result[k] for k in output_specs)

    # Lazy GraphModules (as TorchInductor uses): the passes below each end with recompile(),
    # which for a large graph means generating and exec'ing thousands of lines of Python;
    # lazily, the code is generated once, if and when something calls or prints the graph.
    with (
        _rng_preserved(),
        _one_metadata_fake_mode(),
        _use_lazy_graph_module(True),
        signature.recording() as notes,
    ):
        with _restored(reg_tensors, optimizers, guard), _no_node_values():
            gm = make_fx(flat_step, _DECOMPOSITIONS, tracing_mode="real")(*reg_tensors, *inputs)
        gm = _strip_profiler_ops(gm)
        constants = _lift_constants(gm, n_inputs_before=len(reg_tensors))
        state = [
            StateBinding(n, StateKind.REGISTERED, t, role=roles.get(n))
            for n, t in zip(reg_names, reg_tensors, strict=True)
        ]
        state += [
            StateBinding(_describe(t, i), StateKind.CONSTANT, t) for i, t in enumerate(constants)
        ]
        functional, mutated = _functionalize(gm, [s.tensor for s in state] + inputs, len(state))
    for index in mutated:
        state[index].mutated = True
    unregistered = []
    for binding in state:
        if binding.kind is StateKind.CONSTANT and binding.mutated:
            binding.kind = StateKind.PRIVATE
            unregistered.append(binding.name)
    if unregistered:
        warnings.warn(_unregistered_message(unregistered), stacklevel=3)
    input_specs = {k: TensorSpec.of(sample[k]) for k in input_keys}
    traced = _prune_unused_state(TracedStep(functional, state, input_specs, output_specs))
    traced.signature = signature.signature_of(
        [(s.name, s.input_kind, s.mutated) for s in traced.state],
        [notes.input(k, t) for k, t in zip(input_keys, inputs, strict=True)],
        output_kinds,
        notes.guards,
    )
    return traced


def _unregistered_message(names: list[str], shown: int = 5) -> str:
    """One warning for every updated tensor that was never registered (a model's BatchNorm
    buffers are often all of them: a warning each would bury the fix)."""
    listed = ", ".join(repr(n) for n in names[:shown])
    if len(names) > shown:
        listed += f", ... ({len(names) - shown} more)"
    what = "tensor is" if len(names) == 1 else "tensors are"
    return (
        f"{len(names)} {what} updated by the compiled step but never registered: {listed}. "
        "They train on the device, but synchronize() will not write them back to the host. "
        "Register them with context.register_param / register_buffer / "
        "register_optimizer_buffers (for a model's buffers: `for b in model.buffers(): "
        "context.register_buffer(b)`, or context.registry.register(name, model)), before the "
        "compiled step's first call: the step then trains the registered copies."
    )


# --- the trace guard ------------------------------------------------------------------


class _TraceGuard(TorchDispatchMode):
    """Runs in front of make_fx's proxy mode while the user function executes.

    It tracks which tensors are computed only from constants and shapes ("constant": made
    inside the step by deterministic ops from constants alone; never state, batch inputs,
    tensors from outside the step or random draws). A host read of a constant tensor is folded:
    evaluated on its real value, with nothing recorded. A host read of any other traced tensor
    raises StaticGraphError at the user's line. It also snapshots any untraced tensor before
    its first in-place update, and the gradient of any untraced leaf the step computes with
    (an unregistered parameter, whose backward sets it), so that tracing has no side effect on
    tensors that the Context does not know.
    """

    def __init__(self) -> None:
        super().__init__()
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.grads: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.constant = WeakIdKeyDictionary()
        self.overwritten: set[StorageWeakRef] = set()  # storages written with non-constants

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = get_proxy_mode().tracer
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        constant = all(self._is_constant(t) for t in tensors)
        if kwargs.get("generator") is not None:
            self._refuse(
                "draws random numbers from its own torch.Generator",
                "A compiled step draws from the default generator, which it carries as device "
                "state (seed it with torch.manual_seed or Lightning's seed_everything); drop "
                "the generator= argument inside the step.",
            )
        if func in _DATA_DEPENDENT_OPS:
            if not all(self._is_constant(t) or not _is_traced(t, tracer) for t in tensors):
                self._refuse(_DATA_DEPENDENT_OPS[func])
            with disable_proxy_modes_tracing():  # folded: evaluated now, nothing recorded
                result = func(*args, **kwargs)
            self._mark(result, constant)
            return result
        if func is aten.index.Tensor:
            args = (args[0], self._integer_indices(args[1], tracer), *args[2:])
        for tensor in tensors:
            if tensor.requires_grad and tensor.is_leaf and id(tensor) not in self.grads:
                if not _is_traced(tensor, tracer):
                    self.grads[id(tensor)] = (tensor, tensor.grad)
        written = self._written(func, args)
        for value in written:
            if not _is_traced(value, tracer):
                self._save(value)
        if written and torch.Tag.nondeterministic_seeded in func.tags:
            result = _draw_in_memory_order(func, args, kwargs)
        else:
            result = func(*args, **kwargs)
        constant = (
            constant or func in (aten.lift_fresh.default, aten.lift_fresh_copy.default)
        ) and torch.Tag.nondeterministic_seeded not in func.tags
        self._mark(result, constant)
        if not constant:
            for value in written:
                self.constant.pop(value, None)
                self.overwritten.add(StorageWeakRef(value.untyped_storage()))
        self._record_source(result, tracer)
        return result

    def check_host_read(self, tensor: torch.Tensor, what: str) -> None:
        """A host read that bypasses dispatch (.tolist()): refused as _DATA_DEPENDENT_OPS
        are, unless the tensor is a constant or not traced."""
        mode = get_proxy_mode()
        if mode is not None and _is_traced(tensor, mode.tracer) and not self._is_constant(tensor):
            self._refuse(what)

    def _is_constant(self, tensor: torch.Tensor) -> bool:
        return (
            tensor in self.constant
            and StorageWeakRef(tensor.untyped_storage()) not in self.overwritten
        )

    def _mark(self, result, constant: bool) -> None:
        if constant:
            for value in tree_leaves(result):
                if isinstance(value, torch.Tensor):
                    self.constant[value] = True

    @staticmethod
    def _written(func, args) -> list[torch.Tensor]:
        """The tensors that an in-place or out= op writes (BatchNorm's running stats too)."""
        undeclared = _UNDECLARED_WRITES.get(func)
        if undeclared is not None:
            return undeclared(args)
        if not func._schema.is_mutable:
            return []
        # args may stop before the schema's trailing defaulted arguments
        return [
            value
            for arg, value in zip(func._schema.arguments, args, strict=False)
            if arg.alias_info is not None
            and arg.alias_info.is_write
            and isinstance(value, torch.Tensor)
        ]

    def _integer_indices(self, indices, tracer) -> list:
        """x[mask]: a constant mask becomes its (constant) integer indices, a fixed-size
        selection; a mask that depends on the batch or state cannot be one static graph."""
        result = []
        for index in indices:
            if index is None or index.dtype not in (torch.bool, torch.uint8):
                result.append(index)
            elif self._is_constant(index) or not _is_traced(index, tracer):
                with disable_proxy_modes_tracing():
                    positions = index.bool().nonzero().unbind(1)
                self._mark(positions, constant=True)
                result.extend(positions)
            else:
                self._refuse(
                    _BOOLEAN_MASK_HINT,
                    "Keep the shape fixed: torch.where(mask, x, 0) (with a masked sum or mean), "
                    "or a fixed-size selection (topk, gather with integer indices).",
                )
        return result

    @staticmethod
    def _refuse(what: str, advice: str | None = None) -> None:
        where = user_frame() or "<unknown location>"
        raise StaticGraphError(
            f"the step {what} at {where}. A compiled step is one static graph: its control flow "
            "and shapes are fixed at trace time and cannot depend on the values of the batch or "
            "of state. "
            + (
                advice
                or "Compute with tensors instead (torch.where, masks, clamp), or move this code "
                "out of the compiled step."
            )
        )

    @staticmethod
    def _record_source(result, tracer) -> None:
        """Remember the user's line on the graph node, for errors raised when it runs (for
        an op of the backward, the forward line it differentiates, when anomaly mode recorded
        the forward's lines)."""
        frame, name = backward_frame_summary(), None
        if frame is not None:
            name = f"{frame.name} (its backward)"
        else:
            frame = user_frame_summary()
        if frame is None:
            return
        name = name or frame.name
        text = f'  File "{frame.filename}", line {frame.lineno}, in {name}\n    {frame.line}\n'
        for value in tree_leaves(result):
            if isinstance(value, torch.Tensor):
                proxy = get_proxy_slot(value, tracer, None)
                node = getattr(getattr(proxy, "proxy", None), "node", None)
                if node is not None:
                    node.meta["stack_trace"] = text

    def _save(self, tensor: torch.Tensor) -> None:
        if id(tensor) not in self.saved:
            with disable_proxy_modes_tracing(), torch.no_grad():
                self.saved[id(tensor)] = (tensor, tensor.detach().clone())

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, value in self.saved.values():
                tensor.copy_(value)
        for tensor, grad in self.grads.values():
            tensor.grad = grad
        self.saved.clear()
        self.grads.clear()


def _draw_in_memory_order(func, args, kwargs):
    """A random in-place fill (dropout's bernoulli_) of a non-contiguous tensor, done on a view
    whose logical order is the tensor's memory order.

    Eager PyTorch draws in memory order; functionalization turns the fill into an out-of-place
    op that draws into a new contiguous tensor, in logical order. Through the view both orders
    agree, so the compiled step draws the same mask as eager PyTorch (a transposed attention
    output, say)."""
    target = args[0]
    if (
        target.is_contiguous()
        or any(isinstance(t, torch.Tensor) for t in tree_leaves((args[1:], kwargs)))
        or not is_non_overlapping_and_dense_or_false(target)
    ):
        return func(*args, **kwargs)
    view = target.permute(sorted(range(target.dim()), key=lambda d: -target.stride(d)))
    if not view.is_contiguous():
        return func(*args, **kwargs)
    func(view, *args[1:], **kwargs)
    return target


def _one_hot(tensor, num_classes=-1):
    """F.one_hot as torch.compile traces it: the range check runs in the graph
    (_assert_async) instead of reading the tensor on the host."""
    if num_classes < 0:  # the result's shape depends on the values: leave it to the guard
        return torch.nn.functional.one_hot(tensor, num_classes)
    return decompositions.one_hot(tensor, num_classes)


class _TracingSafeFunctions(TorchFunctionMode):
    """Functions whose eager kernel checks values on the host although the result's shape is
    known run torch's own tracing-safe decomposition instead, so the check does not stop a
    step. Host copies of a traced tensor (.tolist(), .numpy()), which read its values without
    going through dispatch, are refused as .item() is (see _TraceGuard)."""

    _REPLACEMENTS = {torch.nn.functional.one_hot: _one_hot}
    _HOST_COPIES = {
        torch.Tensor.tolist: "copies a tensor's values to Python (.tolist())",
        torch.Tensor.numpy: "copies a tensor's values to NumPy (.numpy())",
        torch.Tensor.__array__: "copies a tensor's values to NumPy (np.asarray(t))",
    }

    def __init__(self, guard: _TraceGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._HOST_COPIES:
            self.guard.check_host_read(args[0], self._HOST_COPIES[func])
        return self._REPLACEMENTS.get(func, func)(*args, **(kwargs or {}))


# Python's and NumPy's global random generators: a draw inside a step would be drawn once,
# at trace time, and replayed as a constant at every call.
_HOST_RANDOM = {
    "random": (
        "random",
        "uniform",
        "randint",
        "randrange",
        "choice",
        "choices",
        "sample",
        "shuffle",
        "gauss",
        "normalvariate",
        "betavariate",
        "expovariate",
    ),
    "numpy.random": (
        "rand",
        "randn",
        "random",
        "random_sample",
        "uniform",
        "normal",
        "beta",
        "randint",
        "choice",
        "permutation",
        "shuffle",
        "binomial",
        "poisson",
        "default_rng",
    ),
}


@contextlib.contextmanager
def _host_random_refused():
    """While the step is traced, drawing from Python's or NumPy's global random generator
    raises StaticGraphError at the user's line (torch's generators are traced)."""
    patched = []
    for module_name, names in _HOST_RANDOM.items():
        if module_name.split(".")[0] not in sys.modules:
            continue
        module = importlib.import_module(module_name)
        for name in names:
            original = getattr(module, name, None)
            if original is None:
                continue
            patched.append((module, name, original))
            setattr(module, name, _refusing(f"{module_name}.{name}"))
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


@contextlib.contextmanager
def _prints_noted():
    """While the step is traced, a print() in user code warns (once per trace) that it runs
    at trace time only: a user who prints a loss to follow training would see one value."""
    original = builtins.print
    warned = []

    def noted_print(*args: Any, **kwargs: Any) -> None:
        if not warned and called_from_user_code():
            warned.append(True)
            warnings.warn(
                f"print() in the compiled step at {user_frame()} runs once, when the step is "
                "traced, and shows the traced batch's values; it does not run at each call. "
                "Log values with the framework's logging (self.log in Lightning) or print "
                "them from a hook outside the step.",
                stacklevel=2,
            )
        original(*args, **kwargs)

    builtins.print = noted_print
    try:
        yield
    finally:
        builtins.print = original


def _refusing(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        where = user_frame() or "<unknown location>"
        raise StaticGraphError(
            f"the step draws a random number with {name}() at {where}. A compiled step is "
            "traced once, so the draw would happen once and be replayed as a constant at "
            "every call. Draw with torch instead (torch.rand, torch.randn, "
            "torch.distributions: traced, a new draw at every call), or draw in a hook "
            "outside the step and pass the value in as a tensor."
        )

    return refuse


@contextlib.contextmanager
def _compiling():
    """`torch.compiler.is_compiling()` is true while the step is traced."""
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = previous


def _autocast(args: tuple[torch.Tensor, ...], dtype: torch.dtype | None):
    """torch.autocast on the device the traced tensors live on, or nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    device_type = args[0].device.type if args else "cpu"
    return torch.autocast(device_type, dtype=dtype)


def _outputs_in_host_dtype(
    result: Mapping[str, torch.Tensor],
    args: tuple[torch.Tensor, ...],
    autocast_dtype: torch.dtype | None,
) -> Mapping[str, torch.Tensor]:
    """float_dtype "mixed": outputs come back in the host tensors' dtype, not bfloat16.

    MLSDK's mixed precision is internal to the device (dtypes are inherited from the host
    tensors), so a step returns what it would return computing in "float": an output that
    autocast left in `autocast_dtype` is cast (in the graph) to the host's floating dtype, the
    widest floating dtype among the step's inputs and state (float32 by default). Where the
    host tensors are themselves in `autocast_dtype`, nothing changes."""
    if autocast_dtype is None:
        return result
    floats = [a.dtype for a in args if a.is_floating_point()]
    host = max(floats, key=lambda d: torch.finfo(d).bits) if floats else torch.get_default_dtype()
    if torch.finfo(host).bits <= torch.finfo(autocast_dtype).bits:
        return result
    return {k: v.to(host) if v.dtype == autocast_dtype else v for k, v in result.items()}


def _is_traced(tensor: torch.Tensor, tracer) -> bool:
    return get_proxy_slot(tensor, tracer, None) is not None


class _restored:
    """Undo what one real-mode trace did to host tensors, optimizer state and the RNG."""

    def __init__(self, tensors, optimizers, guard: _TraceGuard) -> None:
        self.tensors = tensors
        self.optimizers = list(optimizers)
        self.guard = guard

    def __enter__(self):
        with torch.no_grad():
            self.values = [t.detach().clone() for t in self.tensors]
        self.grads = [t.grad for t in self.tensors]
        self.versions = [t._version for t in self.tensors]
        self.state_keys = [_state_keys(o) for o in self.optimizers]
        # the optimizers' parameters, registered or not: the step's zero_grad may drop a
        # gradient before the trace guard first sees the parameter
        self.parameter_grads = [
            (p, p.grad) for o in self.optimizers for g in o.param_groups for p in g["params"]
        ]
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with torch.no_grad():
            restore = zip(self.tensors, self.values, self.grads, self.versions, strict=True)
            for tensor, value, grad, version in restore:
                # only what the trace wrote (in place, or through .data, which no version
                # counts): a tensor the host's autograd saved (host code of a step with
                # graph breaks) keeps its version
                if tensor._version != version or not torch.equal(tensor, value):
                    tensor.copy_(value)
                tensor.grad = grad
        self.guard.restore()
        for parameter, grad in self.parameter_grads:
            parameter.grad = grad
        lazy = [
            o for o, k in zip(self.optimizers, self.state_keys, strict=True) if _state_keys(o) != k
        ]
        for optimizer, keys in zip(self.optimizers, self.state_keys, strict=True):
            _drop_new_state(optimizer, dict(keys))
        if lazy:
            # Lazy state often fails tracing first (torch.optim.Adam reads its new step with
            # .item()); the cause worth naming is the lazy state, so it wins.
            raise StaticGraphError(
                f"{type(lazy[0]).__name__} created new state while the step was traced "
                "(torch.optim creates momentum/Adam buffers lazily on the first step). "
                "Device state must exist before compile: use an optimizer that creates its state "
                "when it is constructed and keeps its hyperparameters in tensors (the MN-Core "
                "optimizers MNCoreSGD, MNCoreAdam and MNCoreAdamW do)."
            ) from exc


@contextlib.contextmanager
def _one_metadata_fake_mode():
    """One fake mode for the whole trace: the functionalizing pass runs in it, and the node
    values that make_fx records in real mode come from it. Without a tracing context that
    provides one, real-mode make_fx builds a new FakeTensorMode for every value it records,
    and each captures the whole Python stack when it is made (most of the trace time of a
    large model, before the first pass stopped recording values)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    context = TracingContext.try_get()
    if context is not None and context.fake_mode is not None:
        yield
        return
    with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        yield


@contextlib.contextmanager
def _no_node_values():
    """The first pass records no shape/dtype metadata (node.meta["val"]) on its nodes.

    Its graph is only replayed by the functionalizing pass, which records its own. Making a
    fake tensor for each result of the real-mode trace was a third of the first pass's time."""
    original = proxy_tensor.set_meta
    proxy_tensor.set_meta = lambda proxy, value: proxy
    try:
        yield
    finally:
        proxy_tensor.set_meta = original


@contextlib.contextmanager
def _rng_preserved():
    """Tracing draws random numbers (dropout); the compiled calls must draw the same ones."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _state_keys(optimizer: torch.optim.Optimizer) -> list[tuple[int, tuple[str, ...]]]:
    return [(id(p), tuple(s)) for p, s in optimizer.state.items()]


def _drop_new_state(optimizer: torch.optim.Optimizer, keys: dict[int, tuple[str, ...]]) -> None:
    """Remove state entries that appeared during tracing, in place."""
    for param in list(optimizer.state):
        if id(param) not in keys:
            del optimizer.state[param]
            continue
        entry = optimizer.state[param]
        for key in [k for k in entry if k not in keys[id(param)]]:
            del entry[key]


def _check_outputs(result) -> Mapping[str, torch.Tensor]:
    if not isinstance(result, Mapping):
        raise TypeError(
            f"a compiled function must return a dict of tensors, got {type(result).__name__}"
        )
    for key, value in result.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"output {key!r} of the compiled function is a {type(value).__name__}, "
                "not a tensor: return tensors (e.g. torch.tensor(x)) from the step"
            )
    return result


def _describe(tensor: torch.Tensor, index: int) -> str:
    """A captured tensor's state name: its tensor name, else a unique description."""
    shape = "x".join(map(str, tensor.shape)) or "scalar"
    dtype = str(tensor.dtype).removeprefix("torch.")
    return get_tensor_name(tensor) or f"<captured {index}: unnamed {shape} {dtype}>"


def _is_view_of(node: fx.Node, nodes: set[fx.Node]) -> bool:
    """Whether `node` may share memory with one of `nodes` (a view op, or getitem of one)."""
    target = node.target
    if target is operator.getitem:
        return node.args[0] in nodes
    if not isinstance(target, torch._ops.OpOverload):
        return any(a in nodes for a in node.all_input_nodes)  # unknown: assume it aliases
    returns_alias = any(r.alias_info is not None for r in target._schema.returns)
    return returns_alias and any(a in nodes for a in node.all_input_nodes)


# --- graph passes -----------------------------------------------------------------------


def _strip_profiler_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop torch.optim's record_function markers: Inductor cannot compile them."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and any(p in str(node.target) for p in _PROFILER_OPS):
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _lift_constants(gm: fx.GraphModule, n_inputs_before: int) -> list[torch.Tensor]:
    """Turn every tensor constant (closed-over host tensor) into a graph input."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    anchor = placeholders[n_inputs_before - 1] if n_inputs_before else None
    constants: list[torch.Tensor] = []
    lifted: dict[int, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        tensor = getattr(gm, node.target)
        if not isinstance(tensor, torch.Tensor):
            continue
        if id(tensor) not in lifted:
            where = anchor.next if anchor is not None else next(iter(gm.graph.nodes))
            with gm.graph.inserting_before(where):
                lifted[id(tensor)] = gm.graph.placeholder(f"const_{len(constants)}")
            anchor = lifted[id(tensor)]
            constants.append(tensor)
        node.replace_all_uses_with(lifted[id(tensor)])
        gm.graph.erase_node(node)
    for name, _ in list(gm.named_buffers()) + list(gm.named_parameters()):
        delattr(gm, name)
    for name in [k for k in vars(gm) if k.startswith("_tensor_constant")]:
        delattr(gm, name)
    gm.recompile()
    return constants


def _functionalize(gm: fx.GraphModule, args: list[torch.Tensor], n_state: int):
    """Second pass: a mutation-free graph returning (*outputs, *updated state).

    It runs on fake tensors: the first pass already ran the step for real and folded every
    value-dependent read, so this pass needs only shapes (no compute, no copies of state)."""
    from torch._guards import detect_fake_mode

    with detect_fake_mode():  # separate fresh tensors, as clones would be (and cheaper)
        fakes = [
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device) for a in args
        ]
    interpreter = fx.Interpreter(gm)
    with fx_traceback.preserve_node_meta():
        functional = make_fx(
            torch.func.functionalize(interpreter.run, remove="mutations_and_views"),
            tracing_mode="fake",
        )(*fakes)
    graph = functional.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index_of = {node: i for i, node in enumerate(placeholders)}
    updates: dict[int, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.copy_.default:
            destination = node.args[0]
            if destination in index_of and not node.users:
                updates[index_of[destination]] = node.args[1]
                graph.erase_node(node)
    mutated = sorted(i for i in updates if i < n_state)
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    output.args = (tuple(outputs + [updates[i] for i in mutated]),)
    _views_instead_of_copies(graph)
    graph.eliminate_dead_code()
    functional.recompile()
    return functional, mutated


def _views_instead_of_copies(graph: fx.Graph) -> None:
    """Functionalization turns every view into a copy (t_copy, view_copy, detach_copy...).
    The graph mutates nothing any more, so a view and a copy read the same values: use the
    view and save the copy (a transposed weight matrix, every step)."""
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target.overloadpacket.__name__
        if not name.endswith("_copy"):
            continue
        packet = getattr(aten, name.removesuffix("_copy"), None)
        view = getattr(packet, target._overloadname, None) if packet is not None else None
        if view is not None and view._schema.returns and view._schema.returns[0].alias_info:
            node.target = view


def _prune_unused_state(traced: TracedStep) -> TracedStep:
    """Remove state inputs the graph neither reads nor writes (another model's, say)."""
    graph = traced.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    keep = []
    for binding, node in zip(traced.state, placeholders[: len(traced.state)], strict=True):
        if node.users or binding.mutated:
            keep.append(binding)
        else:
            graph.erase_node(node)
    traced.graph_module.recompile()
    traced.state = keep
    return traced
