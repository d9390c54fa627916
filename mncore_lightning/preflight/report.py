"""The preflight report: plain data, independent of how the step was captured, rendered as
Markdown (a rich table on a terminal) and as JSON.

`HookReport` is filled from what the TorchDynamo capture recorded for one hook (run.py):
its graphs, guards, graph breaks and re-compiles, and the device functions it compiled.
The JSON schema is `PreflightReport.to_json()`'s, documented in docs/preflight.md.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


@dataclass
class GraphBreak:
    """Where a step stops being one graph (host code between device calls), or why the
    capture refused it: the user's line and the reason."""

    line: str | None
    reason: str


@dataclass
class GuardedValue:
    """A Python value Dynamo guards the captured step on: changing it re-compiles the step."""

    name: str
    value: Any
    written_by: list[str] = field(default_factory=list)  # methods that assign it


@dataclass
class Memory:
    """Device memory in bytes; `peak_bytes` = resident state + the call's inputs + its
    activation peak (the larger of the estimated and the measured one), for the device call
    of a step that needs the most."""

    parameter_bytes: int
    buffer_bytes: int
    optimizer_state_bytes: int
    input_bytes: int  # the inputs of one call: the batch and the numbers it is fed
    activation_peak_bytes: int  # estimated: liveness walk over the graph's shapes
    peak_bytes: int
    measured_activation_peak_bytes: int | None = None  # the emulator running the graph
    board_bytes: int | None = None  # None: no public figure (see docs/preflight.md)

    @property
    def fits(self) -> bool | None:
        return None if self.board_bytes is None else self.peak_bytes <= self.board_bytes


@dataclass
class HookReport:
    """One compiled hook (training_step, validation_step, test_step, predict_step)."""

    stage: str  # train, validate, test, predict
    hook: str
    compiles: bool
    # 1.0; 1/K with steps_per_call=K; more with host code in a training step (its graphs'
    # forward and backward calls and the update), an evaluation step's graphs
    device_calls_per_step: float | None = None
    graph_breaks: list[GraphBreak] = field(default_factory=list)
    graphs: int = 0  # Dynamo graphs captured in the preflight (a re-compile adds one)
    batch_shapes: dict[str, list] = field(default_factory=dict)  # "batch[0]": [shape, dtype]
    guarded: list[GuardedValue] = field(default_factory=list)
    live_inputs: list[str] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)
    replayed: list[str] = field(default_factory=list)
    op_counts: dict[str, int] = field(default_factory=dict)
    memory: Memory | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # trace + compile, by preset
    retraces: list[str] = field(default_factory=list)  # re-compiles seen, with the reason
    error: GraphBreak | None = None  # the run failed otherwise (not a refusal of the capture)


@dataclass
class DataReport:
    """One stage's DataLoader as the compiled steps see it."""

    stage: str
    batch_size: int | None
    batches: int | None
    samples: int | None
    drop_last: bool
    dropped_per_epoch: int = 0  # samples a training epoch skips (static shapes)
    ragged_last_batch: int | None = None  # an evaluation's smaller last batch: a 2nd graph
    device_calls: int | None = None  # per epoch: one per batch, or per K with steps_per_call


@dataclass
class PreflightReport:
    module: str
    device: str
    hooks: list[HookReport]
    data: list[DataReport]
    board_memory: dict[str, Any]
    notes: list[str] = field(default_factory=list)  # warnings the preflight run gave

    # --- conditions a user may fail on

    def graph_breaks(self) -> list[tuple[HookReport, GraphBreak]]:
        return [(h, b) for h in self.hooks for b in h.graph_breaks]

    def retrace_risks(self) -> list[str]:
        """Re-compiles observed, and guarded values a method of the module writes."""
        found = [f"re-compiled {r}" for h in self.hooks for r in h.retraces]
        for h in self.hooks:
            for g in h.guarded:
                if g.written_by:
                    found.append(
                        f"{h.hook} is guarded on {g.name}={g.value!r}, which "
                        f"{', '.join(g.written_by)} assigns: each change re-compiles it"
                    )
        return found

    def failures(self, fail_on: tuple[str, ...]) -> list[str]:
        found = []
        if "graph_break" in fail_on:
            found += [f"{h.hook}: {b.reason} (at {b.line})" for h, b in self.graph_breaks()]
            found += [
                f"{h.hook} failed: {h.error.reason} (at {h.error.line})"
                for h in self.hooks
                if h.error
            ]
        if "retrace" in fail_on:
            found += self.retrace_risks()
        if "memory" in fail_on:
            found += [
                f"{h.hook}: peak {h.memory.peak_bytes:,} bytes > board {h.memory.board_bytes:,} bytes"
                for h in self.hooks
                if h.memory is not None and h.memory.fits is False
            ]
        return found

    # --- JSON

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for hook, entry in zip(self.hooks, data["hooks"], strict=True):
            if hook.memory is not None:
                entry["memory"]["fits"] = hook.memory.fits
        return {"schema": SCHEMA_VERSION, **data}

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1, default=str)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    # --- Markdown

    def to_markdown(self) -> str:
        lines = [f"# MN-Core preflight: {self.module}", "", f"Device: {self.device}.", ""]
        board = self.board_memory
        lines.append(
            f"Board memory: {_size(board['bytes']) if board['bytes'] else 'unknown'} "
            f"({board['source']})."
        )
        lines += ["", *_table(["hook", *(h.hook for h in self.hooks)], self._rows()), ""]
        for hook in self.hooks:
            for b in hook.graph_breaks:
                if hook.compiles:
                    lines.append(
                        f"- {hook.hook}: graph break at {b.line}: {b.reason} (host code between "
                        "device calls)"
                    )
                else:
                    lines.append(f"- **{hook.hook} does not compile** at {b.line}: {b.reason}")
            if hook.error is not None:
                lines.append(f"- **{hook.hook} failed** at {hook.error.line}: {hook.error.reason}")
        for risk in self.retrace_risks():
            lines.append(f"- {risk}")
        if self.data:
            lines += ["", "## Data", ""]
            rows = [
                [
                    d.stage,
                    str(d.batch_size),
                    str(d.batches),
                    str(d.device_calls),
                    str(d.samples),
                    f"{d.dropped_per_epoch} samples" if d.drop_last else "no",
                    (
                        f"{d.ragged_last_batch} samples: a second graph"
                        if d.ragged_last_batch
                        else "no"
                    ),
                ]
                for d in self.data
            ]
            head = ["stage", "batch size", "batches", "device calls", "samples"]
            head += ["drop_last drops", "ragged last"]
            lines += _table(head, rows)
        if self.notes:
            lines += ["", "## Notes", "", *(f"- {n}" for n in self.notes)]
        return "\n".join(lines) + "\n"

    def _rows(self) -> list[list[str]]:
        hooks = self.hooks

        def row(name: str, cell) -> list[str]:
            shown = [h.memory is not None or name == "compiles" for h in hooks]
            return [name, *(cell(h) if show else "-" for h, show in zip(hooks, shown, strict=True))]

        presets = sorted({p for h in hooks for p in h.seconds})
        rows = [
            row(
                "compiles",
                lambda h: (
                    "yes"
                    if h.compiles
                    else "**no: graph break**"
                    if h.graph_breaks
                    else "**no: error**"
                ),
            ),
            row("device calls per step", lambda h: f"{h.device_calls_per_step:g}"),
            row("graphs captured", lambda h: str(h.graphs)),
            row(
                "batch",
                lambda h: "; ".join(f"{k} {v[0]} {v[1]}" for k, v in h.batch_shapes.items()),
            ),
            row("guarded values", lambda h: _guarded(h)),
            row("live inputs", lambda h: ", ".join(h.live_inputs) or "none"),
            row("carried tensors", lambda h: ", ".join(h.carried) or "none"),
            row("replayed on host", lambda h: ", ".join(h.replayed) or "none"),
            row(
                "ops",
                lambda h: ", ".join(f"{v} {k}" for k, v in h.op_counts.items() if v),
            ),
            row("parameters", lambda h: _size(h.memory.parameter_bytes)),
            row("optimizer state", lambda h: _size(h.memory.optimizer_state_bytes)),
            row("buffers", lambda h: _size(h.memory.buffer_bytes)),
            row("call inputs", lambda h: _size(h.memory.input_bytes)),
            row("activation peak (estimated)", lambda h: _size(h.memory.activation_peak_bytes)),
            row(
                "activation peak (measured)",
                lambda h: _size(h.memory.measured_activation_peak_bytes),
            ),
            row("device memory peak", lambda h: _peak(h.memory)),
            row("re-compiled in preflight", lambda h: str(len(h.retraces))),
        ]
        for preset in presets:
            rows.append(
                row(
                    f"trace + compile, {preset}",
                    lambda h, p=preset: f"{h.seconds[p]:.2f} s" if p in h.seconds else "-",
                )
            )
        return rows

    def print(self, file: Any = None, rich: bool | None = None) -> None:
        """Markdown on `file` (stdout); a rich rendering when it is a terminal."""
        file = file if file is not None else sys.stdout
        text = self.to_markdown()
        if rich is None:
            rich = file.isatty() if hasattr(file, "isatty") else False
        if rich:
            try:
                from rich.console import Console
                from rich.markdown import Markdown
            except ImportError:
                rich = False
            else:
                Console(file=file).print(Markdown(text))
                return
        file.write(text)


def _guarded(hook: HookReport) -> str:
    if not hook.guarded:
        return "none"
    shown = sorted(hook.guarded, key=_likely_to_change)[:4]
    text = ", ".join(
        f"{g.name}={g.value!r}"
        + (f" (written by {', '.join(g.written_by)})" if g.written_by else "")
        for g in shown
    )
    more = len(hook.guarded) - len(shown)
    return f"{len(hook.guarded)}: {text}" + (f", {more} more" if more else "")


def _likely_to_change(value: GuardedValue) -> tuple[int, int]:
    """Values a method assigns first; then the module's own and its hparams; then submodules'
    floats (a dropout's p); then the structure (sizes, flags) that seldom changes."""
    name = value.name.removeprefix("self.")
    if "." not in name.split("[")[0] or name.startswith("hparams."):
        kind = 0
    elif type(value.value) is float:
        kind = 1
    else:
        kind = 2
    return (not value.written_by, kind)


def _peak(memory: Memory) -> str:
    text = _size(memory.peak_bytes)
    if memory.board_bytes:
        text += f" ({100 * memory.peak_bytes / memory.board_bytes:.2g}% of the board)"
    return text


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    def cells(values: list[str]) -> str:
        return "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"

    return [cells(head), "|" + "---|" * len(head), *(cells(r) for r in rows)]
