"""What MN-Core optimizers share: tensor hyperparameters, eager state, torch-compatible I/O.

A compiled MN-Core step is traced once and replayed, so an optimizer must

* keep every number its step reads in a tensor: a Python float would be baked into the
  graph. Each param group mirrors its hyperparameters into 0-d tensors (`ParamGroup`);
  the device layer re-uploads such a read-only constant whenever its `_version` changes, so
  a host-side `group["lr"] = x` (schedulers, callbacks) reaches the compiled step;
* create its state before the first step, so the device can register those tensors;
* never replace a state tensor the device may have registered: `load_state_dict` copies
  values into the existing tensors.

`state_dict()` keeps torch.optim's layout exactly, so checkpoints move freely between an
MN-Core optimizer and its torch.optim counterpart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

Coefficients = Callable[[Mapping[str, Any]], dict[str, float]]

# Group keys whose values feed the coefficient tensors. They are always stored as Python
# numbers (a tensor value is converted), so torch's schedulers take their float path and
# state_dict() holds plain floats, as torch.optim's does.
HYPERPARAMETER_KEYS = frozenset({"lr", "momentum", "dampening", "weight_decay", "eps", "betas"})

# Constructor defaults compared by identity, to tell "not given" from "given": only then can
# an MLSDK alias (learning_rate=, beta1=, beta2=) be refused when both names are given, while
# the signature still shows the plain defaults (tools such as LightningCLI read it).
DEFAULT_LR = 1e-3
DEFAULT_BETAS = (0.9, 0.999)


def resolve_alias(name: str, value: Any, default: Any, alias: str, alias_value: Any) -> Any:
    """The value given as `name` or as its MLSDK alias; giving both is a TypeError."""
    if alias_value is None:
        return value
    if value is not default:
        raise TypeError(f"got both {name!r} and its alias {alias!r}: give only one")
    return alias_value


def _to_number(value: Any) -> Any:
    """Host-side conversion of tensor hyperparameters (torch allows a Tensor lr) to floats."""
    if isinstance(value, Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return tuple(_to_number(v) for v in value)
    return value


class ParamGroup(dict[str, Any]):
    """A torch.optim param group whose hyperparameters are mirrored into 0-d tensors.

    It behaves as the plain dict torch.optim uses (`group["lr"]` is a float), but setting a
    hyperparameter also refills, in place, the tensors derived from it (`tensors`), which
    the step reads. Derived values (say `1 - dampening`) are computed on the host in double
    precision, as torch.optim computes them. The tensors are float64: 0-d tensors do not
    promote the params, so every update is computed in the param dtype, while the scalar
    arithmetic on them (Adam's bias corrections) is done in double, as torch.optim does it
    in Python. That keeps results equal to torch.optim's, not merely close.
    """

    def __init__(self, group: Mapping[str, Any], coefficients: Coefficients) -> None:
        super().__init__()
        self._coefficients = coefficients
        self.tensors: dict[str, Tensor] = {}
        self._values: dict[str, float] = {}
        self.update(group)

    def bind(self, reuse: Mapping[str, Tensor] | None = None) -> None:
        """Create the coefficient tensors, or refill those in `reuse` and keep them."""
        params = self["params"]
        device = params[0].device if params else torch.device("cpu")
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        self._values = self._coefficients(self)
        reuse = reuse or {}
        with torch.no_grad():
            for name, value in self._values.items():
                tensor = reuse.get(name)
                if tensor is None:
                    tensor = torch.empty((), dtype=dtype, device=device)
                self.tensors[name] = tensor.fill_(value)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in HYPERPARAMETER_KEYS:
            super().__setitem__(key, value)
            return
        super().__setitem__(key, _to_number(value))
        if self.tensors:
            values = self._coefficients(self)
            with torch.no_grad():
                for name, new in values.items():
                    if new != self._values.get(name):
                        self.tensors[name].fill_(new)  # bumps _version: the device re-uploads
            self._values = values

    def update(self, *args: Any, **kwargs: Any) -> None:  # dict.update bypasses __setitem__
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other: Any) -> ParamGroup:
        self.update(other)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle and deepcopy: rebuild without replaying __setitem__ on a half-built group.
        return (_rebuild_group, (type(self), dict(self)), dict(self.__dict__))


def _rebuild_group(cls: type[ParamGroup], items: dict[str, Any]) -> ParamGroup:
    group = cls.__new__(cls)
    dict.update(group, items)  # its attributes (tensors, ...) follow as the pickled state
    return group


class MNCoreOptimizer(Optimizer):
    """Base class of the MN-Core optimizers.

    Subclasses define `_coefficients` (group floats -> the tensors the step reads),
    `_init_state` (the eager state of one param) and `step`; `_export_state` and
    `_import_state` translate state that torch.optim's layout lacks.
    """

    _coefficients: Coefficients
    _group_class: type[ParamGroup] = ParamGroup

    def _init_state(self, param: Tensor, group: Mapping[str, Any]) -> None:
        """Create the state of `param` that is missing (all state starts at zero)."""
        raise NotImplementedError

    def _export_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The state_dict() view of one param's state (torch.optim's layout)."""
        return dict(state)

    def _import_state(self, param: Tensor, loaded: dict[str, Any]) -> dict[str, Any]:
        """Complete one param's loaded torch.optim state with what only we keep."""
        return loaded

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch.optim, plus the group's coefficient tensors and its eager state."""
        group = self._group_class(param_group, self._coefficients)
        super().add_param_group(group)
        group.bind()
        for param in group["params"]:
            if param.requires_grad:  # frozen params never step: no state until they get grads
                self._init_state(param, group)

    def _rate_dependent(self, group: ParamGroup, lr: Tensor) -> dict[str, Tensor]:
        """The coefficient tensors computed from `lr`, for a learning rate given as a tensor."""
        return {"lr": lr}

    @contextlib.contextmanager
    def learning_rates_from(self, rates: list[Tensor]) -> Iterator[None]:
        """While in the block, the step reads its learning rates from `rates` (one 0-d tensor
        per param group): MLSDK's legacy training compile feeds them as step inputs."""
        saved = [dict(group.tensors) for group in self.param_groups]
        try:
            for group, rate in zip(self.param_groups, rates, strict=True):
                lr = rate.to(group.tensors["lr"].dtype)
                group.tensors.update(self._rate_dependent(group, lr))
            yield
        finally:
            for group, tensors in zip(self.param_groups, saved, strict=True):
                group.tensors.clear()
                group.tensors.update(tensors)

    def ensure_state(self) -> None:
        """Create the state of every trainable param that has none yet (a param unfrozen
        after construction, by fine-tuning say), so that a device can register it before
        the step is traced again."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.requires_grad:
                    self._init_state(param, group)

    @staticmethod
    def _evaluate_closure(closure: Callable[[], float] | None) -> float | None:
        """torch.optim's contract: re-evaluate the loss (with grad enabled) when given one."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _params_with_grad(self, group: Mapping[str, Any]) -> list[Tensor]:
        """The params the step updates: those with a gradient (a trace-time decision)."""
        params = [p for p in group["params"] if p.grad is not None]
        for param in params:
            if param.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            self._init_state(param, group)  # no-op unless frozen at construction
        return params

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state_dict, in its layout (no key that torch.optim lacks)."""
        state_dict = super().state_dict()
        state = {}
        for key, value in state_dict["state"].items():
            if isinstance(value, dict):
                value = self._export_state(value)
                if not value:
                    continue  # torch.optim has no entry for a param without state
            state[key] = value
        state_dict["state"] = state
        return state_dict

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Used by unpickling and by torch's load_state_dict, which hands over plain dicts.

        On load, the groups are re-wrapped (keeping their coefficient tensors) and loaded
        values are copied into the state tensors we already had: a device may have
        registered those very objects.
        """
        previous_groups = self.__dict__.get("param_groups")
        previous_state = self.__dict__.get("state")
        super().__setstate__(state)
        if previous_groups is None and all(isinstance(g, ParamGroup) for g in self.param_groups):
            return  # unpickled: groups and state are complete
        groups = []
        for index, loaded in enumerate(self.param_groups):
            for key, default in self.defaults.items():
                loaded.setdefault(key, default)
            group = self._group_class(loaded, self._coefficients)
            group.bind(previous_groups[index].tensors if previous_groups else None)
            groups.append(group)
        self.param_groups = groups
        kept_state = previous_state or {}
        for group in groups:
            for param in group["params"]:
                self._merge_state(param, group, kept_state.get(param, {}))

    def _merge_state(self, param: Tensor, group: Mapping[str, Any], kept: dict) -> None:
        loaded = self.state.pop(param, {})
        loaded = self._import_state(param, {k: v for k, v in loaded.items() if v is not None})
        merged = kept  # keep the dict too, not only the tensors
        with torch.no_grad():
            for key in list(merged):
                if key not in loaded and isinstance(merged[key], Tensor):
                    merged[key].zero_()  # absent from a checkpoint means fresh: zero
            for key, value in loaded.items():
                target = merged.get(key)
                if isinstance(target, Tensor) and isinstance(value, Tensor):
                    target.copy_(value)
                else:  # torch's load may alias the source's tensors: own a copy
                    merged[key] = value.clone() if isinstance(value, Tensor) else value
        if merged:
            self.state[param] = merged
        if param.requires_grad:
            self._init_state(param, group)


def check_hyperparameter(what: str, value: Any, below: float | None = None) -> float:
    """Validate a hyperparameter as torch.optim does (`0 <= value [< below]`); a float."""
    number = float(_to_number(value))
    if not 0.0 <= number or (below is not None and not number < below):
        raise ValueError(f"Invalid {what}: {value}")
    return number
