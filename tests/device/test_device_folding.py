"""Constant folding: host reads of tensors computed only from constants and shapes are
evaluated at trace time; reads of values that depend on the batch or on state still raise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mncore_device import StaticGraphError
from mncore_device.runtime.tracing import trace_step
from tests.device.device_testing import (
    assert_state_close,
    classification_batches,
    compile_o0,
    device_train,
    eager_train,
    line_of,
    make_sgd,
    register,
    training_step,
    twin,
)

HERE = Path(__file__).name


def _matches_eager(context, loss_fn, batches, model=None, capture=None):
    """Compile a training step with `loss_fn`, run it over `batches`, compare with eager
    (each from the same random state: a step's draws are eager's)."""
    model = model if model is not None else nn.Linear(4, 2)
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    step = training_step(model, optimizer, loss_fn)
    compiled = compile_o0(context, step, batches[0], capture=capture)
    torch.manual_seed(1)
    losses = device_train(compiled, batches)
    context.synchronize()
    torch.manual_seed(1)
    expected = eager_train(reference, make_sgd(reference.parameters(), 0.1, 0.9), loss_fn, batches)
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-6)
    assert_state_close(model, reference)
    return compiled


def _constant_reads(model, batch):
    out = model(batch["x"])
    if torch.all(torch.tril(torch.ones(4, 4)) >= 0):  # folded: always true
        out = out * 2
    scale = (torch.arange(4.0) * 0.5).sum().item()  # folded: 3.0
    if torch.equal(torch.zeros(2), torch.zeros(2)) and bool(torch.ones(()) > 2):
        scale = -100.0  # never taken
    return F.cross_entropy(out * scale, batch["t"])


def test_reads_of_constant_tensors_are_folded_and_match_eager(context):
    _matches_eager(context, _constant_reads, classification_batches(3, 8, 4, 2), capture="trace")


def test_a_branch_on_a_constant_tensor_is_refused_at_its_line_under_dynamo(context):
    """TorchDynamo does not fold tensor values: the branch is refused, naming its line."""
    with pytest.raises(StaticGraphError) as info:
        _matches_eager(context, _constant_reads, classification_batches(1, 8, 4, 2))
    assert f"{HERE}:{line_of(_constant_reads, 'if torch.all(')}" in str(info.value)


READS = [
    "batch",  # the batch itself
    "mixed",  # a constant combined with the batch
    "in_place",  # a constant tensor overwritten in place with a batch value
    "view",  # a view of a constant tensor whose storage was overwritten with a batch value
    "state",  # a parameter
    "random",  # a random draw: a new value on every call
]


def _value_read(read: str):
    def loss_fn(model, batch):
        x = batch["x"]
        if read == "batch":
            value = x.sum()
        elif read == "mixed":
            value = torch.ones(3) * x.sum()
        elif read == "in_place":
            value = torch.zeros(1)
            value += x.sum()
        elif read == "view":
            base = torch.zeros(2)
            value = base[:1]
            base.copy_(x[0, :2])
        elif read == "state":
            value = model.weight
        else:
            value = torch.rand(())
        scale = value.sum().item()  # the read
        return F.cross_entropy(model(x) * scale, batch["t"])

    return loss_fn


@pytest.mark.parametrize("read", READS)
def test_reads_of_batch_or_state_values_still_raise_at_the_line(context, read):
    """make_fx would fold the traced batch's value: refused."""
    model = nn.Linear(4, 2)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batch = classification_batches(1, 8, 4, 2)[0]
    loss_fn = _value_read(read)
    with pytest.raises(StaticGraphError) as info:
        compile_o0(context, training_step(model, optimizer, loss_fn), batch, capture="trace")
    assert f"{HERE}:{line_of(loss_fn, '# the read')}" in str(info.value)


@pytest.mark.parametrize("read", READS)
def test_reads_of_batch_or_state_values_are_graph_values_under_dynamo(context, read):
    """TorchDynamo keeps such a `.item()` in the graph: each call computes it, as eager."""
    batches = classification_batches(3, 8, 4, 2)
    compiled = _matches_eager(context, _value_read(read), batches)
    assert compiled.retraces == []


def test_boolean_mask_of_batch_values_raises_at_the_line_suggesting_where(context):
    model = nn.Linear(4, 2)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)

    def loss_fn(model, batch):
        out = model(batch["x"])
        return out[out > 0].sum()

    with pytest.raises(StaticGraphError) as info:
        compile_o0(context, training_step(model, optimizer, loss_fn), {"x": torch.randn(8, 4)})
    message = str(info.value)
    assert f"{HERE}:{line_of(loss_fn, 'out[out > 0]')}" in message
    assert "torch.where" in message and "fixed-size selection" in message


def test_boolean_mask_of_constants_is_a_fixed_selection_and_matches_eager(context):
    def loss_fn(model, batch):
        out = model(batch["x"])
        keep = torch.arange(8) % 3 != 0  # constant mask over the batch rows
        return F.cross_entropy(out[keep], batch["t"][keep])

    batches = classification_batches(3, 8, 4, 2)
    _matches_eager(context, loss_fn, batches)
    # the graph selects with constant integer indices: no value-dependent shape left
    model = nn.Linear(4, 2)
    traced = trace_step(lambda b: {"loss": loss_fn(model, b)}, batches[0], {})
    assert "nonzero" not in traced.graph_module.code
    rows = [s.tensor for s in traced.state if s.tensor.dtype == torch.int64]
    assert rows and all(r.tolist() == [1, 2, 4, 5, 7] for r in rows)  # out[keep], t[keep]


def test_is_compiling_is_true_while_the_step_is_traced_only(context):
    seen = []

    def step(batch):
        seen.append(torch.compiler.is_compiling())
        return {"y": batch["x"] * 2}

    compiled = compile_o0(context, step, {"x": torch.ones(2)}, capture="trace")
    assert seen == [True]
    assert not torch.compiler.is_compiling()
    torch.testing.assert_close(compiled({"x": torch.ones(2)})["y"], torch.full((2,), 2.0))


def test_is_compiling_is_true_in_the_step_captured_by_dynamo(context):
    """Libraries take their tracing-safe paths in a captured step too, at every call."""

    def step(batch):
        return {"y": batch["x"] * (2.0 if torch.compiler.is_compiling() else 3.0)}

    compiled = compile_o0(context, step, {"x": torch.ones(2)})
    assert not torch.compiler.is_compiling()
    for _ in range(2):
        torch.testing.assert_close(compiled({"x": torch.ones(2)})["y"], torch.full((2,), 2.0))
    torch.testing.assert_close(step({"x": torch.ones(2)})["y"], torch.full((2,), 3.0))


def test_one_hot_with_num_classes_compiles_and_matches_eager(context):
    def loss_fn(model, batch):
        target = F.one_hot(batch["t"], num_classes=10).float()
        return F.mse_loss(model(batch["x"]).softmax(-1), target)

    batches = classification_batches(3, 8, 4, 10)
    _matches_eager(context, loss_fn, batches, model=nn.Linear(4, 10))


def test_one_hot_still_checks_its_range_when_the_step_runs(context):
    compiled = compile_o0(
        context, lambda b: {"y": F.one_hot(b["t"], num_classes=3)}, {"t": torch.tensor([0, 2])}
    )
    expected = torch.tensor([[0, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(compiled({"t": torch.tensor([1, 0])})["y"], expected)
    with pytest.raises(RuntimeError, match="num_classes"):
        compiled({"t": torch.tensor([1, 3])})


def test_one_hot_without_num_classes_still_raises(context):
    with pytest.raises(StaticGraphError):
        compile_o0(context, lambda b: {"y": F.one_hot(b["t"])}, {"t": torch.tensor([0, 2])})
