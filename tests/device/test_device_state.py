"""Device memory: registration, host/device transfers, captured tensors, tracing side effects."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mncore_device import (
    RegistrationError,
    set_buffer_name_in_optimizer,
    set_tensor_name,
    set_tensor_name_in_module,
)
from tests.device.device_testing import (
    CAPTURES,
    HAS_MNCORE_SGD,
    MNCoreSGD,
    Wrapped,
    assert_state_close,
    classification_batches,
    clone_state,
    compile_o0,
    cross_entropy,
    device_train,
    eager_train,
    make_sgd,
    register,
    training_step,
    twin,
)

needs_mncore_sgd = pytest.mark.skipif(
    not HAS_MNCORE_SGD, reason="mncore_lightning.optimizers.MNCoreSGD is not importable yet"
)


# --- host and device copies ---------------------------------------------------------------


def _momentum_buffers(optimizer):
    return [s["momentum_buffer"] for s in optimizer.state.values()]


def test_host_change_reaches_the_device_only_through_load_from(context):
    model = nn.Linear(3, 1)
    register(context, model)
    x = torch.randn(4, 3)
    compiled = compile_o0(context, lambda b: {"y": model(b["x"])}, {"x": x})
    before = compiled({"x": x})["y"]

    with torch.no_grad():
        model.weight.mul_(-2.0)  # in place on the host: the device copy is unaffected
    torch.testing.assert_close(compiled({"x": x})["y"], before, rtol=0, atol=0)

    context.get_registered_value_proxy(model.weight).load_from(model.weight)
    torch.testing.assert_close(compiled({"x": x})["y"], model(x).detach())
    assert not torch.allclose(model(x), before)


def test_synchronize_writes_device_state_back(context):
    model = nn.Linear(3, 2)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    initial = clone_state(model)
    batches = classification_batches(3, 4, 3, 2)
    compiled = compile_o0(context, training_step(model, optimizer, cross_entropy), batches[0])
    device_train(compiled, batches)

    for key, value in model.state_dict().items():
        assert torch.equal(value, initial[key]), f"{key} changed before synchronize()"
    assert all(torch.equal(b, torch.zeros_like(b)) for b in _momentum_buffers(optimizer))

    context.synchronize([model.weight])  # only the tensors asked for
    assert not torch.equal(model.weight, initial["weight"])
    assert torch.equal(model.bias, initial["bias"])

    context.synchronize()
    assert not torch.equal(model.bias, initial["bias"])
    assert all(not torch.equal(b, torch.zeros_like(b)) for b in _momentum_buffers(optimizer))


def test_load_from_host_pushes_a_loaded_checkpoint(context):
    model = nn.Linear(3, 2)
    register(context, model)
    x = torch.randn(4, 3)
    compiled = compile_o0(context, lambda b: {"y": model(b["x"])}, {"x": x})
    checkpoint = nn.Linear(3, 2).state_dict()
    model.load_state_dict(checkpoint)  # copies in place into the registered tensors
    context.load_from_host()
    torch.testing.assert_close(compiled({"x": x})["y"], model(x).detach())


def test_registering_an_unnamed_tensor_fails(context):
    with pytest.raises(RegistrationError, match="no name"):
        context.register_param(nn.Parameter(torch.zeros(3)))


def test_registering_two_tensors_under_one_name_fails(context):
    a, b = torch.zeros(2), torch.zeros(2)
    set_tensor_name(a, "same")
    set_tensor_name(b, "same")
    context.register_buffer(a)
    context.register_buffer(a)  # the same tensor again is fine
    with pytest.raises(RegistrationError, match="already registered"):
        context.register_buffer(b)


def test_proxy_of_an_unregistered_tensor_fails(context):
    with pytest.raises(RegistrationError, match="not registered"):
        context.get_registered_value_proxy(torch.zeros(2))


# --- unregistered state ------------------------------------------------------------------


@pytest.mark.parametrize("capture", CAPTURES)
def test_unregistered_parameter_warns_trains_on_device_and_is_never_synced(context, capture):
    """Register everything except the bias: it trains on the device, but never reaches the host
    (TorchDynamo once passed it as a host input of every call, which nothing trained)."""
    model = Wrapped(4, 2)
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    set_tensor_name_in_module(model, "model")
    context.register_param(model.linear.weight)  # not the bias
    set_buffer_name_in_optimizer(optimizer, "optimizer")
    context.register_optimizer_buffers(optimizer)
    batches = classification_batches(4, 8, 4, 2)

    with pytest.warns(
        UserWarning, match=r"1 tensor is updated .* never registered: 'model@linear/bias'"
    ):
        compiled = compile_o0(
            context, training_step(model, optimizer, cross_entropy), batches[0], capture=capture
        )
    assert "model@linear/bias" not in context.registered_names
    assert model.linear.bias.grad is None  # compile left no gradient on the host

    losses = device_train(compiled, batches)
    expected = eager_train(
        reference, make_sgd(reference.parameters(), 0.1, 0.9), cross_entropy, batches
    )
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)  # the bias did train

    bias = model.linear.bias.detach().clone()
    context.synchronize()
    assert torch.equal(model.linear.bias, bias), "an unregistered tensor was written back"
    torch.testing.assert_close(model.linear.weight, reference.linear.weight, rtol=0, atol=1e-6)
    assert not torch.equal(reference.linear.bias, bias)


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_tensor_registered_after_compile_is_trained_and_synchronized(context, capture):
    """Registered after the compile that captured it (before the first call): the compiled
    step trains the registered copy, and synchronize() writes the trained value back."""
    model = Wrapped(4, 2)
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    set_tensor_name_in_module(model, "model")
    set_buffer_name_in_optimizer(optimizer, "optimizer")
    batches = classification_batches(4, 8, 4, 2)
    with pytest.warns(UserWarning, match="never registered"):
        compiled = compile_o0(
            context, training_step(model, optimizer, cross_entropy), batches[0], capture=capture
        )
    register(context, model, optimizer)

    losses = device_train(compiled, batches)
    reference_optimizer = make_sgd(reference.parameters(), 0.1, 0.9)
    expected = eager_train(reference, reference_optimizer, cross_entropy, batches)
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-6)
    context.synchronize()  # never the untrained registered copy over the host tensor
    assert_state_close(model, reference)
    for ours, theirs in zip(
        _momentum_buffers(optimizer), _momentum_buffers(reference_optimizer), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("capture", CAPTURES)
def test_batchnorm_running_stats_registered_after_compile_are_device_state(context, capture):
    """BatchNorm's running stats, registered after the compile that captured them (before the
    first call, which MLSDK allows), are device state: every call updates the device copy,
    the host's stays as it was until synchronize() brings back eager's values. (TorchDynamo
    once updated the host copy at each call instead, which synchronize() then overwrote
    with the untrained device copy; make_fx's compile wrote the host copy.)"""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    set_tensor_name_in_module(model, "model")
    for p in model.parameters():
        context.register_param(p)
    set_buffer_name_in_optimizer(optimizer, "optimizer")
    context.register_optimizer_buffers(optimizer)
    batches = classification_batches(4, 8, 4, 2)
    step = training_step(model, optimizer, cross_entropy)
    with pytest.warns(UserWarning, match="3 tensors are updated .* never registered"):
        compiled = compile_o0(context, step, batches[0], capture=capture)
    for buffer in model.buffers():
        context.register_buffer(buffer)
    initial = clone_state(reference)

    losses = device_train(compiled, batches)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, initial[name]), f"{name} changed on the host"
    context.synchronize()
    expected = eager_train(
        reference, make_sgd(reference.parameters(), 0.1, 0.9), cross_entropy, batches
    )
    assert losses == expected  # O0: bit for bit
    trained = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, trained[name]), name
        assert not torch.equal(buffer, initial[name]), name


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_captured_constant_registered_after_compile_reads_the_registered_copy(context, capture):
    """A tensor the step only reads, registered after compile, is read from device memory:
    a load_from on its registered copy reaches the step, a host edit does not."""
    scale = torch.tensor(2.0)
    set_tensor_name(scale, "scale")
    x = torch.randn(3)
    compiled = compile_o0(context, lambda b: {"y": b["x"] * scale}, {"x": x}, capture=capture)
    context.register_buffer(scale)
    context.get_registered_value_proxy(scale).load_from(torch.tensor(5.0))
    torch.testing.assert_close(compiled({"x": x})["y"], 5 * x)
    scale.fill_(-3.0)  # the host copy of a registered tensor: not re-uploaded
    torch.testing.assert_close(compiled({"x": x})["y"], 5 * x)


@pytest.mark.parametrize("capture", CAPTURES)
def test_registering_a_tensor_a_compiled_step_already_trained_fails_naming_it(context, capture):
    """After calls that trained an unregistered copy, registering would drop that training."""
    model = Wrapped(4, 2)
    optimizer = make_sgd(model.parameters(), 0.1, 0.0)
    set_tensor_name_in_module(model, "model")
    context.register_param(model.linear.weight)
    batches = classification_batches(2, 8, 4, 2)
    with pytest.warns(UserWarning, match="never registered"):
        compiled = compile_o0(
            context, training_step(model, optimizer, cross_entropy), batches[0], capture=capture
        )
    device_train(compiled, batches)
    bias = model.linear.bias.detach().clone()
    with pytest.raises(RegistrationError, match=r"'model@linear/bias'.*2 call.*before compile"):
        context.register_param(model.linear.bias)
    context.synchronize()
    assert torch.equal(model.linear.bias, bias)


@pytest.mark.parametrize("capture", CAPTURES)
def test_unregistered_buffers_get_one_warning_listing_them(context, capture):
    """A model whose BatchNorm buffers were not registered (timm's resnet50: 159 of them)
    gets one warning with the count, the first names and the fix, not one per buffer."""
    model = nn.Sequential(*[nn.BatchNorm1d(4) for _ in range(8)])
    set_tensor_name_in_module(model, "model")
    for p in model.parameters():
        context.register_param(p)  # the buffers are not registered
    x = torch.randn(6, 4)
    with pytest.warns(UserWarning) as caught:
        compiled = compile_o0(context, lambda b: {"y": model(b["x"])}, {"x": x}, capture=capture)
    messages = [str(w.message) for w in caught if "never registered" in str(w.message)]
    assert len(messages) == 1, messages
    (message,) = messages
    assert message.startswith("24 tensors are updated by the compiled step but never registered")
    assert "'model@0/running_mean', 'model@0/running_var'" in message
    assert "(19 more)" in message and "context.register_buffer(b)" in message
    reference = twin(model)
    torch.testing.assert_close(compiled({"x": x})["y"], reference(x), rtol=0, atol=0)


# --- captured read-only tensors -----------------------------------------------------------


@pytest.mark.parametrize("capture", CAPTURES)
def test_in_place_change_of_a_captured_tensor_reaches_the_step(context, capture):
    """A closed-over host tensor is a device constant, re-uploaded when changed in place."""
    scale = torch.tensor(2.0)
    x = torch.randn(3)
    compiled = compile_o0(context, lambda b: {"y": b["x"] * scale}, {"x": x}, capture=capture)
    torch.testing.assert_close(compiled({"x": x})["y"], 2 * x)
    scale.fill_(-3.0)
    torch.testing.assert_close(compiled({"x": x})["y"], -3 * x)


@needs_mncore_sgd
def test_host_lr_change_reaches_the_compiled_step(context):
    model = nn.Linear(4, 2)
    optimizer = MNCoreSGD(model.parameters(), 0.1, 0.9, 0.0)
    register(context, model, optimizer)
    batch = classification_batches(1, 8, 4, 2)[0]
    compiled = compile_o0(context, training_step(model, optimizer, cross_entropy), batch)
    weight = context.get_registered_value_proxy(model.weight)

    compiled(batch)
    trained = weight.cpu().clone()
    assert not torch.equal(trained, model.weight.detach())

    optimizer.param_groups[0]["lr"] = 0.0  # no recompile
    compiled(batch)
    compiled(batch)
    assert torch.equal(weight.cpu(), trained), "lr=0 set on the host did not reach the device"


@needs_mncore_sgd
def test_step_lr_scheduler_reaches_the_compiled_step(context):
    model = nn.Linear(4, 2)
    reference = twin(model)
    optimizer = MNCoreSGD(model.parameters(), 0.1, 0.9, 0.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    register(context, model, optimizer)
    batches = classification_batches(6, 8, 4, 2)
    compiled = compile_o0(context, training_step(model, optimizer, cross_entropy), batches[0])
    for batch in batches:
        compiled(batch)
        scheduler.step()
    context.synchronize()

    ref_optimizer = torch.optim.SGD(reference.parameters(), 0.1, 0.9, 0.0)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_optimizer, step_size=2, gamma=0.1)
    step = training_step(reference, ref_optimizer, cross_entropy)
    for batch in batches:
        step(batch)
        ref_scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    assert_state_close(model, reference, atol=1e-6)


# --- tracing leaves no trace ----------------------------------------------------------------


class _Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.net(x))


@pytest.mark.parametrize("registered", ["all", "parameters_but_one"])
@pytest.mark.parametrize("capture", CAPTURES)
def test_compile_leaves_host_state_and_rng_untouched(context, capture, registered):
    """Compiling runs the step once to trace it: no host tensor may keep what that run did,
    registered or not (an unregistered BatchNorm's running stats, whose kernel's schema does
    not say it writes them; an unregistered parameter's gradient; a counter the step adds
    to, which TorchDynamo's dry run once wrote back)."""
    model = _Noisy()
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    if registered == "all":
        register(context, model, optimizer)
    else:  # the BatchNorm buffers and the head's bias are not registered
        set_tensor_name_in_module(model, "model")
        for name, p in model.named_parameters():
            if name != "head.bias":
                context.register_param(p)
        set_buffer_name_in_optimizer(optimizer, "optimizer")
        context.register_optimizer_buffers(optimizer)
    calls = torch.zeros(())  # unregistered host tensor that the step updates in place

    def step(batch):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["t"])
        loss.backward()
        optimizer.step()
        calls.add_(1)
        return {"loss": loss}

    batch = classification_batches(1, 8, 6, 3)[0]
    state = clone_state(model)
    momentum = [b.clone() for b in _momentum_buffers(optimizer)]
    rng = torch.get_rng_state()

    with pytest.warns(UserWarning, match="never registered") as caught:
        compile_o0(context, step, batch, capture=capture)
    if registered != "all":
        (message,) = [str(w.message) for w in caught if "never registered" in str(w.message)]
        assert "'model@head/bias'" in message and "'model@net/1/running_mean'" in message

    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    for before, after in zip(momentum, _momentum_buffers(optimizer), strict=True):
        assert torch.equal(before, after)
    assert all(p.grad is None for p in model.parameters())
    assert calls.item() == 0


def test_value_proxy_cpu_is_a_snapshot(context):
    bn = nn.BatchNorm1d(3)
    register(context, bn)
    compiled = compile_o0(context, lambda b: {"y": bn(b["x"])}, {"x": torch.randn(4, 3)})
    snapshot = context.get_registered_value_proxy(bn.running_mean).cpu()
    compiled({"x": torch.randn(4, 3) + 5})
    assert torch.equal(snapshot, torch.zeros(3)), "an earlier .cpu() copy changed"


def test_synchronize_of_an_unregistered_tensor_names_it(context):
    stray = torch.zeros(2)
    set_tensor_name(stray, "stray")
    with pytest.raises(RegistrationError, match="stray"):
        context.synchronize([stray])


# --- outputs never alias device memory ------------------------------------------------------


def _returns_updated_weight(model, optimizer):
    def step(batch):
        optimizer.zero_grad()
        loss = cross_entropy(model, batch)
        loss.backward()
        optimizer.step()
        return {"loss": loss, "weight": model.weight, "weight_t": model.weight.t()}

    return step


def _returns_weight_unchanged(model, optimizer):
    del optimizer
    return lambda batch: {"weight": model.weight, "bias": model.bias[:2], "y": model(batch["x"])}


@pytest.mark.parametrize("preset", ["O0", "debug", "O1", "O2"])
@pytest.mark.parametrize("make_step", [_returns_updated_weight, _returns_weight_unchanged])
def test_editing_a_returned_tensor_in_place_never_changes_device_state(context, preset, make_step):
    """A step that returns a registered tensor (updated, unchanged, or a view of it): the
    caller's in-place edits of the result stay in the caller's copy."""
    model = nn.Linear(4, 3)
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batches = classification_batches(3, 8, 4, 3)
    compiled = context.compile(
        make_step(model, optimizer), batches[0], options={"option_json": preset}
    )
    for batch in batches:
        for value in compiled(batch).values():
            value.add_(1000.0)  # the caller scribbles on every result
    context.synchronize()

    reference_optimizer = make_sgd(reference.parameters(), 0.1, 0.9)
    step = make_step(reference, reference_optimizer)
    with torch.no_grad() if make_step is _returns_weight_unchanged else contextlib.nullcontext():
        for batch in batches:
            step(batch)
    assert_state_close(model, reference)
    weights = compiled(batches[0])["weight"]
    assert torch.equal(weights, context.get_registered_value_proxy(model.weight).cpu())


# --- Inductor presets update device state in place ------------------------------------------


def test_o1_trains_in_the_device_memory_it_registered(context):
    """At O1 a step writes the new weights and momentum into the device tensors themselves
    (no new buffers per step), trains as eager does, leaves the host and earlier `.cpu()`
    snapshots alone until synchronize, and keeps working after `load_from` swaps in a new
    device value (a checkpoint pushed mid-run)."""
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    initial = clone_state(model)
    batches = classification_batches(4, 8, 6, 3)
    step = training_step(model, optimizer, cross_entropy)
    compiled = context.compile(step, batches[0], options={"option_json": "O1"})
    memory = [v.data_ptr() for v in context.device_values()]
    snapshot = context.get_registered_value_proxy(model[0].weight).cpu()

    losses = device_train(compiled, batches[:2])
    assert [v.data_ptr() for v in context.device_values()] == memory
    assert torch.equal(snapshot, initial["0.weight"])
    assert all(torch.equal(v, initial[k]) for k, v in model.state_dict().items())

    reference_optimizer = make_sgd(reference.parameters(), 0.1, 0.9)
    expected = eager_train(reference, reference_optimizer, cross_entropy, batches[:2])
    with torch.no_grad():  # a checkpoint edit on both sides, pushed to the device
        model[2].bias.fill_(0.5)
        reference[2].bias.fill_(0.5)
    context.get_registered_value_proxy(model[2].bias).load_from(model[2].bias)
    losses += device_train(compiled, batches[2:])
    expected += eager_train(reference, reference_optimizer, cross_entropy, batches[2:])
    context.synchronize()
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-5)
    assert_state_close(model, reference, atol=1e-5)


class _TwoBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.arange(3.0))
        self.register_buffer("b", torch.arange(3.0) + 10)


@pytest.mark.parametrize("preset", ["O0", "O1"])
def test_state_whose_new_value_is_another_states_old_value(context, preset):
    """Two buffers swapped each step (one's new value is the other's old one): updating them
    in place must not let one update overwrite a value the other still needs."""
    module = _TwoBuffers()
    reference = twin(module)
    register(context, module)

    def swap(m):
        def step(batch):
            old_a = m.a.clone()
            m.a.copy_(m.b)
            m.b.copy_(old_a + batch["x"])
            return {"a": m.a * 1, "old_a": old_a}

        return step

    sample = {"x": torch.ones(3)}
    compiled = context.compile(swap(module), sample, options={"option_json": preset})
    eager = swap(reference)
    for _ in range(3):
        got, want = compiled(sample), eager(sample)
        assert all(torch.equal(got[k], want[k]) for k in want)
    context.synchronize()
    assert torch.equal(module.a, reference.a) and torch.equal(module.b, reference.b)


@pytest.mark.parametrize("alpha, apart", [(None, True), (1.0, True), (0.5, False)])
def test_o1_keeps_a_weight_gradient_matmul_apart_from_its_momentum_add(alpha, apart):
    """torch.optim.SGD adds the gradient to the momentum with `alpha=1 - dampening` (1.0):
    that add must still be kept out of Inductor's addmm fusion (which would copy the momentum
    term into a new weight-sized buffer each step); a scaled add is another op, left alone."""
    from torch._higher_order_ops.flex_gemm import _PRESERVE_FLEX_GEMM_GEMM_OP as preserve
    from torch.fx.experimental.proxy_tensor import make_fx

    from mncore_device.runtime.executors import _matmuls_apart_from_full_size_adds

    kwargs = {} if alpha is None else {"alpha": alpha}

    def update(momentum, grad_out, x):
        return momentum.mul(0.9).add(grad_out.t() @ x, **kwargs)

    gm = make_fx(update, tracing_mode="fake")(
        torch.ones(8, 16), torch.ones(4, 8), torch.ones(4, 16)
    )
    _matmuls_apart_from_full_size_adds()(gm.graph)
    (matmul,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert matmul.meta.get(preserve, False) is apart


@pytest.mark.parametrize("cpp_wrapper_max_ops", [1000, 0], ids=["cpp_wrapper", "python_wrapper"])
def test_o1_trains_as_eager_with_either_inductor_wrapper(context, tmp_path, cpp_wrapper_max_ops):
    """O1 gives a graph of up to `cpp_wrapper_max_ops` operations the C++ wrapper and a
    larger one the Python wrapper: both train a torch.optim.SGD momentum step as eager does."""
    import json

    from mncore_device import preset_path

    preset = json.loads(preset_path("O1").read_text())
    preset["cpp_wrapper_max_ops"] = cpp_wrapper_max_ops
    (tmp_path / "O1.json").write_text(json.dumps(preset))
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batches = classification_batches(4, 8, 6, 3)
    step = training_step(model, optimizer, cross_entropy)
    compiled = context.compile(step, batches[0], options={"option_json": tmp_path / "O1.json"})
    losses = device_train(compiled, batches)
    expected = eager_train(
        reference, make_sgd(reference.parameters(), 0.1, 0.9), cross_entropy, batches
    )
    context.synchronize()
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-5)
    assert_state_close(model, reference, atol=1e-5)
