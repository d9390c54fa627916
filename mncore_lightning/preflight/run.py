"""Run a LightningModule's hooks once per stage on the emulator, on copies, through the
strategy's TorchDynamo capture, and fill the report from what it captured.

A private Trainer trains one batch for two epochs (so that epoch hooks that change what a step
was captured for show up as re-compiles), validates, tests and predicts one batch, at each
preset asked for, with an `MNCoreStrategy` on `pfvm:cpu` and its default capture. It keeps
each captured hook (`CapturedHook`: its Dynamo graphs with their typed inputs and guards, its
graph breaks and re-compiles, its `self.log` calls, the device functions it compiled and their
codegen directories) and the time of its first call. The user's module, optimizer, data and
random state are left as they were.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import random
import re
import shutil
import tempfile
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
from torch._dynamo.source import ConstDictKeySource
from torch.utils._pytree import keystr, tree_flatten_with_path
from torch.utils.data import DataLoader

from mncore_device import Context, StaticGraphError
from mncore_device._source import frames_of, user_frame_summary
from mncore_device.capture import InputKind
from mncore_device.runtime import artifacts

from ..data import StepGroup
from ..steps.groups import CapturedStepGroup
from ..steps.hooks import CapturedHook
from ..steps.manual_host import is_host_call
from ..strategy import MNCoreStrategy
from . import graph as graphs
from .report import DataReport, GraphBreak, GuardedValue, HookReport, Memory, PreflightReport
from .sources import Namer, assigned_attributes, plain

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
_LINE = re.compile(r"([^\s(\[]+\.py:\d+)")
_SCHEDULER_STEP = (
    "scheduler_step"  # the marker a manual step's `sch.step()` leaves (steps/manual.py)
)


@dataclass
class _FirstCall:
    """What one captured hook did at its first call in the preflight."""

    stage: str
    hook: CapturedHook
    seconds: float  # capture, trace and compile of its device graphs, and the call
    functions: list[Any]  # the device functions it compiled
    graphs: int  # the Dynamo graphs it captured
    logged: list[str]  # its `self.log` calls, by name
    batch_shapes: dict[str, list]
    appended: list[str]  # the module's lists it appended to
    codegen_root: Path  # where its device functions' codegen directories are
    trainer: L.Trainer


@dataclass
class _Record:
    calls: list[_FirstCall] = field(default_factory=list)
    # stage -> (hook, error): the capture refused the step, or it failed
    refused: dict[str, tuple[str, BaseException]] = field(default_factory=dict)
    retraces: list[tuple[str, str, str]] = field(default_factory=list)  # (stage, what, reason)


class _RecordingStrategy(MNCoreStrategy):
    """MNCoreStrategy that keeps the first call of each hook it captured, its device
    functions' codegen directories under `workdir`."""

    def __init__(self, record: _Record, workdir: Path, **kwargs: Any) -> None:
        super().__init__(codegen_dir=workdir, **kwargs)
        self._record = record

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._recorded("training_step", super().training_step, args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._recorded("validation_step", super().validation_step, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._recorded("test_step", super().test_step, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._recorded("predict_step", super().predict_step, args, kwargs)

    def _recorded(self, hook_name: str, step: Any, args: tuple, kwargs: dict) -> Any:
        stage = _stage_name(self._stage())
        known = list(self._captured.values())
        module = self.lightning_module
        lengths = _list_lengths(module)
        start = time.perf_counter()
        try:
            result = step(*args, **kwargs)
        except Exception as error:
            self._record.refused.setdefault(stage, (hook_name, error))
            raise
        seconds = time.perf_counter() - start
        for hook in self._captured.values():
            if any(hook is k for k in known):
                continue
            logged = hook.logged
            if not logged and isinstance(hook, CapturedStepGroup):  # it replayed them already
                results = module.trainer._results or {}
                logged = [k.split(".", 1)[1] for k in results if k.startswith(f"{hook_name}.")]
            self._record.calls.append(
                _FirstCall(
                    stage,
                    hook,
                    seconds,
                    list(hook.compiled),
                    len(hook.frontend.graphs),
                    logged,
                    _batch_shapes(args[0]),
                    _appended(module, lengths),
                    self.codegen_dir,
                    module.trainer,
                )
            )
        return result

    def _retrace(self, what: str, reason: str) -> None:
        self._record.retraces.append((_stage_name(self._stage()), what, reason))
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
    """Lightning's messages, and FakeTensor's traceback of an op that fails (the report
    names the error and the user's line)."""
    names = ("lightning.pytorch", "lightning.fabric", "torch._subclasses.fake_tensor")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL if lg.name.startswith("torch") else logging.ERROR)
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
    trainers = 0

    def trainer() -> L.Trainer:
        nonlocal trainers
        trainers += 1
        strategy = _RecordingStrategy(
            record,
            workdir / f"run_{trainers}",  # each strategy numbers its codegen folders anew
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
        if any(c.stage == stage for c in record.calls) or stage in record.refused:
            continue  # validation ran within fit
        try:
            runs[stage]()
        except Exception as error:  # noqa: BLE001 - a refused step is what the report shows
            seen = [e for _, e in record.refused.values()]
            if not any(error is e or error.__context__ is e for e in seen):
                # not from a step (the strategy recorded those, by their stage)
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
    """One stage's hook, from its first call (memory, ops, batch, what it logged) and from
    all its captured graphs in the preflight (guards, inputs, graph breaks, re-compiles)."""
    hook_name = STAGE_HOOKS[stage]
    calls = [c for c in record.calls if c.stage == stage]
    refusal = record.refused.get(stage)
    refused, error = _failure(refusal[1] if refusal else None)
    if not calls:
        if refusal is None:
            return None
        return HookReport(stage, refusal[0], compiles=False, graph_breaks=refused, error=error)
    first = calls[0]
    hooks = [c.hook for c in calls]
    trainer = first.trainer
    namer = Namer(
        module,
        hook_name,
        optimizers=max(len(trainer.optimizers), 1),
        schedulers=max(len(trainer.lr_scheduler_configs), 1),
        keys=_dict_keys(hooks),
    )
    captured = [
        (graph, sources)
        for hook in hooks
        for graph, sources in zip(hook.frontend.graphs, hook.frontend.sources, strict=True)
    ]
    # one per line: Dynamo may log a break twice as it restarts (a data-dependent guard,
    # then the branch on it); the last reason is the one it acted on
    by_line: dict[str | None, GraphBreak] = {}
    for hook in hooks:
        for found in hook.frontend.breaks:
            if is_host_call(found):  # a manual step's optimizer call, run on the host
                continue
            line = _where_line(found.where)
            by_line[line] = GraphBreak(line, found.reason)
    for found in refused:  # a refusal of what Dynamo saw is reported at its line once
        by_line.setdefault(found.line, found)
    breaks = list(by_line.values())
    memory, ops, constants = _memory_and_ops(first, module, board_memory_bytes, measure)
    seconds = {}
    for preset, (other, *_rest) in runs.items():
        same = [c for c in other.calls if c.stage == stage]
        if same:
            seconds[preset] = round(same[0].seconds, 3)
    named: dict[str, str] = {}  # Dynamo's name of a source (as in its reasons) -> the user's
    guarded = _guarded(hooks, namer, module, named)
    live = _inputs(captured, namer, InputKind.NUMBER, named=named)
    live += _optimizer_hyperparameters(constants, first.trainer.optimizers)
    first_graphs = captured[: first.graphs]
    return HookReport(
        stage,
        hook_name,
        compiles=refusal is None,  # every call of the preflight ran on the device
        device_calls_per_step=_device_calls(first, stage),
        graphs=len(captured),
        batch_shapes=first.batch_shapes,
        guarded=guarded,
        live_inputs=live,
        carried=_inputs(first_graphs, namer, InputKind.TENSOR, self_only=True),
        replayed=_replayed(first, first_graphs),
        op_counts=ops,
        memory=memory,
        seconds=seconds,
        retraces=[
            f"{what}: {_retrace_text(reason, named)}"
            for s, what, reason in record.retraces
            if s == stage
        ],
        error=error,  # a later call failed (a re-compile the capture refused, say)
        graph_breaks=breaks,
    )


def _device_calls(first: _FirstCall, stage: str) -> float:
    """Device calls per step: a training step's (1/K for a group of K steps; more with host
    code, as the hook measured), an evaluation step's graphs."""
    hook = first.hook
    if stage != "train":
        return float(first.graphs)
    if isinstance(hook, CapturedStepGroup):
        return 1.0 / first.trainer.strategy.steps_per_call
    return float(hook.device_calls_per_step or 1)


def _memory_and_ops(
    first: _FirstCall, module: LightningModule, board_memory_bytes: int | None, measure: bool
) -> tuple[Memory | None, dict[str, int], list[dict]]:
    """Memory and op counts of the hook's first call, from its device functions' graphs (as
    their codegen directories hold them): the ops of all of them; the memory of the call that
    needs the most (resident state + its inputs + its activation peak); the captured 0-d
    constants they read (optimizer hyperparameters)."""
    if not first.functions:
        return None, {}, []
    ops: dict[str, int] = dict.fromkeys(graphs.OP_KINDS, 0)
    calls = []  # (need, input bytes, estimated peak, measured peak)
    constants = []
    for function in first.functions:
        traced, specs = artifacts.load(first.codegen_root / function.name)
        gm = traced.graph_module
        constants += [s for s in specs["state"] if s["kind"] == "constant" and not s["shape"]]
        for kind, count in graphs.op_counts(gm).items():
            ops[kind] += count
        placeholders = graphs.placeholder_specs(specs)
        graphs.propagate_shapes(gm, placeholders)
        estimated = graphs.activation_peak(gm).peak_bytes
        measured = None
        if measure:
            args = [_sample(shape, dtype) for shape, dtype in placeholders]
            measured = graphs.measured_peak(gm, args)
        inputs = sum(
            int(np.prod(e["shape"], dtype=np.int64)) * getattr(torch, e["dtype"]).itemsize
            for e in specs["inputs"].values()
        )
        # the larger of the two: a storage the shapes cannot see (mse_loss's) is counted
        calls.append((inputs + max(estimated, measured or 0), inputs, estimated, measured))
    _, inputs, estimated, measured = max(calls, key=lambda c: c[0])
    params = sum(_bytes(p) for p in module.parameters())
    buffers = sum(_bytes(b) for b in module.buffers())
    optimizer_state = sum(
        _bytes(t)
        for opt in first.trainer.optimizers
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    peak = params + buffers + optimizer_state + inputs + max(estimated, measured or 0)
    memory = Memory(
        params, buffers, optimizer_state, inputs, estimated, peak, measured, board_memory_bytes
    )
    return memory, ops, constants


def _failure(error: BaseException | None) -> tuple[list[GraphBreak], GraphBreak | None]:
    """A refusal of the capture is a graph break (at the line its message names); any other
    failure is an error, at the user's line (of what Dynamo was running, or of the traceback),
    with the error the user's code raised (not Dynamo's wrapper of it)."""
    if error is None:
        return [], None
    message = str(error)
    if isinstance(error, StaticGraphError):
        match = _LINE.search(message)
        line = match[1] if match else _user_line(error)
        return [GraphBreak(line, message.split("\n")[0])], None
    original = _original(error)
    if original is not None:
        reason = f"{type(original).__name__}: {original}"
    else:
        reason = f"{type(error).__name__}: {message.partition(chr(10))[0]}"
    return [], GraphBreak(_user_line(error), reason)


def _original(error: BaseException) -> BaseException | None:
    """What the user's code raised under Dynamo's wrappers of it: the innermost error of
    `error`'s chain that is not Dynamo's (None for an error Dynamo raised itself)."""
    if not isinstance(error, torch._dynamo.exc.TorchDynamoException):
        return error
    found, seen, chain = None, error, set()
    while seen is not None and id(seen) not in chain:
        chain.add(id(seen))
        if not isinstance(seen, torch._dynamo.exc.TorchDynamoException):
            found = seen
        seen = seen.__cause__ or seen.__context__
    return found


def _where_line(where: str) -> str | None:
    """ "file.py:N" of a GraphBreak's `where` ("file.py:N in function: code")."""
    match = _LINE.match(where)
    return match[1] if match else None


def _user_line(error: BaseException) -> str | None:
    """The user's innermost frame: in what Dynamo was running (its `real_stack`), else in the
    error's traceback (not in a library)."""
    stack = list(getattr(error, "real_stack", None) or [])
    frame = user_frame_summary(stack) if stack else None
    if frame is None:
        frame = user_frame_summary(traceback.extract_tb(error.__traceback__))
    return None if frame is None else f"{frame.filename}:{frame.lineno}"


def _sample(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Values to measure a graph with; its own generator leaves the global RNG alone."""
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(0))
    return torch.zeros(shape, dtype=dtype)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dict_keys(hooks: list[CapturedHook]) -> dict[str, Any]:
    """The dict keys the hooks' steps read (Dynamo guards each, with its value), by source."""
    return {
        g.source.name: g.value
        for hook in hooks
        for sources in hook.frontend.sources
        for g in sources.guards
        if g.has_value and isinstance(g.source, ConstDictKeySource)
    }


def _dynamo_name(source_name: str) -> str:
    """A source as Dynamo's re-compile reasons write it: `L['x'].y` -> `x.y`."""
    return re.sub(r"\b[LG]\['(\w+)'\]", r"\1", source_name)


# hooks that run before the first step is captured: what they assign is captured as it is
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


def _guarded(
    hooks: list[CapturedHook], namer: Namer, module: LightningModule, named: dict[str, str]
) -> list[GuardedValue]:
    """The Python values Dynamo guards (CONSTANT_MATCH and EQUALS_MATCH guards: a value, not
    a type, an identity or a tensor's metadata) that lead to something of the user's (see
    sources.py), with their value when first captured; the first graph's value wins."""
    writers = assigned_attributes(type(module), skip=_BEFORE_FIRST_STEP)
    found: dict[str, GuardedValue] = {}
    for hook in hooks:
        for sources in hook.frontend.sources:
            for guard in sources.guards:
                name = namer.name(guard.source, sources.code)
                if name is None:
                    continue
                named.setdefault(_dynamo_name(guard.source.name), name)  # any kind of guard
                if not guard.has_value or not plain(guard.value):
                    continue
                if name not in found:
                    path = name.removeprefix("self.")
                    found[name] = GuardedValue(name, guard.value, writers.get(path, []))
    return sorted(found.values(), key=lambda g: g.name)


def _inputs(
    captured: list[tuple[Any, Any]],
    namer: Namer,
    kind: InputKind,
    self_only: bool = False,
    named: dict[str, str] | None = None,
) -> list[str]:
    """The user's names of the graphs' inputs of `kind`, in order, once each."""
    found: list[str] = []
    for graph, sources in captured:
        for spec, source in zip(graph.inputs, sources.inputs, strict=True):
            if spec.kind is not kind or source is None:
                continue
            name = namer.name(source, sources.code)
            if name is None or (self_only and not name.startswith("self.")):
                continue
            if named is not None:
                named.setdefault(_dynamo_name(source.name), name)
            if name not in found:
                found.append(name)
    return found


def _optimizer_hyperparameters(constants: list[dict], optimizers: list[Any]) -> list[str]:
    """The optimizer hyperparameters the device graph reads from their tensors at each call
    (captured 0-d constants, uploaded again when a scheduler changes them)."""
    if not optimizers or not any(s["name"].startswith("<captured") for s in constants):
        return []
    keys = sorted(
        {
            k
            for opt in optimizers
            for group in opt.param_groups
            for k, v in group.items()
            if k != "params" and isinstance(v, (float, torch.Tensor))
        }
    )
    return ["optimizer hyperparameters (" + ", ".join(keys) + ")"] if "lr" in keys else []


def _replayed(first: _FirstCall, captured: list[tuple[Any, Any]]) -> list[str]:
    """What the host runs after each call, in its order: the appends to the module's lists
    (Dynamo's side effects), a manual step's scheduler steps (their markers in the graphs),
    the `self.log` calls."""
    found = [f"{path}.append(...)" for path in first.appended]
    for graph, _ in captured:
        for node in graph.graph_module.graph.nodes:
            name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
            if name.endswith(_SCHEDULER_STEP):
                found.append("lr_scheduler.step()")
    return found + [f"self.log({name!r})" for name in first.logged]


def _retrace_text(reason: str, named: Mapping[str, str]) -> str:
    """Dynamo's reason for a re-compile in one line, the guard in the user's names, at the
    user's line: "self.scale == 1.0 failed, at model.py:12 in training_step"; another
    reason (the strategy's: the module's structure changed, say) as it is."""
    first = reason.split("\n", 1)[0]
    if not re.match(r"\d+/\d+: ", first):  # not a guard Dynamo reports by its compile id
        return first
    first = re.sub(r"^\d+/\d+: ", "", first)
    guard = re.sub(r"\s*\(HINT:.*$", "", first).split("  # ", 1)[0].strip()
    if named:
        longest_first = sorted(named, key=len, reverse=True)
        pattern = "|".join(re.escape(n) + r"(?![\w])" for n in longest_first)
        guard = re.sub(pattern, lambda m: named[m[0]], guard)
    frame = user_frame_summary(frames_of(reason))
    where = f", at {frame.filename}:{frame.lineno} in {frame.name}" if frame else ""
    return f"{guard} failed{where}"


def _batch_shapes(batch: Any) -> dict[str, list]:
    """`{"batch[0]": [shape, dtype]}`: each tensor of the batch by its place (a group of
    steps_per_call batches: `batch[k][...]`)."""
    if isinstance(batch, StepGroup):
        batch = list(batch)
    leaves, _ = tree_flatten_with_path(batch)
    return {
        f"batch{keystr(path)}": [list(leaf.shape), str(leaf.dtype).removeprefix("torch.")]
        for path, leaf in leaves
        if isinstance(leaf, torch.Tensor)
    }


def _list_lengths(module: LightningModule) -> dict[str, int]:
    """The length of each list attribute of the module and its submodules, by path."""
    return {
        f"self.{prefix + '.' if prefix else ''}{name}": len(value)
        for prefix, sub in module.named_modules()
        for name, value in vars(sub).items()
        if type(value) is list
    }


def _appended(module: LightningModule, before: Mapping[str, int]) -> list[str]:
    """The lists that grew during a call (a step's `self.outputs.append(...)`)."""
    after = _list_lengths(module)
    return [path for path, n in after.items() if n > before.get(path, n)]


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
