"""Run a LightningModule's compiled hooks once per stage on the emulator, on copies, and fill
the report from what the capture recorded.

A private Trainer trains one batch for two epochs (so that epoch hooks that change what the
step was traced for show up as re-traces), validates, tests and predicts one batch, at each
preset asked for, with an `MNCoreStrategy` on `pfvm:cpu` that keeps every compiled hook, its
graph (its codegen directory) and its trace + compile time. The user's module, optimizer,
data and random state are left as they were.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import inspect
import logging
import random
import re
import shutil
import tempfile
import textwrap
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

from mncore_device import Context, StaticGraphError, artifacts
from mncore_device._source import user_frame_summary

from ..compiled_hooks import BATCH_PREFIX, CompiledHook, _HostCall, _leaf_names, _LogCall
from ..side_effects import _MetricCall
from ..step_counters import COUNTER_PREFIX
from ..strategy import MNCoreStrategy
from . import graph as graphs
from .report import DataReport, GraphBreak, GuardedValue, HookReport, Memory, PreflightReport

# MN-Core 2's board memory: no public figure was found (docs/preflight.md says where we
# looked); pass it with board_memory_bytes= / --board-memory-gib.
BOARD_MEMORY_SOURCE = (
    "no public figure found: MLSDK's hardware specification "
    "(https://dev.mn-core.com/sdk/0.5/MLSDK/docs/en/hardware_specification.html) describes one "
    "DRAM per Group, 4 Groups per board, without a capacity; pass board_memory_bytes= "
    "(--board-memory-gib)"
)
STAGE_HOOKS = {
    "train": "training_step",
    "validate": "validation_step",
    "test": "test_step",
    "predict": "predict_step",
}
_LINE = re.compile(r"\bat ([^\s,;()]+\.py:\d+)")


@dataclass
class _Compiled:
    stage: str
    hook_name: str
    hook: CompiledHook
    codegen_dir: Path
    seconds: float
    trainer: L.Trainer


@dataclass
class _Record:
    compiled: list[_Compiled] = field(default_factory=list)
    # stage -> (hook, error): the capture refused the step (a graph break), or it failed
    refused: dict[str, tuple[str, BaseException]] = field(default_factory=dict)
    retraces: list[tuple[str, str]] = field(default_factory=list)  # (stage, reason)


class _RecordingStrategy(MNCoreStrategy):
    """MNCoreStrategy that keeps what it compiled, each into a codegen directory of its own."""

    def __init__(self, record: _Record, workdir: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # The report reads what the make_fx tracer compiled (its graphs, refusals and
        # re-traces); the steps that TorchDynamo captures (captured_hooks.py) are not
        # reported yet, so the preflight traces every step with make_fx.
        self.capture = "trace"
        self._record = record
        self._workdir = workdir

    def _compile(self, hook_name: str, batch: Any, rest: tuple, label: str | None = None, **kw):
        stage = _stage_name(self._stage())
        base = self._workdir / f"{len(self._record.compiled):03d}"
        self.codegen_dir = base
        start = time.perf_counter()
        try:
            hook, inputs = super()._compile(hook_name, batch, rest, label, **kw)
        except Exception as error:
            self._record.refused.setdefault(stage, (hook_name, error))
            raise
        seconds = time.perf_counter() - start
        directory = next(p.parent for p in base.rglob("specs.json"))
        trainer = self.lightning_module.trainer
        self._record.compiled.append(_Compiled(stage, hook_name, hook, directory, seconds, trainer))
        return hook, inputs

    def _retrace(self, what: str, reason: str) -> None:
        self._record.retraces.append((_stage_name(self._stage()), f"{what}: {reason}"))
        super()._retrace(what, reason)


def _stage_name(stage: str) -> str:
    return {"fit": "train", "train": "train", "sanity_check": "validate"}.get(stage, stage)


def copy_module(module: LightningModule) -> LightningModule:
    """A deep copy, without the Trainer it may be attached to."""
    trainer = module._trainer
    module._trainer = None
    try:
        return copy.deepcopy(module)
    finally:
        module._trainer = trainer


@contextlib.contextmanager
def _kept_random_state() -> Iterator[None]:
    states = (torch.random.get_rng_state(), np.random.get_state(), random.getstate())
    context = Context._current
    try:
        yield
    finally:
        torch.random.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        Context._current = context


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def run_preflight(
    module: LightningModule,
    dataloaders: Mapping[str, DataLoader | None],
    presets: tuple[str, ...] = ("O0",),
    board_memory_bytes: int | None = None,
    measure: bool = True,
    steps_per_call: int = 1,
) -> PreflightReport:
    """Compile the hooks of `module` for the stages that have a DataLoader ("train",
    "validate", "test", "predict") on copies, and report on them."""
    if not presets:
        raise ValueError("preflight needs at least one preset (O0 is the fast one)")
    stages = [s for s in STAGE_HOOKS if dataloaders.get(s) is not None]
    notes: list[str] = []
    runs: dict[str, tuple[_Record, LightningModule]] = {}
    workdirs = []
    try:
        for preset in presets:
            workdir = Path(tempfile.mkdtemp(prefix="mncore-preflight-"))
            workdirs.append(workdir)
            with (
                _kept_random_state(),
                _quiet_lightning(),
                warnings.catch_warnings(record=True) as seen,
            ):
                warnings.simplefilter("always")
                runs[preset] = _run(module, dataloaders, stages, preset, workdir, steps_per_call)
            if preset == presets[0]:
                for w in seen:
                    text = str(w.message).split("\n")[0]
                    if "mncore" in str(w.filename) or "MNCore" in text or "compiled" in text:
                        if text not in notes:
                            notes.append(text)
        record, copied = runs[presets[0]]
        hooks = [
            _hook_report(stage, record, copied, runs, board_memory_bytes, measure)
            for stage in stages
        ]
        hooks = [h for h in hooks if h is not None]
    finally:
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)
    board = {
        "bytes": board_memory_bytes,
        "source": "given" if board_memory_bytes else BOARD_MEMORY_SOURCE,
    }
    data = [_data_report(stage, dataloaders[stage], steps_per_call) for stage in stages]
    return PreflightReport(
        module=type(module).__qualname__,
        device="pfvm:cpu (emulated MN-Core 2)",
        hooks=hooks,
        data=data,
        board_memory=board,
        notes=notes,
    )


def _run(
    module: LightningModule,
    dataloaders: Mapping[str, DataLoader | None],
    stages: list[str],
    preset: str,
    workdir: Path,
    steps_per_call: int,
) -> tuple[_Record, LightningModule]:
    """Fit (one batch, two epochs, validating), test and predict a copy of `module` with the
    recording strategy; a stage whose step fails is recorded and the next one runs."""
    record = _Record()
    copied = copy_module(module)

    def trainer() -> L.Trainer:
        strategy = _RecordingStrategy(
            record,
            workdir,
            device="pfvm:cpu",
            preset=preset,
            max_retraces=1000,
            steps_per_call=steps_per_call,
        )
        return L.Trainer(
            accelerator="mncore",
            strategy=strategy,
            max_epochs=2,
            limit_train_batches=1,
            limit_val_batches=1,
            limit_test_batches=1,
            limit_predict_batches=1,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(workdir),
        )

    get = dataloaders.get
    runs = {
        "train": lambda: trainer().fit(copied, get("train"), get("validate")),
        "validate": lambda: trainer().validate(copied, get("validate"), verbose=False),
        "test": lambda: trainer().test(copied, get("test"), verbose=False),
        "predict": lambda: trainer().predict(copied, get("predict")),
    }
    for stage in stages:
        if any(c.stage == stage for c in record.compiled) or stage in record.refused:
            continue  # validation ran within fit
        try:
            runs[stage]()
        except Exception as error:  # noqa: BLE001 - a refused step is what the report shows
            seen = [e for _, e in record.refused.values()]
            if not any(error is e or error.__context__ is e for e in seen):
                # not from a compile (the strategy recorded those, by their stage)
                record.refused.setdefault(stage, (STAGE_HOOKS[stage], error))
    return record, copied


def _hook_report(
    stage: str,
    record: _Record,
    module: LightningModule,
    runs: Mapping[str, tuple],
    board_memory_bytes: int | None,
    measure: bool,
) -> HookReport | None:
    hook_name = STAGE_HOOKS[stage]
    compiled = [c for c in record.compiled if c.stage == stage]
    breaks, error = _failure(record.refused.get(stage, (None, None))[1])
    if stage in record.refused and not compiled:
        name = record.refused[stage][0]
        return HookReport(stage, name, compiles=False, graph_breaks=breaks, error=error)
    if not compiled:
        return None
    first = compiled[0]
    hook, trainer = first.hook, first.trainer
    traced, specs = artifacts.load(first.codegen_dir)
    gm = traced.graph_module
    placeholders = graphs.placeholder_specs(specs)
    graphs.propagate_shapes(gm, placeholders)
    activations = graphs.activation_peak(gm)
    measured = None
    if measure:
        args = [_sample(shape, dtype) for shape, dtype in placeholders]
        measured = graphs.measured_peak(gm, args)
    inputs = specs["inputs"]
    input_bytes = sum(
        int(np.prod(e["shape"], dtype=np.int64)) * getattr(torch, e["dtype"]).itemsize
        for e in inputs.values()
    )
    params = sum(_bytes(p) for p in module.parameters())
    buffers = sum(_bytes(b) for b in module.buffers())
    optimizer_state = sum(
        _bytes(t)
        for opt in trainer.optimizers
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    # the larger of the two: a storage the shapes cannot see (mse_loss's) is counted
    activation_peak = max(activations.peak_bytes, measured or 0)
    peak = params + buffers + optimizer_state + input_bytes + activation_peak
    memory = Memory(
        params,
        buffers,
        optimizer_state,
        input_bytes,
        activations.peak_bytes,
        peak,
        measured,
        board_memory_bytes,
    )
    names = _leaf_names(hook.layout.spec)
    batch_shapes = {
        f"batch{names[int(k.removeprefix(BATCH_PREFIX))]}": [v["shape"], v["dtype"]]
        for k, v in inputs.items()
        if k.startswith(BATCH_PREFIX)
    }
    seconds = {}
    for preset, (other, *_rest) in runs.items():
        same = [c for c in other.compiled if c.stage == stage]
        if same:
            seconds[preset] = round(same[0].seconds, 3)
    return HookReport(
        stage,
        hook_name,
        compiles=not breaks and error is None,  # every batch of the preflight compiled
        device_calls_per_step=1.0 / trainer.strategy.steps_per_call if stage == "train" else 1.0,
        graphs=len(compiled),
        batch_shapes=batch_shapes,
        guarded=_guarded(hook, module),
        live_inputs=_live_inputs(hook, specs, trainer),
        carried=sorted("self." + k.removeprefix("carry/") for k in hook.carried.slots),
        replayed=_replayed(hook),
        op_counts=graphs.op_counts(gm),
        memory=memory,
        seconds=seconds,
        retraces=[reason for s, reason in record.retraces if s == stage],
        error=error,  # a later batch failed (a re-trace the capture refused, say)
        graph_breaks=breaks,
    )


def _failure(error: BaseException | None) -> tuple[list[GraphBreak], GraphBreak | None]:
    """A refusal of the capture is a graph break (at the line its message names); any other
    failure is an error, at the innermost user frame of its traceback."""
    if error is None:
        return [], None
    message = str(error)
    if isinstance(error, StaticGraphError):
        match = _LINE.search(message)
        return [GraphBreak(match[1] if match else _user_line(error), message)], None
    return [], GraphBreak(_user_line(error), f"{type(error).__name__}: {message}")


def _user_line(error: BaseException) -> str | None:
    """The innermost frame of the error's traceback in the user's code (not in a library)."""
    frame = user_frame_summary(traceback.extract_tb(error.__traceback__))
    return None if frame is None else f"{frame.filename}:{frame.lineno}"


def _sample(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Values to measure a graph with; its own generator leaves the global RNG alone."""
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(0))
    return torch.zeros(shape, dtype=dtype)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _guarded(hook: CompiledHook, module: LightningModule) -> list[GuardedValue]:
    writers = _attribute_writers(type(module))
    found = []
    for key, (_, _, value) in sorted(hook.python_values.guarded.items()):
        name = key.removeprefix("self.")
        found.append(GuardedValue(key, value, writers.get(name, [])))
    return found


# hooks that run before the first step is traced: what they assign is traced for, not changed
_BEFORE_FIRST_STEP = frozenset(
    {
        "__init__",
        "setup",
        "prepare_data",
        "configure_model",
        "configure_sharded_model",
        "configure_optimizers",
        "configure_callbacks",
        "on_fit_start",
        "on_train_start",
    }
)


def _attribute_writers(cls: type) -> dict[str, list[str]]:
    """`{"scale": [methods], "temperature.value": [...], "hparams.lr": [...]}`: the
    methods of the user's classes (not Lightning's, not those that run before the first
    step) that assign `self.<path>`."""
    writers: dict[str, list[str]] = {}
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in (
            "lightning",
            "pytorch_lightning",
            "torch",
            "builtins",
        ):
            continue
        for name, function in vars(klass).items():
            if name in _BEFORE_FIRST_STEP or not inspect.isfunction(function):
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
            except (OSError, TypeError, SyntaxError):
                continue
            for node in ast.walk(tree):
                targets = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                for target in targets:
                    path = _self_path(target)
                    if path is not None and name not in writers.setdefault(path, []):
                        writers[path].append(name)
    return writers


def _self_path(target: ast.expr) -> str | None:
    """`self.a.b = ...` -> "a.b"; `self.net[2].p` -> "net.2.p" (a submodule's name);
    `self.d["k"] = ...` -> "d['k']"; else None."""
    parts = []
    while True:
        if isinstance(target, ast.Attribute):
            parts.append(f".{target.attr}")
        elif isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
            key = target.slice.value
            parts.append(f".{key}" if isinstance(key, int) else f"[{key!r}]")
        else:
            break
        target = target.value
    if not parts or not (isinstance(target, ast.Name) and target.id == "self"):
        return None
    return "".join(reversed(parts)).removeprefix(".")


def _live_inputs(hook: CompiledHook, specs: Mapping, trainer: L.Trainer) -> list[str]:
    live = [
        k.removeprefix(COUNTER_PREFIX)
        for k in specs["inputs"]
        if k.startswith(COUNTER_PREFIX) and k.removeprefix(COUNTER_PREFIX) in hook.used_counters
    ]
    constants = [s for s in specs["state"] if s["kind"] == "constant" and not s["shape"]]
    if (
        constants
        and trainer.optimizers
        and any(s["name"].startswith("<captured") for s in constants)
    ):
        keys = sorted(
            {
                k
                for opt in trainer.optimizers
                for group in opt.param_groups
                for k, v in group.items()
                if k != "params" and isinstance(v, (float, torch.Tensor))
            }
        )
        if "lr" in keys:
            live.append("optimizer hyperparameters (" + ", ".join(keys) + ")")
    return live


def _replayed(hook: CompiledHook) -> list[str]:
    found = []
    for call in hook.recorder.calls:
        if isinstance(call, _LogCall):
            found.append(f"self.log({call.name!r})")
        elif isinstance(call, _MetricCall):
            found.append(call.describe())
        elif isinstance(call, _HostCall):
            found.append(getattr(call.call, "__qualname__", "a host call").split(".<")[0])
    for append in hook.effects.appends:
        found.append(f"self.{hook.effects.path_of(append.module)}{append.name}.append(...)")
    return found


def _data_report(stage: str, loader: DataLoader, steps_per_call: int = 1) -> DataReport:
    batch_size = getattr(loader, "batch_size", None)
    drop_last = bool(getattr(loader, "drop_last", False)) or stage == "train"
    try:
        samples = len(loader.dataset)
    except TypeError:
        samples = None
    batches = None
    dropped, ragged = 0, None
    if samples is not None and batch_size:
        rest = samples % batch_size
        batches = samples // batch_size + (0 if drop_last or not rest else 1)
        if drop_last:
            dropped = rest
        elif rest:
            ragged = rest
    calls = batches
    if batches is not None and stage == "train":
        calls = -(-batches // steps_per_call)  # a shorter last group is a call too
    return DataReport(stage, batch_size, batches, samples, drop_last, dropped, ragged, calls)
