"""`Context`: the device's memory and the steps compiled against it (MLSDK's programming model).

`Context` is the interface every backend implements; `Context(device)` returns the
implementation that runs `device`: `EmulatorContext` (this package's emulated MN-Core,
"pfvm:*") or `MLSDKContext` (PFN's MLSDK, "mncore2:*", or "pfvm:*" with backend="mlsdk").
What is the same on every backend lives here: choosing the backend, the current context,
naming and registration checks (with the one copy of each message), host transfers of
outputs. Each backend fills in device memory, transfers and compilation.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any, ClassVar

import torch

from . import trace_events
from .automap import AutomapFunction, compile_automap
from .compile_keywords import CompileKeywords
from .device import Backend, MNDevice, resolve_backend
from .errors import ContextInvalidatedError, RegistrationError
from .naming import get_tensor_name, name_optimizer_state
from .registry import Registry
from .runtime.artifacts import CacheOptions

StepFunction = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


class Role(StrEnum):
    """What a registered tensor is to the model: the `register_<role>` call that made it."""

    PARAM = "param"
    BUFFER = "buffer"
    OPTIMIZER = "optimizer"


CAPTURE_MODES = ("dynamo", "trace")
CAPTURE_ENV = "MNCORE_DEVICE_CAPTURE"


def _capture_mode(function: Any, capture: str | None) -> str:
    """How `compile` turns `function` into a graph (see `Context.compile`'s `capture`)."""
    if getattr(function, "_mncore_replay", False):
        return "trace"  # already a captured graph's replay
    mode = capture or os.environ.get(CAPTURE_ENV) or "dynamo"
    if mode not in CAPTURE_MODES:
        raise ValueError(f"compile(capture=...) must be one of {CAPTURE_MODES}, got {mode!r}")
    return mode


class Context(ABC):
    """Device memory plus the functions compiled against it.

    `Context(device, backend=None)`: the device string picks the backend ("mncore2:*" runs on
    PFN's MLSDK, "pfvm:*" on this package's emulator; backend="mlsdk" runs "pfvm:*" on MLSDK's
    own virtual machine), and the result is that backend's Context.
    """

    backend: ClassVar[Backend]
    _implementations: ClassVar[dict[Backend, type[Context]]] = {}
    _current: ClassVar[Context | None] = None

    def __init_subclass__(cls, backend: Backend | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if backend is not None:
            cls.backend = backend
            Context._implementations[backend] = cls

    def __new__(cls, device: MNDevice | str = "pfvm:cpu", backend: str | None = None) -> Context:
        if cls is Context:
            cls = Context._implementations[resolve_backend(device, backend)]
        return super().__new__(cls)

    def __init__(self, device: MNDevice | str = "pfvm:cpu", backend: str | None = None) -> None:
        self.device = device if isinstance(device, MNDevice) else MNDevice(device)
        if resolve_backend(self.device, backend or self.backend) is not self.backend:
            raise ValueError(
                f"{type(self).__name__} runs the {self.backend} backend; "
                f"use Context({str(self.device)!r}, backend={backend!r}) instead"
            )
        self._registered: dict[str, torch.Tensor] = {}  # name -> host tensor
        self._roles: dict[str, Role] = {}  # name -> the register_<role> call that made it
        self._names: dict[int, str] = {}  # id(host tensor) -> name
        self._optimizers: list[torch.optim.Optimizer] = []
        self._invalidated = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"

    # --- the current context -----------------------------------------------------------

    @staticmethod
    def switch_context(context: Context) -> None:
        """Make `context` the current one (on MLSDK, MLSDK's current context too)."""
        context._check_valid("Context.switch_context")
        Context._current = context
        context._made_current()

    def _made_current(self) -> None:
        """Called by switch_context: a backend with its own current context follows it."""
        return None

    @staticmethod
    def get_current_context() -> Context:
        if Context._current is None:
            raise RuntimeError("no current Context: call Context.switch_context(context) first")
        return Context._current

    # --- the end of a context -------------------------------------------------------------

    def invalidate(self) -> None:
        """Release this context's device memory and every function compiled or loaded in it
        (MLSDK's `Context.invalidate`; PFN's pipeline examples call it once a stage is done).

        Device values are dropped, not written back: `synchronize()` first to keep them. The
        host tensors, and outputs already copied to the host, stay as they are. Afterwards the
        context and its compiled functions raise ContextInvalidatedError; registered tensors
        may be registered again in a new Context. Invalidating twice does nothing.
        """
        if self._invalidated:
            return
        self._release()
        self._invalidated = True
        self._registered.clear()
        self._roles.clear()
        self._names.clear()
        self._optimizers.clear()
        if Context._current is self:
            Context._current = None

    @property
    def invalidated(self) -> bool:
        return self._invalidated

    def _release(self) -> None:
        """The backend's part of `invalidate`: free device memory and compiled functions."""
        return None

    def _check_valid(self, what: str) -> None:
        if self._invalidated:
            raise ContextInvalidatedError(
                f"{what}: {self!r} was invalidated (Context.invalidate()); create a new "
                "Context for the device"
            )

    # --- registration --------------------------------------------------------------------

    def register_param(self, param: torch.Tensor) -> None:
        """Copy a parameter into device memory; compiled steps then train the device copy."""
        self._register(param, Role.PARAM)

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Copy a buffer (e.g. BatchNorm running stats) into device memory."""
        self._register(buffer, Role.BUFFER)

    def register_optimizer_buffers(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy every tensor of `optimizer.state` into device memory.

        Name them first with `set_buffer_name_in_optimizer`. The device layer accepts any
        optimizer whose step can be traced once and replayed: it must create its state before
        the first step (so it can be registered here) and keep every number its step reads in
        a tensor (a Python float would be frozen into the graph). A backend may ask for more
        (MLSDK runs only its own optimizers).
        """
        self._check_valid("register_optimizer_buffers")
        self._check_optimizer(optimizer)
        named = name_optimizer_state(optimizer)
        new = [(n, t) for n, t in named if self._registered.get(n) is not t]
        for name, tensor in new:
            self._check_name_free(name, tensor, Role.OPTIMIZER)
        if new or optimizer not in self._optimizers:
            self._add_optimizer(optimizer, new)
        for name, tensor in new:
            self._remember(name, tensor, Role.OPTIMIZER)
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)

    def _register(self, tensor: torch.Tensor, role: Role) -> None:
        self._check_valid(f"register_{role}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register_{role} expects a tensor, got {type(tensor).__name__}")
        name = self._name_of(tensor, role)
        if self._registered.get(name) is tensor:
            return
        self._check_name_free(name, tensor, role)
        self._add_tensor(name, tensor, role)
        self._remember(name, tensor, role)

    def _name_of(self, tensor: torch.Tensor, role: Role) -> str:
        name = get_tensor_name(tensor) or self._backend_name(tensor)
        if name is None:
            raise RegistrationError(
                f"register_{role}: a tensor of shape {list(tensor.shape)} has no name. Name it "
                "first: set_tensor_name_in_module(model, 'model'), "
                "set_buffer_name_in_optimizer(optimizer, 'optimizer') or set_tensor_name(t, name)."
            )
        return name

    def _backend_name(self, tensor: torch.Tensor) -> str | None:
        """A name the backend's own naming functions gave `tensor` (none by default)."""
        return None

    def _check_name_free(self, name: str, tensor: torch.Tensor, role: Role) -> None:
        existing = self._registered.get(name)
        if existing is not None and existing is not tensor:
            raise RegistrationError(
                f"register_{role}: the name {name!r} is already registered for another tensor; "
                "give each model its own prefix in set_tensor_name_in_module"
            )

    def _remember(self, name: str, tensor: torch.Tensor, role: Role) -> None:
        self._registered[name] = tensor
        self._roles[name] = role
        self._names[id(tensor)] = name

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer this backend cannot run (every one is accepted by default)."""
        return None

    @abstractmethod
    def _add_tensor(self, name: str, tensor: torch.Tensor, role: Role) -> None:
        """Put one newly registered host tensor into device memory."""

    @abstractmethod
    def _add_optimizer(
        self, optimizer: torch.optim.Optimizer, new: list[tuple[str, torch.Tensor]]
    ) -> None:
        """Put an optimizer's newly registered state (`new`, named) into device memory."""

    def is_registered(self, tensor: torch.Tensor) -> bool:
        name = self._names.get(id(tensor))
        return name is not None and self._registered.get(name) is tensor

    def _require_registered(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        tensors = list(tensors)
        for tensor in tensors:
            if not self.is_registered(tensor):
                name = get_tensor_name(tensor)
                raise RegistrationError(
                    f"tensor {name or list(tensor.shape)} is not registered in this Context"
                )
        return tensors

    @property
    def registered_names(self) -> list[str]:
        return list(self._registered)

    def registered_tensors(self) -> dict[str, torch.Tensor]:
        """The registered host tensors, by name."""
        return dict(self._registered)

    @abstractmethod
    def device_values(self) -> list[torch.Tensor]:
        """The registered tensors as the device holds them (for memory accounting)."""

    @abstractmethod
    def get_registered_value_proxy(self, tensor: torch.Tensor) -> Any:
        """The device-side value of a registered tensor, for explicit transfers (`load_from`)."""

    # --- host <-> device ------------------------------------------------------------------

    @abstractmethod
    def synchronize(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        """Write registered device values back into their host tensors (all, or `tensors`)."""

    def load_from_host(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        """Push host values of registered tensors to the device (all, or `tensors`)."""
        tensors = self._registered.values() if tensors is None else tensors
        for tensor in self._require_registered(tensors):
            self.get_registered_value_proxy(tensor).load_from(tensor)

    def to_host(self, outputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """One compiled call's outputs as host (CPU) tensors, converted in one pass.

        Device tensors are moved; a backend's tensor proxies are read with `.cpu()` (on
        "pfvm:cuda" that may still give a CUDA tensor, hence the second move). Outputs that
        already live on the host are returned as they are.
        """
        host = {}
        for key, value in outputs.items():
            tensor = value if isinstance(value, torch.Tensor) else value.cpu()
            host[key] = tensor if tensor.device.type == "cpu" else tensor.cpu()
        return host

    # --- compilation ------------------------------------------------------------------------

    def compile(
        self,
        function: StepFunction,
        inputs: Mapping[str, torch.Tensor],
        codegen_dir: str | os.PathLike[str] | None = None,
        options: Mapping[str, object] | None = None,
        cache_options: CacheOptions | None = None,
        *,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
        num_compiler_threads: int | None = None,
        quiet: bool | None = None,
        export_kwargs: Mapping[str, Any] | None = None,
        training: bool | None = None,
        io_spec_constraints: Mapping[str, Any] | None = None,
        capture: str | None = None,
        max_retraces: int = 8,
    ) -> Any:
        """Trace `function` once with the sample `inputs` into one static graph and compile it.

        options: {"option_json": preset name or file (debug, O0 ... O4; default O1),
        "float_dtype": "float" or "mixed" (matmuls and convolutions in bfloat16, as autocast),
        "backprop": True (with `optimizers`: the compiler adds backward and the update),
        "random": "eager" (default: random ops draw eager's numbers for the same seed) or
        "inductor" (under Inductor, O1 and up: its own in-kernel stream, other numbers than
        eager's, for a faster step)}.
        The keywords are MLSDK's (see `CompileKeywords`); a backend warns once about any it
        cannot honour.

        capture: how `function` becomes a graph. "dynamo" (the default): TorchDynamo captures
        it, every Python value it reads is guarded (a changed one re-compiles, reported, at
        most `max_retraces` times), and the backend compiles a replay of the captured graph
        (mncore_device.capture.compiled_step). "trace": make_fx traces the function itself
        (Python reads are frozen at their compile-time values), for functions that are
        already graphs (a framework's own) and before/after comparisons. Default:
        $MNCORE_DEVICE_CAPTURE, else "dynamo". A replay of a captured graph is always traced.
        """
        self._check_valid("compile")
        keywords = CompileKeywords(
            optimizers=list(optimizers) if optimizers is not None else None,
            num_compiler_threads=num_compiler_threads,
            quiet=quiet,
            export_kwargs=dict(export_kwargs) if export_kwargs is not None else None,
            training=training,
            io_spec_constraints=dict(io_spec_constraints) if io_spec_constraints else None,
        )
        name = getattr(function, "__name__", "function")
        with trace_events.span("compile", "compile", function=name, codegen_dir=str(codegen_dir)):
            if _capture_mode(function, capture) == "trace":
                return self._compile(
                    function, inputs, codegen_dir, options, cache_options, keywords
                )
            from .capture.compiled_step import CapturedFunction

            def compile_replay(replay: StepFunction, sample: Mapping, directory: Any) -> Any:
                return self._compile(replay, sample, directory, options, cache_options, keywords)

            return CapturedFunction(
                function,
                inputs,
                compile_replay,
                codegen_dir=codegen_dir,
                max_retraces=max_retraces,
            )

    @abstractmethod
    def _compile(
        self,
        function: StepFunction,
        inputs: Mapping[str, torch.Tensor],
        codegen_dir: str | os.PathLike[str] | None,
        options: Mapping[str, object] | None,
        cache_options: CacheOptions | None,
        keywords: CompileKeywords,
    ) -> Any:
        """The backend's compile (the arguments as `compile` received them)."""

    def compile_automap(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        codegen_dir: str | os.PathLike[str] | None = None,
        **compile_kwargs: Any,
    ) -> AutomapFunction:
        """Compile a function of any pytree of tensors (tuples, lists, dicts, registered
        dataclasses and namedtuples), called as `compiled(*args, **kwargs)`; it returns the
        function's own pytree of results."""
        return compile_automap(self, function, args, kwargs or {}, codegen_dir, **compile_kwargs)

    @property
    def registry(self) -> Registry:
        """`context.registry.register(name, module or optimizer)`: name and register in one call."""
        return Registry(self)

    def push_learning_rates(self) -> None:
        """Copy learning rates changed on the host to the device now (MNCoreLRScheduler.step).

        The emulator reads an optimizer's rate tensors before every call, so this only
        refreshes them early; a backend with its own rate store overrides it.
        """
        return None

    @abstractmethod
    def load_codegen_dir(
        self, path: str | os.PathLike[str], *, trust_compiled_code: bool = False
    ) -> Any:
        """Rebuild a function compiled earlier (possibly in another process), without tracing.

        trust_compiled_code: run the compiled host code the directory holds (checked against
        the sha256 in its specs.json) instead of compiling its graph again; only for
        directories you trust, as for any code you run."""
