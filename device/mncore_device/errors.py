"""Errors raised by the device layer. Each one names what the user must change."""

from __future__ import annotations


class MNCoreError(RuntimeError):
    """Base class of every device-layer error."""


class MLSDKNotInstalledError(MNCoreError):
    """A real MN-Core device was asked for, but PFN's MLSDK (`mlsdk`) is not importable."""


class InputSpecError(ValueError, MNCoreError):
    """A compiled function was called with keys, shapes or dtypes other than its sample's."""


class StaticGraphError(MNCoreError):
    """The step cannot become one static graph (value-dependent control flow, lazy state, ...)."""


class NonFiniteError(FloatingPointError, MNCoreError):
    """The `debug` preset found NaN or inf; the message names the first op that produced it."""


class RegistrationError(ValueError, MNCoreError):
    """A tensor could not be registered (no name, name clash, unknown tensor)."""


class CodegenDirError(ValueError, MNCoreError):
    """A codegen directory is incomplete, inconsistent, of another format or not data this
    package wrote; the message names the file. Nothing from it was run: compile again."""


class InductorFallbackWarning(UserWarning):
    """TorchInductor could not compile or run a step's graph: it runs op by op (as O0)."""


class ContextInvalidatedError(MNCoreError):
    """A Context (or a function compiled in it) was used after `Context.invalidate()`."""
