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


def parse_floor(text: str, what: str = "--decode-floor", references: tuple[str, ...] = GGUF_FILE_TYPES,
                kind: str = "a llama.cpp type") -> DecodeFloor:
    """`40` (tok/s), `Q4_K_M`, or `0.95xQ4_K_M` (`0.95*Q4_K_M` too, quoted in a shell); anything else is one line
    naming the forms. `references`: the names a floor may be relative to (llama.cpp's types; for an ONNX
    allocation its uniform options, `int4/32`), matched without regard to case."""
    t = (text or "").strip()
    if re.fullmatch(r"[0-9]*\.?[0-9]+", t):
        if float(t) <= 0:
            raise QuantgateError(f"{what} {text!r}: a speed above 0 tok/s")
        return DecodeFloor(tps=float(t))
    names = {r.upper(): r for r in references}
    m = re.fullmatch(r"(?:([0-9]*\.?[0-9]+)\s*[*x]\s*)?([A-Za-z][A-Za-z0-9_/]*)", t)
    if m and m.group(2).upper() in names:
        ref = names[m.group(2).upper()]
        frac = float(m.group(1)) if m.group(1) else 1.0
        if not 0.1 <= frac <= 2.0:
            raise QuantgateError(f"{what} {text!r}: the fraction of {ref}'s speed must be between 0.1 and 2")
        return DecodeFloor(reference=ref, fraction=frac)
    example = references[min(2, len(references) - 1)] if references != GGUF_FILE_TYPES else "Q4_K_M"
    raise QuantgateError(f"{what} {text!r}: give tok/s (40), {kind} ({example}) or a fraction of one "
                         f"(0.95x{example})")
