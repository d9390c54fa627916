"""A Python wrapper's C++ kernels, built a few to a library instead of one library each.

TorchInductor (torch 2.14.1) builds each fused C++ kernel of a graph with the Python wrapper
as a library of its own, one compiler run each, and hands them to its compile workers only
when the finished wrapper module is imported, after the code generation of the whole graph.
Most of each run is not the kernel: loading the precompiled header and linking took 0.35 s
of the 0.46 s of a MobileNet v2 kernel's build (g++, -O3, this machine), whatever the kernel.
Measured on the 68 kernels of MobileNet v2's step (batch 32, O1), two compilers at a time:
38.5 s of compiler time one library each, 9.9 s eight to a library, 4.8 s all in one. Eight
to a library, its cold compile (1 thread) took 35.4 and 32.4 s against 43.8 and 44.3 s, and
ResNet-50's 38.5 and 38.0 s against 50.9 and 53.0; sixteen was no faster on DenseNet-121.

Within `kernels_built_in_libraries()`:
- the wrapper defines its kernels `per_library` to a library: one statement of the module
  (`name_a, name_b, ... = kernel_library(async_compile, [(argtypes, source), ...])`) binds
  the kernels of one library, each built from its own source as Inductor would build it, in
  a namespace of its own, with one Python binding per kernel;
- each library starts building when it is defined, while Inductor generates the rest, in a
  pool of one thread fewer than Inductor's compile threads: the code generation keeps a core
  of its own, and the compilers use the others. Inductor's C++ code cache keeps one build
  per source: when the module runs the statement, it gets that build, done or under way.
  (Handed to Inductor's workers all at once, as many as cores, the compilers slowed the code
  generation more than they saved: MobileNet v2 after torch.compile in one process, 66.4-67.1
  s against 63.3-64.3.)

A library is named by its source, as any of Inductor's, so a warm cache or a loaded codegen
dir finds it built. A kernel that does not have the expected form is defined as Inductor
defines it; a library that fails to build falls back to building its kernels one by one, so
a compiler error is Inductor's own. Nothing changes with the C++ wrapper (its kernels are
one library already) or on a torch without these functions.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

Kernel = tuple[list[str], str]  # (argument types, source), as in `cpp_pybinding`

_PYBINDING_CALL = "async_compile.cpp_pybinding("
_ENTRY = re.compile(r'extern "C"\s+void\s+kernel\(')
_ENTRY_BINDING = '{{"{entry_func}", {entry_func}_py, METH_VARARGS, ""}},'


def kernel_library(async_compile: Any, kernels: Sequence[Kernel]) -> list[Any]:
    """The kernels of one library, as the wrapper module binds them: each kernel's Python
    binding, or (with several compile threads, as Inductor's `cpp_pybinding`) a future of
    it that the module's `async_compile.wait` resolves."""
    from torch._inductor.async_compile import get_compile_threads
    from torch._inductor.codecache import CppPythonBindingsCodeCache, LambdaFuture

    submit = async_compile.submit if get_compile_threads() > 1 else None
    built = _once(CppPythonBindingsCodeCache.load_async(library_source(kernels), submit_fn=submit))

    def kernel(i: int) -> Callable:
        try:
            return getattr(built(), f"kernel_{i}")
        except Exception:  # noqa: BLE001 (its own build raises the compiler's error, if any)
            return CppPythonBindingsCodeCache.load_pybinding(*kernels[i])

    if submit is None:
        return [kernel(i) for i in range(len(kernels))]
    return [LambdaFuture(functools.partial(kernel, i)) for i in range(len(kernels))]


def library_source(kernels: Sequence[Kernel]) -> str:
    """One C++ source for `kernels`: their includes, each kernel's code in a namespace of its
    own (its entry no longer `extern "C"`), and Inductor's Python bindings with one method
    `kernel_<i>` per kernel."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache as bindings

    includes: dict[str, None] = {}
    parts, calls = [], []
    for i, (argtypes, source) in enumerate(kernels):
        lines = source.splitlines()
        includes.update(dict.fromkeys(line for line in lines if line.startswith("#include")))
        code = "\n".join(line for line in lines if not line.startswith("#include"))
        parts.append(f"namespace mncore_kernel_{i} {{\n{_ENTRY.sub('void kernel(', code)}\n}}\n")
        parse = ", ".join(
            f"parse_arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(argtypes)
        )
        # Inductor's own binding function for this kernel, cut from its bindings' template
        binding = bindings.suffix_template.format(
            arg_len=len(argtypes),
            call_entry_func=f"mncore_kernel_{i}::" + bindings.call_entry_function.format(parse),
            entry_func=f"kernel_{i}",
            extra_parse_arg="",
        )
        start = binding.index(f"static PyObject* kernel_{i}_py(")
        calls.append(binding[start : binding.index("static PyMethodDef", start)])
    suffix = bindings.suffix_template.format(
        arg_len=0,
        call_entry_func="Py_RETURN_NONE;",
        entry_func=bindings.entry_function,
        extra_parse_arg="".join(calls),
    )
    entry = _ENTRY_BINDING.format(entry_func=bindings.entry_function)
    methods = "".join(_ENTRY_BINDING.format(entry_func=f"kernel_{i}") for i in range(len(kernels)))
    return "\n".join(includes) + "\n" + "".join(parts) + suffix.replace(entry, entry + methods)


def _kernel_of(kernel_body: str) -> Kernel | None:
    """(argtypes, source) of a `cpp_pybinding` call that a library can hold: one entry
    function `kernel`, declared as Inductor declares it; None for anything else."""
    if not kernel_body.startswith(_PYBINDING_CALL):
        return None
    try:
        call = ast.parse(kernel_body.strip(), mode="eval").body
        argtypes, source = (ast.literal_eval(arg) for arg in call.args)
    except (SyntaxError, ValueError, TypeError, AttributeError):
        return None
    if call.keywords or not isinstance(source, str) or len(_ENTRY.findall(source)) != 1:
        return None
    if not (isinstance(argtypes, list) and all(isinstance(t, str) for t in argtypes)):
        return None
    return argtypes, source


def _once(load: Callable[[], Any]) -> Callable[[], Any]:
    """`load`, run once: its result, or its exception, is kept."""

    @functools.cache
    def outcome() -> tuple[Any, BaseException | None]:
        try:
            return load(), None
        except Exception as error:  # noqa: BLE001 (raised again below, to every caller)
            return None, error

    def loaded() -> Any:
        result, error = outcome()
        if error is not None:
            raise error
        return result

    return loaded


@contextlib.contextmanager
def kernels_built_in_libraries(per_library: int = 8) -> Iterator[None]:
    """Within this context a graph with the Python wrapper defines its C++ kernels
    `per_library` to a library, and each library starts building when it is defined (see the
    module's docstring)."""
    try:
        from torch._inductor.async_compile import get_compile_threads
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen

        probe = [(["float*"], 'extern "C" void kernel(float* out) {}')]
        bound = _ENTRY_BINDING.format(entry_func="kernel_0") in library_source(probe)
    except (ImportError, AttributeError, KeyError, IndexError, ValueError):
        bound = False
    if not bound:  # another torch: its own builds
        yield
        return

    define, generate = PythonWrapperCodegen.define_kernel, PythonWrapperCodegen.generate
    pending: weakref.WeakKeyDictionary[Any, list[tuple[str, Kernel]]] = weakref.WeakKeyDictionary()
    builders = max(0, get_compile_threads() - 1)
    builds = ThreadPoolExecutor(max(1, builders), "mncore-kernel-build")

    def build(source: str) -> None:
        try:
            CppPythonBindingsCodeCache.load_async(source)()
        except Exception:  # noqa: BLE001 (the module's own statement builds it, or raises)
            pass

    def define_library(wrapper: Any) -> None:
        kernels = pending.pop(wrapper, [])
        if not kernels:
            return
        names = ", ".join(name for name, _ in kernels) + ("," if len(kernels) == 1 else "")
        listed = ",\n".join(
            f"    ({argtypes!r}, r'''{source}''')" for _, (argtypes, source) in kernels
        )
        body = f"kernel_library(async_compile, [\n{listed},\n])"
        wrapper.add_import_once(f"from {__name__} import kernel_library")
        define(wrapper, names, body, gpu=False)
        if builders:
            builds.submit(build, library_source([kernel for _, kernel in kernels]))

    def define_kernel(
        self: Any,
        kernel_name: str,
        kernel_body: str,
        metadata: str | None = None,
        gpu: bool = True,
        cpp_definition: str | None = None,
    ) -> None:
        kernel = None if gpu or metadata else _kernel_of(kernel_body)
        if kernel is None:
            define(self, kernel_name, kernel_body, metadata, gpu, cpp_definition)
            return
        pending.setdefault(self, []).append((kernel_name, kernel))
        if len(pending[self]) >= per_library:
            define_library(self)

    def generating(self: Any, *args: Any, **kwargs: Any) -> Any:
        define_library(self)  # the kernels of a library not yet full
        return generate(self, *args, **kwargs)

    PythonWrapperCodegen.define_kernel = define_kernel
    PythonWrapperCodegen.generate = generating
    try:
        yield
    finally:
        PythonWrapperCodegen.define_kernel = define
        PythonWrapperCodegen.generate = generate
        builds.shutdown(wait=True, cancel_futures=True)
