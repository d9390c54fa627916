"""`trace_scope(path)` and `trace_event(name)`: MLSDK's timeline of what the device did.

Inside `with trace_scope(path):`, every compile, codegen-dir load, compiled call, host <->
device transfer and synchronize is recorded as a Chrome trace event; on leaving the scope the
events are written to `path` as Chrome/Perfetto trace-event JSON (`{"traceEvents": [...]}`,
complete events with ph "X", `trace_event` spans as ph "B"/"E", timestamps in microseconds),
which opens in ui.perfetto.dev and chrome://tracing. MLSDK writes Perfetto's protobuf format;
the JSON form opens in the same viewers whatever the file is called.

Outside a scope nothing is recorded and a recorded call costs one attribute check.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class _Recorder:
    """The events of one trace_scope."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def add(self, event: dict[str, Any]) -> None:
        event.setdefault("pid", self.pid)
        event.setdefault("tid", threading.get_ident())
        with self.lock:
            self.events.append(event)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"traceEvents": self.events, "displayTimeUnit": "ms"}
        staging = self.path.with_name(f".{self.path.name}.writing")
        staging.write_text(json.dumps(data))
        os.replace(staging, self.path)


_active: list[_Recorder] = []  # innermost last


def _now_us() -> float:
    return time.perf_counter_ns() / 1000.0


def recording() -> bool:
    """True inside a trace_scope (callers skip building event arguments otherwise)."""
    return bool(_active)


@contextlib.contextmanager
def span(event_name: str, category: str, /, **args: Any) -> Iterator[None]:
    """Record the enclosed work as one complete ("X") event, when a trace_scope is open."""
    if not _active:
        yield
        return
    start = _now_us()
    try:
        yield
    finally:
        event = {"name": event_name, "cat": category, "ph": "X", "ts": start}
        event["dur"] = _now_us() - start
        if args:
            event["args"] = args
        for recorder in _active:
            recorder.add(dict(event))


@contextlib.contextmanager
def trace_scope(path: str | os.PathLike[str]) -> Iterator[None]:
    """Record the device's work inside the block and write it to `path` when it ends.

    Scopes nest: an event is written to every open scope's file.
    """
    recorder = _Recorder(Path(os.fspath(path)))
    _active.append(recorder)
    try:
        yield
    finally:
        _active.remove(recorder)
        recorder.write()


@contextlib.contextmanager
def trace_event(name: str) -> Iterator[None]:
    """Mark a span of the user's own work ("optimizer", "HtoD") on the timeline (ph "B"/"E")."""
    if not _active:
        yield
        return
    begin = {"name": name, "cat": "user", "ph": "B", "ts": _now_us()}
    for recorder in _active:
        recorder.add(dict(begin))
    try:
        yield
    finally:
        end = {"name": name, "cat": "user", "ph": "E", "ts": _now_us()}
        for recorder in list(_active):
            recorder.add(dict(end))
