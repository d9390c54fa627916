"""The MLSDK backend of the device layer, against the fake `mlsdk` in tests/fake_mlsdk.

The scripts here follow PFN's MLSDK examples (train.py, add.py, explicit_data_transfer_api.py,
load_codegen_dir.py) written against `mncore_device`; the same scripts run on the emulator, and
the tests compare both. The fake records every MLSDK call, so the tests also check what reaches
MLSDK, and in which order.
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import mncore_device
from mncore_device import (
    CacheOptions,
    Context,
    EmulatorContext,
    InputSpecError,
    MLSDKContext,
    MLSDKNotInstalledError,
    MNDevice,
    RegistrationError,
    get_tensor_name,
    preset_path,
    resolve_backend,
    set_buffer_name_in_optimizer,
    set_tensor_name,
    set_tensor_name_in_module,
    storage,
)
from mncore_device.mlsdk_backend import compile_keyword, mlsdk_preset_path
from mncore_lightning.optimizers import MNCoreAdam, MNCoreSGD, device_optimizer, to_mlsdk_optimizer
from tests.fake_mlsdk import install as fake

REAL_MLSDK = mncore_device.mlsdk_available()
O0 = {"option_json": "O0"}  # the interpreter preset: instant compiles


@pytest.fixture
def mlsdk(monkeypatch):
    """The fake mlsdk, importable as `mlsdk` for this test only."""
    with fake.installed(monkeypatch) as module:
        yield module


def names(sdk, prefix: str = "") -> list[str]:
    return [call.name for call in sdk.call_log if call.name.startswith(prefix)]


def index_of(sdk, name: str, /, **args) -> int:
    for i, call in enumerate(sdk.call_log):
        if call.name == name and all(call.args.get(k) == v for k, v in args.items()):
            return i
    raise AssertionError(f"{name} {args} not in the call log")


def new_context(device: str = "mncore2:auto", backend: str | None = None) -> Context:
    context = Context(MNDevice(device), backend=backend)
    Context.switch_context(context)
    return context


# --- the scripts (PFN's examples, written against mncore_device) ------------------------------


def train_example(context: Context, codegen_dir: Path, steps: int = 10) -> nn.Linear:
    """train.py: Linear(10, 1) trained by an MN-Core SGD inside the compiled step.

    The same code for both backends: device_optimizer gives MLSDK's SGD on MLSDK.
    """
    model = nn.Linear(10, 1)
    model.weight.data.fill_(1.0)
    model.bias.data.fill_(1.0)
    set_tensor_name_in_module(model, "model")
    for p in model.parameters():
        context.register_param(p)
    for b in model.buffers():
        context.register_buffer(b)
    optimizer = device_optimizer(context, MNCoreSGD(model.parameters(), 0.1, 0.9, 0.0))
    set_buffer_name_in_optimizer(optimizer, "optim0")
    context.register_optimizer_buffers(optimizer)

    def step(inputs):
        optimizer.zero_grad()
        loss = torch.relu(model(inputs["x"])).sum()
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    sample = {"x": torch.ones(1, 10)}
    compiled = context.compile(
        step, sample, storage.path(codegen_dir), options={"option_json": "O0"}
    )
    for _ in range(steps):
        compiled(sample)
    return model


def add(inputs):
    return {"out": inputs["x"] + inputs["y"]}


def compile_add(context: Context, codegen_dir: Path, cache_dir: Path | None = None):
    sample = {"x": torch.randn(3, 4), "y": torch.randn(3, 4)}
    return context.compile(
        add,
        sample,
        storage.path(codegen_dir),
        options={"option_json": "O0", "float_dtype": "float"},
        cache_options=CacheOptions(cache_dir) if cache_dir is not None else None,
    )


# --- choosing the backend ---------------------------------------------------------------------


@pytest.mark.skipif(REAL_MLSDK, reason="MLSDK is installed here")
def test_without_mlsdk_the_hardware_error_says_what_to_install():
    for make in (lambda: Context("mncore2:auto"), lambda: Context("pfvm:cpu", backend="mlsdk")):
        with pytest.raises(MLSDKNotInstalledError) as info:
            make()
        message = str(info.value)
        assert "mlsdk" in message and "MN-Core SDK" in message and "pfvm:cpu" in message
    assert type(Context("pfvm:cpu")) is EmulatorContext
    assert resolve_backend("pfvm:cpu") == "emulator"


def test_backend_argument_is_checked():
    with pytest.raises(ValueError, match="unknown MN-Core backend 'tpu'"):
        resolve_backend("pfvm:cpu", "tpu")
    with pytest.raises(ValueError, match="real MN-Core hardware, which runs on MLSDK"):
        resolve_backend("mncore2:auto", "emulator")


@pytest.mark.skipif(REAL_MLSDK, reason="MLSDK is installed here")
def test_the_fake_is_gone_after_its_test(monkeypatch):
    with fake.installed(monkeypatch) as sdk:
        assert mncore_device.mlsdk_available() and sdk.__file__.startswith(str(fake.FAKE_ROOT))
    assert not mncore_device.mlsdk_available()
    assert "mlsdk" not in sys.modules
    with pytest.raises(MLSDKNotInstalledError):
        MNDevice("mncore2:auto")


def test_device_string_picks_the_backend(mlsdk):
    hardware = Context("mncore2:auto")
    assert isinstance(hardware, MLSDKContext) and isinstance(hardware, Context)
    assert hardware.backend == "mlsdk" and str(hardware.device) == "mncore2:auto"
    assert isinstance(hardware.sdk_context, mlsdk.Context)
    emulated = Context("pfvm:cpu")
    assert type(emulated) is EmulatorContext and emulated.backend == "emulator"
    vm = Context("pfvm:cpu", backend="mlsdk")  # MLSDK's own virtual machine
    assert isinstance(vm, MLSDKContext) and vm.sdk_context.device.device_str == "pfvm:cpu"
    assert [c.args["device"] for c in mlsdk.call_log if c.name == "MNDevice"] == [
        "mncore2:auto",
        "pfvm:cpu",
    ]
    Context.switch_context(hardware)
    assert Context.get_current_context() is hardware
    assert mlsdk.Context.get_current_context() is hardware.sdk_context


# --- PFN's examples -----------------------------------------------------------------------------


def test_train_example_matches_the_emulator(mlsdk, tmp_path):
    emulated = train_example(new_context("pfvm:cpu"), tmp_path / "emu")
    Context.get_current_context().synchronize()
    mlsdk.call_log.clear()

    context = new_context("mncore2:auto")
    model = train_example(context, tmp_path / "mlsdk")
    assert torch.equal(model.bias.detach(), torch.ones(1))  # the host is stale ...
    context.synchronize()
    torch.testing.assert_close(model.weight, emulated.weight, rtol=0, atol=0)  # ... until now
    torch.testing.assert_close(model.bias, emulated.bias, rtol=0, atol=0)
    assert model.bias.item() < 0

    # names before registration, registration before compile, as MLSDK needs them
    for name in ("model@weight", "model@bias"):
        assert index_of(mlsdk, "set_tensor_name", name=name) < index_of(
            mlsdk, "Context.register_param", name=name
        )
    assert index_of(mlsdk, "set_buffer_name_in_optimizer", prefix="optim0") < index_of(
        mlsdk, "Context.register_optimizer_buffers", prefix="optim0"
    )
    compile_at = index_of(mlsdk, "Context.compile")
    assert max(i for i, c in enumerate(mlsdk.call_log) if "register" in c.name) < compile_at
    compiled = mlsdk.call_log[compile_at].args
    assert compiled["keyword"] == "codegen_dir"
    assert compiled["codegen_dir"] == str(tmp_path / "mlsdk")
    assert compiled["options"] == {"option_json": str(fake.PRESET_DIR / "O0.json")}
    assert compiled["replay"] is True  # captured by TorchDynamo: MLSDK gets the replay
    assert names(mlsdk, "Context.compile") == ["Context.compile"]  # one graph, one call a step
    assert names(mlsdk, "CompiledFunction.__call__") == ["CompiledFunction.__call__"] * 10
    assert names(mlsdk, "MNCoreSGD") == ["MNCoreSGD"]  # MLSDK's optimizer did the update
    assert names(mlsdk)[-1] == "Context.synchronize"


def test_add_example(mlsdk, tmp_path):
    context = new_context()
    compiled = compile_add(context, tmp_path / "add", cache_dir=tmp_path / "cache")
    result = compiled({"x": torch.ones(3, 4), "y": torch.ones(3, 4)})
    assert isinstance(result["out"], mlsdk.TensorProxy)  # MLSDK's proxies, as on MLSDK
    torch.testing.assert_close(result["out"].cpu(), torch.full((3, 4), 2.0))
    call = mlsdk.call_log[index_of(mlsdk, "Context.compile")].args
    assert call["replay"] is True
    assert call["options"]["float_dtype"] == "float"  # MLSDK options pass through
    assert call["cache_dir"] == str(tmp_path / "cache")
    assert call["inputs"] == {"x": (3, 4), "y": (3, 4)}
    assert compiled.input_specs["x"].shape == (3, 4)
    assert compiled.output_specs["out"].dtype == torch.float32


@pytest.mark.skipif(REAL_MLSDK, reason="MLSDK is installed here")
def test_a_default_codegen_dir_is_removed_with_its_compiled_function(mlsdk, monkeypatch, tmp_path):
    """Without codegen_dir, MLSDK writes into a temporary directory that goes with the function;
    a directory the user named stays."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sample = {"x": torch.randn(3, 4), "y": torch.randn(3, 4)}
    context = new_context()
    compiled = context.compile(add, sample, options={"option_json": "O0"})
    (temporary,) = tmp_path.glob("mncore-codegen-*")
    assert mlsdk.call_log[index_of(mlsdk, "Context.compile")].args["codegen_dir"] == str(temporary)
    torch.testing.assert_close(compiled(sample)["out"].cpu(), sample["x"] + sample["y"])
    named = compile_add(context, tmp_path / "named")
    del compiled, named
    gc.collect()
    assert not temporary.exists()
    assert (tmp_path / "named").is_dir()


def test_explicit_data_transfer_example(mlsdk, tmp_path):
    context = new_context()
    model = nn.Linear(4, 4)
    set_tensor_name_in_module(model, "model")
    for p in model.parameters():
        context.register_param(p)
    compiled = context.compile(
        lambda i: {"out": model(i["x"])}, {"x": torch.randn(4, 4)}, tmp_path, options=O0
    )
    proxies = compiled.allocate_input_proxy()
    proxies["x"].load_from(torch.eye(4), clone=False)
    with torch.no_grad():  # a host-side change reaches the device only when pushed
        model.weight.fill_(2.0)
        model.bias.zero_()
    stale = context.to_host(compiled(proxies))["out"]
    assert not torch.equal(stale, torch.full((4, 4), 2.0))
    for p in model.parameters():
        context.get_registered_value_proxy(p).load_from(p)
    torch.testing.assert_close(context.to_host(compiled(proxies))["out"], torch.full((4, 4), 2.0))
    with pytest.raises(RegistrationError, match="not registered"):
        context.get_registered_value_proxy(torch.zeros(4))


def test_load_codegen_dir_example(mlsdk, tmp_path):
    compile_add(new_context(), tmp_path / "add")
    loaded = new_context().load_codegen_dir(tmp_path / "add")
    result = loaded({"x": torch.ones(3, 4), "y": torch.ones(3, 4)})
    torch.testing.assert_close(result["out"].cpu(), torch.full((3, 4), 2.0))
    assert mlsdk.call_log[-3].name == "Context.load_codegen_dir"
    assert mlsdk.call_log[-3].args["path"] == str(tmp_path / "add")
    assert loaded.input_specs["y"].shape == (3, 4)  # read back from MLSDK's specs


def test_older_sdk_compile_keyword_is_detected(monkeypatch, tmp_path):
    with fake.installed(monkeypatch, compile_keyword="codegen_base_dir") as sdk:
        assert compile_keyword(sdk) == "codegen_base_dir"
        compiled = compile_add(new_context(), tmp_path / "add")
        torch.testing.assert_close(
            compiled({"x": torch.ones(3, 4), "y": torch.ones(3, 4)})["out"].cpu(),
            torch.full((3, 4), 2.0),
        )
        call = sdk.call_log[index_of(sdk, "Context.compile")].args
        assert call["keyword"] == "codegen_base_dir" and call["codegen_dir"] == str(
            tmp_path / "add"
        )
    with fake.installed(monkeypatch) as sdk:
        assert compile_keyword(sdk) == "codegen_dir"


# --- names, registration, optimizers -------------------------------------------------------------


def test_names_given_with_mlsdk_functions_are_used(mlsdk):
    context = new_context()
    model = nn.Linear(2, 2)
    mlsdk.set_tensor_name_in_module(model, "net")  # MLSDK's function, not ours
    context.register_param(model.weight)
    assert get_tensor_name(model.weight) == "net@weight"
    assert context.registered_names == ["net@weight"]
    with pytest.raises(RegistrationError, match="has no name"):
        context.register_param(torch.zeros(3))
    set_tensor_name(model.bias, "net@weight")
    with pytest.raises(RegistrationError, match="already registered for another tensor"):
        context.register_param(model.bias)


def test_only_mlsdk_optimizers_register(mlsdk):
    context = new_context()
    model = nn.Linear(2, 2)
    set_tensor_name_in_module(model, "model")
    for optimizer in (MNCoreSGD(model.parameters(), 0.1, 0.9), torch.optim.SGD(model.parameters())):
        set_buffer_name_in_optimizer(optimizer, "optimizer")
        with pytest.raises(RegistrationError, match="device_optimizer"):
            context.register_optimizer_buffers(optimizer)
    with pytest.raises(ValueError, match="set_buffer_name_in_optimizer"):
        context.register_optimizer_buffers(mlsdk.MNCoreSGD(model.parameters(), 0.1, 0.9))


def test_to_mlsdk_optimizer_keeps_hyperparameters(mlsdk):
    model = nn.Linear(2, 2)
    params = list(model.parameters())
    cases = [
        (torch.optim.SGD(params, lr=0.2, momentum=0.8, dampening=0.1, weight_decay=0.01), "SGD"),
        (torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.9), eps=1e-6), "Adam"),
        (torch.optim.AdamW(params, lr=0.01, weight_decay=0.3), "AdamW"),
        (MNCoreAdam(params, lr=0.01, decoupled_weight_decay=True), "AdamW"),
        (MNCoreSGD(params, 0.3, 0.9), "SGD"),
    ]
    for optimizer, kind in cases:
        converted = to_mlsdk_optimizer(optimizer)
        assert type(converted) is getattr(mlsdk, f"MNCore{kind}")
        for key in ("lr", "momentum", "dampening", "weight_decay", "betas", "eps"):
            if key in optimizer.param_groups[0]:
                assert converted.param_groups[0][key] == optimizer.param_groups[0][key], key
        assert converted.param_groups[0]["params"] == params
        assert to_mlsdk_optimizer(converted) is converted

    groups = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=0.1)
    groups.param_groups[0]["initial_lr"] = 0.1  # what a scheduler adds
    converted = to_mlsdk_optimizer(groups)
    assert [g["lr"] for g in converted.param_groups] == [0.1, 0.5]
    assert converted.param_groups[0]["initial_lr"] == 0.1
    with pytest.raises(ValueError, match="nesterov"):
        to_mlsdk_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True))
    with pytest.raises(TypeError, match="LBFGS"):
        to_mlsdk_optimizer(torch.optim.LBFGS(params))


def _lr_step(context: Context, sdk, lr: float):
    """One SGD (no momentum) step on a 1-weight model; returns (model, optimizer, compiled)."""
    model = nn.Linear(1, 1, bias=False)
    model.weight.data.fill_(1.0)
    set_tensor_name_in_module(model, "model")
    context.register_param(model.weight)
    optimizer = sdk.MNCoreSGD(model.parameters(), lr)
    set_buffer_name_in_optimizer(optimizer, "optimizer")
    context.register_optimizer_buffers(optimizer)

    def step(inputs):  # gradient of sum(w * x) is x = 1: each step subtracts lr
        optimizer.zero_grad()
        (model(inputs["x"])).sum().backward()
        optimizer.step()
        return {}

    compiled = context.compile(step, {"x": torch.ones(1, 1)}, options=O0)  # a temporary codegen_dir
    return model, optimizer, compiled


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_the_fake_keeps_learning_rates_on_the_device(mlsdk, tmp_path):
    """Without MNCoreLRScheduler a host-side change does not reach the fake device (as on MLSDK)."""
    sdk_context = mlsdk.Context(mlsdk.MNDevice("mncore2:auto"))
    mlsdk.Context.switch_context(sdk_context)
    model = nn.Linear(1, 1, bias=False)
    model.weight.data.fill_(1.0)
    mlsdk.set_tensor_name_in_module(model, "model")
    sdk_context.register_param(model.weight)
    optimizer = mlsdk.MNCoreSGD(model.parameters(), 0.1)
    mlsdk.set_buffer_name_in_optimizer(optimizer, "optimizer")
    sdk_context.register_optimizer_buffers(optimizer)

    def step(inputs):
        optimizer.zero_grad()
        model(inputs["x"]).sum().backward()
        optimizer.step()
        return {}

    o0 = {"option_json": str(fake.PRESET_DIR / "O0.json")}
    path = mlsdk.storage.path(str(tmp_path))
    compiled = sdk_context.compile(step, {"x": torch.ones(1, 1)}, path, options=o0)
    optimizer.param_groups[0]["lr"] = 0.5
    compiled({"x": torch.ones(1, 1)})
    assert sdk_context._device_value(model.weight).item() == pytest.approx(0.9)  # still 0.1
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=1.0)
    mlsdk.MNCoreLRScheduler(scheduler, sdk_context).step()
    compiled({"x": torch.ones(1, 1)})
    assert sdk_context._device_value(model.weight).item() == pytest.approx(0.4)  # now 0.5


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_a_host_learning_rate_change_reaches_the_device(mlsdk):
    context = new_context()
    model, optimizer, compiled = _lr_step(context, mlsdk, lr=0.1)
    compiled({"x": torch.ones(1, 1)})
    assert "MNCoreLRScheduler" not in names(mlsdk)  # nothing to push while the lr is unchanged
    optimizer.param_groups[0]["lr"] = 0.25  # e.g. a scheduler or a callback
    compiled({"x": torch.ones(1, 1)})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.4)
    scheduler.step()  # 0.25 -> 0.1
    compiled({"x": torch.ones(1, 1)})
    compiled({"x": torch.ones(1, 1)})
    context.synchronize()
    assert model.weight.item() == pytest.approx(1.0 - 0.1 - 0.25 - 0.1 - 0.1)
    pushes = [c.args["lrs"] for c in mlsdk.call_log if c.name == "MNCoreLRScheduler.step"]
    assert pushes == [[0.25], [pytest.approx(0.1)]]
    assert names(mlsdk, "MNCoreLRScheduler").count("MNCoreLRScheduler") == 1  # made once


# --- calls and outputs ------------------------------------------------------------------------------


def test_outputs_become_host_tensors_in_one_pass(mlsdk, tmp_path):
    context = new_context()

    def three(inputs):
        x = inputs["x"]
        return {"a": x + 1, "b": x * 2, "c": x.sum()}

    compiled = context.compile(three, {"x": torch.ones(2)}, tmp_path, options=O0)
    outputs = compiled({"x": torch.ones(2)})
    start = len(mlsdk.call_log)
    host = context.to_host(outputs)
    assert [c.name for c in mlsdk.call_log[start:]] == ["TensorProxy.cpu"] * 3
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in host.values())
    torch.testing.assert_close(host["c"], torch.tensor(2.0))


def test_wrong_batch_is_refused_before_mlsdk_is_called(mlsdk, tmp_path):
    context = new_context()
    compiled = compile_add(context, tmp_path)
    calls = len(mlsdk.call_log)
    with pytest.raises(InputSpecError, match="drop_last"):
        compiled({"x": torch.ones(2, 4), "y": torch.ones(2, 4)})
    with pytest.raises(InputSpecError, match="keys must be those of the sample"):
        compiled({"x": torch.ones(3, 4)})
    assert len(mlsdk.call_log) == calls


def test_extra_keys_and_size_one_dimensions_are_conformed_before_mlsdk(mlsdk, tmp_path):
    context = new_context()
    compiled = compile_add(context, tmp_path)
    x = torch.ones(3, 4)
    out = compiled({"x": x, "y": x, "unused": torch.zeros(2)})
    torch.testing.assert_close(context.to_host(out)["out"], x + x)


def test_presets_map_to_mlsdk_preset_files(mlsdk, tmp_path):
    o0 = fake.PRESET_DIR / "O0.json"
    assert mlsdk_preset_path("O0") == o0
    assert mlsdk_preset_path("O0.json") == o0
    assert mlsdk_preset_path(preset_path("O0")) == o0  # the emulator's file maps by name
    custom = tmp_path / "mine.json"
    custom.write_text('{"emulator_preset": "O0"}')
    assert mlsdk_preset_path(custom) == custom
    with pytest.raises(ValueError, match="PRESET_OPTIONS_DIR"):
        mlsdk_preset_path("O9")


def test_the_fake_is_strict(mlsdk, tmp_path):
    sdk_context = mlsdk.Context(mlsdk.MNDevice("mncore2:auto"))
    mlsdk.Context.switch_context(sdk_context)
    sample = {"x": torch.ones(2), "y": torch.ones(2)}
    path = mlsdk.storage.path(str(tmp_path))
    with pytest.raises(TypeError, match="unexpected keyword"):
        sdk_context.compile(add, sample, path, option={"option_json": "O0"})
    with pytest.raises(TypeError, match="storage.path"):
        sdk_context.compile(add, sample, str(tmp_path))
    with pytest.raises(ValueError, match="unknown compile option"):
        sdk_context.compile(add, sample, path, options={"preset": "O0"})
    with pytest.raises(TypeError, match="unexpected keyword"):
        mlsdk.MNCoreSGD([torch.zeros(1, requires_grad=True)], 0.1, nesterov=True)
    with pytest.raises(TypeError, match="lr"):
        mlsdk.MNCoreSGD([torch.zeros(1, requires_grad=True)], "0.1")
    with pytest.raises(ValueError, match="no name"):
        sdk_context.register_param(torch.zeros(1))
    with pytest.raises(ValueError, match="unknown device"):
        mlsdk.MNDevice("mncore3:auto")


def test_compile_keywords_reach_mlsdk_or_warn_once(mlsdk, monkeypatch, tmp_path):
    """A keyword this MLSDK's compile lacks is not dropped silently: it warns, once."""
    from mncore_device import compile_keywords

    monkeypatch.setattr(compile_keywords, "_warned", set())
    context = new_context()
    with pytest.warns(UserWarning, match=r"compile\(quiet=...\) is not honoured") as record:
        for name in ("a", "b"):
            sample = {"x": torch.randn(3, 4), "y": torch.randn(3, 4)}
            compiled = context.compile(add, sample, storage.path(tmp_path / name), quiet=True)
    assert sum("quiet" in str(w.message) for w in record) == 1
    out = context.to_host(compiled(sample))["out"]
    torch.testing.assert_close(out, sample["x"] + sample["y"])


def test_cache_options_flags_reach_mlsdk(mlsdk, monkeypatch, tmp_path):
    given = []

    class Recording(mlsdk.CacheOptions):
        def __init__(self, cache_dir, **flags):
            given.append(flags)
            super().__init__(cache_dir, **flags)

    monkeypatch.setattr(mlsdk, "CacheOptions", Recording)
    context = new_context()
    sample = {"x": torch.randn(3, 4), "y": torch.randn(3, 4)}
    options = CacheOptions(str(tmp_path / "cache"), enable_onnx_cache=False)
    context.compile(add, sample, storage.path(tmp_path / "add"), options=O0, cache_options=options)
    assert given == [
        {
            "enable_app_cache": True,
            "enable_onnx_cache": False,
            "enable_codegen_cache": True,
            "enable_gpfn2obj_cache": True,
        }
    ]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_mncore_lr_scheduler_pushes_rates_through_mlsdk(mlsdk):
    from mncore_device import MNCoreLRScheduler

    context = new_context()
    model, optimizer, compiled = _lr_step(context, mlsdk, lr=0.1)
    scheduler = MNCoreLRScheduler(
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=5.0), context
    )
    compiled({"x": torch.ones(1, 1)})  # w = 1 - 0.1
    scheduler.step()  # lr 0.5, pushed to the device now
    assert names(mlsdk, "MNCoreLRScheduler.step")
    compiled({"x": torch.ones(1, 1)})  # w = 0.9 - 0.5
    context.synchronize()
    assert model.weight.item() == pytest.approx(0.4)


def test_mlsdk_tensor_proxies_are_tensor_proxies(mlsdk, tmp_path):
    from mncore_device import TensorProxy

    context = new_context()
    compiled = compile_add(context, tmp_path / "add")
    out = compiled({"x": torch.ones(3, 4), "y": torch.ones(3, 4)})["out"]
    assert isinstance(out, mlsdk.TensorProxy) and isinstance(out, TensorProxy)
    torch.testing.assert_close(out.cpu(), torch.full((3, 4), 2.0))


def test_invalidate_invalidates_mlsdk_context(mlsdk, tmp_path):
    from mncore_device import ContextInvalidatedError

    context = new_context()
    compile_add(context, tmp_path)
    start = len(mlsdk.call_log)
    context.invalidate()
    assert [c.name for c in mlsdk.call_log[start:]] == ["Context.invalidate"]
    with pytest.raises(ContextInvalidatedError):
        context.synchronize()
