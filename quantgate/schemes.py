"""Quantization schemes as small named config objects (torchao's `quantize_(model, Config())` style).

A scheme says what happens to the weights (bits, group size), to the activations entering each Linear
(none, a static per-tensor range from calibration, or dynamic per-token) and to the gate. Only the
Linears inside the decoder blocks are quantized; embeddings, norms and lm_head stay in float (llama.cpp
likewise keeps its output tensor at higher precision).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .errors import QuantgateError


@dataclass(frozen=True)
class Scheme:
    name: str
    weight_bits: int | None = 8          # None keeps float weights
    group_size: int | None = None        # None: one scale per output row
    act: str | None = None               # None (weight-only) | "static" | "dynamic"
    act_bits: int = 8
    calib: str = "minmax"                # static ranges: "minmax" | "percentile"
    percentile: float = 99.99
    symmetric: bool = False              # static activations: symmetric int8 or asymmetric uint8
    sink_aware: bool = False             # PrefixQuant-style: BOS kept in float and left out of calibration
    gate_bits: int | None = None         # gate-aware: the gate rows keep this many bits
    gate_scope: str = "gate"             # "gate": only W_g; "q_and_gate": the whole fused q|gate projection
    method: str = "rtn"                  # weight rounding: "rtn" (round to nearest) | "gptq"
    smooth_alpha: float | None = None    # SmoothQuant migration strength before quantizing (None: off)
    kv_bits: int | None = None           # KV cache rounded per token and head to this many bits

    @property
    def needs_calibration(self) -> bool:
        return self.act == "static" or self.method == "gptq" or self.smooth_alpha is not None

    def to_dict(self) -> dict:
        return asdict(self)


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("w8a8-static", act="static"),
    Scheme("w8a8-static-sym", act="static", symmetric=True),
    Scheme("w8a8-static-pct", act="static", calib="percentile"),
    Scheme("w8a8-static-sink", act="static", sink_aware=True),
    Scheme("w8a8-smoothquant", act="static", smooth_alpha=0.5),
    Scheme("w8a8-dynamic", act="dynamic"),
    Scheme("w8a16"),
    Scheme("kv-int8", weight_bits=None, kv_bits=8),
    Scheme("kv-int4", weight_bits=None, kv_bits=4),
    Scheme("w4a16-g32", weight_bits=4, group_size=32),
    Scheme("w4a16-g64", weight_bits=4, group_size=64),
    Scheme("w4a16-g128", weight_bits=4, group_size=128),
    Scheme("w4a16-g32-gate8", weight_bits=4, group_size=32, gate_bits=8),
    Scheme("w4a16-g32-qgate8", weight_bits=4, group_size=32, gate_bits=8, gate_scope="q_and_gate"),
    Scheme("gptq-w4a16-g32", weight_bits=4, group_size=32, method="gptq"),
    Scheme("gptq-w4a16-g128", weight_bits=4, group_size=128, method="gptq"),
)}


def get_scheme(name: str, **overrides) -> Scheme:
    if name not in SCHEMES:
        raise QuantgateError(f"unknown scheme {name!r}; choose from {', '.join(SCHEMES)}")
    return replace(SCHEMES[name], **overrides) if overrides else SCHEMES[name]
