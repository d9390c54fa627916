"""`storage.path`: MLSDK's path-like handle for codegen and cache directories.

On the emulator every storage is the local file system, so a path is a `pathlib.Path`
(it supports `/` and works with `torch.save`).
"""

from __future__ import annotations

import os
from pathlib import Path


def path(location: str | os.PathLike[str]) -> Path:
    """Return a path-like object for `location` (a local directory on the emulator)."""
    return Path(os.fspath(location)).expanduser()
