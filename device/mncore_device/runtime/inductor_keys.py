"""Inductor's source keys, remembered across processes.

Inductor keys its caches by hashes of the source files of torch and of triton (`torch_key`,
`triton_key`), computed once per process by reading and hashing thousands of files and
triton's shared library: most of what a `load_codegen_dir` of a small step spends outside
Inductor's imports. The keys are remembered in Inductor's cache directory together with a
fingerprint of the same files (path, size and modification time of each). While no file
changed, the remembered key is handed to Inductor; any change (another torch or triton
build, an edited file) makes the fingerprint differ and the key is computed again. The
values are Inductor's own, so a compile and a load still find each other's cache entries.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

_done: list[str] = []  # cache dirs whose keys this process has already applied
FILE_NAME = "mncore_source_keys.json"


def _fingerprint(root: str, suffixes: tuple[str, ...], packages_only: bool) -> str:
    """A hash of (path, size, mtime) of the files under `root` that a source key reads."""
    hasher = hashlib.sha256()
    for directory, subdirs, files in os.walk(root):
        subdirs.sort()
        if packages_only:  # torch_key reads Python packages only
            subdirs[:] = [
                d for d in subdirs if os.path.isfile(os.path.join(directory, d, "__init__.py"))
            ]
        for name in sorted(files):
            if name.endswith(suffixes):
                stat = os.stat(os.path.join(directory, name))
                hasher.update(f"{directory}/{name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return hasher.hexdigest()


def _sources() -> list[tuple[str, Callable[[], Any], Callable[[], str]]]:
    """(name, Inductor's key function, fingerprint of the files it reads)."""
    import torch
    from torch._inductor import codecache

    torch_root = os.path.dirname(torch.__file__)
    sources = [
        (
            "torch",
            codecache.torch_key,
            lambda: (
                torch.__version__ + _fingerprint(torch_root, (".py", ".cpp", ".h", ".ld"), True)
            ),
        )
    ]
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin is not None:
        triton_root = os.path.dirname(spec.origin)
        sources.append(
            (
                "triton",
                codecache.triton_key,
                lambda: _fingerprint(triton_root, (".py", ".so"), False),
            )
        )
    return sources


def _encode(value: Any) -> Any:
    return {"bytes": value.hex()} if isinstance(value, bytes) else value


def _decode(value: Any) -> Any:
    return bytes.fromhex(value["bytes"]) if isinstance(value, dict) else value


def apply_remembered_source_keys() -> None:
    """Give Inductor its torch/triton keys from the cache directory when the files are
    unchanged; compute and remember them otherwise. Once per process and cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    directory = Path(cache_dir())
    if str(directory) in _done:
        return
    _done.append(str(directory))
    path = directory / FILE_NAME
    try:
        remembered = json.loads(path.read_text())
        if not isinstance(remembered, dict):
            remembered = {}
    except (OSError, ValueError):
        remembered = {}
    changed = False
    for name, key_function, fingerprint in _sources():
        current = fingerprint()
        entry = remembered.get(name)
        if isinstance(entry, dict) and entry.get("fingerprint") == current:
            try:
                key_function.set(_decode(entry.get("key")))
                continue
            except RuntimeError:  # computed in this process already
                continue
        remembered[name] = {"fingerprint": current, "key": _encode(key_function())}
        changed = True
    if changed:
        directory.mkdir(parents=True, exist_ok=True)
        staging = directory / f".{FILE_NAME}.{os.getpid()}"
        staging.write_text(json.dumps(remembered))
        os.replace(staging, path)
