"""Trainer(accelerator="mncore") on the MLSDK backend, against the fake `mlsdk` (tests/fake_mlsdk).

The same LightningModule and Trainer arguments as on the emulator; the strategy's device
string ("mncore2:auto") selects MLSDK. The fake runs every compiled step on the emulator, so
the run must match accelerator="cpu"; its call log shows what the plugin asked of MLSDK.
"""

from __future__ import annotations

import logging
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

import mncore_device
from mncore_device import MLSDKContext, MLSDKNotInstalledError
from mncore_lightning import MNCoreStrategy
from tests.fake_mlsdk import install as fake
from tests.lightning.lightning_testing import (
    ATOL,
    LitClassifier,
    assert_state_close,
    fit_once,
    loader,
    make_trainer,
)

# Lightning's rank-zero messages: "lightning.pytorch." or, once pytorch_lightning is imported
# (the two packages share the module that picks the logger), "pytorch_lightning."
RANK_ZERO_LOGGER = "utilities.rank_zero"

pytestmark = [  # the scheduler's optimizer is replaced by MLSDK's, whose step() runs on the device
    pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`"),
    pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden"),
]


@pytest.fixture
def mlsdk(monkeypatch):
    """The fake mlsdk, importable as `mlsdk` for this test only."""
    with fake.installed(monkeypatch) as module:
        yield module


def hardware(**kwargs) -> MNCoreStrategy:
    return MNCoreStrategy(device="mncore2:auto", preset="O0", **kwargs)


class RecordingCheckpointIO(TorchCheckpointIO):
    """Puts "checkpoint written" on the fake's timeline when a checkpoint file is written."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        sys.modules["mlsdk"].record_event("checkpoint written", path=str(path))
        super().save_checkpoint(checkpoint, path, storage_options)


def first(log, name: str, /, **args) -> int:
    """Where `name` (with `args`) is first in the call log."""
    return next(
        i
        for i, c in enumerate(log)
        if c.name == name and all(c.args.get(k) == v for k, v in args.items())
    )


class ContextPeek(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.context = trainer.strategy.context


def _fit(accelerator, strategy=None, **overrides):
    model_kwargs = dict(net="mlp", optimizer="sgd", lr=0.1, scheduler="step")
    if strategy is not None:
        overrides["strategy"] = strategy
    overrides.setdefault("max_epochs", 2)
    return fit_once(
        accelerator,
        model_kwargs,
        train=loader(n=48, batch_size=16, shuffle=True),
        val=loader(n=40, batch_size=16, drop_last=False, seed=1),
        **overrides,
    )


def test_fit_on_mlsdk_matches_cpu(mlsdk):
    _, reference, cpu_losses = _fit("cpu")
    peek = ContextPeek()
    trainer, model, losses = _fit("mncore", hardware(), callbacks=[peek])

    assert trainer.strategy.backend == "mlsdk"
    assert isinstance(peek.context, MLSDKContext)
    assert peek.context.sdk_context.device.device_str == "mncore2:auto"
    assert type(trainer.optimizers[0]) is mlsdk.MNCoreSGD  # MLSDK's optimizer, same settings
    assert trainer.optimizers[0].param_groups[0]["momentum"] == 0.9
    assert_state_close(model, reference)  # trained on the (fake) device, synchronized back
    torch.testing.assert_close(
        torch.stack(losses.losses), torch.stack(cpu_losses.losses), atol=ATOL, rtol=0
    )
    # StepLR halves the lr every epoch: each change went to the device through MLSDK, before
    # the next compiled call
    pushes = [c.args["lrs"] for c in mlsdk.call_log if c.name == "MNCoreLRScheduler.step"]
    assert pushes == [[pytest.approx(0.05)], [pytest.approx(0.025)]]
    metrics = trainer.callback_metrics
    assert {"train_loss", "val_loss", "val_acc"} <= set(metrics)
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in metrics.values())


def test_calls_reach_mlsdk_in_order_and_checkpoints_follow_synchronize(mlsdk, tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    trainer, model, _ = _fit(
        "mncore",
        hardware(checkpoint_io=RecordingCheckpointIO()),
        callbacks=[checkpoints],
        enable_checkpointing=True,
    )
    log = mlsdk.call_log
    calls = [c.name for c in log]

    # every parameter is named for MLSDK before it is registered, all before the first compile
    for name, _ in model.named_parameters():
        name = f"model@{name.replace('.', '/')}"
        assert first(log, "set_tensor_name", name=name) < first(
            log, "Context.register_param", name=name
        )
    assert calls.index("set_buffer_name_in_optimizer") < calls.index(
        "Context.register_optimizer_buffers"
    )
    first_compile = calls.index("Context.compile")
    assert max(i for i, n in enumerate(calls) if n.startswith("Context.register")) < first_compile
    assert calls.index("Context.switch_context") < first_compile

    # compile keywords as documented: a storage path, MLSDK's preset file
    compiles = [c.args for c in log if c.name == "Context.compile"]
    assert len(compiles) == 3  # training step; validation at batch 16 and at the last batch (8)
    for args in compiles:
        assert args["keyword"] == "codegen_dir" and args["codegen_dir"]
        assert args["options"] == {"option_json": str(fake.PRESET_DIR / "O0.json")}

    # every checkpoint file is written after a synchronize that follows the last device step
    # that changed device state (a training step; evaluation steps change nothing)
    written = [i for i, n in enumerate(calls) if n == "checkpoint written"]
    assert len(written) == 2
    for at in written:
        last_step = max(
            i
            for i in range(at)
            if calls[i] == "CompiledFunction.__call__" and log[i].args["updates_state"]
        )
        assert "Context.synchronize" in calls[last_step:at]
    saved = torch.load(checkpoints.best_model_path, weights_only=False)["state_dict"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0)

    # outputs (MLSDK proxies) become host tensors once per call, in the strategy's _to_host
    steps = [i for i, n in enumerate(calls) if n == "CompiledFunction.__call__"]
    for start, end in zip(steps, steps[1:] + [len(log)], strict=True):
        converted = [c.args["name"] for c in log[start:end] if c.name == "TensorProxy.cpu"]
        assert converted  # the loss and the logged values of each step ...
        assert len(converted) == len(set(converted))  # ... each converted once
    assert "TensorProxy.item" not in calls


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_pushes_the_loaded_state_to_the_device(mlsdk, tmp_path):
    train = loader(n=48, batch_size=16)  # not shuffled: the same batches, resumed or not
    kwargs = dict(net="mlp", optimizer="sgd", lr=0.1, scheduler="step")
    L.seed_everything(0)
    saving = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer(
        strategy=hardware(), callbacks=[saving], enable_checkpointing=True, max_epochs=1
    ).fit(LitClassifier(**kwargs), train)
    L.seed_everything(1)
    resumed = LitClassifier(**kwargs)  # other weights: the checkpoint must replace them
    mlsdk.call_log.clear()
    make_trainer(strategy=hardware()).fit(resumed, train, ckpt_path=tmp_path / "last.ckpt")
    L.seed_everything(0)
    reference = LitClassifier(**kwargs)
    make_trainer("cpu").fit(reference, train)
    assert_state_close(resumed, reference)
    calls = [c.name for c in mlsdk.call_log]
    loaded = calls.index("TensorProxy.load_from")  # weights and momentum pushed to the device
    assert loaded < calls.index("CompiledFunction.__call__")
    pushes = [c.args["lrs"] for c in mlsdk.call_log if c.name == "MNCoreLRScheduler.step"]
    assert pushes[0] == [pytest.approx(0.05)]  # the restored lr, before the first step


# --- choice and banner --------------------------------------------------------------------------


def _banner(caplog, strategy) -> list[str]:
    # The banner is printed when the strategy is set up (at fit), not for every Trainer.
    trainer = L.Trainer(
        accelerator="mncore",
        strategy=strategy,
        logger=False,
        max_steps=1,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(LitClassifier(), loader())
    return [r.getMessage() for r in caplog.records if r.name.endswith(RANK_ZERO_LOGGER)]


def test_banner_says_which_backend_and_device(mlsdk, caplog):
    messages = _banner(caplog, hardware())
    assert "MN-Core available: True (mncore2:auto, MLSDK), used: True" in messages
    caplog.clear()
    messages = _banner(caplog, MNCoreStrategy(device="pfvm:cpu", backend="mlsdk"))
    assert "MN-Core available: True (pfvm:cpu, MLSDK), used: True" in messages
    caplog.clear()
    messages = _banner(caplog, MNCoreStrategy(device="pfvm:cpu"))
    assert "MN-Core available: True (pfvm:cpu, emulated), used: True" in messages


def test_pfvm_on_mlsdk_is_a_choice(mlsdk):
    assert MNCoreStrategy(device="pfvm:cpu").backend == "emulator"  # MLSDK installed or not
    assert MNCoreStrategy(device="pfvm:cpu", backend="mlsdk").backend == "mlsdk"
    assert MNCoreStrategy(device="mncore2:3").backend == "mlsdk"
    with pytest.raises(ValueError, match="runs on MLSDK"):
        MNCoreStrategy(device="mncore2:auto", backend="emulator")


@pytest.mark.skipif(mncore_device.mlsdk_available(), reason="MLSDK is installed here")
def test_hardware_without_mlsdk_says_what_to_install():
    with pytest.raises(MLSDKNotInstalledError, match="MN-Core SDK"):
        MNCoreStrategy(device="mncore2:auto")
    with pytest.raises(MLSDKNotInstalledError, match="mlsdk"):
        MNCoreStrategy(device="pfvm:cpu", backend="mlsdk")
