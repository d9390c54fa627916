"""What `compile` writes to `codegen_dir`, how `load_codegen_dir` reads it, and the cache.

A codegen directory holds everything needed to run the step again without its Python
function, as data, never code: the functional graph as a JSON op list (`graph.json`,
resolved against `torch.ops` when read; `graph.py` is a readable listing, never imported),
the input, output and state specs (`specs.json`), and the values of every tensor the graph
reads as state (`captured.pt`, read with `weights_only=True`): the unregistered tensors it
captured and the registered ones as the device held them at compile time. At load time,
registered state is bound again by name to the loading Context's tensors; a name that
Context has not registered starts from the directory's value, in device memory only (as
MLSDK's codegen dirs carry their weights: PFN's run_pp_llama.py loads stages without
registering the model).

With an Inductor preset the directory also holds the step's compiled host code under
`compiled/`: Inductor's cache for that step alone (its FX graph and AOTAutograd entries and
the built kernels), each file's sha256 in specs.json["compiled"]. That is code, so a load
runs it only when asked to (`load_codegen_dir(path, trust_compiled_code=True)`, after
checking every hash); otherwise the graph, which is data, is compiled again.

A directory is written whole into a temporary sibling and renamed into place, so an
interrupted compile leaves the previous directory (or none), never a mix of two; specs.json
carries the sha256 of graph.json and captured.pt, checked before either is read.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CodegenDirError
from ..presets import Preset
from .graph_json import GraphFormatError, graph_from_json, graph_to_json
from .signature import GraphSignature
from .specs import TensorSpec
from .state_layout import CHANNELS_LAST
from .tracing import StateBinding, StateKind, TracedStep

FORMAT_VERSION = 2
GRAPH_FILE = "graph.json"
LISTING_FILE = "graph.py"
SPECS_FILE = "specs.json"
CAPTURED_FILE = "captured.pt"
COMPILED_DIR = "compiled"  # Inductor's cache files for the step: compiled host code
# What a compile writes (and, on rewriting a directory, replaces); graph.pt is format 1's.
_OWN_FILES = (GRAPH_FILE, LISTING_FILE, SPECS_FILE, CAPTURED_FILE, COMPILED_DIR, "graph.pt")


@dataclass(frozen=True)
class CacheOptions:
    """Where compiled steps are cached: compiling the same step at the same shapes hits it.

    The flags are MLSDK's, one per compiler stage. The emulator's one compiled artifact is
    Inductor's code, cached when `enable_codegen_cache` is true; the other stages (the app,
    ONNX export, gpfn2 objects) do not exist here, so their flags change nothing.
    """

    cache_dir: str | os.PathLike[str]
    enable_app_cache: bool = True
    enable_onnx_cache: bool = True
    enable_codegen_cache: bool = True
    enable_gpfn2obj_cache: bool = True

    @property
    def path(self) -> Path:
        return Path(os.fspath(self.cache_dir))


def describe(traced: TracedStep) -> dict:
    """The JSON-able description of a traced step (specs and state names)."""
    return {
        "format": FORMAT_VERSION,
        "torch": torch.__version__,
        "inputs": {k: v.to_json() for k, v in traced.input_specs.items()},
        "outputs": {k: v.to_json() for k, v in traced.output_specs.items()},
        "state": [
            {
                "name": s.name,
                "kind": s.kind.value,
                "mutated": s.mutated,
                **TensorSpec.of(s.tensor).to_json(),
            }
            for s in traced.state
        ],
        **({"signature": traced.signature.to_json()} if traced.signature is not None else {}),
    }


def canonical(traced: TracedStep) -> TracedStep:
    """The step with its graph rebuilt from its JSON form: compiling runs exactly what a
    codegen dir holds, and Inductor's caches see one graph whether compiled or loaded."""
    traced.graph_module = graph_from_json(graph_to_json(traced.graph_module.graph))
    return traced


@dataclass(frozen=True)
class PreparedDir:
    """A codegen directory's data files, serialized before the step is handed to Inductor
    (whose passes edit the graph module in place)."""

    graph: bytes
    listing: str
    tensors: bytes
    specs: dict


def prepare(
    traced: TracedStep,
    specs: dict,
    preset: Preset,
    registered_values: dict[str, torch.Tensor] | None = None,
) -> PreparedDir:
    """The files of a codegen directory for `traced`.

    registered_values: the device values of the registered state, by name (default: the
    host tensors), saved so that a Context that has not registered them can run the step."""
    graph = json.dumps(graph_to_json(traced.graph_module.graph), indent=0).encode()
    buffer = io.BytesIO()
    registered_values = registered_values or {}
    captured = {
        s.name: registered_values.get(s.name, s.tensor).detach().cpu() for s in traced.state
    }
    torch.save(captured, buffer)
    tensors = buffer.getvalue()
    specs = {
        **specs,
        "preset": preset.to_json(),
        "sha256": {GRAPH_FILE: _sha256(graph), CAPTURED_FILE: _sha256(tensors)},
    }
    return PreparedDir(graph, traced.graph_module.code, tensors, specs)


def save(
    path: Path,
    prepared: PreparedDir,
    compiled_from: Path | None = None,
    compiled_files: list[str] = (),
    compiled_entry: str | None = None,
    dim_orders: Mapping[int, Sequence[int]] | None = None,
) -> None:
    """Write a codegen directory: all of it, or (if interrupted) nothing.

    compiled_from / compiled_files: Inductor's cache files for this step (its compiled host
    code), copied into `compiled/` with their sha256 in specs.json["compiled"].
    compiled_entry: the one of them a trusted load runs directly, if any
    (`CompiledCode.runnable_entry`); dim_orders: the state inputs it takes laid out
    otherwise than row-major (`StateLayout`)."""
    specs = dict(prepared.specs)
    path = path.absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.writing-", dir=path.parent))
    try:
        (staging / GRAPH_FILE).write_bytes(prepared.graph)
        (staging / LISTING_FILE).write_text(prepared.listing)
        (staging / CAPTURED_FILE).write_bytes(prepared.tensors)
        if compiled_from is not None:
            hashes = {}
            for name in compiled_files:
                data = (compiled_from / name).read_bytes()
                target = staging / COMPILED_DIR / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                hashes[name] = _sha256(data)
            specs["compiled"] = {"torch": torch.__version__, "sha256": hashes}
            if compiled_entry is not None and compiled_entry in hashes:
                # Inductor's CPU kernels are built for the compile's thread count
                specs["compiled"]["entry"] = compiled_entry
                specs["compiled"]["entry_threads"] = torch.get_num_threads()
                specs["compiled"]["dim_orders"] = {
                    str(i): list(order) for i, order in (dim_orders or {}).items()
                }
        (staging / SPECS_FILE).write_text(json.dumps(specs, indent=1))
        _replace_dir(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def compiled_dim_orders(specs: dict) -> dict[int, tuple[int, ...]]:
    """The state inputs a codegen dir's compiled entry takes laid out otherwise than
    row-major (`StateLayout`); a dir of an earlier version lists its channels_last ones."""
    compiled = specs.get("compiled", {})
    if "dim_orders" in compiled:
        return {int(i): tuple(order) for i, order in compiled["dim_orders"].items()}
    return {int(i): CHANNELS_LAST for i in compiled.get("channels_last", ())}


def compiled_entry(specs: dict, names: list[str]) -> str | None:
    """The checked file (one of `names`) that a trusted load runs directly, if any: not
    under another thread count than the compile's, where Inductor compiles again."""
    entry = specs["compiled"].get("entry")
    threads = specs["compiled"].get("entry_threads")
    return entry if entry in names and threads == torch.get_num_threads() else None


def compiled_files(path: Path, specs: dict, trust_compiled_code: bool) -> list[str] | None:
    """The compiled host code a load may use: the names of the files under `compiled/`, each
    checked against specs.json's sha256; None where the step is to be compiled from its graph.

    Compiled code is code: it runs only when the caller trusts the directory
    (`trust_compiled_code=True`). Otherwise the load compiles the graph, which is data, and
    says so in one line."""
    compiled = specs.get("compiled")
    if compiled is None:
        return None
    if not trust_compiled_code:
        warnings.warn(
            f"load_codegen_dir({str(path)!r}): compiling the step from its graph; pass "
            "trust_compiled_code=True to run the compiled code the directory holds instead "
            "(verified against specs.json, and much faster)",
            stacklevel=3,
        )
        return None
    try:
        hashes = compiled["sha256"]
        if compiled["torch"] != torch.__version__:
            warnings.warn(
                f"load_codegen_dir({str(path)!r}): its compiled code is for torch "
                f"{compiled['torch']}, this is torch {torch.__version__}; compiling the step "
                "from its graph",
                stacklevel=3,
            )
            return None
        names = list(hashes)
        for name in names:
            relative = Path(name)
            if relative.is_absolute() or ".." in relative.parts:
                raise CodegenDirError(f"{path / SPECS_FILE}: compiled file {name!r} is outside")
            _read_checked(path / COMPILED_DIR / relative, hashes[name], path / SPECS_FILE)
    except (KeyError, TypeError, AttributeError) as error:
        raise CodegenDirError(
            f"{path / SPECS_FILE}: its 'compiled' entry is malformed ({error}); compile the "
            "step again"
        ) from None
    return names


def _replace_dir(staging: Path, path: Path) -> None:
    """Rename `staging` to `path`. An existing `path` is renamed aside first (os.replace
    cannot replace a non-empty directory); files in it that a compile does not write (the
    user's own) are moved into the new directory, then the old one is removed."""
    if not path.exists():
        os.rename(staging, path)
        return
    if not path.is_dir():
        raise NotADirectoryError(f"codegen_dir {path} exists and is not a directory")
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    os.rename(path, old / "dir")
    os.rename(staging, path)
    for entry in (old / "dir").iterdir():
        if entry.name not in _OWN_FILES:
            os.rename(entry, path / entry.name)
    shutil.rmtree(old, ignore_errors=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load(path: Path) -> tuple[TracedStep, dict]:
    """Read a codegen directory back into a TracedStep (registered tensors still unbound).

    Nothing in the directory is unpickled or executed: graph.json is data resolved against
    torch.ops, captured.pt is read weights-only, and both must match specs.json's hashes."""
    specs_file = path / SPECS_FILE
    if not specs_file.is_file():
        raise FileNotFoundError(f"{path} is not a codegen directory (no {SPECS_FILE})")
    try:
        specs = json.loads(specs_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CodegenDirError(
            f"{specs_file} is not valid JSON ({error}): truncated or corrupt; compile the step "
            "again"
        ) from None
    if not isinstance(specs, dict):
        raise CodegenDirError(f"{specs_file} is not a JSON object: compile the step again")
    if specs.get("format") != FORMAT_VERSION:
        raise CodegenDirError(
            f"{specs_file}: codegen format {specs.get('format')!r}, but this version of "
            f"mncore_device reads format {FORMAT_VERSION}: compile the step again"
        )
    try:
        hashes = specs["sha256"]
        graph_data = _read_checked(path / GRAPH_FILE, hashes[GRAPH_FILE])
        tensors = _read_checked(path / CAPTURED_FILE, hashes[CAPTURED_FILE])
        try:
            gm = graph_from_json(json.loads(graph_data))
        except (UnicodeDecodeError, json.JSONDecodeError, GraphFormatError) as error:
            raise CodegenDirError(f"{path / GRAPH_FILE}: {error}") from None
        try:
            captured = torch.load(io.BytesIO(tensors), weights_only=True)
        except Exception as error:
            raise CodegenDirError(
                f"{path / CAPTURED_FILE} cannot be read as plain tensors ({error})"
            ) from None
        if not isinstance(captured, dict):
            raise CodegenDirError(f"{path / CAPTURED_FILE} does not hold a dict of tensors")
        state = []
        for entry in specs["state"]:
            spec = TensorSpec.from_json(entry)
            tensor = captured.get(
                entry["name"], torch.empty(spec.shape, dtype=spec.dtype, device="meta")
            )
            if not isinstance(tensor, torch.Tensor) or TensorSpec.of(tensor) != spec:
                raise CodegenDirError(
                    f"{path / CAPTURED_FILE}: {entry['name']!r} does not match {specs_file}"
                )
            state.append(
                StateBinding(entry["name"], StateKind(entry["kind"]), tensor, entry["mutated"])
            )
        traced = TracedStep(
            gm,
            state,
            {k: TensorSpec.from_json(v) for k, v in specs["inputs"].items()},
            {k: TensorSpec.from_json(v) for k, v in specs["outputs"].items()},
            GraphSignature.from_json(specs["signature"]) if "signature" in specs else None,
        )
        Preset(**specs["preset"])
    except CodegenDirError:
        raise
    except KeyError as error:
        raise CodegenDirError(
            f"{specs_file} has no key {error}: written by another tool or edited; compile the "
            "step again"
        ) from None
    except (TypeError, ValueError) as error:
        raise CodegenDirError(
            f"{specs_file} is malformed ({error}): compile the step again"
        ) from None
    return traced, specs


def _read_checked(file: Path, expected: object, specs_file: Path | None = None) -> bytes:
    """The bytes of `file`, if they hash to what specs.json (`specs_file`) says."""
    specs_file = specs_file or file.parent / SPECS_FILE
    if not file.is_file():
        raise CodegenDirError(
            f"{file} is missing (a codegen dir of an older format, or not complete): compile "
            "the step again"
        )
    data = file.read_bytes()
    if _sha256(data) != expected:
        raise CodegenDirError(
            f"{file} does not match the sha256 in {specs_file}: it was changed, "
            "truncated or comes from another compile; compile the step again"
        )
    return data


def compiled_code_key(specs: dict, preset: Preset, device: torch.device) -> str:
    """The same graph.json, preset, device type and torch: the same key (specs as written
    to specs.json, with the graph's sha256)."""
    text = json.dumps(
        [specs["sha256"][GRAPH_FILE], preset.to_json(), device.type, torch.__version__],
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_key(traced: TracedStep, specs: dict, preset: Preset, device: torch.device) -> str:
    """Same graph, shapes, state layout, preset and device: same key."""
    layout = {k: v for k, v in specs.items() if k != "signature"}  # names and guards: not code
    text = json.dumps(
        [traced.graph_module.code, layout, preset.to_json(), device.type], sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()


def cache_contains(options: CacheOptions, key: str) -> bool:
    """True if a step with this key was compiled into the cache before."""
    return (options.path / "index" / key).exists()


def cache_record(options: CacheOptions, key: str) -> None:
    """Remember that a step with this key is now compiled into the cache."""
    index = options.path / "index"
    index.mkdir(parents=True, exist_ok=True)
    (index / key).touch()
