"""The PyTorch schemes, kept at this path for one release: they now live in `quantgate.quant` with the
other backends' (`quantgate.quant.get("torch", name)`)."""
from __future__ import annotations

from dataclasses import replace

from .errors import QuantgateError
from .quant.schemes import TORCH_SCHEMES
from .quant.schemes import TorchScheme as Scheme

SCHEMES: dict[str, Scheme] = {s.name: s for s in TORCH_SCHEMES}


def get_scheme(name: str, **overrides) -> Scheme:
    if name not in SCHEMES:
        raise QuantgateError(f"unknown scheme {name!r}; choose from {', '.join(SCHEMES)}")
    return replace(SCHEMES[name], **overrides) if overrides else SCHEMES[name]


__all__ = ["SCHEMES", "Scheme", "get_scheme"]
