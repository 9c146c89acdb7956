"""Kept at this path for one release: the llama.cpp runner is `quantgate.runners.llama`."""
from __future__ import annotations

from .runners.llama import KV_TYPES, QUANTIZED_KV, GenerationStats, LlamaRunner

__all__ = ["KV_TYPES", "QUANTIZED_KV", "GenerationStats", "LlamaRunner"]
