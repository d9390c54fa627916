"""Python numbers and strings a compiled step reads or writes are never silently frozen.

A value the step reads and a hook or callback changes makes the strategy trace the step again
(the losses and weights match cpu within ATOL = 1e-5); a value the step itself changes is
refused at trace time, by name, with the host value left as it was.
"""

from __future__ import annotations

import inspect
import random
import re
import warnings

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from mncore_device import StaticGraphError
from tests.lightning.lightning_testing import (
    ATOL,
    LitClassifier,
    assert_state_close,
    fit_once,
    loader,
    make_trainer,
)

pytestmark = pytest.mark.usefixtures("make_fx_capture")


def _same_run(model_cls, **kwargs):
    runs = [
        fit_once(accelerator, model_cls=model_cls, **kwargs) for accelerator in ("cpu", "mncore")
    ]
    (_, cpu_model, cpu_losses), (mn_trainer, mn_model, mn_losses) = runs
    torch.testing.assert_close(
        torch.stack(cpu_losses.losses), torch.stack(mn_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu_model, mn_model)
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
    assert strategy.retraces == 2  # epochs 1 and 2: the step read new values


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


def test_a_step_that_changes_python_values_is_refused_by_name_and_the_host_kept():
    with pytest.raises(StaticGraphError) as error:
        fit_once("mncore", model_cls=CountsInPython)
    message = str(error.value)
    assert "self.seen: 0 -> " in message and "self.stats['batches']: 0 -> 1" in message
    assert "on_train_batch_end" in message
    lines, first = inspect.getsourcelines(CountsInPython.training_step)
    line = first + next(i for i, text in enumerate(lines) if "self.seen +=" in text)
    assert f"test_python_values.py:{line}" in message  # the user's line that set it


def test_the_refused_trace_leaves_the_modules_python_values_as_they_were():
    model = CountsInPython()
    with pytest.raises(StaticGraphError):
        make_trainer("mncore").fit(model, loader())
    assert model.seen == 0 and model.stats == {"batches": 0}


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


def test_a_submodule_filling_a_cache_at_trace_time_keeps_it_and_warns():
    with pytest.warns(UserWarning, match=r"self.cache.cached_width: 0 -> 8"):
        strategy = _same_run(UsesALazyCache, max_epochs=2)
    assert strategy.retraces == 0


TOTALS = {"loss": torch.zeros(())}
LOSSES: list[torch.Tensor] = []
POSITIONS: dict[int, torch.Tensor] = {}


class KeepsTotalsInGlobals(LitClassifier):
    """State kept in module-level globals, which a compiled step cannot carry."""

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
def test_a_step_that_changes_tensors_in_module_globals_is_refused_by_name(way):
    model_cls = type(f"KeepsTotals{way.title()}", (KeepsTotalsInGlobals,), {"way": way})
    total, losses = TOTALS["loss"], list(LOSSES)
    name = "LOSSES" if way == "append" else "TOTALS"
    with pytest.raises(StaticGraphError, match=rf"global {__name__}\.{name} "):
        fit_once("mncore", model_cls=model_cls)
    assert TOTALS["loss"] is total and LOSSES == losses  # the bindings are as they were


class CachesPositionsInAGlobal(LitClassifier):
    """A cache of constants filled on the first call, as a lazy positional table."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if x.shape[-1] not in POSITIONS:
            POSITIONS[x.shape[-1]] = torch.linspace(0.9, 1.1, x.shape[-1])
        return super().training_step((x * POSITIONS[x.shape[-1]], y), batch_idx)


def test_a_global_cache_of_constants_filled_at_trace_time_is_kept_with_a_warning():
    runs = []
    for accelerator in ("mncore", "cpu"):
        POSITIONS.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs.append(fit_once(accelerator, model_cls=CachesPositionsInAGlobal))
        cached = [w for w in caught if f"global {__name__}.POSITIONS" in str(w.message)]
        assert len(cached) == (accelerator == "mncore")
    (_, mn_model, mn_losses), (_, cpu_model, cpu_losses) = runs
    torch.testing.assert_close(
        torch.stack(mn_losses.losses), torch.stack(cpu_losses.losses), atol=ATOL, rtol=0
    )
    assert_state_close(cpu_model, mn_model)


MIXUP_RNG = np.random.default_rng(7)


class MixesWithAHostGenerator(LitClassifier):
    """A mixup weight drawn from a generator object the module holds (or a global one):
    drawn once at trace time, so refused."""

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
        else:
            lam = MIXUP_RNG.random()
        return super().training_step((x * lam, y), batch_idx)


@pytest.mark.parametrize(
    ("source", "named"),
    [("numpy", "self.rng"), ("python", "self.py_rng"), ("global", f"{__name__}.MIXUP_RNG")],
)
def test_drawing_from_a_host_generator_object_is_refused_and_its_state_put_back(source, named):
    model_cls = type(f"Mixes{source.title()}", (MixesWithAHostGenerator,), {"source": source})
    global_state = MIXUP_RNG.bit_generator.state
    model = model_cls()
    with pytest.raises(StaticGraphError, match=rf"{re.escape(named)}, a random generator"):
        make_trainer("mncore").fit(model, loader(shuffle=True))
    assert MIXUP_RNG.bit_generator.state == global_state  # the trace's draw is undone
    assert model.rng.random() == np.random.default_rng(7).random()
    assert model.py_rng.random() == random.Random(7).random()


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


def test_a_step_that_changes_a_number_on_a_plain_object_is_refused_and_put_back():
    model = CountsOnAPlainObject()
    with pytest.raises(StaticGraphError, match=r"self\.settings\.steps: 0 -> 1"):
        make_trainer("mncore").fit(model, loader())
    assert model.settings.steps == 0
