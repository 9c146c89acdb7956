"""Quantization schemes of every backend in one registry, and one `quantize(source, scheme, out)`.

    from quantgate.quant import get, quantize
    quantize("runs/a/gated.gguf", get("gguf", "Q4_K_M+gate8"), "gated-q4.gguf")

The registry (`schemes`) is read at every layer: the GGUF reader for llama.cpp's type names, the PyTorch
simulation (`simulate`) for its scheme type. The builders `quantize` dispatches to sit above the formats and
runners they use (`build`), so this package loads `quantize` and `CalibSettings` from `build` on first use
(PEP 562), and importing the registry never imports the builders.
"""
from __future__ import annotations

import importlib

from .schemes import (SCHEMES, SCOPES, GgufBudget, GgufScheme, KeepAt, OnnxBudget, OnnxScheme, TorchaoScheme, TorchBudget,
                      TorchScheme, get, listing, names, plain_of, scope_words, with_gate_bits)

BUILD_NAMES = ("CalibSettings", "quantize")  # quantgate.quant.build's, loaded on first use

__all__ = ["SCHEMES", "SCOPES", "scope_words", "CalibSettings", "GgufBudget", "GgufScheme", "KeepAt", "OnnxBudget",
           "OnnxScheme", "TorchBudget", "TorchScheme", "TorchaoScheme", "get", "listing", "names", "plain_of", "quantize", "with_gate_bits"]


def __getattr__(name: str):
    if name in BUILD_NAMES:
        return getattr(importlib.import_module("quantgate.quant.build"), name)
    raise AttributeError(f"module 'quantgate.quant' has no attribute {name!r}")
