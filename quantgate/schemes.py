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

    @classmethod
    def from_saved(cls, d, where: str) -> "Scheme":
        """A scheme read back from a checkpoint's config.json: every field checked (the file may have been
        edited by hand), one error line naming the field otherwise."""
        if not isinstance(d, dict):
            raise QuantgateError(f"{where}: quant_scheme must be a JSON object")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown or not isinstance(d.get("name"), str):
            raise QuantgateError(f"{where}: quant_scheme has unknown fields {unknown[:3]} or no name")
        for k, (ok, want) in _SAVED_FIELDS.items():
            if k in d and not ok(d[k]):
                raise QuantgateError(f"{where}: quant_scheme.{k} must be {want}, got {str(d[k])[:40]}")
        return cls(**d)


def _bits(lo: int, hi: int):
    return lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi)


def _flag(v) -> bool:
    return isinstance(v, bool)


def _number(lo: float, hi: float, none: bool = False):
    return lambda v: (none and v is None) or (isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi)


_SAVED_FIELDS = {  # field -> (check, what it must be)
    "weight_bits": (_bits(2, 8), "2..8 or null"), "group_size": (_bits(1, 1 << 16), "a positive integer or null"),
    "act": (lambda v: v in (None, "static", "dynamic"), "null, static or dynamic"),
    "act_bits": (lambda v: v is not None and _bits(2, 16)(v), "2..16"),
    "calib": (lambda v: v in ("minmax", "percentile"), "minmax or percentile"),
    "percentile": (_number(50, 100), "a number in [50, 100]"), "symmetric": (_flag, "true or false"),
    "sink_aware": (_flag, "true or false"), "gate_bits": (_bits(2, 16), "2..16 or null"),
    "gate_scope": (lambda v: v in ("gate", "q_and_gate"), "gate or q_and_gate"),
    "method": (lambda v: v in ("rtn", "gptq"), "rtn or gptq"),
    "smooth_alpha": (_number(0, 1, none=True), "a number in [0, 1] or null"),
    "kv_bits": (_bits(2, 16), "2..16 or null"),
}


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
