"""`MNCorePreflight`: the preflight report as a Trainer callback, before the first step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from .report import PreflightReport
from .run import run_preflight

FAIL_ON = ("graph_break", "retrace", "memory")
_STAGES = {"fit": ("train", "validate"), "validate": ("validate",), "test": ("test",)}
_STAGES["predict"] = ("predict",)


class PreflightError(MisconfigurationException):
    """The preflight found what `fail_on` names: the run stops before any device time."""


class MNCorePreflight(Callback):
    """Report, at `setup`, on what the run's compiled steps will be: one batch of each stage
    captured by TorchDynamo and compiled on the emulator (pfvm:cpu) at `presets`, on copies of
    the module and optimizer. Works whatever the Trainer's accelerator ("mncore" or "cpu").

    Args:
        fail_on: stop the run (PreflightError) on "graph_break" (host code between device
            calls, a step the capture refuses, or one that fails), "retrace" (a re-compile
            seen, or a guarded value a method assigns), "memory" (the peak over
            `board_memory_bytes`).
        presets: trace + compile time is measured at each (O0 is fast; O1+ run Inductor).
        json_path: also write the report as JSON there.
        board_memory_bytes: the board's memory, to compare the peak with.
        print_report: print the Markdown report (rich on a terminal).
    """

    def __init__(
        self,
        fail_on: tuple[str, ...] | list[str] = (),
        presets: tuple[str, ...] | list[str] = ("O0",),
        json_path: str | Path | None = None,
        board_memory_bytes: int | None = None,
        print_report: bool = True,
    ) -> None:
        unknown = set(fail_on) - set(FAIL_ON)
        if unknown:
            raise ValueError(
                f"MNCorePreflight(fail_on=...): unknown {sorted(unknown)}; use {FAIL_ON}"
            )
        self.fail_on = tuple(fail_on)
        self.presets = tuple(presets)
        self.json_path = json_path
        self.board_memory_bytes = board_memory_bytes
        self.print_report = print_report
        self.report: PreflightReport | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.global_rank != 0 and not self.fail_on:
            return
        loaders = {s: _dataloader(trainer, s) for s in _STAGES.get(stage, ())}
        steps_per_call = getattr(trainer.strategy, "steps_per_call", 1)
        self.report = run_preflight(
            pl_module,
            loaders,
            self.presets,
            board_memory_bytes=self.board_memory_bytes,
            steps_per_call=steps_per_call,
        )
        if trainer.global_rank == 0:
            if self.print_report:
                self.report.print()
            if self.json_path is not None:
                self.report.to_json(self.json_path)
        failures = self.report.failures(self.fail_on)
        if failures:
            raise PreflightError(
                "MNCorePreflight(fail_on=" + repr(self.fail_on) + ") stopped the run before "
                "any step: " + "; ".join(failures)
            )


def _dataloader(trainer: Any, stage: str) -> Any:
    """The DataLoader the Trainer would use for `stage` (from fit/validate/test/predict's
    arguments, the DataModule or the module's hooks); its first one if several."""
    loop = {
        "train": trainer.fit_loop,
        "validate": trainer.fit_loop.epoch_loop.val_loop
        if trainer.state.fn == "fit"
        else trainer.validate_loop,
        "test": trainer.test_loop,
        "predict": trainer.predict_loop,
    }[stage]
    source = loop._data_source
    if not source.is_defined():
        return None
    try:
        loader = source.dataloader()
    except Exception:  # noqa: BLE001 - a stage without data is not reported
        return None
    if isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    elif isinstance(loader, dict):
        loader = next(iter(loader.values()), None)
    return loader
