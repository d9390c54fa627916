"""Shared helpers for the device-layer tests: models, optimizers, eager references.

Everything here goes through the public `mncore_device` API. Tests use the O0 preset (an
interpreter: instant compile) unless they are about Inductor.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from mncore_device import (
    CompiledFunction,
    Context,
    MNDevice,
    set_buffer_name_in_optimizer,
    set_tensor_name_in_module,
)

try:  # being written alongside these tests; tests that need it skip until it exists
    from mncore_lightning.optimizers import MNCoreSGD
except ImportError:  # pragma: no cover - depends on the state of the tree
    MNCoreSGD = None

HAS_MNCORE_SGD = MNCoreSGD is not None
# Context.compile's two ways of making a graph: TorchDynamo (the default) and make_fx
CAPTURES = ("dynamo", "trace")
SGD_KINDS = ["torch"] + (["mncore"] if HAS_MNCORE_SGD else [])

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def new_context() -> Context:
    """A fresh emulated device context, made current."""
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    return context


def make_sgd(
    params, lr: float = 0.1, momentum: float = 0.9, dampening: float = 0.0, kind: str = "torch"
) -> torch.optim.Optimizer:
    """SGD whose device state exists before compile.

    kind="torch": torch.optim.SGD with its momentum buffers created up front (torch creates
    them lazily on the first step, which a static graph cannot do). kind="mncore": MNCoreSGD.
    """
    params = list(params)
    if kind == "mncore":
        return MNCoreSGD(params, lr, momentum, dampening)
    optimizer = torch.optim.SGD(params, lr, momentum, dampening)
    if momentum:
        for p in params:
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


def register(
    context: Context,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    prefix: str = "model",
    optimizer_prefix: str = "optimizer",
) -> None:
    """Name and register a model's parameters and buffers, and the optimizer's state."""
    set_tensor_name_in_module(model, prefix)
    for p in model.parameters():
        context.register_param(p)
    for b in model.buffers():
        context.register_buffer(b)
    if optimizer is not None:
        set_buffer_name_in_optimizer(optimizer, optimizer_prefix)
        context.register_optimizer_buffers(optimizer)


def training_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn
) -> Callable[[Batch], Batch]:
    """The MLSDK-style step: zero_grad, forward, backward and update, returning the loss."""

    def step(batch: Batch) -> Batch:
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    return step


def registered_with_twin(context: Context, model: nn.Module):
    """`model` and its SGD-momentum optimizer (`make_sgd`) registered with `context`, and an
    eager twin of the model: (model, reference, optimizer)."""
    reference = twin(model)
    optimizer = make_sgd(model.parameters())
    register(context, model, optimizer)
    return model, reference, optimizer


def device_value(context: Context, tensor: torch.Tensor) -> torch.Tensor:
    """The device's value of registered `tensor`, as it lies in device memory."""
    return context.get_registered_value_proxy(tensor).cpu()


def momentum_of(optimizer: torch.optim.Optimizer, parameter: torch.Tensor) -> torch.Tensor:
    return optimizer.state[parameter]["momentum_buffer"]


def compile_o0(context: Context, function, sample: Batch, **kwargs) -> CompiledFunction:
    """`context.compile` with the O0 preset (the op-by-op interpreter)."""
    return context.compile(function, sample, options={"option_json": "O0"}, **kwargs)


def eager_train(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, batches: Sequence[Batch]
) -> list[float]:
    """The hand-written eager loop over `batches`; returns the loss of every step."""
    step = training_step(model, optimizer, loss_fn)
    return [step(batch)["loss"].item() for batch in batches]


def device_train(compiled: CompiledFunction, batches: Sequence[Batch]) -> list[float]:
    """Run a compiled step over `batches`; returns the loss of every step."""
    return [compiled(batch)["loss"].item() for batch in batches]


def clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter and buffer of `model`."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_close(model: nn.Module, reference: nn.Module, atol: float = 1e-6) -> None:
    """Every parameter and buffer of `model` equals `reference`'s within `atol`."""
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=atol, rtol=0, msg=key)


def twin(model: nn.Module) -> nn.Module:
    """An independent copy of `model` for the eager reference."""
    return copy.deepcopy(model)


def line_of(function: Callable, text: str) -> int:
    """The line number (in its file) of the first source line of `function` containing `text`."""
    lines, start = inspect.getsourcelines(function)
    for offset, line in enumerate(lines):
        if text in line:
            return start + offset
    raise AssertionError(f"{text!r} not found in the source of {function.__name__}")


# --- models and data ---------------------------------------------------------------------


def mnist_mlp() -> nn.Module:
    """The MLSDK tutorial MLP: 1024-256-10."""
    return nn.Sequential(nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))


class Wrapped(nn.Module):
    """A Linear layer under the attribute `linear`: tensors are named `<prefix>@linear/...`."""

    def __init__(self, in_features: int = 4, out_features: int = 2) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class GrokkingCNN(nn.Module):
    """The MNIST CNN of grokking-pytorch: two convolutions, Dropout2d, two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def cross_entropy(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["t"])


def nll(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.nll_loss(model(batch["x"]), batch["t"])


def classification_batches(
    n: int, batch: int, features: int, classes: int, seed: int = 0, scale: float = 1.0
) -> list[Batch]:
    """`n` fixed batches whose label is a fixed linear function of the input (learnable)."""
    generator = torch.Generator().manual_seed(seed)
    rule = torch.randn(features, classes, generator=generator)
    batches = []
    for _ in range(n):
        x = torch.randn(batch, features, generator=generator) * scale
        batches.append({"x": x, "t": (x @ rule).argmax(dim=1)})
    return batches


def recording_small_map_rewrites(monkeypatch) -> list[tuple[str, object]]:
    """The (rewrite, convolution op) of each convolution the matmul rewrites replace from
    now on, with both floors of the dense rewrite lowered: test models' matrices and
    batches are far below where it pays."""
    from mncore_device.runtime import convolution_rewrites

    rewritten = []
    for name in ("_pointwise_as_matmul", "_small_map_as_matmul"):
        real = getattr(convolution_rewrites, name)

        def recording(graph, node, *args, real=real, name=name):
            rewritten.append((name, node.target))
            return real(graph, node, *args)

        monkeypatch.setattr(convolution_rewrites, name, recording)
    monkeypatch.setattr(convolution_rewrites, "SMALL_MAP_MIN_ELEMENTS", 0)
    monkeypatch.setattr(convolution_rewrites, "SMALL_MAP_MIN_BATCH", 1)
    return rewritten
