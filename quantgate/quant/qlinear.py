"""Integer quantizers (quantize-dequantize) and the Linear wrapper that applies them.

Fake quantization: values are rounded to the integer grid and mapped back to float, so accuracy can be
measured on any device with the model's own kernels. Integer kernels for speed are the backends'
business (torchao on CUDA, ONNX Runtime, llama.cpp). Written by hand because no library offers these
exact per-tensor/per-token/group-wise variants with a sink-position exemption in one place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import QuantgateError


def quantize_weight(w: torch.Tensor, bits: int, group_size: int | None = None) -> torch.Tensor:
    """Symmetric round-to-nearest, one scale per output row (group_size None) or per group of inputs."""
    out_f, in_f = w.shape
    g = in_f if group_size is None else group_size
    if in_f % g:
        raise QuantgateError(f"group size {g} does not divide the layer's input width {in_f}")
    qmax = 2 ** (bits - 1) - 1
    wg = w.reshape(out_f, in_f // g, g)
    scale = wg.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / qmax
    return ((wg / scale).round().clamp(-qmax - 1, qmax) * scale).reshape(out_f, in_f)


@dataclass
class ActRange:
    """A static per-tensor activation range found by calibration."""
    lo: float
    hi: float


def fake_quant_static(x: torch.Tensor, r: ActRange, bits: int, symmetric: bool) -> torch.Tensor:
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = max(abs(r.lo), abs(r.hi), 1e-12) / qmax
        return (x / scale).round().clamp(-qmax - 1, qmax) * scale
    levels = 2 ** bits - 1
    lo, hi = min(r.lo, 0.0), max(r.hi, 0.0)  # the grid always holds 0 exactly
    scale = max(hi - lo, 1e-12) / levels
    zero = round(-lo / scale)
    return ((x / scale).round() + zero).clamp(0, levels).sub(zero) * scale


def fake_quant_per_token(x: torch.Tensor, bits: int) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / qmax
    return (x / scale).round().clamp(-qmax - 1, qmax) * scale


class QuantLinear(nn.Module):
    """A Linear whose weight is already quantized and whose input is quantized on the fly.

    act: None (weight-only), "static" (per-tensor range from calibration) or "dynamic" (per token).
    skip_first_position: leave position 0 (BOS, the sink token) in full precision: PrefixQuant-style.
    """

    def __init__(self, weight: torch.Tensor, act: str | None = None, act_bits: int = 8,
                 act_range: ActRange | None = None, symmetric: bool = False, skip_first_position: bool = False,
                 weight_bits: int | None = None, group_size: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.act, self.act_bits, self.act_range = act, act_bits, act_range
        self.symmetric, self.skip_first_position = symmetric, skip_first_position
        self.weight_bits, self.group_size = weight_bits, group_size  # what was done to the weight, for reports

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is None:
            return x
        if self.act == "dynamic":
            return fake_quant_per_token(x, self.act_bits)
        if self.skip_first_position and x.dim() == 3 and x.shape[1] > 0:
            return torch.cat([x[:, :1], fake_quant_static(x[:, 1:], self.act_range, self.act_bits, self.symmetric)], 1)
        return fake_quant_static(x, self.act_range, self.act_bits, self.symmetric)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.quantize_input(x), self.weight)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, w{self.weight_bits or 32}"
                f"{'' if self.group_size is None else f'/g{self.group_size}'}, act={self.act}")
