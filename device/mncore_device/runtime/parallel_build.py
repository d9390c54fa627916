"""A C++ wrapper's entry and its kernels, compiled side by side (TorchInductor, torch 2.14.1):
the context here changes when a build starts, never what is built.

With `cpp_wrapper_build_separate` (the O1 and O2 presets) Inductor compiles a graph's C++
entry function (at -O1) and its kernels (at -O3) as two object files and links them, one
compiler run after the other (`codecache._worker_compile_cpp`). The two runs do not depend on
each other: here they run side by side, and the link waits for both. Measured (ResNet-18,
batch 32, bench_compile.py, fresh processes): the entry took 4.8 s and the kernels 6.4 s one
after the other. A Python wrapper's kernels: `kernel_libraries`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor


@contextlib.contextmanager
def entry_and_kernels_built_together() -> Iterator[None]:
    """Within this context, Inductor's build of a library from two object files and a link
    compiles the two at once. Other builds (one source, as the Python wrapper's kernels, which
    Inductor's compile workers build in parallel already) are Inductor's own. A no-op on a
    torch without that build function."""
    from torch._inductor import codecache

    serial = getattr(codecache, "_worker_compile_cpp", None)
    if serial is None:
        yield
        return

    def worker_compile_cpp(lock_path: str, cpp_builders: Sequence) -> None:
        if len(cpp_builders) != 3:
            return serial(lock_path, cpp_builders)
        return _build_objects_together(lock_path, cpp_builders, codecache.LOCK_TIMEOUT)

    codecache._worker_compile_cpp = worker_compile_cpp
    try:
        yield
    finally:
        codecache._worker_compile_cpp = serial


def _build_objects_together(lock_path: str, cpp_builders: Sequence, timeout: float) -> None:
    """Inductor's `_worker_compile_cpp` for (entry, kernels, linker): the two object files
    that are missing compile in parallel (each is a compiler process), then the link."""
    from torch.utils._filelock import FileLock

    *objects, linker = cpp_builders
    with FileLock(lock_path, timeout=timeout):
        missing = [b for b in objects if not os.path.exists(b.get_target_file_path())]
        if missing:
            with ThreadPoolExecutor(len(missing)) as pool:
                for built in [pool.submit(b.build) for b in missing]:
                    built.result()
        if not os.path.exists(linker.get_target_file_path()):
            linker.build()
