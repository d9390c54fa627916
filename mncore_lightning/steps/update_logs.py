"""`self.log` in the hooks a captured automatic training step runs in its update.

The update of a captured training step (clipping and the optimizer step, after the backward)
is traced into a device graph once: `backward_and_update` calls the module's
`configure_gradient_clipping` there, at trace time, where Lightning's `self.log` would store
a traced tensor once (and fail on it) instead of each step's value. While the update is
traced, `recording_update_logs` hands the module a recorder (captured_manual.TracedStep, as
a manual step's gradient hooks have): a tensor logged is an output of the device graph, and
the calls are logged after each device call with that call's values, under the hook's name
(`configure_gradient_clipping`, as Lightning's own call of the hook sets it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_ABSENT = object()
_HOOK = "configure_gradient_clipping"


@contextlib.contextmanager
def recording_update_logs(module: Any) -> Iterator[Any]:
    """While the update is traced: `module.log` / `log_dict` record into the TracedStep
    yielded, and `configure_gradient_clipping` runs under its own hook name."""
    from .manual import TracedStep  # captured_manual imports captured_hooks

    traced = TracedStep(module)
    state = module.__dict__
    saved = {name: state.get(name, _ABSENT) for name in ("log", "log_dict", _HOOK)}
    clip = getattr(module, _HOOK)

    def clipping(*args: Any, **kwargs: Any) -> Any:
        fx = module._current_fx_name
        module._current_fx_name = _HOOK
        try:
            return clip(*args, **kwargs)
        finally:
            module._current_fx_name = fx

    state["log"], state["log_dict"], state[_HOOK] = traced.log, traced.log_dict, clipping
    try:
        yield traced
    finally:
        for name, value in saved.items():
            if value is _ABSENT:
                state.pop(name, None)
            else:
                state[name] = value
