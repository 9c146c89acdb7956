"""The PyTorch schemes, kept at this path for one release: they now live in `quantgate.quant` with the
other backends' (`quantgate.quant.get("torch", name)`)."""
from __future__ import annotations

from .quant.schemes import TORCH_SCHEMES, get
from .quant.schemes import TorchScheme as Scheme

SCHEMES: dict[str, Scheme] = {s.name: s for s in TORCH_SCHEMES}


def get_scheme(name: str, **overrides) -> Scheme:
    return get("torch", name, "scheme", **overrides)


__all__ = ["SCHEMES", "Scheme", "get_scheme"]
