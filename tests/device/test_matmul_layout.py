"""A linear weight stored transposed where its matmuls ran faster so (runtime/matmul_layout):
a layer on the batch (an MLP's first) reads its weight only as `W.t()`; with the weight, its
momentum and its gradient laid out column by column, the forward's matmul reads it
untransposed. Which layout wins is this machine's, timed at compile time; these tests choose
it, and check that every graph computes what eager does in either."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mncore_device import storage
from mncore_device.runtime import matmul_layout, timed_layouts
from tests.device.device_testing import (
    assert_state_close,
    classification_batches,
    cross_entropy,
    device_value,
    make_sgd,
    momentum_of,
    registered_with_twin,
    training_step,
)

ATOL = 1e-5
TRANSPOSED_STRIDES = {(6, 12): (1, 6)}  # the first layer's weight, column by column


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3))


@pytest.fixture
def timing(tmp_path, monkeypatch):
    """timing["faster"]: the layout the next compile's timing finds faster ("transposed" or
    "stored"); timing["cases"]: the matmuls each timing was asked about. Decisions are made
    afresh and kept in this test's folder."""
    chosen = {"faster": "transposed", "cases": []}

    def time_both(cases, device):
        chosen["cases"].append(list(cases))
        return (2.0, 1.0) if chosen["faster"] == "transposed" else (1.0, 2.0)

    monkeypatch.setattr(matmul_layout, "_time_both", time_both)
    monkeypatch.setattr(timed_layouts, "_DECIDED", {})
    monkeypatch.setattr(timed_layouts, "_inductor_cache_dir", lambda: tmp_path / "decisions")
    return chosen


def _assert_trained_as_eager(context, model, reference, optimizer, data, losses, loss_fn):
    reference_optimizer = make_sgd(reference.parameters())
    reference_step = training_step(reference, reference_optimizer, loss_fn)
    expected = [reference_step(batch)["loss"].item() for batch in data]
    context.synchronize()
    torch.testing.assert_close(losses, expected, rtol=0, atol=ATOL)
    assert_state_close(model, reference, atol=ATOL)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(
            momentum_of(optimizer, ours),
            momentum_of(reference_optimizer, theirs),
            atol=ATOL,
            rtol=0,
        )


def test_an_mlps_first_weight_trains_stored_transposed_with_its_momentum(context, timing):
    """The first layer's weight and momentum are held column by column on the device; the
    second layer (whose input needs a gradient, so `g @ W` reads it untransposed) keeps the
    host's layout. What was timed: the forward's read of `W.t()` and the gradient's matmul,
    with their operands as traced."""
    model, reference, optimizer = registered_with_twin(context, mlp())
    data = classification_batches(3, 8, 12, 3)
    compiled = context.compile(
        training_step(model, optimizer, cross_entropy), data[0], options={"option_json": "O1"}
    )
    losses = [compiled(batch)["loss"].item() for batch in data]

    for tensor in (model[0].weight, momentum_of(optimizer, model[0].weight)):
        assert device_value(context, tensor).stride() == (1, 6)
    for tensor in (model[2].weight, momentum_of(optimizer, model[2].weight)):
        assert device_value(context, tensor).is_contiguous()
    (cases,) = timing["cases"]
    reads = [c for c in cases if c.reads_group]
    gradients = [c for c in cases if not c.reads_group]
    assert [(c.a, c.b, c.b_strides) for c in reads] == [((8, 12), (12, 6), (1, 12))]
    assert [(c.a, c.b) for c in gradients] == [((6, 8), (8, 12))]
    _assert_trained_as_eager(context, model, reference, optimizer, data, losses, cross_entropy)
    assert model[0].weight.is_contiguous()  # the host's tensors keep their own layout


def test_the_gradient_is_computed_laid_out_as_its_weight(context, timing, monkeypatch):
    """The matmul computing the first weight's gradient is computed transposed, so the
    update reads the weight, its momentum and its gradient in one order: Inductor's graph
    has a matmul whose result is `(x.t() @ g)`, of the weight's transposed shape."""
    graphs = []
    compile_fx = __import__("torch._inductor.compile_fx", fromlist=["compile_fx"]).compile_fx

    def recording(gm, args, **kwargs):
        from torch._guards import detect_fake_mode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        FakeTensorProp(gm, detect_fake_mode(args)).propagate_dont_convert_inputs(*args)
        graphs.append(gm)
        return compile_fx(gm, args, **kwargs)

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", recording)
    model, _, optimizer = registered_with_twin(context, mlp())
    data = classification_batches(1, 8, 12, 3)
    context.compile(
        training_step(model, optimizer, cross_entropy), data[0], options={"option_json": "O1"}
    )
    gm = graphs[0]  # the step as the executor hands it over (compile_fx calls itself after)
    shapes = [
        tuple(n.meta["val"].shape)
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.mm.default
    ]
    assert (12, 6) in shapes and (6, 12) not in shapes


def test_where_the_stored_layout_was_faster_the_weight_stays_so(context, timing):
    timing["faster"] = "stored"
    model, reference, optimizer = registered_with_twin(context, mlp())
    data = classification_batches(3, 8, 12, 3)
    compiled = context.compile(
        training_step(model, optimizer, cross_entropy), data[0], options={"option_json": "O1"}
    )
    losses = [compiled(batch)["loss"].item() for batch in data]
    assert timing["cases"]
    assert device_value(context, model[0].weight).is_contiguous()
    _assert_trained_as_eager(context, model, reference, optimizer, data, losses, cross_entropy)


def test_a_weight_read_otherwise_too_keeps_the_hosts_layout_untimed(context, timing):
    """A weight the step also reads row by row (a penalty on its first row) is no candidate:
    its layout is not timed, and the step computes what eager does."""

    def penalized(m, batch):
        return cross_entropy(m, batch) + 0.1 * m[0].weight[0].pow(2).sum()

    model, reference, optimizer = registered_with_twin(context, mlp())
    data = classification_batches(3, 8, 12, 3)
    compiled = context.compile(
        training_step(model, optimizer, penalized), data[0], options={"option_json": "O1"}
    )
    losses = [compiled(batch)["loss"].item() for batch in data]
    assert timing["cases"] == []
    assert device_value(context, model[0].weight).is_contiguous()
    _assert_trained_as_eager(context, model, reference, optimizer, data, losses, penalized)


def test_graphs_in_either_layout_share_the_weight_each_as_eager(context, timing):
    """A prediction compiled with the weight as stored, then a training step with it
    transposed: called in turn, each gets the weight laid out as it was compiled for."""
    model, reference, optimizer = registered_with_twin(context, mlp())
    data = classification_batches(3, 8, 12, 3)

    def predict(batch):
        with torch.no_grad():
            return {"y": model(batch["x"])}

    timing["faster"] = "stored"
    prediction = context.compile(predict, {"x": data[0]["x"]}, options={"option_json": "O1"})
    timing["faster"] = "transposed"  # what the training step's matmuls are timed to
    train = context.compile(
        training_step(model, optimizer, cross_entropy), data[0], options={"option_json": "O1"}
    )
    reference_step = training_step(reference, make_sgd(reference.parameters()), cross_entropy)
    for batch in data:
        loss = train(batch)["loss"].item()
        assert device_value(context, model[0].weight).stride() == (1, 6)
        y = prediction({"x": batch["x"]})["y"]
        assert device_value(context, model[0].weight).is_contiguous()
        torch.testing.assert_close(loss, reference_step(batch)["loss"].item(), rtol=0, atol=ATOL)
        with torch.no_grad():
            torch.testing.assert_close(y, reference(batch["x"]), rtol=0, atol=ATOL)
    context.synchronize()
    assert_state_close(model, reference, atol=ATOL)


def test_a_trusted_load_takes_the_weight_as_its_compiled_code_does(
    context, timing, tmp_path, monkeypatch
):
    """The codegen dir lists the state its compiled code takes transposed: a trusted load
    lays it out so without timing anything, and trains on from where the step left off."""
    model, reference, optimizer = registered_with_twin(context, mlp())
    data = classification_batches(4, 8, 12, 3)
    codegen = storage.path(tmp_path / "codegen")
    step = training_step(model, optimizer, cross_entropy)
    compiled = context.compile(step, data[0], codegen, {"option_json": "O1"})
    losses = [compiled(batch)["loss"].item() for batch in data[:2]]
    specs = json.loads((tmp_path / "codegen" / "specs.json").read_text())
    orders = specs["compiled"]["dim_orders"]
    assert sorted(orders.values()) == [[1, 0], [1, 0]]  # the weight and its momentum

    monkeypatch.setattr(matmul_layout, "_time_both", lambda *a: pytest.fail("timed"))
    timed_layouts._DECIDED.clear()
    context.synchronize()
    context.get_registered_value_proxy(model[0].weight).load_from(model[0].weight)
    loaded = context.load_codegen_dir(codegen, trust_compiled_code=True)
    losses += [loaded(batch)["loss"].item() for batch in data[2:]]
    assert device_value(context, model[0].weight).stride() == (1, 6)
    _assert_trained_as_eager(context, model, reference, optimizer, data, losses, cross_entropy)


def test_groups_follow_views_and_elementwise_ops_only(timing):
    """Adam's two moments join their weight through elementwise ops, and are stored as it
    is; a value joined to the weight both ways (`w + w.t()`) keeps the host's layout,
    untimed. The graphs come without values on their nodes, as the executor gets them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def adam_like(w, m, v, x, g):
        grad = g.t() @ x
        m2 = 0.9 * m + 0.1 * grad
        v2 = 0.99 * v + 0.01 * grad * grad
        return (x @ w.t()).sum(), w - 0.1 * m2 / (v2.sqrt() + 1e-8), m2, v2

    args = [torch.randn(6, 12), torch.zeros(6, 12), torch.zeros(6, 12)]
    args += [torch.randn(8, 12), torch.randn(8, 6)]
    found = matmul_layout.transposed_where_faster(_without_values(make_fx(adam_like)(*args)),
                                                   args, 3, [0, 1, 2])  # fmt: skip
    assert found.inputs == (0, 1, 2) and len(found.matmuls) == 1

    def symmetric(w, x):
        return (x @ w.t()).sum(), w + w.t()

    square = [torch.randn(6, 6), torch.randn(8, 6)]
    gm = _without_values(make_fx(symmetric)(*square))
    timing["cases"].clear()
    assert matmul_layout.transposed_where_faster(gm, square, 1, [0]).inputs == ()
    assert timing["cases"] == []


def test_a_functional_linear_on_the_batch_is_a_candidate(timing):
    """`F.linear` on the batch, its gradient taken with `torch.autograd.grad`."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(w, x):
        y = F.linear(x, w)
        (grad,) = torch.autograd.grad(y.square().sum(), [w])
        return y.sum(), w - 0.1 * grad

    args = [torch.randn(6, 12, requires_grad=True), torch.randn(8, 12)]
    gm = _without_values(make_fx(step)(*args))
    found = matmul_layout.transposed_where_faster(gm, [a.detach() for a in args], 1, [0])
    assert found.inputs == (0,) and len(found.matmuls) == 1


def _without_values(gm):
    for node in gm.graph.nodes:
        node.meta.clear()
    return gm
