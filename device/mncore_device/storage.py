"""`storage.path`: MLSDK's path-like handle for codegen and cache directories.

On the emulator every storage is the local file system, so a path is a `pathlib.Path`
(it supports `/` and works with `torch.save`).
"""

from __future__ import annotations

import os
from pathlib import Path


def path(target: str | os.PathLike[str]) -> Path:
    """Return a path-like object for `target` (a local directory on the emulator).

    MLSDK's scripts call it as `storage.path(dir)` or `storage.path(target=dir)`."""
    return Path(os.fspath(target)).expanduser()
