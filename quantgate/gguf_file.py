"""Kept at this path for one release: the GGUF reader is `quantgate.formats.gguf`."""
from __future__ import annotations

from .formats.gguf import (F16_SCALE_OFFSETS, FILE_TYPE_NAMES, GGUF_MAGIC, GGUFInfo, check_finite_weights,
                           inspect_gguf, load_gguf_model, open_reader, read_tensor, tokenizer_from_gguf)
from .formats.gguf_layout import SUPPORTED_ARCHS

__all__ = ["FILE_TYPE_NAMES", "GGUF_MAGIC", "GGUFInfo", "open_reader", "inspect_gguf", "F16_SCALE_OFFSETS",
           "check_finite_weights", "read_tensor", "tokenizer_from_gguf", "load_gguf_model", "SUPPORTED_ARCHS"]
