"""Training through compiled steps matches a hand-written eager PyTorch loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.device.device_testing import (
    SGD_KINDS,
    assert_state_close,
    classification_batches,
    compile_o0,
    cross_entropy,
    device_train,
    eager_train,
    make_sgd,
    mnist_mlp,
    register,
    training_step,
    twin,
)


def relu_sum(model, batch):
    return F.relu(model(batch["x"])).sum()


@pytest.mark.parametrize("kind", SGD_KINDS)
def test_linear_with_unit_weights_matches_eager_sgd(context, kind):
    """Linear(10, 1) filled with ones, SGD(0.1, 0.9, 0.0), 10 steps of relu(model(x)).sum()."""
    model = nn.Linear(10, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9, 0.0, kind=kind)
    register(context, model, optimizer)
    batches = [{"x": torch.randn(8, 10)} for _ in range(10)]
    compiled = compile_o0(context, training_step(model, optimizer, relu_sum), batches[0])

    losses = device_train(compiled, batches)
    assert torch.equal(model.bias, torch.ones(1)), "host changed before synchronize()"
    assert torch.equal(model.weight, torch.ones(1, 10))
    context.synchronize()

    expected = eager_train(
        reference, torch.optim.SGD(reference.parameters(), 0.1, 0.9, 0.0), relu_sum, batches
    )
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)
    assert_state_close(model, reference, atol=1e-6)
    assert not torch.equal(model.bias, torch.ones(1)), "the model did not train"


def test_mnist_tutorial_mlp_learns(context):
    """The tutorial's 1024-256-10 MLP at batch 64 learns a synthetic rule within 30 steps."""
    model = mnist_mlp()
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9, 0.0)
    register(context, model, optimizer)
    batches = classification_batches(10, 64, 1024, 10)
    compiled = compile_o0(context, training_step(model, optimizer, cross_entropy), batches[0])

    losses = device_train(compiled, batches * 3)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.25 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"

    expected = eager_train(
        reference, make_sgd(reference.parameters(), 0.1, 0.9, 0.0), cross_entropy, batches * 3
    )
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-5)


def test_two_models_in_one_context_train_independently(context):
    """Two prefixes, two optimizers, two compiled steps, interleaved calls."""
    small = nn.Linear(6, 3)
    deep = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    small_ref, deep_ref = twin(small), twin(deep)
    small_opt = make_sgd(small.parameters(), 0.1, 0.9)
    deep_opt = make_sgd(deep.parameters(), 0.05, 0.5)
    register(context, small, small_opt, prefix="small", optimizer_prefix="small_opt")
    register(context, deep, deep_opt, prefix="deep", optimizer_prefix="deep_opt")
    batches = classification_batches(5, 4, 6, 3)
    small_step = compile_o0(context, training_step(small, small_opt, cross_entropy), batches[0])
    deep_step = compile_o0(context, training_step(deep, deep_opt, cross_entropy), batches[0])

    assert all(n.startswith(("deep@", "deep_opt@")) for n in deep_step.state_names)
    assert all(n.startswith(("small@", "small_opt@")) for n in small_step.state_names)
    assert len(deep_step.state_names) == 8 and len(small_step.state_names) == 4

    small_losses, deep_losses = [], []
    for batch in batches:
        small_losses.append(small_step(batch)["loss"].item())
        deep_losses.append(deep_step(batch)["loss"].item())
    context.synchronize()

    small_expected = eager_train(
        small_ref, make_sgd(small_ref.parameters(), 0.1, 0.9), cross_entropy, batches
    )
    deep_expected = eager_train(
        deep_ref, make_sgd(deep_ref.parameters(), 0.05, 0.5), cross_entropy, batches
    )
    torch.testing.assert_close(small_losses, small_expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(deep_losses, deep_expected, rtol=1e-6, atol=1e-6)
    assert_state_close(small, small_ref)
    assert_state_close(deep, deep_ref)


def bn_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def test_batchnorm_running_stats_update_at_synchronize(context):
    model = bn_mlp()
    reference = twin(model)
    bn = model[1]
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batches = classification_batches(4, 16, 8, 3)
    compiled = compile_o0(context, training_step(model, optimizer, cross_entropy), batches[0])
    losses = device_train(compiled, batches)
    assert torch.equal(bn.running_mean, torch.zeros(16))
    assert torch.equal(bn.running_var, torch.ones(16))
    assert bn.num_batches_tracked.item() == 0
    context.synchronize()

    expected = eager_train(
        reference, make_sgd(reference.parameters(), 0.1, 0.9), cross_entropy, batches
    )
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)
    assert bn.num_batches_tracked.item() == 4
    assert not torch.equal(bn.running_mean, torch.zeros(16))
    assert_state_close(model, reference, atol=1e-6)  # running stats included


def test_eval_step_uses_running_stats(context):
    """A second, eval-mode function on the same device state uses the trained running stats."""
    model = bn_mlp()
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batches = classification_batches(3, 16, 8, 3)
    train = compile_o0(context, training_step(model, optimizer, cross_entropy), batches[0])
    model.eval()
    evaluate = compile_o0(context, lambda b: {"logits": model(b["x"])}, {"x": batches[0]["x"]})
    model.train()
    assert evaluate.updated_state_names == []

    device_train(train, batches)
    logits = evaluate({"x": batches[0]["x"]})["logits"]
    context.synchronize()
    model.eval()
    torch.testing.assert_close(logits, model(batches[0]["x"]).detach())


def test_batchnorm_running_stats_are_reported_as_updated_state(context):
    model = bn_mlp()
    register(context, model)
    batch = classification_batches(1, 16, 8, 3)[0]
    compiled = compile_o0(context, lambda b: {"loss": cross_entropy(model, b)}, batch)
    assert "model@1/num_batches_tracked" in compiled.updated_state_names
    assert {"model@1/running_mean", "model@1/running_var"} <= set(compiled.updated_state_names)
