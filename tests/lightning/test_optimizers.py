"""Every torch.optim optimizer that a static step can run trains as on cpu.

RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop and Adafactor run torch's own
update, traced once (SGD, Adam and AdamW have their own tests). Same seed and data on cpu and
mncore: losses, weights and optimizer state within ATOL = 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from mncore_lightning.optimizers import MNCoreTracedOptimizer
from tests.lightning.lightning_testing import (
    ATOL,
    TRACED_OPTIMIZER_KWARGS,
    LitClassifier,
    assert_optimizer_state_close,
    assert_state_close,
    fit_once,
    loader,
    make_trainer,
)

LEARNING_RATES = {"Adadelta": 1.0, "Rprop": 0.01, "ASGD": 0.05}


def _model_kwargs(name: str, **extra) -> dict:
    return {"optimizer": name, "lr": LEARNING_RATES.get(name, 0.01), **extra}


def _assert_same_training(cpu, mncore) -> None:
    (cpu_trainer, cpu_model, cpu_losses), (trainer, model, losses) = cpu, mncore
    assert len(losses.losses) == len(cpu_losses.losses) > 0
    torch.testing.assert_close(
        torch.stack(losses.losses), torch.stack(cpu_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(model, cpu_model)
    assert_optimizer_state_close(trainer.optimizers[0], cpu_trainer.optimizers[0])


@pytest.mark.parametrize("name", sorted(TRACED_OPTIMIZER_KWARGS))
def test_torch_optimizer_trains_as_on_cpu(name):
    cpu = fit_once("cpu", _model_kwargs(name), max_epochs=1)
    mncore = fit_once("mncore", _model_kwargs(name), max_epochs=1)
    _assert_same_training(cpu, mncore)
    optimizer = mncore[0].optimizers[0]
    # The user's object, converted in place: its class name and type are kept.
    assert isinstance(optimizer, getattr(torch.optim, name))
    assert isinstance(optimizer, MNCoreTracedOptimizer)
    assert type(optimizer).__name__ == name
    # torch.optim's state_dict layout: the same keys, dtypes and group options as on cpu.
    ours, theirs = optimizer.state_dict(), cpu[0].optimizers[0].state_dict()
    assert [g.keys() for g in ours["param_groups"]] == [g.keys() for g in theirs["param_groups"]]
    for index, state in theirs["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert ours["state"][index][key].dtype == value.dtype, (index, key)
    assert mncore[0].strategy.retraces == 0


@pytest.mark.parametrize("name", ["RMSprop", "Rprop"])
def test_step_lr_scheduler_drives_a_traced_optimizer(name):
    """StepLR halves lr every epoch: the compiled step reads it from a tensor."""
    kwargs = _model_kwargs(name, scheduler="step")
    cpu = fit_once("cpu", kwargs, max_epochs=3)
    mncore = fit_once("mncore", kwargs, max_epochs=3)
    _assert_same_training(cpu, mncore)
    assert mncore[0].optimizers[0].param_groups[0]["lr"] == pytest.approx(kwargs["lr"] / 8)
    assert mncore[0].strategy.retraces == 0


class ChangeAlpha(Callback):
    """Sets RMSprop's alpha after the first step (compiled with the old value)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 1:
            trainer.optimizers[0].param_groups[0]["alpha"] = 0.5


def test_changing_a_hyperparameter_read_as_a_number_after_compile_raises():
    with pytest.raises(ValueError, match=r"'alpha'.*traced with alpha=0.99.*Only 'lr'"):
        fit_once("mncore", _model_kwargs("RMSprop"), max_epochs=1, callbacks=[ChangeAlpha()])


def test_lbfgs_keeps_its_clear_error():
    with pytest.raises(TypeError, match="LBFGS re-evaluates its closure"):
        fit_once("mncore", {"optimizer": "lbfgs"}, max_epochs=1, train=loader(n=32))


@pytest.mark.parametrize(
    "first,name",
    [("mncore", "NAdam"), ("cpu", "Rprop"), ("mncore", "Adafactor")],
    ids=["saved-on-mncore-nadam", "saved-on-cpu-rprop", "saved-on-mncore-adafactor"],
)
def test_checkpoints_of_traced_optimizers_resume_exactly(tmp_path, first, name):
    """torch.optim's state_dict layout: a checkpoint saved on either accelerator resumes on
    mncore as if training had not stopped."""
    kwargs = _model_kwargs(name)
    train = lambda: loader(n=64, batch_size=16, shuffle=False)  # noqa: E731
    trainer, straight, _ = fit_once("mncore", kwargs, train=train(), max_epochs=2)
    straight_optimizer = trainer.optimizers[0]
    first_trainer, _, _ = fit_once(first, kwargs, train=train(), max_epochs=1)
    path = tmp_path / "epoch1.ckpt"
    first_trainer.save_checkpoint(path)

    resumed = LitClassifier(**kwargs)
    trainer = make_trainer("mncore", max_epochs=2)
    trainer.fit(resumed, train(), ckpt_path=path)
    assert trainer.global_step == 8
    assert_state_close(resumed, straight, atol=1e-6)
    assert_optimizer_state_close(trainer.optimizers[0], straight_optimizer)
