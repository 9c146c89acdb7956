"""Kept at this path for one release: the ONNX weight reader is `quantgate.formats.onnx`."""
from __future__ import annotations

from .formats.kind import artifact_kind
from .formats.onnx import check_finite_initializers, gate_rows, load_onnx_model, onnx_context, read_linear

__all__ = ["is_onnx", "read_linear", "gate_rows", "load_onnx_model", "onnx_context", "check_finite_initializers"]


def is_onnx(path) -> bool:
    """`quantgate.formats.artifact_kind(path) == "onnx"`."""
    return artifact_kind(path) == "onnx"
