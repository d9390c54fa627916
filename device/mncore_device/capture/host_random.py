"""Draws from a `random.Random` the step did not create run on the host, as in eager.

TorchDynamo (torch 2.14.1) models a `random.Random` object it meets as a generator of its
own (`variables.misc.RandomVariable`): it copies the object's state once, when it traces,
draws from that copy at every call, and after each call writes the state the trace ended
with back into the object. Nothing guards the state, so `lam = self.rng.random()` (or
`random.shuffle(order)`, through the module's hidden instance) gives the same draw at every
step and leaves the generator where the first step left it: measured, every step of a fit
mixed with the first step's weight. The module-level `random.random()` and its kin are not
affected (Dynamo calls the real function before each graph and passes the value in).

`existing_generators_are_host_code()` makes Dynamo refuse to model a generator that already
exists when the step runs (one it reads from the module, a global, the arguments): that is
a graph break, so the draw runs on the host at every call, on the real object. A generator
the step creates itself (`random.Random(seed)`) is still modelled, as its state is known.
"""

from __future__ import annotations

from typing import Any


def existing_generators_are_host_code() -> None:
    """Patch Dynamo's RandomVariable once (see the module docstring)."""
    from torch._dynamo.exc import unimplemented
    from torch._dynamo.variables.misc import RandomVariable

    original = RandomVariable.__init__
    if getattr(original, "_mncore_host_code", False):
        return

    def __init__(self: Any, rand: Any = None, seed: Any = None, **kwargs: Any) -> None:
        if rand is not None and kwargs.get("source") is not None:  # read, not created
            unimplemented(
                gb_type="a draw from an existing random.Random",
                context=f"{kwargs['source'].name}",
                explanation=(
                    "A random.Random that exists before the step is drawn from on the host "
                    "(mncore_device.capture.host_random), as in eager."
                ),
                hints=[],
            )
        original(self, rand, seed, **kwargs)

    __init__._mncore_host_code = True
    RandomVariable.__init__ = __init__
