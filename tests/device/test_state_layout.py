"""Device state laid out as each compiled graph needs it (runtime/executors.StateLayout): a
graph whose convolutions Inductor runs in channels_last takes the convolution weights and
their optimizer state channels_last; another graph sharing them gets them as it was compiled
for. Every function computes what eager does, whatever ran before it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from mncore_device import storage
from mncore_device.runtime import executors
from tests.device.device_testing import (
    assert_state_close,
    cross_entropy,
    device_value,
    make_sgd,
    momentum_of,
    registered_with_twin,
    training_step,
)

ATOL = 1e-5


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 6, 3, padding=1, groups=2, bias=False),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    )


def batches(n: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        {"x": torch.randn(4, 2, 6, 6, generator=generator), "t": torch.randint(0, 3, (4,))}
        for _ in range(n)
    ]


@pytest.fixture
def layout(monkeypatch):
    """layout["channels_last"]: the layout the next O1 compile picks for its convolutions
    (instead of timing them)."""
    chosen = {"channels_last": True}
    monkeypatch.setattr(
        executors, "_channels_last_is_faster", lambda gm, args: chosen["channels_last"]
    )
    return chosen


def test_a_channels_last_graph_trains_its_convolution_state_laid_out_so(context, layout):
    model, reference, optimizer = registered_with_twin(context, conv_net())
    step = training_step(model, optimizer, cross_entropy)
    data = batches(3)
    compiled = context.compile(step, data[0], options={"option_json": "O1"})
    losses = [compiled(batch)["loss"].item() for batch in data]

    for tensor in (model[0].weight, model[3].weight, momentum_of(optimizer, model[3].weight)):
        value = device_value(context, tensor)
        assert value.is_contiguous(memory_format=torch.channels_last)
        assert not value.is_contiguous()
    assert device_value(context, model[7].weight).is_contiguous()  # 2-D: as stored

    reference_optimizer = make_sgd(reference.parameters())
    reference_step = training_step(reference, reference_optimizer, cross_entropy)
    expected = [reference_step(batch)["loss"].item() for batch in data]
    context.synchronize()
    torch.testing.assert_close(losses, expected, rtol=0, atol=ATOL)
    assert_state_close(model, reference, atol=ATOL)
    assert model[3].weight.is_contiguous()  # the host's tensors keep their own layout
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(
            momentum_of(optimizer, ours),
            momentum_of(reference_optimizer, theirs),
            atol=ATOL,
            rtol=0,
        )


def test_graphs_compiled_in_either_layout_share_the_state_each_as_eager(context, layout):
    """An evaluation compiled in the stored layout (as Lightning's sanity check compiles its
    validation step before the first training step), then a training step in channels_last:
    called in turn, each gets the weights laid out as it was compiled for, and both compute
    what eager does."""
    model, reference, optimizer = registered_with_twin(context, conv_net())
    data = batches(3)

    def evaluate(batch):
        with torch.no_grad():
            return {"y": model(batch["x"])}

    model.eval()
    layout["channels_last"] = False
    evaluation = context.compile(evaluate, {"x": data[0]["x"]}, options={"option_json": "O1"})
    model.train()
    layout["channels_last"] = True
    train = context.compile(
        training_step(model, optimizer, cross_entropy), data[0], options={"option_json": "O1"}
    )

    reference_step = training_step(reference, make_sgd(reference.parameters()), cross_entropy)
    for batch in data:
        loss = train(batch)["loss"].item()
        assert not device_value(context, model[0].weight).is_contiguous()
        y = evaluation({"x": batch["x"]})["y"]
        assert device_value(context, model[0].weight).is_contiguous()
        torch.testing.assert_close(loss, reference_step(batch)["loss"].item(), rtol=0, atol=ATOL)
        reference.eval()
        with torch.no_grad():
            torch.testing.assert_close(y, reference(batch["x"]), rtol=0, atol=ATOL)
        reference.train()
    context.synchronize()
    assert_state_close(model, reference, atol=ATOL)


def test_a_trusted_load_lays_the_state_out_as_its_compiled_code_needs(
    context, layout, tmp_path, monkeypatch
):
    """The codegen dir says which state its compiled code takes channels_last: a trusted
    load runs that code directly (without the compile that decided the layout) and lays
    the state out so, continuing the training where the compiled step left it."""
    model, reference, optimizer = registered_with_twin(context, conv_net())
    step = training_step(model, optimizer, cross_entropy)
    data = batches(4)
    codegen = storage.path(tmp_path / "codegen")
    compiled = context.compile(step, data[0], codegen, {"option_json": "O1"})
    losses = [compiled(batch)["loss"].item() for batch in data[:2]]
    specs = json.loads((tmp_path / "codegen" / "specs.json").read_text())
    assert specs["compiled"]["dim_orders"]  # the convolutions' weights and momenta

    entries = []
    load_entry = executors._load_compiled_entry
    monkeypatch.setattr(
        executors, "_load_compiled_entry", lambda *a: entries.append(a) or load_entry(*a)
    )
    layout["channels_last"] = False  # what a new compile would pick: the load must not ask
    context.synchronize()
    for tensor in (model[0].weight, model[3].weight):  # the host's values, as stored
        context.get_registered_value_proxy(tensor).load_from(tensor)
    loaded = context.load_codegen_dir(codegen, trust_compiled_code=True)
    losses += [loaded(batch)["loss"].item() for batch in data[2:]]
    assert entries, "the trusted load ran the compiled entry itself"
    assert not device_value(context, model[0].weight).is_contiguous()

    reference_step = training_step(reference, make_sgd(reference.parameters()), cross_entropy)
    expected = [reference_step(batch)["loss"].item() for batch in data]
    context.synchronize()
    torch.testing.assert_close(losses, expected, rtol=0, atol=ATOL)
    assert_state_close(model, reference, atol=ATOL)


class FlattenNet(nn.Module):
    """A convolution whose output is flattened by a view (legal in the host's layout only),
    and returned too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        features = torch.relu(self.conv(x))
        return self.head(features.view(x.shape[0], -1)), features


def test_a_channels_last_graph_computes_its_views_and_outputs_as_eager(context, layout):
    """The graph was traced with the weights laid out as on the host: a view that their
    channels_last layout would not allow computes the same values, and a feature map the
    step returns comes out contiguous, as on the host."""
    model, reference, optimizer = registered_with_twin(context, FlattenNet())

    def step(batch):
        optimizer.zero_grad()
        logits, features = model(batch["x"])
        loss = nn.functional.cross_entropy(logits, batch["t"])
        loss.backward()
        optimizer.step()
        return {"loss": loss, "features": features}

    data = batches(3)
    compiled = context.compile(step, data[0], options={"option_json": "O1"})
    reference_optimizer = make_sgd(reference.parameters())
    for batch in data:
        out = compiled(batch)
        assert not device_value(context, model.conv.weight).is_contiguous()
        reference_optimizer.zero_grad()
        logits, features = reference(batch["x"])
        loss = nn.functional.cross_entropy(logits, batch["t"])
        loss.backward()
        reference_optimizer.step()
        assert out["features"].is_contiguous()
        torch.testing.assert_close(out["features"], features.detach(), rtol=0, atol=ATOL)
        torch.testing.assert_close(out["loss"], loss.detach(), rtol=0, atol=ATOL)
    context.synchronize()
    assert_state_close(model, reference, atol=ATOL)


def test_a_graph_that_reads_strides_keeps_the_state_as_on_the_host(context, layout):
    """`as_strided` reads a weight's memory through its strides: a graph with one takes the
    weights as the host lays them out, and computes what eager does."""
    model, reference, optimizer = registered_with_twin(context, conv_net())

    def loss_fn(m, batch):
        taps = m[0].weight.as_strided((6, 18), (18, 1))  # the first 18 values of each filter
        return cross_entropy(m, batch) + 0.01 * taps.pow(2).sum()

    data = batches(3)
    compiled = context.compile(
        training_step(model, optimizer, loss_fn), data[0], options={"option_json": "O1"}
    )
    losses = [compiled(batch)["loss"].item() for batch in data]
    assert device_value(context, model[0].weight).is_contiguous()
    reference_step = training_step(reference, make_sgd(reference.parameters()), loss_fn)
    expected = [reference_step(batch)["loss"].item() for batch in data]
    context.synchronize()
    torch.testing.assert_close(losses, expected, rtol=0, atol=ATOL)
    assert_state_close(model, reference, atol=ATOL)
