"""Run a traced graph on the emulated device, as the preset says.

debug and O0 run the graph op by op (debug checks every op for NaN/inf); O1 and above hand it
to TorchInductor, each level more aggressive than the last. Every executor takes the flat list
of graph inputs and returns the flat list of graph outputs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from .._source import user_frame_from_stack_trace
from ..errors import InductorFallbackWarning, NonFiniteError
from ..presets import Preset
from .codegen_memo import codegen_work_remembered
from .convolution_layout import channels_last_is_faster, convolutions_of
from .convolution_rewrites import channels_last_weights, is_call, rewritten_convolutions
from .fusion_search import scalar_inputs_pair_equal_sizes
from .inductor_keys import apply_remembered_source_keys
from .kernel_libraries import kernels_built_in_libraries
from .matmul_layout import Transposition, transposed_where_faster, with_results_transposed
from .opaque_ops import make_opaque
from .parallel_build import entry_and_kernels_built_together
from .state_layout import CHANNELS_LAST, StateLayout, for_any_strides, reads_strides
from .state_writes import new_state_written_in_place
from .tracing import _is_view_of

aten = torch.ops.aten
_KEEP_MATMULS_APART = True  # benchmarks/bench_in_place.py turns it off to measure "before"
Executor = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


def build_executor(
    gm: fx.GraphModule,
    preset: Preset,
    device: torch.device,
    example_args: Sequence[torch.Tensor],
    cache_dir: Path | None = None,
    compile_threads: int | None = None,
    mutated_inputs: Sequence[int] = (),
    compiled_code: CompiledCode | None = None,
    state_inputs: int = 0,
) -> Executor:
    """Make `gm` runnable on `device` under `preset` (compiling now, not on the first call).

    compile_threads: worker threads for Inductor's compile (MLSDK's num_compiler_threads).
    compiled_code: Inductor compiles with this cache directory of its own (see CompiledCode).
    mutated_inputs: the graph's last outputs are the new values of these inputs (state), in
    this order. The executor returns them as the graph does; Inductor writes them into the
    inputs' own memory and returns those inputs (see `_updating_state_in_place`).
    state_inputs: how many of the first inputs are device state. A graph Inductor compiles in
    channels_last (`convolution_layout`) takes its 4-D state (convolution weights and their
    optimizer state) laid out so, and a linear weight whose matmuls ran faster so
    (`matmul_layout`) is stored transposed; an Inductor executor's `state_strides` are the
    strides it needs of each state input (see `CompiledFunction`)."""
    _retarget_devices(gm, device)
    make_opaque(gm)
    if preset.executor == "interpreter":
        if preset.check_finite:
            return lambda args: _FiniteCheckingInterpreter(gm).run(*args)
        return _interpreted(gm)
    if compiled_code is not None:
        cache_dir = compiled_code.cache_dir
        if compiled_code.entry is not None:
            try:
                layout = StateLayout.of(example_args, state_inputs, compiled_code.dim_orders)
                run = _load_compiled_entry(
                    gm, preset, layout.args, compiled_code, compile_threads, mutated_inputs
                )
                return _FirstCallChecked(run, gm, preset, list(mutated_inputs), layout.strides)
            except Exception:  # noqa: BLE001 (Inductor's own load below finds the same code)
                pass
    noting = (
        compiled_code.noting_the_compiled_graph() if compiled_code else contextlib.nullcontext()
    )
    try:
        with noting:
            run, layout = _compile_with_inductor(
                gm, preset, example_args, cache_dir, compile_threads, list(mutated_inputs),
                state_inputs,
            )  # fmt: skip
    except Exception as error:  # noqa: BLE001 (any failure of Inductor's: the graph still runs)
        _note_fallback(preset, "compile", error)
        return _interpreted(gm)
    if compiled_code is not None:  # what a trusted load of its entry lays out again
        compiled_code.dim_orders = layout.dim_orders
    return _FirstCallChecked(run, gm, preset, list(mutated_inputs), layout.strides)


def _interpreted(gm: fx.GraphModule) -> Executor:
    """The graph run op by op (O0)."""
    _LazyGraphModule.force_recompile(gm)  # its Python code, now rather than on the first call
    return lambda args: gm(*args)


def _note_fallback(preset: Preset, what: str, error: Exception) -> None:
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    warnings.warn(
        f"preset {preset.name}: TorchInductor could not {what} this graph "
        f"({type(error).__name__}: {first_line}); it runs op by op, as preset O0 does "
        "(the same results, without Inductor's fused kernels)",
        InductorFallbackWarning,
        stacklevel=2,
    )


class _FirstCallChecked:
    """An Inductor executor whose first call may fail (a kernel that compiled but cannot run
    this graph): that call runs on copies of the state it updates in place, and with the
    random generators saved, so that on failure the graph runs op by op from the untouched
    state and the same random stream, now and from then on. On success the copies' new
    values are copied into the state's own memory.
    """

    def __init__(
        self,
        run: Executor,
        gm: fx.GraphModule,
        preset: Preset,
        mutated: list[int],
        state_strides: dict[int, tuple[int, ...]],
    ) -> None:
        self._run: Executor | None = run
        self._gm = gm
        self._preset = preset
        self._mutated = mutated
        self.state_strides = state_strides  # see StateLayout

    def __call__(self, args: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        run = self._run
        if run is None:
            return self._gm(*args)
        if self._mutated is None:
            return run(args)
        trial = list(args)
        for i in self._mutated:
            trial[i] = args[i].clone()
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        try:
            outputs = run(trial)
        except Exception as error:  # noqa: BLE001 (the interpreter raises a real error again)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            _note_fallback(self._preset, "run", error)
            self._run = None
            _LazyGraphModule.force_recompile(self._gm)
            return self._gm(*args)
        n = len(outputs) - len(self._mutated)
        for i in self._mutated:  # into the state's own memory, where later calls write
            args[i].copy_(trial[i])
        outputs = [*outputs[:n], *(args[i] for i in self._mutated)]
        self._mutated = None  # it ran: later calls update the state in place
        return outputs


class CompiledCode:
    """Inductor's cache directory for one step alone, so that it holds exactly what the step
    needs: what a compile into a codegen dir copies into the dir, and where a trusted load
    puts the dir's files back (Inductor then finds its graph, its AOTAutograd entry and its
    built kernels there, and compiles nothing).

    The directory is `<Inductor's cache dir>/mncore_steps/<key>`, `key` naming the step's
    graph, preset, device and torch: the same step compiled again (or loaded without
    trusting the dir's code) finds its entries there, as in Inductor's shared cache. A new
    directory starts with the source keys the shared cache remembers (`inductor_keys`)."""

    def __init__(self, key: str, base: Path | None = None) -> None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir as current_cache_dir

        from .inductor_keys import FILE_NAME

        shared = Path(base) if base is not None else Path(current_cache_dir())
        self.cache_dir = shared / "mncore_steps" / key
        # the state inputs its compiled graph takes laid out otherwise: see StateLayout
        self.dim_orders: dict[int, tuple[int, ...]] = {}
        inductor = self.cache_dir / "inductor"  # where _inductor_cache_dir points Inductor
        inductor.mkdir(parents=True, exist_ok=True)
        remembered = shared / FILE_NAME
        if remembered.is_file() and not (inductor / FILE_NAME).exists():
            _copy_whole(remembered, inductor / FILE_NAME)  # another rank may be reading it

    entry: str | None = None  # set by a trusted load: see `runnable_entry`
    _output_code: str | None = None  # Inductor's key of the compiled graph's Python module

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Holds the directory against other processes for a compile into it and the copy
        out of it (or a load's copy in): data-parallel ranks compile the same step at the
        same time, and one must not list or copy files the other is still writing. The
        second waits, then finds the first's entries, so it compiles nothing."""
        from torch.utils._filelock import FileLock

        with FileLock(str(self.cache_dir.with_name(self.cache_dir.name + ".lock"))):
            yield

    @contextlib.contextmanager
    def noting_the_compiled_graph(self) -> Iterator[None]:
        """Notes which output-code module of this directory the compile inside loads: the
        compiled graph, whose FX graph entry `runnable_entry` names (the directory may hold
        others, from compiles under other conditions, such as another thread count)."""
        from torch._inductor.codecache import PyCodeCache

        before = len(PyCodeCache.modules)
        yield
        paths = {Path(getattr(m, "__file__", None) or "") for m in PyCodeCache.modules[before:]}
        mine = {path for path in paths if self.cache_dir in path.parents}
        self._output_code = mine.pop().stem if len(mine) == 1 else None

    def runnable_entry(self) -> str | None:
        """The compiled graph's FX graph cache entry (a path relative to the directory) where
        it is all there is to run: each AOTAutograd entry for it has a runtime wrapper that
        does nothing (no backward, no input mutation or output aliasing left to it, no
        subclasses, no tokens), and it has no frozen parameters. A trusted load then runs it
        directly (`_load_compiled_entry`), without importing Inductor's compiler or looking
        up its caches. None otherwise, or if the compile loaded no graph of its own (a second
        compile in one process): the load then goes through `compile_fx`."""
        import pickle

        if self._output_code is None:
            return None
        names = self.files()
        try:
            graphs = {
                name: pickle.loads((self.cache_dir / name).read_bytes())
                for name in names
                if name.startswith("inductor/fxgraph/")
            }
            (entry,) = [n for n, g in graphs.items() if g.cache_key == self._output_code]
            fx_key = Path(entry).parent.name
            results = [
                pickle.loads((self.cache_dir / name).read_bytes())
                for name in names
                if name.startswith("inductor/aotautograd/")
            ]
            results = [r for r in results if r.compiled_fw.fx_graph_cache_info[0] == fx_key]
            trivial = bool(results) and not getattr(graphs[entry], "frozen_param_names", None)
            for result in results:
                meta = result.runtime_metadata
                trivial = trivial and (
                    result.compiled_bw is None
                    and result.maybe_subclass_meta is None
                    and not result.indices_of_inps_to_detach
                    and not any(w.needs_post_compile for w in result.dispatch_wrappers)
                    and not meta.mutated_inp_runtime_indices
                    and meta.num_intermediate_bases == 0
                    and all(o.output_type.name == "non_alias" for o in meta.output_info)
                    and not meta.tokens
                    and not meta.is_rng_op_functionalized
                )
        except Exception:  # noqa: BLE001 (another torch's entries: Inductor's own load)
            return None
        return entry if trivial else None

    def install(self, source: Path, names: Sequence[str]) -> None:
        """Copy the files `names` (relative paths, checked by the caller) from `source`."""
        for name in names:
            target = self.cache_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            _copy_whole(source / name, target)

    def files(self) -> list[str]:
        """The files a load needs, relative to the directory (lock files left out)."""
        names = []
        for path in sorted(self.cache_dir.rglob("*")):
            relative = path.relative_to(self.cache_dir)
            if path.is_file() and "locks" not in relative.parts and path.suffix != ".lock":
                names.append(relative.as_posix())
        return names


def _copy_whole(source: Path, target: Path) -> None:
    """Copy `source` to `target` through a staging file: a reader in another process sees
    the old file or the whole new one, never a part."""
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.copy2(source, staging)
    os.replace(staging, target)


def _retarget_devices(gm: fx.GraphModule, device: torch.device) -> None:
    """Tensors the graph creates (zeros, random masks) are created in device memory."""
    if device.type == "cpu":
        return
    for node in gm.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device):
            node.update_kwarg("device", device)
    gm.recompile()


def _compile_with_inductor(
    gm: fx.GraphModule,
    preset: Preset,
    example_args: Sequence[torch.Tensor],
    cache_dir,
    compile_threads: int | None = None,
    mutated_inputs: list[int] | None = None,
    state_inputs: int = 0,
) -> tuple[Executor, StateLayout]:
    from torch._inductor.compile_fx import compile_fx

    mutated = mutated_inputs or []
    keeps_strides = reads_strides(gm)  # such a graph takes its state as the host lays it out
    transposed = Transposition()
    with _inductor_cache_dir(cache_dir):  # where the layouts' timings keep their decisions
        options = _inductor_options(gm, preset, example_args, compile_threads)
        if preset.transposed_weights_where_faster and not keeps_strides:
            transposed = transposed_where_faster(gm, example_args, state_inputs, mutated)
    dim_orders = transposed.dim_orders()
    if options.get("layout_optimization") and not keeps_strides:
        dim_orders = {**dict.fromkeys(range(state_inputs), CHANNELS_LAST), **dim_orders}
    layout = StateLayout.of(example_args, state_inputs, dim_orders)
    example_args = layout.args
    _scale_before_adding(gm)
    in_place = with_results_transposed(gm, transposed.matmuls)
    in_place = _updating_state_in_place(in_place, mutated) if mutated else in_place
    if layout.restrided:
        in_place = for_any_strides(in_place)
    in_place = rewritten_convolutions(in_place, example_args, preset.matmul_max_pixels)
    if options.get("layout_optimization"):
        in_place = channels_last_weights(in_place, example_args)
    with (
        _inductor_cache_dir(cache_dir),
        _static_shape_env(example_args) as fake_args,
        scalar_inputs_pair_equal_sizes(),
        codegen_work_remembered(),
        new_state_written_in_place(),
        kernels_built_in_libraries(),
        entry_and_kernels_built_together()
        if options.get("cpp_wrapper")
        else contextlib.nullcontext(),
    ):
        apply_remembered_source_keys()
        compiled = compile_fx(in_place, fake_args, config_patches=options)
    if not mutated:
        return (lambda args: compiled(*args)), layout

    def run(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        outputs = compiled(*args)
        return [*outputs, *(args[i] for i in mutated)]

    return run, layout


def _load_compiled_entry(
    gm: fx.GraphModule,
    preset: Preset,
    example_args: Sequence[torch.Tensor],
    compiled_code: CompiledCode,
    compile_threads: int | None,
    mutated_inputs: Sequence[int],
) -> Executor:
    """The step's compiled graph from its FX graph cache entry (`CompiledCode.entry`, a file
    a trusted load checked and installed), run as Inductor's cache hit runs it, without
    `compile_fx`: importing Inductor's compiler and looking up its caches was most of a
    trusted load. The entry's AOTAutograd wrapper does nothing (`runnable_entry`), so the
    graph's own outputs are the step's; the state it updates it writes in place.

    Inductor's options are those of the compile: the C++ build flags are part of the name
    Inductor finds each built library under."""
    import pickle

    import torch._inductor.config as inductor_config
    from torch._inductor.output_code import CompiledFxGraphConstants, maybe_realign_inputs
    from torch._inductor.utils import BoxedBool

    options = _inductor_options(gm, preset, example_args, compile_threads, passes=False)
    graph = pickle.loads((compiled_code.cache_dir / compiled_code.entry).read_bytes())
    with (
        _inductor_cache_dir(compiled_code.cache_dir),
        inductor_config.patch(options),
        _building_nothing(compiled_code.cache_dir),
    ):
        graph.after_deserialization(CompiledFxGraphConstants())
    maybe_realign_inputs(BoxedBool(False), graph, graph.inputs_to_check, graph.mutated_input_idxs)
    call = graph.current_callable
    mutated = list(mutated_inputs)

    def run(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad(), torch._C._DisableAutocast():
            outputs = call(list(args))  # `call` empties the list it gets
        return [*outputs, *(args[i] for i in mutated)]

    return run


@contextlib.contextmanager
def _building_nothing(cache_dir: Path):
    """Inductor's loading of the built libraries, without precompiling the header that a
    build of them would use: its C++ compiler runs (preprocessing the header to hash it,
    building it on a machine that has none) were a third of a trusted load, for a build that
    does not happen (every library is there, named by its source and flags). Were one
    missing, its build fails on the header given instead (a path that does not exist), and
    the load falls back to `compile_fx`, after Inductor's code caches forget this attempt."""
    from torch._inductor import codecache

    precompile = getattr(codecache, "_precompile_header", None)
    if precompile is None:  # another torch: its own way
        yield
        return
    missing = str(cache_dir / "no-precompiled-header" / "cpp_prefix.h")
    codecache._precompile_header = lambda *args, **kwargs: missing
    try:
        yield
    except BaseException:
        for cache in (codecache.CppWrapperCodeCache, codecache.CppPythonBindingsCodeCache):
            cache.cache_clear()
        codecache.CppCodeCache.cache_clear()
        raise
    finally:
        codecache._precompile_header = precompile


def _inductor_options(
    gm: fx.GraphModule,
    preset: Preset,
    example_args: Sequence[torch.Tensor],
    compile_threads: int | None,
    passes: bool = True,
) -> dict:
    """Inductor's config for compiling `gm` under `preset` (before `_scale_before_adding`);
    passes=False leaves out the graph passes and the convolution layout's timing, which
    only a compile needs."""
    from torch._inductor import list_mode_options

    on_cuda = bool(example_args) and example_args[0].device.type == "cuda"
    options = dict(list_mode_options(preset.inductor_mode))
    # The ISA a CPU kernel is built for is picked from the CPU's flags, without Inductor's
    # trial builds of a test program per ISA (seconds each, and repeated by every process
    # with a fresh cache: a loaded codegen dir would spend most of its time there).
    options["cpp.vec_isa_ok"] = True
    preset_options = preset.inductor_options
    options.update(preset_options)
    options["fallback_random"] = preset.random == "eager"
    if compile_threads is not None:
        options["compile_threads"] = int(compile_threads)
    if on_cuda:
        # pfvm:cuda keeps the Python wrapper: a C++ one is untested there
        options.pop("cpp_wrapper", None)
    else:
        options.pop("triton.cudagraphs", None)
        limit = preset.cpp_wrapper_max_ops
        if limit is not None and sum(n.op == "call_function" for n in gm.graph.nodes) <= limit:
            options["cpp_wrapper"] = True
        if not options.get("cpp_wrapper") and "reorder_for_peak_memory" not in preset_options:
            # A step graph ends with the optimizer's update of every parameter. Inductor's
            # reordering for peak memory moves each parameter's update next to its
            # gradient, between the convolutions' backward calls; with the Python wrapper
            # each run of kernels between them is a library of its own, built by a compiler
            # run. Measured (ResNet-50, batch 32, 1 thread, O1): 44 libraries instead of 66,
            # a cold compile of 48 s instead of 63, and a step of 369 ms instead of 417.
            # With the C++ wrapper (one library whatever the order) the reordering stays:
            # its steps were faster (batch 32, 1 thread, one process: the tutorial MLP
            # 1.72x torch.compile instead of 1.70x, vit_small 1.26x instead of 1.22x,
            # ResNet-18 1.36x instead of 1.32x).
            options["reorder_for_peak_memory"] = False
    if preset.channels_last_where_faster and passes and _channels_last_is_faster(gm, example_args):
        options["layout_optimization"] = True
    if _KEEP_MATMULS_APART and passes:
        options["post_grad_custom_pre_pass"] = _matmuls_apart_from_full_size_adds()
    return options


def _channels_last_is_faster(gm: fx.GraphModule, example_args: Sequence[torch.Tensor]) -> bool:
    """Whether `gm`'s convolutions ran faster in channels_last, timed on this machine
    (`convolution_layout`); False for a graph without any."""
    convolutions = convolutions_of(gm, example_args)
    device = example_args[0].device if example_args else torch.device("cpu")
    return channels_last_is_faster(convolutions, device)


def _updating_state_in_place(gm: fx.GraphModule, mutated: Sequence[int]) -> fx.GraphModule:
    """A copy of the functional step graph that writes the new value of each state input in
    `mutated` into that input (`aten.copy_`) instead of returning it.

    The step graph returns new state as fresh tensors: each call would allocate, fill and
    free a new buffer per weight and momentum (hundreds of MB a step for AlexNet's or VGG's
    classifier), where eager's optimizer updates in place. TorchInductor turns a copy into a
    graph input into a kernel that stores into the input's memory (its fused update kernel
    writes the weight where it lies), as it does for a compiled in-place optimizer step.

    Only the executor sees this copy; the traced graph, the one that codegen dirs save, stays
    functional. Every read of an old value comes before the copies at the end of the graph.
    Functionalization gives every new value and output its own tensor, so none should be the
    old value of updated state itself; should a graph pass make one so (an output, or one
    state's new value being another's old one), it is cloned before the copies, so the graph
    still computes exactly what the functional one does."""
    graph = fx.Graph()
    values: dict[fx.Node, fx.Node] = {}
    results = list(graph.graph_copy(gm.graph, values))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    n_outputs = len(results) - len(mutated)
    old_state = {placeholders[i] for i in mutated}
    for node in graph.nodes:
        if node.op == "call_function" and _is_view_of(node, old_state):
            old_state.add(node)
    for i, value in enumerate(results):
        if value in old_state:
            results[i] = graph.call_function(aten.clone.default, (value,))
            results[i].meta.update(value.meta)
    for index, value in zip(mutated, results[n_outputs:], strict=True):
        graph.call_function(aten.copy_.default, (placeholders[index], value))
    graph.output(tuple(results[:n_outputs]))
    return _LazyGraphModule(gm, graph)  # Inductor reads the graph, never its Python code


def _matmuls_apart_from_full_size_adds():
    """Inductor's post-grad pass that keeps `mm(a, b) + x` as a matmul and a pointwise add
    when `x` has the result's full shape (built on first use: importing Inductor when this
    module is imported would load it, and its logging set-up, for every user of the device).

    TorchInductor fuses every `add(mm, x)` into `addmm(x, a, b)`, which is good for a bias
    (a broadcast row). For a full-size `x` its addmm first copies `x` into a new buffer and
    then accumulates the product into it. In a training step that `x` is the momentum term of
    a weight's update (`momentum * buf + grad`): for a large weight that is two extra passes
    over weight-sized memory and a fresh weight-sized buffer each step, and the add can no
    longer join the fused update kernel that reads the gradient once. Left apart, the add
    fuses with the rest of the update, and it rounds as eager does (the product, then the
    add). Inductor's own GPU heuristic already unfuses a bias add feeding pointwise ops."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    try:  # Inductor leaves an mm marked so out of its mm + add -> addmm fusion
        from torch._higher_order_ops.flex_gemm import _PRESERVE_FLEX_GEMM_GEMM_OP as preserve
    except ImportError:  # another torch: the fusion stays (slower, same results)
        preserve = None

    class MatmulsApartFromFullSizeAdds(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            if preserve is None:
                return
            for node in graph.nodes:
                if node.op != "call_function" or node.target is not aten.add.Tensor:
                    continue
                if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
                    continue
                for matmul, other in (node.args, node.args[::-1]):
                    if is_call(matmul, aten.mm.default) and _has_full_shape(other, node):
                        matmul.meta[preserve] = True

        def uuid(self) -> str:
            return f"mncore_device.matmuls_apart_from_full_size_adds.2.{preserve is not None}"

    return MatmulsApartFromFullSizeAdds()


def _has_full_shape(value: object, result: fx.Node) -> bool:
    """`value` is a tensor of `result`'s shape with no broadcast (zero-stride) dimension."""
    if not isinstance(value, fx.Node):
        return False
    tensor, full = value.meta.get("val"), result.meta.get("val")
    if not (isinstance(tensor, torch.Tensor) and isinstance(full, torch.Tensor)):
        return False
    return tensor.shape == full.shape and 0 not in tensor.stride()


def _scale_before_adding(gm: fx.GraphModule) -> None:
    """Rewrite `add(x, y, alpha=a)` / `sub(x, y, alpha=a)` as `add(x, mul(y, a))`.

    TorchInductor in torch 2.14.1 miscompiles `add(w, add(mm(a, b), w, alpha=c), alpha=d)`
    (a weight-decay update on a matmul's gradient): the result is off by far more than
    rounding. The same math with the scaling as its own op compiles correctly.
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.add.Tensor, aten.sub.Tensor):
            continue
        alpha = node.kwargs.get("alpha", 1)
        if alpha == 1 or len(node.args) != 2:
            continue
        with gm.graph.inserting_before(node):
            scaled = gm.graph.call_function(aten.mul.Tensor, (node.args[1], alpha))
        scaled.meta.update(node.meta)
        node.args = (node.args[0], scaled)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
        changed = True
    if changed:
        gm.recompile()


@contextlib.contextmanager
def _static_shape_env(example_args: Sequence[torch.Tensor]):
    """Fake copies of `example_args`, every dimension static, under a fake mode that has a
    ShapeEnv: without one Inductor bypasses its FX graph cache and AOTAutograd's cache ("No
    shape env"), so a second compile or a load_codegen_dir of the same graph would run
    Inductor's whole codegen again."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    with tracing(TracingContext(fake_mode)):
        yield [fake_mode.from_tensor(arg, static_shapes=True) for arg in example_args]


@contextlib.contextmanager
def _inductor_cache_dir(cache_dir: Path | None):
    """Point Inductor's on-disk caches at the user's CacheOptions directory."""
    if cache_dir is None:
        yield
        return
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache_dir) / "inductor")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


# Ops that allocate without writing: their memory may hold anything, NaN included (the
# dropout mask's empty_like before bernoulli fills it). What is computed from them is checked.
_UNINITIALIZED = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}


def _reads_uninitialized(node: fx.Node, uninitialized: set[fx.Node]) -> bool:
    """An allocation, or a view or plain copy of one (a functional graph's permute_copy of
    an empty_like): memory nobody has written yet, which may hold NaN."""
    target = node.target
    if target in _UNINITIALIZED:
        return True
    if not node.args or node.args[0] not in uninitialized:
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return False
    name = target.overloadpacket.__name__
    if name in ("clone", "_to_copy", "contiguous"):
        return True
    base = getattr(aten, name.removesuffix("_copy"), None)
    view = getattr(base, target._overloadname, None) if base is not None else None
    schema = (view or target)._schema
    return bool(schema.returns) and schema.returns[0].alias_info is not None


class _FiniteCheckingInterpreter(fx.Interpreter):
    """The debug preset: run op by op; NaN anywhere stops the step at the op that made it.

    Infinities are legitimate inside a step (a `-inf` attention mask that softmax turns into
    zeros), so inf is reported only where it reaches the step's results: its outputs and the
    new values of its state (the update, and so the gradients behind it). The report names
    the op where that inf first appeared, following inf-carrying inputs back from the result.
    """

    def run(self, *args, **kwargs):
        self._inf_nodes: set[fx.Node] = set()
        self._uninitialized: set[fx.Node] = set()
        return super().run(*args, **kwargs)

    def run_node(self, node: fx.Node):
        result = super().run_node(node)
        if node.op == "call_function" and _reads_uninitialized(node, self._uninitialized):
            self._uninitialized.add(node)  # an allocation, or a view or copy of one
        elif node.op == "call_function":
            for value in result if isinstance(result, (tuple, list)) else (result,):
                if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
                    continue
                if torch.isfinite(value).all():
                    continue
                if torch.isnan(value).any():
                    raise NonFiniteError(_message(node, "NaN"))
                self._inf_nodes.add(node)
        elif node.op == "output":
            for value_node in node.all_input_nodes:
                if value_node in self._inf_nodes:
                    raise NonFiniteError(_message(self._origin(value_node), "inf"))
        return result

    def _origin(self, node: fx.Node) -> fx.Node:
        """The first op on an inf-carrying path into `node`."""
        while True:
            inputs = [n for n in node.all_input_nodes if n in self._inf_nodes]
            if not inputs:
                return node
            node = inputs[0]


def _message(node: fx.Node, kind: str) -> str:
    where = user_frame_from_stack_trace(node.meta.get("stack_trace"))
    return (
        f"debug preset: op {node.target} (graph node '{node.name}') produced {kind} first"
        + (f", from {where}" if where else "")
        + (" and it reaches the step's outputs or state" if kind == "inf" else "")
    )
