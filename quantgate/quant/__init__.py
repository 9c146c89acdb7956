"""Quantization schemes of every backend in one registry, and one `quantize(source, scheme, out)`.

    from quantgate.quant import get, quantize
    quantize("runs/a/gated.gguf", get("gguf", "Q4_K_M+gate8"), "gated-q4.gguf")
"""
from .build import CalibSettings, quantize
from .schemes import (SCHEMES, SCOPES, GgufScheme, KeepAt, OnnxScheme, TorchaoScheme, TorchScheme, get, listing,
                      names, plain_of, with_gate_bits)

__all__ = ["SCHEMES", "SCOPES", "CalibSettings", "GgufScheme", "KeepAt", "OnnxScheme", "TorchScheme", "TorchaoScheme",
           "get", "listing", "names", "plain_of", "quantize", "with_gate_bits"]
