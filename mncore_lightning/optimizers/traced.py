"""torch.optim's other optimizers, run by their own update code traced into a static step.

SGD, Adam and AdamW have hand-written MN-Core classes. Every other torch.optim optimizer
whose update can be captured (`TRACED_TORCH_OPTIMIZERS`) runs through one mechanism,
`MNCoreTracedOptimizer`, mixed into the user's class (`type("RMSprop", (MNCoreTracedOptimizer,
torch.optim.RMSprop), ...)`):

* its state is created before the first step, by torch's own `_init_group` (on zero gradients
  for a param that has none), so a device can register it;
* the learning rate is a 0-d tensor while the step runs (`ParamGroup` mirrors `group["lr"]`
  into it, so a scheduler's or callback's `group["lr"] = x` reaches the compiled step) and
  the step is traced with `capturable=True` where torch has it, so that torch's update
  computes with tensors instead of reading them back with `.item()`;
* its other hyperparameters are read by torch's update as Python numbers and are therefore
  fixed when the step is traced: setting a different value afterwards is a ValueError that
  says so, rather than a change that silently does nothing;
* `state_dict()` is torch.optim's, key for key (the group holds the user's own `capturable`,
  `foreach`, `differentiable` and a float `lr`), so checkpoints move between cpu and mncore.

Outside a trace (an eager `step()` on the host) the optimizer runs torch's default path with
float hyperparameters, exactly as torch.optim would.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ._base import MNCoreOptimizer, ParamGroup

# Exact types: a subclass may change the update rule. Adagrad and Adafactor have no
# `capturable` option; their default paths read the step count through torch's
# `_get_value`, which keeps it a tensor while tracing, so they are captured as they are.
TRACED_TORCH_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.RMSprop,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.ASGD,
        torch.optim.Rprop,
        torch.optim.Adafactor,
    }
)

# Group keys that only choose how torch computes (kernels, capture, autograd): overridden
# while a traced step runs, never stored.
_TRACE_OPTIONS = {"capturable": True, "foreach": False, "differentiable": False, "fused": False}
_NOT_FROZEN = frozenset({"params", "lr", "initial_lr", "name", *_TRACE_OPTIONS})


def _lr_only(group: Mapping[str, Any]) -> dict[str, float]:
    return {"lr": float(group["lr"])}


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, (tuple, list)) and any(_is_number(v) for v in value)


class TracedParamGroup(ParamGroup):
    """A ParamGroup whose numeric hyperparameters other than lr are fixed once traced.

    torch's update reads them as Python numbers, which the trace bakes into the graph;
    `frozen` holds the values the compiled step uses, and setting a different one raises.
    """

    frozen: dict[str, Any] | None = None
    optimizer_name: str = "optimizer"

    def __setitem__(self, key: str, value: Any) -> None:
        frozen = self.frozen
        if frozen is not None and key in frozen and _as_tuple(value) != _as_tuple(frozen[key]):
            raise ValueError(
                f"cannot set {self.optimizer_name}'s {key!r} to {value!r}: torch.optim."
                f"{self.optimizer_name}'s update reads it as a Python number, so the compiled "
                f"MN-Core step was traced with {key}={frozen[key]!r} and cannot change it. "
                "Only 'lr' can change after compile (schedulers may drive it); keep the other "
                "hyperparameters fixed (OneCycleLR/CyclicLR: cycle_momentum=False), or use "
                "accelerator='cpu'."
            )
        super().__setitem__(key, value)


def _as_tuple(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.item()
    return tuple(value) if isinstance(value, list) else value


_STEP_DTYPE = torch.float64


class _TensorScalars(TorchFunctionMode):
    """`x.add_(y, alpha=lr)` with a tensor lr, computed as `x.addcmul_(y, lr)`.

    torch.optim's updates pass the learning rate as `alpha=`/`value=`, a Python scalar
    argument: a tensor there is read back with `.item()`, which a static graph cannot do.
    The rewrites keep it a tensor in the graph and round as torch's kernels do:
    `add(y, alpha=s)` is `addcmul(y, s)`, `addcdiv(a, b, value=s)` is `addcdiv(a * s, b)`
    and `addcmul(a, b, value=s)` is `addcmul(a * s, b)`.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        additive = name in ("add", "add_", "sub", "sub_")
        keyword = "alpha" if additive else "value"
        scale = kwargs.get(keyword)
        if additive and _is_number(scale) and scale != 1 and _floating(args):
            # A number alpha too (L2 weight decay: `grad.add(param, alpha=wd)`): Inductor
            # (torch 2.14, preset O1 and up) miscomputes `mm(a, b).add(w, alpha=c)`, the
            # weight gradient's case; addcmul computes the same bits and is compiled right.
            scale = torch.tensor(scale, dtype=torch.float64)
        if (
            (additive or name in ("addcmul", "addcmul_", "addcdiv", "addcdiv_"))
            and isinstance(scale, Tensor)
            and len(args) >= 2
            and isinstance(args[1], Tensor)
        ):
            kwargs = {k: v for k, v in kwargs.items() if k != keyword}
            this, other, *rest = args
            if additive:
                scale = -scale if name.startswith("sub") else scale
                addcmul = this.addcmul_ if name.endswith("_") else this.addcmul
                return addcmul(other, scale, **kwargs)
            return func(this, other * scale, *rest, **kwargs)
        return func(*args, **kwargs)


def _floating(args: tuple) -> bool:
    return (
        len(args) >= 2
        and isinstance(args[0], Tensor)
        and isinstance(args[1], Tensor)
        and args[0].is_floating_point()
        and args[1].is_floating_point()
    )


def _traceable_adafactor(
    params: list[Tensor],
    grads: list[Tensor],
    row_vars: list[Tensor | None],
    col_vars: list[Tensor | None],
    variances: list[Tensor | None],
    state_steps: list[Tensor],
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    *,
    d: float,
    lr: Tensor | float,
    beta2_decay: float,
    weight_decay: float,
    eps1: float | None,
    eps2: float,
    maximize: bool,
    has_complex: bool,
) -> None:
    """torch.optim's `_single_tensor_adafactor`, with its host reads (`.item()` of the step
    and of two norms, Python min/max on them) computed in float64 tensors instead: the same
    numbers, as the Python doubles torch computes with, but one static graph."""
    if grad_scale is not None or found_inf is not None:
        raise AssertionError("Grad scaling should occur outside of optimizer.step()")
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        step_t, row_var, col_var, variance = state_steps[i], row_vars[i], col_vars[i], variances[i]
        if eps1 is None:
            eps1 = torch.finfo(param.dtype).eps
        step_t += 1
        step = step_t.to(torch.float64)
        one_minus_beta2_t = step**beta2_decay
        rho_t = torch.minimum(torch.as_tensor(lr, dtype=torch.float64), 1 / step**0.5)
        rms = param.norm(2).to(torch.float64) / (param.numel() ** 0.5)
        alpha = torch.clamp(rms, min=eps2) * rho_t
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        if grad.dim() > 1:
            row_mean = torch.linalg.vector_norm(grad, dim=-1, keepdim=True).square_()
            row_var.lerp_(row_mean.div_(grad.size(-1)), one_minus_beta2_t.to(row_var.dtype))
            col_mean = torch.linalg.vector_norm(grad, dim=-2, keepdim=True).square_()
            col_var.lerp_(col_mean.div_(grad.size(-2)), one_minus_beta2_t.to(col_var.dtype))
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            variance.lerp_(grad * grad, one_minus_beta2_t.to(variance.dtype))
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        rms_update = update.norm(2).to(torch.float64) / ((update.numel() ** 0.5) * d)
        denom = torch.clamp(rms_update, min=1.0)
        param.addcmul_(update, -alpha / denom)


@contextlib.contextmanager
def _traceable_torch_functions() -> Iterator[None]:
    """While a step is traced: torch's update functions that read tensors on the host are
    replaced by traceable ones computing the same numbers (only Adafactor's, today)."""
    module = torch.optim._adafactor
    original = module._single_tensor_adafactor
    module._single_tensor_adafactor = _traceable_adafactor
    try:
        yield
    finally:
        module._single_tensor_adafactor = original


class MNCoreTracedOptimizer(MNCoreOptimizer):
    """torch.optim's own update, traced: mixed in before a torch.optim class (see module)."""

    _coefficients = staticmethod(_lr_only)
    _group_class = TracedParamGroup

    def _torch_class(self) -> type[torch.optim.Optimizer]:
        for cls in type(self).__mro__:
            if cls in TRACED_TORCH_OPTIMIZERS:
                return cls
        raise TypeError(f"{type(self).__name__} is not based on a traceable torch.optim class")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self.param_groups[-1].optimizer_name = self._torch_class().__name__

    def _init_state(self, param: Tensor, group: Mapping[str, Any]) -> None:
        """Create `param`'s state with torch's own `_init_group`, as its first step would."""
        if not self.state.get(param):
            self.state[param] = self._fresh_state(param, group)

    def _fresh_state(self, param: Tensor, group: Mapping[str, Any]) -> dict[str, Any]:
        """The state torch's `_init_group` gives `param` (not all zeros: Rprop's step sizes
        start at lr, ASGD's eta at lr and mu at 1, Adagrad's sums at their initial value)."""
        kept = self.state.pop(param, None)
        view = {key: dict.__getitem__(group, key) for key in group}
        view["params"] = [param]
        if "capturable" in view:
            view["capturable"] = True  # the state a capturable step expects (step on device)
        lists = len(inspect.signature(self._init_group).parameters) - 1
        grad = param.grad
        if grad is None:
            param.grad = torch.zeros_like(param, memory_format=torch.preserve_format)
        try:
            with torch.no_grad():
                self._init_group(view, *([] for _ in range(lists)))
            return self._import_state(param, self.state.pop(param, {}))
        finally:
            param.grad = grad
            if kept is not None:
                self.state[param] = kept

    def _import_state(self, param: Tensor, loaded: dict[str, Any]) -> dict[str, Any]:
        """The step count in double: the traced update computes its bias corrections (and
        RAdam's rectification) from it in tensors, which torch computes in Python doubles."""
        step = loaded.get("step")
        if isinstance(step, Tensor) and step.dim() == 0 and step.is_floating_point():
            loaded["step"] = step.to(_STEP_DTYPE)
        return loaded

    def _export_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """torch.optim's layout: the step count as torch stores it (float32)."""
        state = dict(state)
        step = state.get("step")
        if isinstance(step, Tensor) and step.dtype == _STEP_DTYPE:
            state["step"] = step.to(torch.get_default_dtype())
        return state

    def _merge_state(self, param: Tensor, group: Mapping[str, Any], kept: dict) -> None:
        """A loaded checkpoint without state for `param` means fresh state: torch's, copied
        into the tensors we had (a device may have registered them)."""
        if self.state.get(param) or not (kept or param.requires_grad):
            super()._merge_state(param, group, kept)
            return
        self.state.pop(param, None)
        fresh = self._fresh_state(param, group)
        with torch.no_grad():
            for key in [k for k in kept if k not in fresh]:
                del kept[key]
            for key, value in fresh.items():
                target = kept.get(key)
                if isinstance(target, Tensor) and isinstance(value, Tensor):
                    target.copy_(value)
                else:
                    kept[key] = value
        self.state[param] = kept

    @contextlib.contextmanager
    def _traceable_groups(self) -> Iterator[None]:
        """While torch's step runs in a trace: lr is the group's tensor, capture is on."""
        saved = []
        for group in self.param_groups:
            saved.append(
                {k: dict.__getitem__(group, k) for k in ("lr", *_TRACE_OPTIONS) if k in group}
            )
            dict.__setitem__(group, "lr", group.tensors["lr"])
            for key, value in _TRACE_OPTIONS.items():
                if key in group:
                    dict.__setitem__(group, key, value)
            group.frozen = {  # the constructor's hyperparameters, not extra keys (max_lr, ...)
                k: dict.__getitem__(group, k)
                for k in self.defaults
                if k in group and k not in _NOT_FROZEN and _is_number(dict.__getitem__(group, k))
            }
        try:
            yield
        finally:
            for group, values in zip(self.param_groups, saved, strict=True):
                for key, value in values.items():
                    dict.__setitem__(group, key, value)

    @contextlib.contextmanager
    def _eager_groups(self) -> Iterator[None]:
        """On the host: torch's default path, with the user's options minus capture."""
        saved = []
        for group in self.param_groups:
            saved.append(dict.get(group, "capturable"))
            if "capturable" in group:
                dict.__setitem__(group, "capturable", False)  # host tensors: not capturable
        try:
            yield
        finally:
            for group, value in zip(self.param_groups, saved, strict=True):
                if "capturable" in group:
                    dict.__setitem__(group, "capturable", value)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """torch.optim's step: traceable while compiling, torch's default path otherwise."""
        for group in self.param_groups:
            self._params_with_grad(group)  # sparse gradients refused, late state created
        if not torch.compiler.is_compiling():
            with self._eager_groups():
                return super().step(closure)
        with self._traceable_groups(), _traceable_torch_functions(), _TensorScalars():
            return super().step(closure)

    def __setstate__(self, state: dict[str, Any]) -> None:
        frozen = [g.frozen for g in self.__dict__.get("param_groups", ())]
        super().__setstate__(state)
        if "differentiable" not in inspect.signature(self._torch_class()).parameters:
            # torch's Optimizer.__setstate__ adds it to the defaults of every optimizer (and
            # ours copies defaults into the groups): torch's Adafactor groups have no such key
            self.defaults.pop("differentiable", None)
            for group in self.param_groups:
                dict.pop(group, "differentiable", None)
        for group in self.param_groups:
            group.optimizer_name = self._torch_class().__name__
        for group, values in zip(self.param_groups, frozen, strict=False):
            group.frozen = values
            for key in values or ():  # a checkpoint loaded after compile: same fixed values
                if key in group:
                    group[key] = dict.__getitem__(group, key)  # raises if it differs
