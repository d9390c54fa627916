"""Compiler runs that TorchInductor (torch 2.14.1) starts one after another, started side by
side: each context here changes when a build starts, never what is built.

- A C++ wrapper's entry and kernels (`entry_and_kernels_built_together`). With
  `cpp_wrapper_build_separate` (the O1 and O2 presets) Inductor compiles a graph's C++ entry
  function (at -O1) and its kernels (at -O3) as two object files and links them, one compiler
  run after the other (`codecache._worker_compile_cpp`). The two runs do not depend on each
  other: here they run side by side, and the link waits for both. Measured (ResNet-18, batch
  32, bench_compile.py, fresh processes): the entry took 4.8 s and the kernels 6.4 s one
  after the other.
- A Python wrapper's kernels (`kernels_built_while_generating`). Inductor hands each fused
  C++ kernel to its compile workers only when the finished wrapper module is imported, after
  the code generation of the whole graph, which runs on one core: the other cores wait until
  then, and then the module waits for them. Here each kernel starts building as soon as it is
  generated, on the cores the code generation leaves free. Measured (batch 32, 1 thread, O1,
  fresh processes, the layout pinned): DenseNet-121 214.3 -> 181.1 s, of which 33 of its 204
  kernels (30.5 s of compiler time) were built before the module import. Handed to
  Inductor's workers all at once (as many as cores), the compilers slowed the code
  generation more than they saved (MobileNet v2 after torch.compile in one process: 66.4-67.1
  s against 63.3-64.3).
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


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


_PYBINDING_CALL = "async_compile.cpp_pybinding("


@contextlib.contextmanager
def kernels_built_while_generating() -> Iterator[None]:
    """Within this context, each C++ kernel of a graph with the Python wrapper is built when
    Inductor defines it, by running then the statement the wrapper module will run for it
    (`name = async_compile.cpp_pybinding(...)`), in a pool of one thread fewer than Inductor's
    compile threads: the code generation keeps a core of its own, and the compilers use the
    others. Inductor's C++ code cache keeps one build per source: when the module runs the
    same statement, it gets that build, done or under way. Nothing changes with one compile
    thread, with the C++ wrapper (its kernels are one library), or on a torch without these
    functions."""
    try:
        from torch._inductor.async_compile import get_compile_threads
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen
        from torch._inductor.utils import IndentedBuffer

        define = PythonWrapperCodegen.define_kernel
        statement_of = PythonWrapperCodegen._format_kernel_definition
        build_now = CppPythonBindingsCodeCache.load_pybinding
    except (ImportError, AttributeError):
        yield
        return

    # what the statement calls: Inductor's own build when it has one compile thread
    names = {"async_compile": types.SimpleNamespace(cpp_pybinding=build_now)}
    builds = ThreadPoolExecutor(max(1, get_compile_threads() - 1), "mncore-kernel-build")

    def build(statement: str) -> None:
        try:
            exec(statement, dict(names))  # noqa: S102
        except Exception:  # noqa: BLE001 (the module's own statement builds it, or raises)
            pass

    def define_kernel(
        self: Any,
        kernel_name: str,
        kernel_body: str,
        metadata: str | None = None,
        gpu: bool = True,
        cpp_definition: str | None = None,
    ) -> None:
        define(self, kernel_name, kernel_body, metadata, gpu, cpp_definition)
        if gpu or not kernel_body.startswith(_PYBINDING_CALL) or get_compile_threads() <= 1:
            return
        # the statement as the wrapper writes it into the module (_define_kernel_helper)
        module_lines = IndentedBuffer()
        module_lines.splice(statement_of(kernel_name, kernel_body, metadata))
        builds.submit(build, module_lines.getvalue())

    PythonWrapperCodegen.define_kernel = define_kernel
    try:
        yield
    finally:
        PythonWrapperCodegen.define_kernel = define
        builds.shutdown(wait=True, cancel_futures=True)
