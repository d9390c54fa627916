"""mncore_device.capture: a Python step under TorchDynamo becomes typed, guarded device graphs.

Each test compares with eager PyTorch on the same inputs (bit-identical at O0 here: the
device graph runs the same aten ops).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from mncore_device import (
    Context,
    StaticGraphError,
    set_buffer_name_in_optimizer,
    set_tensor_name_in_module,
)
from mncore_device.capture import DynamoFrontend, InputKind, traced_call

GLOBAL = {"k": 2.0}


class _Reads(nn.Module):
    """A forward that reads Python values of every kind."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.scales = (1.0, 0.5)
        self.np_scale = np.float64(0.3)
        self.step = 0
        self.lr = 0.1

    def forward(self, x: torch.Tensor, records: list) -> torch.Tensor:
        w = min(1.0, (self.step + 1) / 4)
        out = self.lin(x) * self.scales[1] * float(self.np_scale) * GLOBAL["k"]
        loss = out.pow(2).mean() * w * math.sqrt(self.lr)
        if self.step > 3:
            loss = loss * 2
        records.append(loss.item() * 3)
        return loss


def _context(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Context:
    set_tensor_name_in_module(module, "m")
    context = Context("pfvm:cpu")
    for param in module.parameters():
        context.register_param(param)
    for buffer in module.buffers():
        context.register_buffer(buffer)
    if optimizer is not None:
        set_buffer_name_in_optimizer(optimizer, "opt")
        context.register_optimizer_buffers(optimizer)
    return context


def _frontend(step, context: Context, calls=None, **kwargs) -> DynamoFrontend:
    compiled = []

    def compile_graph(captured):
        function = context.compile(  # a replay of the captured graph: traced, as the
            lambda inputs: captured.run(inputs, calls or {}),  # frameworks' backends do
            captured.sample(),
            options={"option_json": "O0"},
            capture="trace",
        )
        compiled.append((captured, function))
        return function

    frontend = DynamoFrontend(step, compile_graph, is_state=context.is_registered, **kwargs)
    frontend.compiled = compiled
    return frontend


def test_every_python_read_follows_its_value_as_eager_does():
    torch.manual_seed(0)
    module = _Reads()
    context = _context(module)
    reasons = []
    frontend = _frontend(module.forward, context, on_retrace=reasons.append)
    for step in range(7):
        module.step, module.lr = step, 0.1 / (step + 1)
        module.scales = (1.0, 0.5 + (step >= 5))
        module.np_scale = np.float64(0.3 + 0.1 * step)
        GLOBAL["k"] = 2.0 + step
        x = torch.randn(5, 4)
        got, expected = [], []
        loss = frontend(x, got)
        eager = module(x, expected)
        assert loss.dtype == eager.dtype and torch.equal(loss, eager), (
            step,
            frontend.graphs[-1].graph_module.code,
        )
        assert got == expected
    # re-compiles: step and lr become inputs (1), `step > 3` flips (1), the tuple changes
    # (1); the NumPy scalar and the global dict's float are inputs, never re-compiled
    assert len(reasons) == 3, reasons
    assert "scales" in reasons[-1]
    kinds = {i.source: i.kind for i in frontend.graphs[-1].inputs}
    weight = next(s for s in kinds if s.endswith("_modules['lin']._parameters['weight']"))
    assert kinds[weight] is InputKind.STATE
    assert kinds["L['args'][0]"] is InputKind.TENSOR


def test_a_training_step_is_one_device_graph_with_backward_and_update_at_the_marker():
    torch.manual_seed(0)
    eager, captured = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)), None
    captured = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    captured.load_state_dict(eager.state_dict())
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(captured.parameters(), lr=0.1, momentum=0.9)
    for group in opt.param_groups:  # state exists before it is registered
        for p in group["params"]:
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    context = _context(captured, opt)
    update = traced_call("update")
    total = torch.zeros(())  # a tensor the step changes in place, not registered

    def backward_and_step(loss):
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    def step(x, y, total):
        loss = (captured(x) - y).pow(2).mean()
        total += loss.detach()
        return update(loss)

    frontend = _frontend(step, context, {update: backward_and_step})
    expected_total = torch.zeros(())
    for _ in range(4):
        x, y = torch.randn(6, 4), torch.randn(6, 1)
        opt_eager.zero_grad()
        loss = (eager(x) - y).pow(2).mean()
        loss.backward()
        opt_eager.step()
        expected_total += loss.detach()
        assert torch.equal(frontend(x, y, total), loss.detach())
    assert torch.equal(total, expected_total)  # the in-place change reached the caller's
    context.synchronize()
    for a, b in zip(eager.state_dict().values(), captured.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert len(frontend.compiled) == 1


def test_host_code_runs_between_device_calls_and_the_break_names_the_line():
    torch.manual_seed(0)
    module = nn.Linear(4, 2)
    context = _context(module)
    seen = []

    def step(x):
        h = module(x)
        seen.append(h.sum().tolist())  # host code: a value read on the host
        return (h * 2).sum()

    frontend = _frontend(step, context)
    x = torch.randn(3, 4)
    assert torch.equal(frontend(x), (module(x) * 2).sum())
    assert seen == [module(x).sum().tolist()]
    assert frontend.device_calls == 2
    assert "test_capture.py" in frontend.breaks[0].where
    assert "seen.append" in frontend.breaks[0].where, frontend.breaks


def test_fullgraph_makes_a_graph_break_an_error_naming_the_line():
    module = nn.Linear(4, 2)
    context = _context(module)

    def step(x):
        h = module(x)
        print("host code")
        return h.sum()

    frontend = _frontend(step, context, fullgraph=True)
    with pytest.raises(StaticGraphError, match=r"(?s)fullgraph=True.*test_capture.py"):
        frontend(torch.randn(3, 4))


def test_a_value_changing_at_every_call_is_refused_past_max_retraces_naming_the_guard():
    module = nn.Linear(4, 2)
    context = _context(module)
    names = ["a", "b", "c", "d", "e"]

    def step(x, name):
        return module(x).sum() * len(name + "x")  # a string is guarded by its value

    frontend = _frontend(step, context, max_retraces=2)
    with pytest.raises(StaticGraphError, match=r"max_retraces=2.*name"):
        for name in names:
            frontend(torch.randn(3, 4), name * (names.index(name) + 1))


def test_a_number_an_op_needs_as_such_is_fixed_and_checked_at_every_call():
    """dropout's p: a float the step reads, needed as a Python number by the op."""
    module = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.25))
    context = _context(module)
    frontend = _frontend(module, context)
    for p in (0.25, 0.5, 0.0):
        module[1].p = p
        x = torch.randn(3, 4)
        torch.manual_seed(1)
        got = frontend(x)
        torch.manual_seed(1)
        assert torch.equal(got, module(x))


def test_an_int_input_follows_its_value_across_the_frontends_number_tensors():
    """An int the step reads that changes is a graph input, handed to the device function as
    a 0-d tensor made once per value: past the bound of those tensors (1,024 values) and
    back to a value seen before, every call computes what eager does."""

    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.step + self.step // 3

    module = Counted()
    reasons = []
    frontend = _frontend(module.forward, _context(module), on_retrace=reasons.append)
    x = torch.randn(3)
    for value in [*range(1100), 7, 1099, 0]:
        module.step = value
        assert torch.equal(frontend(x), module(x)), value
    assert len(reasons) <= 1, reasons  # at most once, when the int becomes an input
    kinds = [spec.kind for spec in frontend.graphs[-1].inputs]
    assert InputKind.NUMBER in kinds


def test_a_frontends_dynamic_sources_apply_to_its_own_captures_only():
    """`dynamic_sources` (a Lightning step's counters and batch size) make the matching ints
    and batch dimensions graph inputs in that frontend's captures, and in no other capture of
    the process: an MLSDK-style step compiled after it has the static shapes it would have in
    a fresh process (its saved codegen directory loads there)."""
    module = nn.Linear(4, 2)
    context = _context(module)
    first_dim = r".*\['args'\]\[0\].*:0"
    with_sources = _frontend(module, context, dynamic_sources=(first_dim,))
    without = _frontend(module.forward, context)
    x = torch.randn(3, 4)
    assert torch.equal(with_sources(x), module(x))
    assert torch.equal(without(x), module(x))

    def numbers(frontend):  # the graph's int inputs: here, a symbolic batch dimension
        return [i.source for i in frontend.graphs[-1].inputs if i.kind is InputKind.NUMBER]

    assert numbers(with_sources) and not numbers(without)
    assert first_dim not in torch.compiler.config.dynamic_sources

    compiled = context.compile(lambda batch: {"y": module(batch["x"])}, {"x": x})
    assert not [k for k in compiled.functions[0].input_specs if k.startswith("mncore_read")]
    assert torch.equal(compiled({"x": x})["y"], module(x))
