"""A traced graph as data: a JSON op list, resolved against `torch.ops` when read.

A codegen directory must never run code from disk, so its graph is not a pickled
GraphModule. Each node is written as {name, op, target, args, kwargs}: `target` names a
registered operator overload ("aten::mm.default") or one of a few Python builtins
(`operator.getitem`); argument values are JSON scalars, lists, or tagged objects
({"node": name}, {"dtype": "float32"}, {"tuple": [...]}, ...). Reading resolves targets
only through `torch.ops.<namespace>.<name>.<overload>` and refuses anything else.
"""

from __future__ import annotations

import inspect
import math
import operator
import re
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

GRAPH_FORMAT = "mncore_device.graph/1"

# The only non-operator call targets a graph may name, by name: never an import.
_BUILTINS: dict[str, Any] = {"operator.getitem": operator.getitem}
_BUILTIN_NAMES = {id(f): name for name, f in _BUILTINS.items()}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_LAYOUTS = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)
}
_MEMORY_FORMATS = {
    str(v).removeprefix("torch."): v
    for v in vars(torch).values()
    if isinstance(v, torch.memory_format)
}


class GraphFormatError(ValueError):
    """A graph file that is not a graph this module wrote (or names what it cannot resolve)."""


# --- writing ---------------------------------------------------------------------------


def graph_to_json(graph: fx.Graph) -> dict:
    """The JSON-able description of `graph` (placeholders, operator calls, one output)."""
    nodes = []
    for node in graph.nodes:
        entry: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            entry["target"] = _target_name(node)
        elif node.op not in ("placeholder", "output"):
            raise GraphFormatError(
                f"graph node {node.name!r} is a {node.op} node: a codegen dir holds only "
                "placeholders, operator calls and one output"
            )
        entry["args"] = _encode(node.args, node)
        entry["kwargs"] = {k: _encode(v, node) for k, v in node.kwargs.items()}
        stack_trace = node.meta.get("stack_trace")
        if isinstance(stack_trace, str):
            entry["stack_trace"] = stack_trace
        nodes.append(entry)
    return {"format": GRAPH_FORMAT, "nodes": nodes}


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        namespace, _, name = target._schema.name.partition("::")
        return f"{namespace}::{name}.{target._overloadname}"
    name = _BUILTIN_NAMES.get(id(target))
    if name is None:
        raise GraphFormatError(
            f"graph node {node.name!r} calls {target!r}, which is not a registered operator: "
            "a codegen dir names only torch.ops operators"
        )
    return name


def _encode(value: Any, node: fx.Node) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, list):
        return [_encode(v, node) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, node) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"slice": [_encode(v, node) for v in (value.start, value.stop, value.step)]}
    raise GraphFormatError(
        f"graph node {node.name!r} has an argument of type {type(value).__name__} "
        "that a codegen dir cannot store"
    )


# --- reading ---------------------------------------------------------------------------


def graph_from_json(data: Any) -> fx.GraphModule:
    """Rebuild the GraphModule `graph_to_json` described; raise GraphFormatError if invalid."""
    if not isinstance(data, dict) or data.get("format") != GRAPH_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise GraphFormatError(f"graph format {found!r}, expected {GRAPH_FORMAT!r}")
    entries = data.get("nodes")
    if not isinstance(entries, list):
        raise GraphFormatError("no node list")
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    outputs = 0
    for entry in entries:
        if not isinstance(entry, dict):
            raise GraphFormatError(f"node entry {entry!r} is not an object")
        name, op = entry.get("name"), entry.get("op")
        if not isinstance(name, str) or not _IDENTIFIER.match(name) or name in nodes:
            raise GraphFormatError(f"bad or repeated node name {name!r}")
        args = _decode(entry.get("args", []), nodes)
        kwargs = _decode_kwargs(entry.get("kwargs", {}), nodes)
        if not isinstance(args, tuple):
            raise GraphFormatError(f"node {name!r}: args must be a tuple")
        if op == "placeholder":
            default = args[0] if args else inspect.Signature.empty
            node = graph.placeholder(name, default_value=default)
        elif op == "call_function":
            node = graph.create_node(op, resolve_target(entry.get("target")), args, kwargs, name)
        elif op == "output":
            if len(args) != 1:
                raise GraphFormatError("the output node takes one argument")
            node = graph.output(args[0])
            outputs += 1
        else:
            raise GraphFormatError(f"node {name!r}: op {op!r} is not allowed in a codegen dir")
        stack_trace = entry.get("stack_trace")
        if isinstance(stack_trace, str):
            node.meta["stack_trace"] = stack_trace
        nodes[name] = node
    if outputs != 1:
        raise GraphFormatError(f"a graph has one output node, found {outputs}")
    graph.lint()
    return _LazyGraphModule(torch.nn.Module(), graph)  # its Python code made on first use


def resolve_target(target: Any) -> Any:
    """`"aten::mm.default"` -> torch.ops.aten.mm.default; only registered operator overloads
    (and the few builtins graphs use) resolve, never an arbitrary attribute or import."""
    if not isinstance(target, str):
        raise GraphFormatError(f"call target {target!r} is not a string")
    if target in _BUILTINS:
        return _BUILTINS[target]
    namespace, sep, rest = target.partition("::")
    name, dot, overload = rest.rpartition(".")
    if not (sep and dot and all(_IDENTIFIER.match(p) for p in (namespace, name, overload))):
        raise GraphFormatError(f"call target {target!r} is not an operator name")
    if any(p.startswith("__") for p in (namespace, name, overload)):
        raise GraphFormatError(f"call target {target!r} is not an operator name")
    try:
        space = getattr(torch.ops, namespace)
        packet = getattr(space, name) if isinstance(space, torch._ops._OpNamespace) else None
        resolved = (
            getattr(packet, overload) if isinstance(packet, torch._ops.OpOverloadPacket) else None
        )
    except (AttributeError, RuntimeError) as error:
        raise GraphFormatError(f"operator {target!r} is not registered in torch.ops") from error
    if not isinstance(resolved, torch._ops.OpOverload):
        raise GraphFormatError(f"call target {target!r} is not an operator overload")
    return resolved


def _decode(value: Any, nodes: dict[str, fx.Node]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, nodes) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        ((tag, payload),) = value.items()
        if tag == "node" and payload in nodes:
            return nodes[payload]
        if tag == "tuple" and isinstance(payload, list):
            return tuple(_decode(v, nodes) for v in payload)
        if tag == "float" and payload in ("inf", "-inf", "nan"):
            return float(payload)
        if tag == "dtype" and payload in _DTYPES:
            return _DTYPES[payload]
        if tag == "layout" and payload in _LAYOUTS:
            return _LAYOUTS[payload]
        if tag == "memory_format" and payload in _MEMORY_FORMATS:
            return _MEMORY_FORMATS[payload]
        if tag == "device" and isinstance(payload, str):
            try:
                return torch.device(payload)
            except RuntimeError as error:
                raise GraphFormatError(f"bad device {payload!r}") from error
        if tag == "slice" and isinstance(payload, list) and len(payload) == 3:
            return slice(*(_decode(v, nodes) for v in payload))
    raise GraphFormatError(f"argument {value!r} is not a value a codegen graph holds")


def _decode_kwargs(value: Any, nodes: dict[str, fx.Node]) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise GraphFormatError(f"kwargs {value!r} is not an object")
    return {k: _decode(v, nodes) for k, v in value.items()}
