"""Python numbers, strings and objects a compiled step reads or writes behave as on cpu.

The step is captured by TorchDynamo: a value it reads and a hook or callback changes is
guarded (a change re-compiles, or makes the value a graph input), and what the step itself
writes (a Python number on the module or on a plain object, a module-level dict or list, a
host generator's state) is replayed on the host after each call, as eager would. Each test
fits with accelerator="cpu" and "mncore" (preset O0, same seed and data) and compares the
losses, the weights and the host state the step changed within ATOL = 1e-5, and the
re-compiles (`strategy.retraces`) where they are meaningful.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from tests.lightning.lightning_testing import (
    ATOL,
    LitClassifier,
    assert_state_close,
    fit_once,
)


def _runs(model_cls, **kwargs):
    """(cpu, mncore) runs of fit_once, with the same losses and weights."""
    cpu, mn = (fit_once(a, model_cls=model_cls, **kwargs) for a in ("cpu", "mncore"))
    (_, cpu_model, cpu_losses), (_, mn_model, mn_losses) = cpu, mn
    assert len(cpu_losses.losses) == len(mn_losses.losses) > 0
    torch.testing.assert_close(
        torch.stack(mn_losses.losses), torch.stack(cpu_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu_model, mn_model)
    return cpu, mn


def _same_run(model_cls, **kwargs):
    _, (mn_trainer, _, _) = _runs(model_cls, **kwargs)
    return mn_trainer.strategy


class Temperature(nn.Module):
    """A submodule with a Python float that its forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.value = 1.0

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.value


class ScheduledInHooks(LitClassifier):
    """Python values the step reads, changed outside it: an attribute set by a hook, an
    hparam and a submodule's float set by a callback; and one the step never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        self.temperature = Temperature()
        self.epochs_seen = 0  # bookkeeping no step reads: changing it re-traces nothing

    def on_train_epoch_start(self) -> None:
        self.scale = 1.0 + self.current_epoch
        self.epochs_seen += 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.temperature(self(x))
        loss = torch.nn.functional.cross_entropy(logits, y)
        return loss * self.scale * self.hparams.lr * 10


class Anneal(Callback):
    def on_train_epoch_start(self, trainer, module) -> None:
        module.temperature.value = 1.0 + 0.5 * trainer.current_epoch
        module.hparams.lr = 0.1 / (1 + trainer.current_epoch)


def test_python_values_changed_by_hooks_and_callbacks_are_followed():
    strategy = _same_run(ScheduledInHooks, max_epochs=3, callbacks=[Anneal()])
    # epoch 1: the floats' guards fail once and they become graph inputs; epoch 2's new
    # values need no re-compile
    assert strategy.retraces == 1


class OnlyBookkeeping(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.epochs_seen = 0

    def on_train_epoch_end(self) -> None:
        self.epochs_seen += 1


def test_values_the_step_does_not_read_change_freely_without_retracing():
    strategy = _same_run(OnlyBookkeeping, max_epochs=3)
    assert strategy.retraces == 0


class CountsInPython(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.seen = 0
        self.stats = {"batches": 0}

    def training_step(self, batch, batch_idx):
        self.seen += batch[0].shape[0]
        self.stats["batches"] = self.stats["batches"] + 1
        return super().training_step(batch, batch_idx)


def test_a_step_that_changes_python_values_counts_as_on_cpu():
    """`self.seen += n` and a count in a dict the module holds: written back after each
    call, as eager would; the counts become graph inputs at their first change."""
    (_, cpu, _), (trainer, mn, _) = _runs(CountsInPython)
    assert (mn.seen, mn.stats) == (cpu.seen, cpu.stats) == (128, {"batches": 8})
    assert trainer.strategy.retraces == 1


class LazyCache(nn.Module):
    """A library-style submodule that fills a Python cache on its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.cached_width = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cached_width < x.shape[-1]:
            self.cached_width = x.shape[-1]
        return x


class UsesALazyCache(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.cache = LazyCache()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(self.cache(x)), y)


def test_a_submodule_filling_a_cache_in_the_step_keeps_it_as_on_cpu():
    (_, cpu, _), (trainer, mn, _) = _runs(UsesALazyCache, max_epochs=2)
    assert mn.cache.cached_width == cpu.cache.cached_width == 8
    assert trainer.strategy.retraces == 1  # the first call filled it: its guard fails once


TOTALS = {"loss": torch.zeros(())}
LOSSES: list[torch.Tensor] = []
POSITIONS: dict[int, torch.Tensor] = {}


class KeepsTotalsInGlobals(LitClassifier):
    """State kept in module-level globals."""

    way = "replace"

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.way == "replace":
            TOTALS["loss"] = TOTALS["loss"] + loss.detach()
        elif self.way == "in place":
            TOTALS["loss"].add_(loss.detach())
        else:
            LOSSES.append(loss.detach())
        return loss


@pytest.mark.parametrize("way", ["replace", "in place", "append"])
def test_a_step_that_changes_tensors_in_module_globals_changes_them_as_on_cpu(way):
    """A dict entry replaced or added to in place, a list appended to: the host's
    globals hold what cpu's hold after the fit."""
    model_cls = type(f"KeepsTotals{way.title()}", (KeepsTotalsInGlobals,), {"way": way})
    results = []
    for accelerator in ("cpu", "mncore"):
        TOTALS["loss"] = torch.zeros(())
        LOSSES.clear()
        trainer, _, losses = fit_once(accelerator, model_cls=model_cls)
        results.append((TOTALS["loss"].clone(), list(LOSSES), losses.losses, trainer))
    (cpu_total, cpu_list, cpu_losses, _), (mn_total, mn_list, mn_losses, trainer) = results
    torch.testing.assert_close(torch.stack(mn_losses), torch.stack(cpu_losses), atol=ATOL, rtol=0)
    if way == "append":
        assert len(mn_list) == len(cpu_list) == 8
        torch.testing.assert_close(torch.stack(mn_list), torch.stack(cpu_list), atol=ATOL, rtol=0)
        # the list's length guard fails twice (empty, then one item), then it is appended
        # to after each call without a re-compile (mncore_device.capture.appended_lists)
        assert trainer.strategy.retraces == 2
    else:
        assert float(cpu_total) > 0
        torch.testing.assert_close(mn_total, cpu_total, atol=ATOL, rtol=0)
        assert trainer.strategy.retraces == 0  # the total is a tensor input of the graph
    TOTALS["loss"] = torch.zeros(())
    LOSSES.clear()


class CachesPositionsInAGlobal(LitClassifier):
    """A cache of constants filled on the first call, as a lazy positional table."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if x.shape[-1] not in POSITIONS:
            POSITIONS[x.shape[-1]] = torch.linspace(0.9, 1.1, x.shape[-1])
        return super().training_step((x * POSITIONS[x.shape[-1]], y), batch_idx)


def test_a_global_cache_of_constants_filled_in_the_step_is_kept_as_on_cpu():
    runs, caches = [], []
    for accelerator in ("cpu", "mncore"):
        POSITIONS.clear()
        runs.append(fit_once(accelerator, model_cls=CachesPositionsInAGlobal))
        caches.append(dict(POSITIONS))
    POSITIONS.clear()
    (_, cpu, cpu_losses), (trainer, mn, mn_losses) = runs
    torch.testing.assert_close(
        torch.stack(mn_losses.losses), torch.stack(cpu_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu, mn)
    cpu_cache, mn_cache = caches
    assert mn_cache.keys() == cpu_cache.keys() == {8}
    torch.testing.assert_close(mn_cache[8], cpu_cache[8], atol=0, rtol=0)
    assert trainer.strategy.retraces == 1  # filled at the first call: `8 in POSITIONS` flips


MIXUP_RNG = np.random.default_rng(7)


class MixesWithAHostGenerator(LitClassifier):
    """A mixup weight drawn from a generator object the module holds (or a global one)."""

    source = "numpy"

    def __init__(self) -> None:
        super().__init__()
        self.generators = {"numpy": np.random.default_rng(7), "python": random.Random(7)}
        self.rng, self.py_rng = self.generators["numpy"], self.generators["python"]

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.source == "numpy":
            lam = self.rng.beta(0.4, 0.4)
        elif self.source == "python":
            lam = self.py_rng.random()
        elif self.source == "shuffle":  # the random module's own generator
            weights = [0.25, 0.5, 0.75, 1.0]
            random.shuffle(weights)
            lam = weights[0] + 0.1 * random.random()
        else:
            lam = MIXUP_RNG.random()
        self.log("lam", lam)
        return super().training_step((x * lam, y), batch_idx)


class LoggedLam(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.values.append(float(trainer.callback_metrics["lam"]))


@pytest.mark.parametrize("source", ["numpy", "python", "shuffle", "global"])
def test_drawing_from_a_host_generator_object_draws_as_on_cpu(source):
    """A draw from a NumPy or Python generator the module or a global holds, or from the
    random module's, runs once a step, on the host (a graph break; Dynamo's own model of an
    existing random.Random would draw the first step's values again at every step:
    mncore_device.capture.host_random): each step's value and the generators' final states
    are cpu's."""
    model_cls = type(f"Mixes{source.title()}", (MixesWithAHostGenerator,), {"source": source})
    states, lams = [], []
    runs = []
    for accelerator in ("cpu", "mncore"):
        MIXUP_RNG.bit_generator.state = np.random.default_rng(7).bit_generator.state
        logged = LoggedLam()
        trainer, model, losses = fit_once(
            accelerator, model_cls=model_cls, callbacks=[logged], max_epochs=3
        )
        runs.append((trainer, model, losses))
        lams.append(logged.values)
        states.append(
            (
                model.rng.bit_generator.state,
                model.py_rng.getstate(),
                MIXUP_RNG.bit_generator.state,
                random.getstate(),
            )
        )
    (_, cpu, cpu_losses), (trainer, mn, mn_losses) = runs
    torch.testing.assert_close(
        torch.stack(mn_losses.losses), torch.stack(cpu_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu, mn)
    assert len(lams[1]) == 12 and len(set(lams[1])) >= 8  # a new draw at every step
    assert lams[1] == pytest.approx(lams[0], abs=ATOL)
    assert states[1] == states[0]
    MIXUP_RNG.bit_generator.state = np.random.default_rng(7).bit_generator.state


class Settings:
    """A plain object of the user's holding Python numbers."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.steps = 0


class ReadsPlainSettings(LitClassifier):
    """The step reads a number on a plain object, which a hook changes every epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.settings = Settings()

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.settings.scale

    def on_train_epoch_end(self) -> None:
        self.settings.scale *= 0.5


def test_numbers_on_a_plain_object_changed_by_a_hook_are_followed():
    strategy = _same_run(ReadsPlainSettings, max_epochs=3)
    assert strategy.retraces >= 1


class CountsOnAPlainObject(ReadsPlainSettings):
    def training_step(self, batch, batch_idx):
        self.settings.steps += 1
        return super().training_step(batch, batch_idx)


def test_a_step_that_changes_a_number_on_a_plain_object_counts_as_on_cpu():
    (_, cpu, _), (trainer, mn, _) = _runs(CountsOnAPlainObject, max_epochs=3)
    assert mn.settings.steps == cpu.settings.steps == 12
    assert mn.settings.scale == cpu.settings.scale == 0.125
    # steps: its guard fails at the second call, then it is a graph input; scale: changed
    # by the hook after the first epoch, likewise
    assert trainer.strategy.retraces == 2
