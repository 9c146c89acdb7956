"""What a user asks of an allocation, as values: a file size (`2.6GB`) and a decode floor (`0.95xQ4_K_M`).

Parsed here, without numpy, gguf-py or llama.cpp, because the scheme registry reads them from report cell names
(`gguf:auto@2.6GB+floor=Q4_K_M`) and the CLI's options, and a bad one is refused before any work starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import QuantgateError
from .gguf_types import GGUF_FILE_TYPES


def parse_size(text: str, what: str = "--target-size") -> int:
    """`2.6GB`, `900MB`, `512KiB` or a byte count, as bytes (GB = 1e9, GiB = 2**30); `what` names it in an error."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)\s*", text or "", re.I)
    if not m:
        raise QuantgateError(f"{what} {text!r}: give a size like 2.6GB, 900MB or a byte count")
    unit = m.group(2).upper().rstrip("B") or ""
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2 ** 10, "MI": 2 ** 20, "GI": 2 ** 30,
             "TI": 2 ** 40}.get(unit)
    if scale is None or float(m.group(1)) <= 0:
        raise QuantgateError(f"{what} {text!r}: give a size like 2.6GB, 900MB or a byte count")
    return int(float(m.group(1)) * scale)


@dataclass(frozen=True)
class DecodeFloor:
    """At least `tps` tokens per second (`reference` None), or `fraction` of what llama.cpp's `reference` type
    decodes at on the same model, measured in the same rounds."""
    tps: float | None = None
    reference: str | None = None
    fraction: float = 1.0

    def __str__(self) -> str:
        if self.reference is None:
            return f"{self.tps:g} tok/s"
        return f"{self.fraction:g}x{self.reference}" if self.fraction != 1.0 else self.reference


def parse_floor(text: str, what: str = "--decode-floor") -> DecodeFloor:
    """`40` (tok/s), `Q4_K_M`, or `0.95xQ4_K_M` (`0.95*Q4_K_M` too, quoted in a shell); anything else is one line
    naming the forms."""
    t = (text or "").strip()
    if re.fullmatch(r"[0-9]*\.?[0-9]+", t):
        if float(t) <= 0:
            raise QuantgateError(f"{what} {text!r}: a speed above 0 tok/s")
        return DecodeFloor(tps=float(t))
    m = re.fullmatch(r"(?:([0-9]*\.?[0-9]+)\s*[*x]\s*)?([A-Za-z][A-Za-z0-9_]*)", t)
    if m and m.group(2).upper() in GGUF_FILE_TYPES:
        frac = float(m.group(1)) if m.group(1) else 1.0
        if not 0.1 <= frac <= 2.0:
            raise QuantgateError(f"{what} {text!r}: the fraction of {m.group(2).upper()}'s speed must be "
                                 f"between 0.1 and 2")
        return DecodeFloor(reference=m.group(2).upper(), fraction=frac)
    raise QuantgateError(f"{what} {text!r}: give tok/s (40), a llama.cpp type (Q4_K_M) or a fraction of "
                         f"one (0.95xQ4_K_M)")
