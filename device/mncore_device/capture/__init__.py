"""The capture frontend: a Python step becomes typed, guarded graphs (TorchDynamo)."""

from .dynamo import CapturedGraph, DynamoFrontend, GraphBreak, GraphInput, InputKind
from .markers import traced_call
from .scalars import ScalarsAsTensors

__all__ = [
    "CapturedGraph",
    "DynamoFrontend",
    "GraphBreak",
    "GraphInput",
    "InputKind",
    "ScalarsAsTensors",
    "traced_call",
]
