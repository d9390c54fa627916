"""What `compile` writes to `codegen_dir`, how `load_codegen_dir` reads it, and the cache.

A codegen directory holds everything needed to run the step again without its Python
function: the functional graph (`graph.pt`, with a readable `graph.py`), the input, output
and state specs (`specs.json`), and the values of the unregistered tensors the graph
captured (`captured.pt`). Registered state is bound again by name at load time.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx

from .presets import Preset
from .specs import TensorSpec
from .tracing import StateBinding, StateKind, TracedStep

FORMAT_VERSION = 1


@dataclass(frozen=True)
class CacheOptions:
    """Where compiled steps are cached: compiling the same step at the same shapes hits it."""

    cache_dir: str | os.PathLike[str]

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
    }


def save(path: Path, traced: TracedStep, specs: dict, preset: Preset) -> None:
    """Write a codegen directory."""
    path.mkdir(parents=True, exist_ok=True)
    torch.save(_portable(traced.graph_module), path / "graph.pt")
    (path / "graph.py").write_text(traced.graph_module.code)
    (path / "specs.json").write_text(json.dumps({**specs, "preset": preset.to_json()}, indent=1))
    captured = {
        s.name: s.tensor.detach().cpu() for s in traced.state if s.kind is not StateKind.REGISTERED
    }
    torch.save(captured, path / "captured.pt")


def _portable(gm: fx.GraphModule) -> fx.GraphModule:
    """A plain GraphModule of the same graph: make_fx's own class re-traces itself with the
    proxy-tensor tracer when unpickled, which fails in a process that has not imported some
    of torch's internals; a plain one is rebuilt by the ordinary FX tracer."""
    plain = fx.GraphModule(torch.nn.Module(), gm.graph)
    plain._tracer_cls = None
    return plain


def load(path: Path) -> tuple[TracedStep, dict]:
    """Read a codegen directory back into a TracedStep (registered tensors still unbound)."""
    specs_file = path / "specs.json"
    if not specs_file.is_file():
        raise FileNotFoundError(f"{path} is not a codegen directory (no specs.json)")
    specs = json.loads(specs_file.read_text())
    if specs.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{specs_file}: codegen format {specs.get('format')!r}, but this version of "
            f"mncore_device reads format {FORMAT_VERSION}: compile the step again"
        )
    gm: fx.GraphModule = torch.load(path / "graph.pt", weights_only=False)
    captured = torch.load(path / "captured.pt", weights_only=True)
    state = []
    for entry in specs["state"]:
        spec = TensorSpec.from_json(entry)
        tensor = captured.get(
            entry["name"], torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        )
        state.append(
            StateBinding(entry["name"], StateKind(entry["kind"]), tensor, entry["mutated"])
        )
    traced = TracedStep(
        gm,
        state,
        {k: TensorSpec.from_json(v) for k, v in specs["inputs"].items()},
        {k: TensorSpec.from_json(v) for k, v in specs["outputs"].items()},
    )
    return traced, specs


def cache_key(traced: TracedStep, specs: dict, preset: Preset, device: torch.device) -> str:
    """Same graph, shapes, state layout, preset and device: same key."""
    text = json.dumps(
        [traced.graph_module.code, specs, preset.to_json(), device.type], sort_keys=True
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
