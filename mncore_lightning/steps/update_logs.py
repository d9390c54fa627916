"""`self.log` in the hooks a captured automatic training step runs in its update.

The update of a captured training step (clipping and the optimizer step, after the backward)
is traced into a device graph once: `backward_and_update` calls the module's
`configure_gradient_clipping` there, at trace time, where Lightning's `self.log` would store
a traced tensor once (and fail on it) instead of each step's value. While the update is
traced, `recording_update_logs` hands the module a recorder (steps/manual.py's TracedStep, as
a manual step's gradient hooks have): a tensor logged is an output of the device graph, and
the calls are logged after each device call with that call's values, under the hook's name
(`configure_gradient_clipping`, as Lightning's own call of the hook sets it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .patches import patched

_HOOK = "configure_gradient_clipping"


@contextlib.contextmanager
def recording_update_logs(module: Any) -> Iterator[Any]:
    """While the update is traced: `module.log` / `log_dict` record into the TracedStep
    yielded, and `configure_gradient_clipping` runs under its own hook name."""
    from .manual import TracedStep  # steps/manual.py imports steps/hooks.py, which imports this

    traced = TracedStep(module)
    clip = getattr(module, _HOOK)

    def clipping(*args: Any, **kwargs: Any) -> Any:
        fx = module._current_fx_name
        module._current_fx_name = _HOOK
        try:
            return clip(*args, **kwargs)
        finally:
            module._current_fx_name = fx

    hooks = {"log": traced.log, "log_dict": traced.log_dict, _HOOK: clipping}
    with patched(module.__dict__, **hooks):
        yield traced
