"""Quantization schemes of every backend in one registry (`quantgate.quant.build.quantize` applies one).

    from quantgate.quant import get
    from quantgate.quant.build import quantize
    quantize("runs/a/gated.gguf", get("gguf", "Q4_K_M+gate8"), "gated-q4.gguf")

This package's `__init__` holds only the registry, which every layer reads (the GGUF reader for llama.cpp's
type names, the PyTorch simulation for its scheme type); the builders sit above the formats and runners they
use, in `quant.build`, so importing the registry never imports them.
"""
from .schemes import (SCHEMES, SCOPES, GgufScheme, KeepAt, OnnxScheme, TorchaoScheme, TorchScheme, get, listing, names,
                      plain_of, with_gate_bits)

__all__ = ["SCHEMES", "SCOPES", "GgufScheme", "KeepAt", "OnnxScheme", "TorchScheme", "TorchaoScheme",
           "get", "listing", "names", "plain_of", "with_gate_bits"]
