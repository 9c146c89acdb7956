"""KV-cache types, one option for every backend (`eval --kv-type`, `generate --kv-type`).

llama.cpp takes its own ggml types (f32, f16, q8_0, q4_0: 32-value blocks with one scale each); PyTorch and ONNX
Runtime take int8 / int4, k and v rounded per token and head (`Model.forward(kv_bits=)`, `runners.ort_kv`). The two
families are different roundings, so each name is accepted only where it means what it says.
"""
from __future__ import annotations

from ..errors import QuantgateError
from ..quant.schemes import GGUF_KV_TYPES

LLAMA_KV_TYPES = tuple(GGUF_KV_TYPES)
ROUNDED_KV_TYPES = {"int8": 8, "int4": 4}  # name -> bits, per token and head
KV_TYPES = (*LLAMA_KV_TYPES, *ROUNDED_KV_TYPES)


def kv_bits_for(kv_type: str, backend: str) -> int | None:
    """The bits a PyTorch or ONNX Runtime run rounds its cache to for `kv_type` (None: a float cache; f32/f16 keep
    the cache in the precision the model computes it)."""
    if kv_type in ROUNDED_KV_TYPES:
        return ROUNDED_KV_TYPES[kv_type]
    if kv_type in ("q8_0", "q4_0"):
        raise QuantgateError(f"--kv-type {kv_type} is a llama.cpp cache type (GGUF files); {backend} rounds its cache "
                             f"with --kv-type int8 or int4")
    if kv_type not in LLAMA_KV_TYPES:
        raise QuantgateError(f"unknown KV-cache type {kv_type!r}; choose from {', '.join(KV_TYPES)}")
    return None


def check_llama_kv_type(kv_type: str) -> str:
    if kv_type in ROUNDED_KV_TYPES:
        raise QuantgateError(f"--kv-type {kv_type} is for PyTorch and ONNX Runtime; llama.cpp's cache types are "
                             f"{', '.join(LLAMA_KV_TYPES)}")
    if kv_type not in LLAMA_KV_TYPES:
        raise QuantgateError(f"unknown KV-cache type {kv_type!r}; choose from {', '.join(KV_TYPES)}")
    return kv_type
