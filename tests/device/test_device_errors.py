"""Errors that name what the user must change: control flow, NaN, lazy state, devices."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mncore_device
from mncore_device import (
    MLSDKNotInstalledError,
    MNDevice,
    NonFiniteError,
    StaticGraphError,
    set_buffer_name_in_optimizer,
)
from tests.device.device_testing import (
    CAPTURES,
    classification_batches,
    compile_o0,
    cross_entropy,
    device_train,
    eager_train,
    line_of,
    make_sgd,
    register,
    training_step,
    twin,
)

HERE = Path(__file__).name


@pytest.fixture
def trainable(context):
    model = nn.Linear(4, 2)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    return model, optimizer, classification_batches(3, 8, 4, 2)


# --- value-dependent control flow -----------------------------------------------------------


def test_branch_on_loss_fails_at_compile_time_with_the_line(context, trainable):
    model, optimizer, batches = trainable

    def step(batch):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["t"])
        if loss > 1:
            loss = loss * 0.5
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    with pytest.raises(StaticGraphError) as info:
        compile_o0(context, step, batches[0])
    assert f"{HERE}:{line_of(step, 'if loss > 1')}" in str(info.value)
    assert "torch.where" in str(info.value)


def _item_step(model, optimizer):
    def step(batch):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["t"])
        loss.backward()
        optimizer.step()
        return {"loss": torch.tensor(loss.item())}

    return step


def test_item_in_the_step_fails_at_compile_time_with_the_line(context, trainable):
    """make_fx would bake the traced batch's value into the graph: refused."""
    model, optimizer, batches = trainable
    step = _item_step(model, optimizer)
    with pytest.raises(StaticGraphError) as info:
        compile_o0(context, step, batches[0], capture="trace")
    assert f"{HERE}:{line_of(step, 'loss.item()')}" in str(info.value)


def test_item_in_the_step_is_a_value_of_the_graph_under_dynamo(context, trainable):
    """TorchDynamo keeps `.item()` in the graph: every call returns its own batch's loss."""
    model, optimizer, batches = trainable
    reference = twin(model)
    compiled = compile_o0(context, _item_step(model, optimizer), batches[0])
    losses = device_train(compiled, batches)
    expected = eager_train(
        reference, make_sgd(reference.parameters(), 0.1, 0.9), cross_entropy, batches
    )
    assert losses == expected and len(set(losses)) == len(batches)


HOST_COPIES = {
    "tolist": lambda t: torch.tensor(t.tolist()),
    "numpy": lambda t: torch.from_numpy(t.detach().numpy()),
    "np.asarray": lambda t: torch.from_numpy(np.asarray(t.detach())),
}


@pytest.mark.parametrize("source", list(HOST_COPIES))
def test_host_copies_of_a_traced_tensor_fail_at_compile_time_with_the_line(
    context, trainable, source
):
    """.tolist() and .numpy() read values without going through dispatch: make_fx refuses
    them as .item(), instead of baking the trace-time batch into the graph."""
    model, optimizer, batches = trainable
    read = HOST_COPIES[source]

    with pytest.raises(StaticGraphError, match=source) as info:
        step = training_step(
            model, optimizer, lambda m, b: cross_entropy(m, {**b, "x": read(b["x"])})
        )
        compile_o0(context, step, batches[0], capture="trace")
    assert f"{HERE}:{line_of(HOST_COPIES[source], source)}" in str(info.value)


@pytest.mark.parametrize("source", list(HOST_COPIES))
def test_host_copies_of_a_tensor_under_dynamo_match_eager_or_name_the_line(
    context, trainable, source
):
    """TorchDynamo traces NumPy on tensors into the graph (every call its own batch, as
    eager); `.tolist()` it cannot keep in one graph: refused at the line."""
    model, optimizer, batches = trainable
    reference = twin(model)
    read = HOST_COPIES[source]

    def loss_fn(m, b):
        return cross_entropy(m, {**b, "x": read(b["x"])})

    step = training_step(model, optimizer, loss_fn)
    if source == "tolist":
        with pytest.raises(StaticGraphError) as info:
            compile_o0(context, step, batches[0])
        assert f"{HERE}:{line_of(HOST_COPIES[source], source)}" in str(info.value)
        return
    losses = device_train(compile_o0(context, step, batches[0]), batches)
    expected = eager_train(reference, make_sgd(reference.parameters(), 0.1, 0.9), loss_fn, batches)
    assert losses == expected and len(set(losses)) == len(batches)


HOST_DRAWS = {
    "random.random": lambda: random.random(),
    "numpy.random.beta": lambda: np.random.beta(0.4, 0.4),
    "numpy.random.rand": lambda: np.random.rand(),
}


@pytest.mark.parametrize("source", list(HOST_DRAWS))
def test_python_and_numpy_random_draws_fail_at_compile_time_with_the_line(
    context, trainable, source
):
    """make_fx would draw once, at trace time (a mixup lambda frozen for every step)."""
    model, optimizer, batches = trainable
    draw = HOST_DRAWS[source]

    with pytest.raises(StaticGraphError, match=rf"{source}\(\).*torch.rand") as info:
        step = training_step(
            model, optimizer, lambda m, b: cross_entropy(m, {**b, "x": b["x"] * draw()})
        )
        compile_o0(context, step, batches[0], capture="trace")
    assert f"{HERE}:{line_of(HOST_DRAWS[source], source)}" in str(info.value)
    assert isinstance(random.random(), float)  # the generators are back after the trace
    assert isinstance(np.random.rand(), float)


@pytest.mark.parametrize("source", list(HOST_DRAWS))
def test_python_random_draws_follow_eager_under_dynamo_numpy_draws_name_the_line(
    context, trainable, source
):
    """TorchDynamo draws Python's random numbers on the host before each call of the graph
    (the compile itself draws none: the sequence is eager's); NumPy's draws it cannot keep
    in one graph: refused at the line."""
    model, optimizer, batches = trainable
    reference = twin(model)
    draw = HOST_DRAWS[source]

    def loss_fn(m, b):
        return cross_entropy(m, {**b, "x": b["x"] * draw()})

    step = training_step(model, optimizer, loss_fn)
    if source != "random.random":
        with pytest.raises(StaticGraphError) as info:
            compile_o0(context, step, batches[0])
        assert f"{HERE}:{line_of(HOST_DRAWS[source], source)}" in str(info.value)
        return
    random.seed(0)
    losses = device_train(compile_o0(context, step, batches[0]), batches)
    random.seed(0)
    expected = eager_train(reference, make_sgd(reference.parameters(), 0.1, 0.9), loss_fn, batches)
    assert losses == expected


def test_a_private_torch_generator_fails_at_compile_time_with_the_line(context, trainable):
    """The graph carries the default generator's state; a private one would be read once."""
    model, optimizer, batches = trainable
    generator = torch.Generator().manual_seed(0)

    def noisy(m, b):
        return cross_entropy(m, {**b, "x": b["x"] + torch.randn(b["x"].shape, generator=generator)})

    with pytest.raises(StaticGraphError, match="torch.Generator") as info:
        compile_o0(context, training_step(model, optimizer, noisy), batches[0], capture="trace")
    assert f"{HERE}:{line_of(noisy, 'generator=generator')}" in str(info.value)
    with pytest.raises(StaticGraphError) as info:  # TorchDynamo refuses it too, at the line
        compile_o0(context, training_step(model, optimizer, noisy), batches[0])
    assert f"{HERE}:{line_of(noisy, 'generator=generator')}" in str(info.value)


def test_tensor_valued_where_compiles_and_matches_eager(context, trainable):
    model, optimizer, batches = trainable
    reference = twin(model)

    def halve_large(model, batch):
        loss = F.cross_entropy(model(batch["x"]), batch["t"])
        return torch.where(loss > 0.5, loss * 0.5, loss)

    compiled = compile_o0(context, training_step(model, optimizer, halve_large), batches[0])
    losses = device_train(compiled, batches)
    expected = eager_train(
        reference, make_sgd(reference.parameters(), 0.1, 0.9), halve_large, batches
    )
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)


def test_host_values_outside_the_graph_are_fine(context):
    """Python numbers that are not tensors are simply baked in at trace time."""
    scale = 3
    compiled = compile_o0(
        context, lambda b: {"y": b["x"] * scale if scale > 1 else b["x"]}, {"x": torch.ones(2)}
    )
    torch.testing.assert_close(compiled({"x": torch.ones(2)})["y"], torch.full((2,), 3.0))


def test_a_print_in_the_step_warns_once_that_it_runs_at_trace_time(context, capsys):
    def step(batch):
        print("x", batch["x"].sum())
        print("again")  # one warning per trace
        return {"y": batch["x"] * 2}

    with pytest.warns(UserWarning, match=r"print\(\) in the compiled step at .*runs once") as w:
        compiled = compile_o0(context, step, {"x": torch.ones(2)}, capture="trace")
    assert [str(r.message).count(f"{HERE}:{line_of(step, 'print(')}") for r in w] == [1]
    compiled({"x": torch.ones(2)})
    assert capsys.readouterr().out.count("again") == 1  # printed at trace time only
    print("after the trace")  # print is itself again
    assert capsys.readouterr().out == "after the trace\n"


def test_a_print_in_the_step_is_refused_at_its_line_under_dynamo(context, capsys):
    """TorchDynamo would run a print between two device calls: a compiled function is one."""

    def step(batch):
        print("x", batch["x"].sum())
        return {"y": batch["x"] * 2}

    with pytest.raises(StaticGraphError, match="print") as info:
        compile_o0(context, step, {"x": torch.ones(2)})
    assert f"{HERE}:{line_of(step, 'print(')}" in str(info.value)
    assert capsys.readouterr().out == ""  # nothing ran


# --- the debug preset ---------------------------------------------------------------------


class _LogHead(nn.Module):
    """log(linear(x) - 1000): the log of a negative number, inside a module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        return torch.log(self.linear(x) - 1e3)


def test_debug_preset_names_the_op_and_line_that_made_nan(context):
    model = _LogHead()
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batch = {"x": torch.randn(8, 4)}
    step = training_step(model, optimizer, lambda m, b: m(b["x"]).mean())
    compiled = context.compile(step, batch, options={"option_json": "debug"})
    initial = model.linear.weight.detach().clone()

    with pytest.raises(NonFiniteError) as info:
        compiled(batch)
    message = str(info.value)
    assert "aten.log" in message and "NaN" in message
    assert f"{HERE}:{line_of(_LogHead.forward, 'torch.log(')}" in message
    assert isinstance(info.value, FloatingPointError)

    context.synchronize()  # the failed call left the device state as it was
    assert torch.equal(model.linear.weight, initial)


def _log_step(model, optimizer):
    def step(batch):
        optimizer.zero_grad()
        loss = torch.log(model(batch["x"]) - 1e3).mean()  # log of a negative number
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    return step


def test_debug_preset_names_the_line_of_nan_in_the_step_function(context, trainable):
    model, optimizer, batches = trainable
    step = _log_step(model, optimizer)
    compiled = context.compile(step, batches[0], options={"option_json": "debug"})
    with pytest.raises(NonFiniteError) as info:
        compiled(batches[0])
    assert "aten.log" in str(info.value)
    assert f"{HERE}:{line_of(step, 'torch.log(')}" in str(info.value)


def _nan_in_backward_step(model, optimizer):
    def step(batch):
        optimizer.zero_grad()
        logits = model(batch["x"])
        penalty = (logits.pow(2).sum(-1) * 0.0).sqrt().mean()  # sqrt'(0) * 0: NaN gradients
        loss = logits.mean() + penalty
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    return step


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("anomaly", [False, True])
def test_debug_preset_names_the_forward_line_of_a_backward_op_under_anomaly_mode(
    context, trainable, anomaly, capture
):
    """The live stack of a backward op is the backward call's; anomaly mode during tracing
    records each forward op's line, by which the op of its backward is named (under
    TorchDynamo the live stack of a forward op is the replay's: the line is the one Dynamo
    recorded for its node)."""
    model, optimizer, batches = trainable
    step = _nan_in_backward_step(model, optimizer)
    with torch.autograd.set_detect_anomaly(anomaly, check_nan=False):
        compiled = context.compile(
            step, batches[0], options={"option_json": "debug"}, capture=capture
        )
    with pytest.raises(NonFiniteError) as info:
        compiled(batches[0])
    message = str(info.value)
    assert "aten.mul" in message and "NaN" in message
    forward = f"{HERE}:{line_of(step, '.sqrt()')} in step (its backward)"
    backward_call = f"{HERE}:{line_of(step, 'loss.backward()')} in step:"
    assert (forward if anomaly else backward_call) in message


def test_o0_does_not_check_for_nan(context, trainable):
    model, optimizer, batches = trainable
    compiled = compile_o0(context, _log_step(model, optimizer), batches[0])
    assert torch.isnan(compiled(batches[0])["loss"])


def test_debug_preset_on_a_finite_step_matches_o0(context, trainable):
    model, optimizer, batches = trainable
    reference = twin(model)
    step = training_step(model, optimizer, cross_entropy)
    compiled = context.compile(step, batches[0], options={"option_json": "debug"})
    losses = device_train(compiled, batches)
    expected = eager_train(
        reference, make_sgd(reference.parameters(), 0.1, 0.9), cross_entropy, batches
    )
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)


# --- optimizers with lazily created state ---------------------------------------------------


@pytest.mark.parametrize(
    "make_optimizer",
    [
        pytest.param(lambda params: torch.optim.Adam(params, lr=1e-3), id="Adam"),
        pytest.param(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), id="SGD"),
    ],
)
def test_lazy_optimizer_state_fails_at_compile_time(context, make_optimizer):
    model = nn.Linear(4, 2)
    optimizer = make_optimizer(model.parameters())
    register(context, model)
    set_buffer_name_in_optimizer(optimizer, "optimizer")
    context.register_optimizer_buffers(optimizer)  # nothing to register yet
    batch = classification_batches(1, 8, 4, 2)[0]
    with pytest.raises(StaticGraphError, match="MNCoreAdam") as info:
        compile_o0(context, training_step(model, optimizer, cross_entropy), batch)
    assert type(optimizer).__name__ in str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_failed_compile_leaves_no_optimizer_state(context):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    register(context, model)
    set_buffer_name_in_optimizer(optimizer, "optimizer")
    context.register_optimizer_buffers(optimizer)
    batch = classification_batches(1, 8, 4, 2)[0]
    with pytest.raises(StaticGraphError):
        compile_o0(context, training_step(model, optimizer, cross_entropy), batch)
    assert len(optimizer.state) == 0, "tracing left momentum buffers in the optimizer"


# --- device strings -----------------------------------------------------------------------


@pytest.mark.skipif(mncore_device.mlsdk_available(), reason="MLSDK is installed here")
@pytest.mark.parametrize("spec", ["mncore2:auto", "mncore2:0"])
def test_real_device_without_mlsdk(spec):
    with pytest.raises(MLSDKNotInstalledError) as info:
        MNDevice(spec)
    assert "MLSDK" in str(info.value) and "pfvm:cpu" in str(info.value)
    assert isinstance(info.value, mncore_device.MNCoreError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_pfvm_cuda_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA is not available.*pfvm:cpu"):
        MNDevice("pfvm:cuda")


@pytest.mark.parametrize("spec", ["tpu:0", "pfvm:tpu", "mncore2:x"])
def test_unknown_device_strings(spec):
    with pytest.raises(ValueError, match=spec):
        MNDevice(spec)


def test_pfvm_cpu():
    device = MNDevice("pfvm:cpu")
    assert device.is_emulated and str(device) == "pfvm:cpu"
    assert device.torch_device == torch.device("cpu")


class _MaskedAttention(nn.Module):
    """Scores with a -inf causal mask: softmax turns the masked entries into zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x):
        scores = self.q(x) @ x.transpose(-1, -2)
        mask = torch.full(scores.shape[-2:], float("-inf")).triu(1)
        return (torch.softmax(scores + mask, dim=-1) @ x).sum(-1)


def test_debug_preset_accepts_a_minus_inf_mask_that_softmax_removes(context):
    model = _MaskedAttention()
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batches = [{"x": torch.randn(2, 5, 4)} for _ in range(3)]
    step = training_step(model, optimizer, lambda m, b: m(b["x"]).pow(2).mean())
    compiled = context.compile(step, batches[0], options={"option_json": "debug"})
    losses = device_train(compiled, batches)
    expected = eager_train(
        reference,
        make_sgd(reference.parameters(), 0.1, 0.9),
        lambda m, b: m(b["x"]).pow(2).mean(),
        batches,
    )
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)


def test_debug_preset_names_the_op_whose_inf_reaches_the_outputs(context):
    model = nn.Linear(4, 2)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)

    def step(batch):
        optimizer.zero_grad()
        loss = model(batch["x"]).mean()
        loss.backward()
        optimizer.step()
        return {"loss": loss, "big": torch.exp(batch["x"] * 1e3).sum()}  # inf, returned

    batch = {"x": torch.ones(3, 4)}
    compiled = context.compile(step, batch, options={"option_json": "debug"})
    with pytest.raises(NonFiniteError) as info:
        compiled(batch)
    message = str(info.value)
    assert "aten.exp" in message and "inf" in message
    assert f"{HERE}:{line_of(step, 'torch.exp(')}" in message


def test_debug_preset_skips_views_of_unwritten_allocations_but_checks_views_of_values(
    monkeypatch,
):
    """An empty_like (and a permute of it) may hold NaN: not checked; a permute of a computed
    NaN is still reported at the op that made it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mncore_device.runtime import executors
    from mncore_device.runtime.executors import _FiniteCheckingInterpreter

    def unwritten(x):
        buffer = torch.empty_like(x).permute(1, 0)
        return x.sum() + buffer.zero_().sum()

    def computed(x):
        return torch.log(x - 10).permute(1, 0).sum()

    x = torch.ones(3, 2)
    graph = make_fx(unwritten)(x)
    for node in graph.graph.nodes:  # make the unwritten memory NaN, whatever it held
        if node.target is torch.ops.aten.empty_like.default:
            node.target = torch.ops.aten.full_like.default
            node.args = (node.args[0], float("nan"))
    graph.recompile()
    # ... as an allocation: full_like stands for empty_like here
    monkeypatch.setattr(
        executors, "_UNINITIALIZED", executors._UNINITIALIZED | {torch.ops.aten.full_like.default}
    )
    assert _FiniteCheckingInterpreter(graph).run(x).item() == 6.0
    with pytest.raises(mncore_device.NonFiniteError, match="log"):
        _FiniteCheckingInterpreter(make_fx(computed)(x)).run(x)
