"""Kept at this path for one release: the ONNX Runtime runner is `quantgate.runners.ort`, the export's I/O
spec and checks are `quantgate.formats.onnx_io`."""
from __future__ import annotations

from .formats.onnx_io import META_TYPES, check_graph, check_meta, io_names, read_meta, resolve_onnx
from .runners.ort import OrtRunner

__all__ = ["io_names", "resolve_onnx", "read_meta", "META_TYPES", "check_meta", "check_graph", "OrtRunner"]
