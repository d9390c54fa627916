"""The grokking-pytorch MNIST CNN: convolutions, Dropout2d, dropout and the RNG on the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.device.device_testing import (
    GrokkingCNN,
    compile_o0,
    cross_entropy,
    device_train,
    eager_train,
    make_sgd,
    new_context,
    nll,
    register,
    training_step,
    twin,
)


@pytest.fixture
def batch():
    """16 noisy copies of 10 random 28x28 class templates: a small learnable batch."""
    generator = torch.Generator().manual_seed(1)
    templates = torch.randn(10, 1, 28, 28, generator=generator)
    t = torch.arange(16) % 10
    return {"x": templates[t] + 0.5 * torch.randn(16, 1, 28, 28, generator=generator), "t": t}


def compiled_cnn_step(context, batch):
    """A fresh CNN trained by SGD(0.1, momentum 0.5) in `context`."""
    model = GrokkingCNN()
    optimizer = make_sgd(model.parameters(), 0.1, 0.5)
    register(context, model, optimizer)
    return model, compile_o0(context, training_step(model, optimizer, nll), batch)


def test_cnn_with_dropout_trains(context, batch):
    _, compiled = compiled_cnn_step(context, batch)
    losses = device_train(compiled, [batch] * 20)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.2, f"loss did not fall: {first:.3f} -> {last:.3f}"


def test_dropout_draws_new_masks_each_call_and_eval_is_deterministic(context, batch):
    model = GrokkingCNN()
    register(context, model)
    forward = compile_o0(context, lambda b: {"loss": nll(model, b)}, batch)
    assert forward.updated_state_names == []
    first, second = forward(batch)["loss"], forward(batch)["loss"]
    assert not torch.equal(first, second), "the same dropout mask was used twice"

    model.eval()
    evaluate = compile_o0(context, lambda b: {"logp": model(b["x"])}, {"x": batch["x"]})
    model.train()
    first, second = evaluate({"x": batch["x"]})["logp"], evaluate({"x": batch["x"]})["logp"]
    assert torch.equal(first, second)
    torch.testing.assert_close(first, twin(model).eval()(batch["x"]).detach())


def test_training_is_reproducible_under_manual_seed(batch):
    def run():
        torch.manual_seed(1234)
        _, compiled = compiled_cnn_step(new_context(), batch)
        return device_train(compiled, [batch] * 4)

    first, second = run(), run()
    assert first == second


def test_o0_dropout_matches_eager_with_the_same_seed(context, batch):
    """Tracing restores the RNG and O0 runs the same aten ops: the same masks as eager."""
    model, compiled = compiled_cnn_step(context, batch)
    reference = twin(model)
    torch.manual_seed(77)
    losses = device_train(compiled, [batch] * 5)
    context.synchronize()

    torch.manual_seed(77)
    expected = eager_train(reference, make_sgd(reference.parameters(), 0.1, 0.5), nll, [batch] * 5)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_dropout_of_a_transposed_tensor_matches_eager_with_the_same_seed(context):
    """Eager PyTorch fills dropout's mask in the memory order of a non-contiguous input (the
    transposed output of batch_first attention); the compiled step draws the same mask."""
    model = torch.nn.Linear(8, 8)
    optimizer = make_sgd(model.parameters(), 0.1, 0.0)
    register(context, model, optimizer)

    def loss_fn(model, batch):
        hidden = model(batch["x"]).transpose(0, 1)  # (5, 3, 8), strides (8, 40, 1)
        return torch.nn.functional.dropout(hidden, 0.5).pow(2).mean()

    batches = [{"x": torch.randn(3, 5, 8)} for _ in range(3)]
    reference = twin(model)
    compiled = compile_o0(context, training_step(model, optimizer, loss_fn), batches[0])
    torch.manual_seed(5)
    losses = device_train(compiled, batches)
    torch.manual_seed(5)
    expected = eager_train(reference, make_sgd(reference.parameters(), 0.1, 0.0), loss_fn, batches)
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-6)


def test_a_batchnorm_conv_net_trains_bit_identical_to_eager_at_o0(context):
    """BatchNorm traces to the kernels eager runs (_native_batch_norm_legit), not to a math
    decomposition that rounds differently: losses, parameters and running stats are equal."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    reference = copy.deepcopy(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batches = [{"x": torch.randn(4, 3, 8, 8), "t": torch.randint(0, 10, (4,))} for _ in range(5)]
    step = training_step(model, optimizer, cross_entropy)
    losses = device_train(compile_o0(context, step, batches[0]), batches)
    expected = eager_train(
        reference, torch.optim.SGD(reference.parameters(), 0.1, 0.9), cross_entropy, batches
    )
    torch.testing.assert_close(losses, expected, rtol=0, atol=0)
    context.synchronize()
    for (name, mine), theirs in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)
