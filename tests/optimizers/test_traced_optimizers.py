"""torch.optim's other optimizers, traced (MNCoreTracedOptimizer): parity with torch.optim
through a compiled device step, eager state, tensor lr, torch's state_dict layout."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mncore_lightning.optimizers import (
    TRACED_TORCH_OPTIMIZERS,
    MNCoreTracedOptimizer,
    from_torch,
)
from mncore_lightning.optimizers._convert import convert_in_place
from tests.device.device_testing import compile_o0, new_context, register
from tests.optimizers.test_optimizers import (
    INPUTS,
    TARGETS,
    assert_same_params,
    make_mlp,
    two_groups,
)

# Options chosen to take each update's less common paths.
CASES = [
    pytest.param(torch.optim.RMSprop, {"lr": 0.01}, id="rmsprop"),
    pytest.param(
        torch.optim.RMSprop,
        {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.01},
        id="rmsprop-centered-momentum",
    ),
    pytest.param(
        torch.optim.Adagrad,
        {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1},
        id="adagrad",
    ),
    pytest.param(torch.optim.Adadelta, {"lr": 1.0, "weight_decay": 0.01}, id="adadelta"),
    pytest.param(torch.optim.Adamax, {"lr": 0.01, "weight_decay": 0.01}, id="adamax"),
    pytest.param(torch.optim.NAdam, {"lr": 0.01, "weight_decay": 0.01}, id="nadam"),
    pytest.param(
        torch.optim.NAdam,
        {"lr": 0.01, "weight_decay": 0.01, "decoupled_weight_decay": True},
        id="nadamw",
    ),
    pytest.param(torch.optim.RAdam, {"lr": 0.01, "weight_decay": 0.01}, id="radam"),
    pytest.param(
        torch.optim.RAdam,
        {"lr": 0.01, "weight_decay": 0.01, "decoupled_weight_decay": True},
        id="radamw",
    ),
    pytest.param(torch.optim.ASGD, {"lr": 0.01, "t0": 10, "weight_decay": 0.01}, id="asgd"),
    pytest.param(torch.optim.Rprop, {"lr": 0.01}, id="rprop"),
    pytest.param(torch.optim.Rprop, {"lr": 0.01, "maximize": True}, id="rprop-maximize"),
    pytest.param(torch.optim.Adafactor, {"lr": 0.01}, id="adafactor"),
    pytest.param(torch.optim.Adafactor, {"lr": 0.01, "weight_decay": 0.01}, id="adafactor-wd"),
]


def loss_of(model: nn.Module, i: int) -> torch.Tensor:
    return nn.functional.mse_loss(model(INPUTS[i]), TARGETS[i])


def eager_step(model, optimizer, i: int) -> float:
    optimizer.zero_grad()
    loss = loss_of(model, i)
    loss.backward()
    optimizer.step()
    return loss.item()


def compiled_step(model, optimizer):
    """The whole step (zero_grad, forward, backward, update) compiled for the emulated device."""
    context = new_context()
    register(context, model, optimizer)

    def step(batch):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    compiled = compile_o0(context, step, {"x": INPUTS[0], "y": TARGETS[0]})
    return context, lambda i: compiled({"x": INPUTS[i], "y": TARGETS[i]})["loss"].item()


@pytest.mark.parametrize("scheduled", [False, True], ids=["constant-lr", "step-lr"])
@pytest.mark.parametrize(("torch_cls", "kwargs"), CASES)
def test_compiled_step_matches_torch_over_100_steps(torch_cls, kwargs, scheduled):
    """Two param groups (their own lr, an extra key); StepLR changes lr on the host every 10
    steps, which the compiled step reads from its tensor without being traced again."""
    model, reference = make_mlp(), make_mlp()
    optimizer = convert_in_place(torch_cls(two_groups(model), **kwargs))
    expected = torch_cls(two_groups(reference), **kwargs)
    schedulers = []
    if scheduled:
        for opt in (optimizer, expected):
            schedulers.append(torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7))
    context, step = compiled_step(model, optimizer)
    for i in range(100):
        loss = step(i)
        expected_loss = eager_step(reference, expected, i)
        assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6), i
        for scheduler in schedulers:
            scheduler.step()
    context.synchronize()
    assert_same_params(model, reference, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(optimizer.param_groups, expected.param_groups, strict=True):
        assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-12)
    ours, theirs = optimizer.state_dict()["state"], expected.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for index in theirs:
        for key, value in theirs[index].items():
            torch.testing.assert_close(ours[index][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("torch_cls", "kwargs"), CASES)
def test_eager_steps_match_torch(torch_cls, kwargs):
    """On the host, outside a trace, the converted optimizer is torch's."""
    model, reference = make_mlp(), make_mlp()
    optimizer = from_torch(torch_cls(model.parameters(), **kwargs))
    expected = torch_cls(reference.parameters(), **kwargs)
    for i in range(20):
        assert eager_step(model, optimizer, i) == eager_step(reference, expected, i)
    assert_same_params(model, reference, rtol=0, atol=0)


# The state that does not start at zero, as torch's first step creates it.
INITIAL_VALUES = {
    "step_size": lambda kwargs: kwargs["lr"],  # Rprop
    "eta": lambda kwargs: kwargs["lr"],  # ASGD
    "mu": lambda kwargs: 1.0,  # ASGD
    "mu_product": lambda kwargs: 1.0,  # NAdam
    "sum": lambda kwargs: kwargs.get("initial_accumulator_value", 0.0),  # Adagrad
}


@pytest.mark.parametrize(("torch_cls", "kwargs"), CASES)
def test_state_exists_before_the_first_step_as_torch_creates_it(torch_cls, kwargs):
    model, reference = make_mlp(), make_mlp()
    optimizer = from_torch(torch_cls(model.parameters(), **kwargs))
    expected = torch_cls(reference.parameters(), **kwargs)
    for param in reference.parameters():
        param.grad = torch.zeros_like(param)
    expected.step()  # torch creates its state lazily, here
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        state, torch_state = optimizer.state[param], expected.state[ref]
        assert state.keys() == torch_state.keys()
        for key, value in state.items():
            assert value.shape == torch_state[key].shape, key
            initial = INITIAL_VALUES.get(key, lambda kwargs: 0.0)(kwargs)
            torch.testing.assert_close(value, torch.full_like(value, initial), msg=key)


@pytest.mark.parametrize(("torch_cls", "kwargs"), CASES)
def test_state_dict_has_torch_layout_and_moves_both_ways(torch_cls, kwargs):
    model, reference = make_mlp(), make_mlp()
    optimizer = from_torch(torch_cls(two_groups(model), **kwargs))
    expected = torch_cls(two_groups(reference), **kwargs)
    for i in range(5):
        eager_step(model, optimizer, i)
        eager_step(reference, expected, i)
    ours, theirs = optimizer.state_dict(), expected.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, state in theirs["state"].items():
        assert ours["state"][index].keys() == state.keys()
        for key, value in state.items():
            assert ours["state"][index][key].dtype == value.dtype
            torch.testing.assert_close(ours["state"][index][key], value, rtol=0, atol=0)

    # torch -> ours: loaded into the tensors we had (a device may have registered them)
    tensors = [t for s in optimizer.state.values() for t in s.values()]
    optimizer.load_state_dict(theirs)
    assert [t for s in optimizer.state.values() for t in s.values()] == tensors
    # ours -> torch, then both continue identically
    fresh = torch_cls(two_groups(reference), **kwargs)
    fresh.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # torch's load aliases
    for i in range(5, 10):
        assert eager_step(model, optimizer, i) == eager_step(reference, fresh, i)
    assert_same_params(model, reference, rtol=0, atol=0)


def test_loading_a_fresh_checkpoint_resets_to_torchs_initial_state():
    """Rprop's step sizes start at lr, not zero: an empty checkpoint restores that."""
    model = make_mlp()
    optimizer = from_torch(torch.optim.Rprop(model.parameters(), lr=0.03))
    for i in range(3):
        eager_step(model, optimizer, i)
    optimizer.load_state_dict(torch.optim.Rprop(make_mlp().parameters(), lr=0.03).state_dict())
    for state in optimizer.state.values():
        torch.testing.assert_close(state["step_size"], torch.full_like(state["prev"], 0.03))
        assert state["step"].item() == 0 and not state["prev"].any()


def test_converted_in_place_keeps_identity_class_name_and_type():
    optimizer = torch.optim.NAdam(make_mlp().parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert convert_in_place(optimizer) is optimizer
    assert type(optimizer).__name__ == "NAdam"
    assert isinstance(optimizer, (torch.optim.NAdam, MNCoreTracedOptimizer))
    scheduler.step()  # the scheduler drives the converted object
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001)
    assert optimizer.param_groups[0].tensors["lr"].item() == pytest.approx(0.001)
    copied = copy.deepcopy(optimizer)
    assert type(copied) is type(optimizer)
    assert copied.param_groups[0].tensors["lr"] is not optimizer.param_groups[0].tensors["lr"]


def test_hyperparameters_read_as_numbers_are_fixed_once_traced():
    model = make_mlp()
    optimizer = convert_in_place(torch.optim.RMSprop(model.parameters(), lr=0.01, alpha=0.9))
    optimizer.param_groups[0]["alpha"] = 0.95  # before compile: any value
    compiled_step(model, optimizer)
    group = optimizer.param_groups[0]
    group["alpha"] = 0.95  # the traced value: fine
    group["lr"] = 0.5  # lr lives in a tensor: may change
    assert group.tensors["lr"].item() == 0.5
    with pytest.raises(ValueError, match=r"'alpha'.*alpha=0.95.*Only 'lr' can change"):
        group["alpha"] = 0.8
    state_dict = optimizer.state_dict()
    state_dict["param_groups"][0]["alpha"] = 0.8
    with pytest.raises(ValueError, match="'alpha'"):
        optimizer.load_state_dict(state_dict)


def test_every_listed_optimizer_is_traced_and_lbfgs_is_refused_with_the_reason():
    names = {cls.__name__ for cls in TRACED_TORCH_OPTIMIZERS}
    assert names == {
        "RMSprop",
        "Adagrad",
        "Adadelta",
        "Adamax",
        "NAdam",
        "RAdam",
        "ASGD",
        "Rprop",
        "Adafactor",
    }
    with pytest.raises(TypeError, match="re-evaluates its closure"):
        from_torch(torch.optim.LBFGS(make_mlp().parameters()))


def test_subclasses_and_differentiable_are_refused():
    class MyRMSprop(torch.optim.RMSprop):
        pass

    with pytest.raises(TypeError, match="exact classes"):
        from_torch(MyRMSprop(make_mlp().parameters()))
    with pytest.raises(ValueError, match="differentiable"):
        from_torch(torch.optim.NAdam(make_mlp().parameters(), differentiable=True))


def test_extra_group_keys_are_not_fixed():
    """Only the constructor's hyperparameters are read by torch's update: a scheduler's or
    user's own keys (initial_lr, max_lr, base_lr) may change after compile."""
    model = make_mlp()
    optimizer = convert_in_place(torch.optim.Adamax(model.parameters(), lr=0.01))
    optimizer.param_groups[0]["base_lr"] = 0.01
    compiled_step(model, optimizer)
    optimizer.param_groups[0]["base_lr"] = 0.02
    optimizer.param_groups[0]["initial_lr"] = 0.02
    assert set(optimizer.param_groups[0].frozen) == {"betas", "eps", "weight_decay"}


def test_l2_weight_decay_compiles_right_under_inductor():
    """torch's `grad.add(param, alpha=weight_decay)` on a weight gradient (an mm) is
    miscomputed by Inductor in torch 2.14 (`mm(a, b).add(w, alpha=c)`); the traced step
    computes it with addcmul, so preset O1 matches torch too."""
    model, reference = make_mlp(), make_mlp()
    kwargs = {"lr": 0.01, "weight_decay": 0.1}
    optimizer = convert_in_place(torch.optim.RMSprop(model.parameters(), **kwargs))
    expected = torch.optim.RMSprop(reference.parameters(), **kwargs)
    context = new_context()
    register(context, model, optimizer)

    def step(batch):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    compiled = context.compile(
        step, {"x": INPUTS[0], "y": TARGETS[0]}, options={"option_json": "O1"}
    )
    for i in range(10):
        loss = compiled({"x": INPUTS[i], "y": TARGETS[i]})["loss"].item()
        assert loss == pytest.approx(eager_step(reference, expected, i), rel=1e-5, abs=1e-6)
    context.synchronize()
    assert_same_params(model, reference, rtol=1e-5, atol=1e-6)
