"""MN-Core optimizers: parity with torch.optim, traceability, hyperparameter tensors, I/O."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from mncore_lightning.optimizers import (
    TORCH_EQUIVALENTS,
    MNCoreAdam,
    MNCoreAdamW,
    MNCoreSGD,
    ParamGroup,
    from_torch,
)

_generator = torch.Generator().manual_seed(1234)
INPUTS = torch.randn(100, 16, 8, generator=_generator)
TARGETS = torch.randn(100, 16, 4, generator=_generator)


def make_mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def two_groups(model: nn.Sequential) -> list[dict]:
    """Two param groups, the second with its own lr and an extra key."""
    return [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), "lr": 0.02, "name": "head"},
    ]


def train(model, optimizer, steps: int, start: int = 0, scheduler=None) -> None:
    for i in range(start, start + steps):
        optimizer.zero_grad()
        inputs = INPUTS[i].to(next(model.parameters()).dtype)
        loss = nn.functional.mse_loss(model(inputs), TARGETS[i].to(inputs.dtype))
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def assert_same_params(model, reference, rtol: float = 1e-5, atol: float = 1e-8) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def state_tensors(optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state.values() for t in s.values()]


# --- numerics ---------------------------------------------------------------------------

NUMERIC_CASES = [
    pytest.param(torch.optim.SGD, MNCoreSGD, {"lr": 0.05}, id="sgd"),
    pytest.param(torch.optim.SGD, MNCoreSGD, {"lr": 0.05, "momentum": 0.9}, id="sgd-momentum"),
    pytest.param(
        torch.optim.SGD,
        MNCoreSGD,
        {"lr": 0.05, "momentum": 0.9, "dampening": 0.3},
        id="sgd-momentum-dampening",
    ),
    pytest.param(
        torch.optim.SGD, MNCoreSGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}, id="nesterov"
    ),
    pytest.param(
        torch.optim.SGD,
        MNCoreSGD,
        {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.01},
        id="sgd-weight-decay",
    ),
    pytest.param(torch.optim.SGD, MNCoreSGD, {"lr": 0.05, "maximize": True}, id="sgd-maximize"),
    pytest.param(torch.optim.Adam, MNCoreAdam, {"lr": 0.01}, id="adam"),
    pytest.param(
        torch.optim.Adam, MNCoreAdam, {"lr": 0.01, "weight_decay": 0.1}, id="adam-weight-decay"
    ),
    pytest.param(torch.optim.Adam, MNCoreAdam, {"lr": 0.01, "amsgrad": True}, id="adam-amsgrad"),
    pytest.param(torch.optim.AdamW, MNCoreAdamW, {"lr": 0.01}, id="adamw"),
]


@pytest.mark.parametrize(("torch_cls", "mncore_cls", "kwargs"), NUMERIC_CASES)
def test_matches_torch_over_100_steps(torch_cls, mncore_cls, kwargs):
    reference, model = make_mlp(), make_mlp()
    train(reference, torch_cls(reference.parameters(), **kwargs), 100)
    train(model, mncore_cls(model.parameters(), **kwargs), 100)
    assert_same_params(model, reference)


@pytest.mark.parametrize(
    ("torch_cls", "mncore_cls", "kwargs"),
    [
        (torch.optim.SGD, MNCoreSGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.1}),
        (torch.optim.AdamW, MNCoreAdamW, {"lr": 0.01, "amsgrad": True}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_param_dtypes(torch_cls, mncore_cls, kwargs, dtype):
    reference, model = make_mlp(dtype), make_mlp(dtype)
    train(reference, torch_cls(reference.parameters(), **kwargs), 20)
    optimizer = mncore_cls(model.parameters(), **kwargs)
    train(model, optimizer, 20)
    assert all(p.dtype == dtype for p in model.parameters())
    assert all(t.dtype in (dtype, torch.float32) for t in state_tensors(optimizer))
    if dtype == torch.float64:
        assert_same_params(model, reference, rtol=1e-12, atol=0)
    else:  # torch's scalar arithmetic rounds differently in bfloat16: a unit in the last place
        assert_same_params(model, reference, rtol=2e-2, atol=4e-3)


# --- construction -----------------------------------------------------------------------


def test_positional_arguments_follow_torch():
    params = list(make_mlp().parameters())
    sgd = MNCoreSGD(params, 0.1, 0.9, 0.2, 0.01)
    assert (sgd.defaults["lr"], sgd.defaults["momentum"], sgd.defaults["dampening"]) == (
        0.1,
        0.9,
        0.2,
    )
    assert sgd.defaults["weight_decay"] == 0.01
    adam = MNCoreAdam(params, 0.1, (0.8, 0.9), 1e-6, 0.1, True)
    assert adam.defaults["betas"] == (0.8, 0.9)
    assert (adam.defaults["eps"], adam.defaults["weight_decay"], adam.defaults["amsgrad"]) == (
        1e-6,
        0.1,
        True,
    )
    adamw = MNCoreAdamW(params)
    assert adamw.defaults["weight_decay"] == 1e-2 and adamw.defaults["decoupled_weight_decay"]


@pytest.mark.parametrize(
    ("torch_cls", "mncore_cls"), [(t, m) for t, m in TORCH_EQUIVALENTS.items()]
)
def test_defaults_have_torch_keys(torch_cls, mncore_cls):
    params = list(make_mlp().parameters())
    assert mncore_cls(params).defaults == torch_cls(params).defaults


def test_mlsdk_aliases():
    params = list(make_mlp().parameters())
    assert MNCoreSGD(params, learning_rate=0.3).defaults["lr"] == 0.3
    assert MNCoreAdam(params, learning_rate=0.3).param_groups[0]["lr"] == 0.3
    assert MNCoreAdam(params, beta1=0.5).defaults["betas"] == (0.5, 0.999)
    assert MNCoreAdamW(params, beta1=0.5, beta2=0.6).defaults["betas"] == (0.5, 0.6)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: MNCoreSGD(p, lr=0.1, learning_rate=0.2),
        lambda p: MNCoreSGD(p, 1e-3, learning_rate=0.2),  # explicit, even equal to the default
        lambda p: MNCoreAdam(p, lr=0.1, learning_rate=0.2),
        lambda p: MNCoreAdam(p, betas=(0.9, 0.999), beta1=0.5),
        lambda p: MNCoreAdamW(p, betas=(0.8, 0.9), beta2=0.5),
    ],
)
def test_both_names_for_one_argument_is_a_type_error(make):
    with pytest.raises(TypeError, match="alias"):
        make(list(make_mlp().parameters()))


@pytest.mark.parametrize(
    "make",
    [
        lambda p: MNCoreSGD(p, lr=-0.1),
        lambda p: MNCoreSGD(p, learning_rate=-0.1),
        lambda p: MNCoreSGD(p, momentum=-0.1),
        lambda p: MNCoreSGD(p, weight_decay=-1),
        lambda p: MNCoreSGD(p, momentum=0, nesterov=True),
        lambda p: MNCoreSGD(p, momentum=0.9, dampening=0.1, nesterov=True),
        lambda p: MNCoreAdam(p, lr=-1),
        lambda p: MNCoreAdam(p, eps=-1),
        lambda p: MNCoreAdam(p, betas=(1.0, 0.9)),
        lambda p: MNCoreAdam(p, beta2=1.5),
        lambda p: MNCoreAdam(p, weight_decay=-0.1),
        lambda p: MNCoreAdamW(p, lr=-1),
    ],
)
def test_invalid_hyperparameters_are_value_errors(make):
    with pytest.raises(ValueError):
        make(list(make_mlp().parameters()))


def test_state_exists_before_the_first_step():
    model = make_mlp()
    params = list(model.parameters())
    sgd = MNCoreSGD(params, momentum=0.9)
    for p in params:
        assert set(sgd.state[p]) == {"momentum_buffer", "step"}
        assert not sgd.state[p]["momentum_buffer"].any()
    assert len(MNCoreSGD(params).state) == 0  # no momentum: no state, as torch
    adam = MNCoreAdam(params, amsgrad=True)
    for p in params:
        assert set(adam.state[p]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        step = adam.state[p]["step"]
        assert step.dim() == 0 and step.dtype == torch.float32 and step.item() == 0
        assert adam.state[p]["exp_avg"].shape == p.shape


# --- hyperparameter tensors ---------------------------------------------------------------


@pytest.mark.parametrize("cls", [MNCoreSGD, MNCoreAdam, MNCoreAdamW])
def test_setting_lr_refills_the_lr_tensor_in_place(cls):
    optimizer = cls(make_mlp().parameters(), lr=0.1)
    group = optimizer.param_groups[0]
    lr = group.tensors["lr"]
    version = lr._version
    group["lr"] = 0.5
    assert group.tensors["lr"] is lr and lr._version > version and lr.item() == 0.5
    assert type(group["lr"]) is float and dict(group.items())["lr"] == 0.5
    assert optimizer.state_dict()["param_groups"][0]["lr"] == 0.5
    group["lr"] = torch.tensor(0.25)  # a tensor value is stored as a float
    assert type(group["lr"]) is float and lr.item() == 0.25


def test_unchanged_hyperparameters_are_not_refilled():
    group = MNCoreAdam(make_mlp().parameters(), lr=0.1, weight_decay=0.1).param_groups[0]
    versions = {name: t._version for name, t in group.tensors.items()}
    group["lr"] = 0.2
    changed = {name for name, t in group.tensors.items() if t._version != versions[name]}
    assert changed == {"lr", "decay"}  # decay = 1 - lr * weight_decay


def test_step_lr_scheduler_updates_the_lr_tensor():
    optimizer = MNCoreSGD(make_mlp().parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    lr = optimizer.param_groups[0].tensors["lr"]
    version = lr._version
    optimizer.step()
    scheduler.step()
    assert lr._version > version and lr.item() == pytest.approx(0.05)
    assert type(optimizer.param_groups[0]["lr"]) is float
    assert optimizer.param_groups[0]["initial_lr"] == 0.1


SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1 / (1 + i)),
    "one-cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=30),
}


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize(
    ("torch_cls", "mncore_cls", "kwargs"),
    [
        (torch.optim.SGD, MNCoreSGD, {"lr": 0.05, "momentum": 0.9}),
        (torch.optim.Adam, MNCoreAdam, {"lr": 0.01}),
    ],
)
def test_schedulers_drive_the_tensors(scheduler, torch_cls, mncore_cls, kwargs):
    reference, model = make_mlp(), make_mlp()
    torch_optimizer = torch_cls(two_groups(reference), **kwargs)
    optimizer = mncore_cls(two_groups(model), **kwargs)
    train(reference, torch_optimizer, 20, scheduler=SCHEDULERS[scheduler](torch_optimizer))
    train(model, optimizer, 20, scheduler=SCHEDULERS[scheduler](optimizer))
    assert_same_params(model, reference)
    for group in optimizer.param_groups:
        assert group.tensors["lr"].item() == group["lr"]
        if "betas" in group:  # OneCycleLR cycles beta1
            assert group.tensors["beta1"].item() == group["betas"][0]
        else:  # and SGD's momentum
            assert group.tensors["momentum"].item() == group["momentum"]


def test_add_param_group():
    reference, model = make_mlp(), make_mlp()
    torch_optimizer = torch.optim.Adam(reference[0].parameters(), lr=0.01)
    optimizer = MNCoreAdam(model[0].parameters(), lr=0.01)
    torch_optimizer.add_param_group({"params": reference[2].parameters(), "lr": 0.03})
    optimizer.add_param_group({"params": model[2].parameters(), "lr": 0.03})
    group = optimizer.param_groups[1]
    assert isinstance(group, ParamGroup) and group.tensors["lr"].item() == 0.03
    assert all(set(optimizer.state[p]) >= {"exp_avg", "step"} for p in group["params"])
    train(reference, torch_optimizer, 10)
    train(model, optimizer, 10)
    assert_same_params(model, reference)


def test_deepcopy_and_pickle():
    model = make_mlp()
    optimizer = MNCoreAdam(two_groups(model), lr=0.01, amsgrad=True)
    train(model, optimizer, 3)
    for clone in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))):
        group = clone.param_groups[1]
        assert isinstance(group, ParamGroup) and group["name"] == "head"
        assert group.tensors["lr"] is not optimizer.param_groups[1].tensors["lr"]
        assert all(p in clone.state for p in group["params"])  # params still key the state
        assert_state_dicts_equal(clone.state_dict(), optimizer.state_dict())
        group["lr"] = 0.5
        assert group.tensors["lr"].item() == 0.5
        assert optimizer.param_groups[1].tensors["lr"].item() == 0.02


# --- state_dict -----------------------------------------------------------------------------


def assert_state_dicts_equal(actual: dict, expected: dict) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert actual["state"][index].keys() == state.keys(), index
        for key, value in state.items():
            torch.testing.assert_close(actual["state"][index][key], value, rtol=0, atol=0)


@pytest.mark.parametrize("steps", [0, 3])
@pytest.mark.parametrize(
    ("torch_cls", "mncore_cls", "kwargs"),
    [
        (torch.optim.SGD, MNCoreSGD, {"lr": 0.05}),
        (torch.optim.SGD, MNCoreSGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.5}),
        (torch.optim.Adam, MNCoreAdam, {"lr": 0.01, "amsgrad": True}),
        (torch.optim.AdamW, MNCoreAdamW, {"lr": 0.01}),
    ],
)
def test_state_dict_has_torch_layout(torch_cls, mncore_cls, kwargs, steps):
    reference, model = make_mlp(), make_mlp()
    torch_optimizer = torch_cls(two_groups(reference), **kwargs)
    optimizer = mncore_cls(two_groups(model), **kwargs)
    train(reference, torch_optimizer, steps)
    train(model, optimizer, steps)
    expected = torch_optimizer.state_dict()
    if steps == 0 and torch_cls is not torch.optim.SGD:
        # torch.optim.Adam creates its state lazily; ours is the state it would create.
        fresh = {"step": torch.tensor(0.0)}
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if kwargs.get("amsgrad") else ())
        expected["state"] = {
            i: {**fresh, **{k: torch.zeros_like(p) for k in keys}}
            for i, p in enumerate(reference.parameters())
        }
    assert_state_dicts_equal(optimizer.state_dict(), expected)


@pytest.mark.parametrize("steps", [0, 3])
@pytest.mark.parametrize("to_torch", [True, False], ids=["mncore-to-torch", "torch-to-mncore"])
@pytest.mark.parametrize(
    ("torch_cls", "mncore_cls", "kwargs"),
    [
        (torch.optim.SGD, MNCoreSGD, {"momentum": 0.9, "dampening": 0.5, "weight_decay": 0.01}),
        (torch.optim.SGD, MNCoreSGD, {"momentum": 0.9, "nesterov": True}),
        (torch.optim.Adam, MNCoreAdam, {"amsgrad": True, "weight_decay": 0.01}),
        (torch.optim.AdamW, MNCoreAdamW, {}),
    ],
)
def test_checkpoints_move_between_torch_and_mncore(torch_cls, mncore_cls, kwargs, to_torch, steps):
    source_cls, target_cls = (mncore_cls, torch_cls) if to_torch else (torch_cls, mncore_cls)
    source_model = make_mlp()
    source = source_cls(two_groups(source_model), lr=0.01, **kwargs)
    train(source_model, source, steps)
    target_model = make_mlp()
    target_model.load_state_dict(source_model.state_dict())
    target = target_cls(two_groups(target_model), lr=1.0, **kwargs)  # lr comes from the load
    target.load_state_dict(copy.deepcopy(source.state_dict()))
    train(source_model, source, 5, start=steps)
    train(target_model, target, 5, start=steps)
    assert_same_params(target_model, source_model, rtol=0, atol=0)


def test_load_state_dict_copies_into_the_existing_tensors():
    model = make_mlp()
    optimizer = MNCoreAdam(two_groups(model), lr=0.01)
    train(model, optimizer, 2)
    tensors = {(id(p), k): t for p, s in optimizer.state.items() for k, t in s.items()}
    lr = optimizer.param_groups[1].tensors["lr"]
    reference = make_mlp()
    torch_optimizer = torch.optim.Adam(two_groups(reference), lr=0.03)
    train(reference, torch_optimizer, 4)
    loaded = torch_optimizer.state_dict()
    optimizer.load_state_dict(loaded)
    for p, state in optimizer.state.items():
        for key, tensor in state.items():
            assert tensor is tensors[id(p), key]
    assert_state_dicts_equal(optimizer.state_dict(), loaded)
    group = optimizer.param_groups[1]
    assert isinstance(group, ParamGroup) and group.tensors["lr"] is lr
    assert lr.item() == 0.02 and group["name"] == "head"
    group["lr"] = 0.5
    assert lr.item() == 0.5


def test_loading_a_fresh_torch_sgd_state_resets_to_eager_zeros():
    model = make_mlp()
    optimizer = MNCoreSGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.5)
    train(model, optimizer, 3)
    buffers = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    reference = make_mlp()
    reference.load_state_dict(model.state_dict())
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, dampening=0.5)
    optimizer.load_state_dict(torch_optimizer.state_dict())  # never stepped: no buffers
    for p, buffer in zip(model.parameters(), buffers, strict=True):
        assert optimizer.state[p]["momentum_buffer"] is buffer and not buffer.any()
        assert optimizer.state[p]["step"].item() == 0
    train(model, optimizer, 5, start=3)
    train(reference, torch_optimizer, 5, start=3)
    assert_same_params(model, reference, rtol=0, atol=0)
    # An explicit None buffer (older torch checkpoints) means the same.
    state_dict = torch_optimizer.state_dict()
    state_dict["state"] = {i: {"momentum_buffer": None} for i in state_dict["state"]}
    optimizer.load_state_dict(state_dict)
    assert all(not b.any() for b in buffers)


# --- from_torch -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("torch_cls", "mncore_cls", "kwargs"),
    [
        (torch.optim.SGD, MNCoreSGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.2}),
        (torch.optim.Adam, MNCoreAdam, {"lr": 0.01, "amsgrad": True, "foreach": True}),
        (torch.optim.Adam, MNCoreAdam, {"lr": 0.01, "decoupled_weight_decay": True}),
        (torch.optim.AdamW, MNCoreAdamW, {"lr": 0.01, "weight_decay": 0.1}),
    ],
)
def test_from_torch(torch_cls, mncore_cls, kwargs):
    model = make_mlp()
    torch_optimizer = torch_cls(two_groups(model), **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(torch_optimizer, step_size=2, gamma=0.5)
    train(model, torch_optimizer, 3, scheduler=scheduler)  # state, "initial_lr", lr halved
    reference = copy.deepcopy(model)  # to go on with torch, from the same point
    reference_optimizer = torch_cls(two_groups(reference), **kwargs)
    reference_optimizer.load_state_dict(copy.deepcopy(torch_optimizer.state_dict()))

    optimizer = from_torch(torch_optimizer)
    assert type(optimizer) is mncore_cls
    for group, torch_group in zip(
        optimizer.param_groups, torch_optimizer.param_groups, strict=True
    ):
        assert isinstance(group, ParamGroup)
        assert group.keys() == torch_group.keys()
        assert group["params"] == torch_group["params"]
        assert group["foreach"] is None  # a kernel choice: dropped
        for key in ("lr", "initial_lr", "weight_decay", "betas", "momentum", "dampening"):
            assert group.get(key) == torch_group.get(key)
        assert group.tensors["lr"].item() == torch_group["lr"]
    assert optimizer.param_groups[1]["name"] == "head"
    for p in model.parameters():  # a copy of the state, not a share
        for key, value in torch_optimizer.state[p].items():
            assert optimizer.state[p][key] is not value
            torch.testing.assert_close(optimizer.state[p][key], value, rtol=0, atol=0)

    train(model, optimizer, 5, start=3)
    train(reference, reference_optimizer, 5, start=3)
    assert_same_params(model, reference, rtol=0, atol=0)


def test_from_torch_returns_mncore_optimizers_as_they_are():
    optimizer = MNCoreSGD(make_mlp().parameters())
    assert from_torch(optimizer) is optimizer


def test_from_torch_refuses_other_optimizers():
    with pytest.raises(TypeError, match=r"SGD.*Adam.*AdamW"):
        from_torch(torch.optim.LBFGS(make_mlp().parameters()))


def test_from_torch_refuses_differentiable():
    with pytest.raises(ValueError, match="differentiable"):
        from_torch(torch.optim.SGD(make_mlp().parameters(), differentiable=True))


# --- tracing ----------------------------------------------------------------------------------


TRACE_CASES = [
    pytest.param(
        lambda p: MNCoreSGD(p, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01), id="sgd"
    ),
    pytest.param(lambda p: MNCoreSGD(p, lr=0.1, momentum=0.9, nesterov=True), id="nesterov"),
    pytest.param(lambda p: MNCoreAdam(p, lr=0.1, amsgrad=True, weight_decay=0.01), id="adam"),
    pytest.param(lambda p: MNCoreAdamW(p, lr=0.1, maximize=True), id="adamw"),
]


@pytest.mark.parametrize("make_optimizer", TRACE_CASES)
def test_step_traces_into_a_replayable_static_graph(make_optimizer):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = make_optimizer(model.parameters())
    tensors = list(model.parameters()) + state_tensors(optimizer)
    inputs = torch.randn(8, 4)

    def train_step(x: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss

    def snapshot() -> list[torch.Tensor]:
        return [t.detach().clone() for t in tensors]

    def restore(values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for tensor, value in zip(tensors, values, strict=True):
                tensor.copy_(value)
        optimizer.zero_grad()

    initial = snapshot()
    graph = make_fx(lambda state, x: train_step(x))(tensors, inputs)
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert not any("_local_scalar_dense" in t or "is_nonzero" in t for t in targets)
    constants = [getattr(graph, n.target) for n in graph.graph.nodes if n.op == "get_attr"]
    assert any(c is optimizer.param_groups[0].tensors["lr"] for c in constants)
    traced_step = snapshot()  # real-mode tracing ran one step

    restore(initial)
    train_step(inputs)
    eager_one = snapshot()
    train_step(inputs)
    eager_two = snapshot()
    for traced, eager in zip(traced_step, eager_one, strict=True):
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)

    # The graph replays the step (its inputs are the very tensors the optimizer holds) ...
    restore(initial)
    with torch.no_grad():
        graph(tensors, inputs)
        for replayed, eager in zip(snapshot(), eager_one, strict=True):
            torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
        graph(tensors, inputs)  # ... the second one too (past SGD's first-step special case)
    for replayed, eager in zip(snapshot(), eager_two, strict=True):
        torch.testing.assert_close(replayed, eager, rtol=1e-6, atol=1e-7)

    # ... and a host-side lr change reaches it without retracing.
    optimizer.param_groups[0]["lr"] = 0.0
    params = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        graph(tensors, inputs)
    for p, before in zip(model.parameters(), params, strict=True):
        torch.testing.assert_close(p, before, rtol=0, atol=0)
