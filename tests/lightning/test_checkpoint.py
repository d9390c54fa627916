"""Checkpoints hold the device's current state; resuming continues training exactly.

Tolerances: resume vs. uninterrupted run 1e-6 absolute (RESUME_ATOL); mncore vs. cpu
ATOL = 1e-5 absolute (conftest); the host model's own outputs are compared exactly.
"""

from __future__ import annotations

import importlib.util

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from tests.lightning.lightning_testing import (
    ATOL,
    LitClassifier,
    assert_optimizer_state_close,
    assert_state_close,
    fit_once,
    loader,
    make_trainer,
    mncore_env,
)

RESUME_ATOL = 1e-6


def _train_loader():
    return loader(n=64, batch_size=16, shuffle=False)


def _val_loader():
    return loader(n=32, batch_size=16, seed=1)


# --- resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "first,optimizer",
    [("mncore", "sgd"), ("mncore", "adam"), ("cpu", "adam")],
    ids=["saved-on-mncore-sgd", "saved-on-mncore-adam", "saved-on-cpu-adam"],
)
def test_resume_equals_uninterrupted(tmp_path, first, optimizer):
    kwargs = dict(optimizer=optimizer, lr=0.05)
    trainer, straight, _ = fit_once("mncore", kwargs, train=_train_loader(), max_epochs=2)
    straight_optimizer = trainer.optimizers[0]

    first_trainer, model, _ = fit_once(first, kwargs, train=_train_loader(), max_epochs=1)
    path = tmp_path / "epoch1.ckpt"
    first_trainer.save_checkpoint(path)

    resumed = LitClassifier(**kwargs)  # a fresh init: everything must come from the checkpoint
    trainer = make_trainer("mncore", max_epochs=2)
    trainer.fit(resumed, _train_loader(), ckpt_path=path)
    assert trainer.global_step == 8
    assert_state_close(resumed, straight, atol=RESUME_ATOL)
    assert_optimizer_state_close(trainer.optimizers[0], straight_optimizer)


def test_resume_mid_epoch_checkpoint_matches_cpu(tmp_path):
    """A ModelCheckpoint saved every 3 steps on mncore, resumed on mncore and on cpu: the same
    (whatever Lightning does with the rest of the interrupted epoch, it does on both)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    fit_once(
        "mncore",
        train=_train_loader(),
        max_epochs=1,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    path = tmp_path / "epoch=0-step=3.ckpt"
    assert path.exists(), sorted(p.name for p in tmp_path.iterdir())
    models, steps = {}, {}
    for accelerator in ("cpu", "mncore"):
        models[accelerator] = LitClassifier()
        trainer = make_trainer(accelerator, max_epochs=2)
        trainer.fit(models[accelerator], _train_loader(), ckpt_path=path)
        steps[accelerator] = trainer.global_step
    assert steps["mncore"] == steps["cpu"]
    assert_state_close(models["mncore"], models["cpu"])


# --- what a checkpoint holds -----------------------------------------------------------------


class SaveAt(Callback):
    """trainer.save_checkpoint after the given global steps (inside training)."""

    def __init__(self, directory, steps) -> None:
        self.directory = directory
        self.steps = set(steps)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            trainer.save_checkpoint(self.directory / f"step{trainer.global_step}.ckpt")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_checkpoint_mid_training_holds_device_state(tmp_path, optimizer):
    kwargs = dict(optimizer=optimizer, lr=0.05)
    (tmp_path / "cpu").mkdir()
    (tmp_path / "mncore").mkdir()
    _, cpu_model, _ = fit_once(
        "cpu",
        kwargs,
        train=_train_loader(),
        max_epochs=2,
        callbacks=[SaveAt(tmp_path / "cpu", [2, 5])],
    )
    _, model, _ = fit_once(
        "mncore",
        kwargs,
        train=_train_loader(),
        max_epochs=2,
        callbacks=[SaveAt(tmp_path / "mncore", [2, 5])],
    )
    for step in (2, 5):
        ours = torch.load(tmp_path / "mncore" / f"step{step}.ckpt", weights_only=False)
        theirs = torch.load(tmp_path / "cpu" / f"step{step}.ckpt", weights_only=False)
        assert ours["global_step"] == theirs["global_step"] == step
        assert ours["state_dict"].keys() == theirs["state_dict"].keys()
        for key in ours["state_dict"]:
            torch.testing.assert_close(
                ours["state_dict"][key], theirs["state_dict"][key], atol=ATOL, rtol=0
            )
        ours_opt, theirs_opt = ours["optimizer_states"][0], theirs["optimizer_states"][0]
        assert ours_opt["state"].keys() == theirs_opt["state"].keys()
        for index, state in theirs_opt["state"].items():
            assert ours_opt["state"][index].keys() == state.keys()
            for key, value in state.items():  # momentum_buffer / exp_avg, exp_avg_sq, step
                torch.testing.assert_close(
                    torch.as_tensor(ours_opt["state"][index][key]),
                    torch.as_tensor(value),
                    atol=ATOL,
                    rtol=0,
                )
        # the two checkpoints differ: each holds the state of its own step
    early = torch.load(tmp_path / "mncore" / "step2.ckpt", weights_only=False)["state_dict"]
    late = torch.load(tmp_path / "mncore" / "step5.ckpt", weights_only=False)["state_dict"]
    assert not torch.equal(early["net.0.weight"], late["net.0.weight"])
    # saving mid-training does not disturb training
    assert_state_close(model, cpu_model)


class DeviceValueCheck(Callback):
    """After a mid-training save, the checkpoint equals the Context's device values."""

    def __init__(self, path) -> None:
        self.path = path
        self.checked = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != 3:
            return
        trainer.save_checkpoint(self.path)
        saved = torch.load(self.path, weights_only=False)["state_dict"]
        context = trainer.strategy.context
        for name, param in pl_module.named_parameters():
            device_value = context.get_registered_value_proxy(param).cpu()
            torch.testing.assert_close(saved[name], device_value, atol=0, rtol=0)
        self.checked = True


def test_checkpoint_equals_context_device_values(tmp_path):
    check = DeviceValueCheck(tmp_path / "mid.ckpt")
    fit_once("mncore", train=_train_loader(), max_epochs=1, callbacks=[check])
    assert check.checked


def test_host_model_is_synced_on_exception():
    """An exception mid-fit leaves the host model with the device's last completed step."""

    class Boom(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 3:
                raise RuntimeError("boom")

    results = {}
    for accelerator in ("cpu", "mncore"):
        L.seed_everything(0, verbose=False)
        model = LitClassifier()
        trainer = make_trainer(accelerator, max_epochs=1, callbacks=[Boom()])
        with pytest.raises(RuntimeError, match="boom"):
            trainer.fit(model, _train_loader())
        results[accelerator] = model
    assert_state_close(results["mncore"], results["cpu"])


# --- after fit: load, test, predict, export ----------------------------------------------------


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A model fitted on mncore with ModelCheckpoints: (trainer, model, ckpt dir, initial)."""
    directory = tmp_path_factory.mktemp("ckpt")
    with mncore_env():  # module-scoped: the autouse (function) fixture is not active yet
        return _fit_with_checkpoints(directory)


def _fit_with_checkpoints(directory):
    L.seed_everything(0, verbose=False)
    model = LitClassifier(net="cnn", dropout=0.2)
    checkpoint = ModelCheckpoint(dirpath=directory, monitor="val_loss")
    every_epoch = ModelCheckpoint(dirpath=directory / "all", save_top_k=-1)
    trainer = make_trainer(
        "mncore", max_epochs=2, enable_checkpointing=True, callbacks=[checkpoint, every_epoch]
    )
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model, _train_loader(), _val_loader())
    assert (directory / "all" / "epoch=1-step=8.ckpt").exists()
    return trainer, model, directory, initial


def test_host_model_holds_trained_weights(fitted):
    trainer, model, directory, initial = fitted
    assert not torch.equal(model.state_dict()["net.1.weight"], initial["net.1.weight"])
    last = torch.load(directory / "all" / "epoch=1-step=8.ckpt", weights_only=False)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(last["state_dict"][key], value, atol=0, rtol=0)
    # and the checkpoint saved after the last step equals the host model
    path = directory / "final.ckpt"
    trainer.save_checkpoint(path)
    final = torch.load(path, weights_only=False)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(final["state_dict"][key], value, atol=0, rtol=0)


def test_load_from_checkpoint(fitted):
    _, model, directory, _ = fitted
    loaded = LitClassifier.load_from_checkpoint(directory / "all" / "epoch=1-step=8.ckpt")
    assert loaded.hparams.net == "cnn"
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, atol=0, rtol=0)


def test_trainer_test_matches_cpu(fitted):
    trainer, model, _, _ = fitted
    results = trainer.test(model, _val_loader(), verbose=False)
    cpu_results = make_trainer("cpu").test(model, _val_loader(), verbose=False)
    assert results[0].keys() == cpu_results[0].keys() == {"test_loss", "test_acc"}
    for key in results[0]:
        assert results[0][key] == pytest.approx(cpu_results[0][key], abs=ATOL)
    # the host model is untouched by evaluation
    model.eval()
    x, y = _val_loader().dataset.tensors
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x), y).item()
    assert results[0]["test_loss"] == pytest.approx(expected, abs=ATOL)


def test_trainer_test_with_best_checkpoint(fitted):
    trainer, model, _, _ = fitted
    best_path = trainer.checkpoint_callbacks[0].best_model_path
    results = trainer.test(model, _val_loader(), ckpt_path=best_path, verbose=False)
    best = LitClassifier.load_from_checkpoint(best_path)
    cpu_results = make_trainer("cpu").test(best, _val_loader(), verbose=False)
    assert results[0]["test_loss"] == pytest.approx(cpu_results[0]["test_loss"], abs=ATOL)


def test_trainer_predict_equals_host_model(fitted):
    trainer, model, _, _ = fitted
    data = loader(n=40, batch_size=16, drop_last=False, seed=2)  # ragged last batch: 8
    predictions = trainer.predict(model, data)
    assert [p.shape[0] for p in predictions] == [16, 16, 8]
    model.eval()
    with torch.no_grad():
        expected = model(data.dataset.tensors[0])
    torch.testing.assert_close(torch.cat(predictions), expected, atol=ATOL, rtol=0)


def test_to_torchscript(fitted, tmp_path):
    _, model, _, _ = fitted
    model.eval()
    scripted = model.to_torchscript(file_path=tmp_path / "model.pt")
    x = _val_loader().dataset.tensors[0]
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x), atol=1e-6, rtol=0)
    assert (tmp_path / "model.pt").exists()


@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="onnx is not installed")
def test_to_onnx(fitted, tmp_path):
    _, model, _, _ = fitted
    path = tmp_path / "model.onnx"
    model.to_onnx(path, torch.zeros(4, 8))
    assert path.exists() and path.stat().st_size > 0
    import onnx

    onnx.checker.check_model(onnx.load(path))


@pytest.mark.parametrize("how", ["tuner", "callback"])
def test_the_learning_rate_finder_restores_the_weights_it_started_from(tmp_path, how):
    """lr_find trains a few steps, then loads the checkpoint it saved first: the loaded
    weights must win over the device's, and the fit that follows matches cpu's."""
    from lightning.pytorch.callbacks import LearningRateFinder
    from lightning.pytorch.tuner import Tuner

    results = []
    for accelerator in ("cpu", "mncore"):
        L.seed_everything(0, verbose=False)
        model = LitClassifier()  # configure_optimizers reads hparams.lr, which lr_find sets
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        finder = dict(min_lr=1e-3, max_lr=0.5, early_stop_threshold=None)
        callbacks = (
            [LearningRateFinder(**finder, num_training_steps=24)] if how == "callback" else []
        )
        trainer = make_trainer(
            accelerator, max_epochs=6, default_root_dir=tmp_path, callbacks=callbacks
        )
        if how == "tuner":
            Tuner(trainer).lr_find(model, train_dataloaders=loader(), **finder, num_training=24)
            for key, value in model.state_dict().items():  # restored: not trained by lr_find
                torch.testing.assert_close(value, initial[key], atol=0, rtol=0, msg=key)
        trainer.fit(model, loader())
        results.append(model)
    cpu, mn = results
    assert mn.hparams.lr == cpu.hparams.lr != 0.1
    assert_state_close(cpu, mn)
