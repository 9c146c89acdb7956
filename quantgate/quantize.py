"""`quantize_(model, scheme, calib_windows)`: apply a Scheme to a model in place (PyTorch backend).

Static schemes first run the calibration windows through the float model and record, per Linear,
the range of its input (min-max, or percentiles of a bounded sample); sink-aware schemes leave
position 0 (BOS) out of that range and out of quantization.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from .errors import QuantgateError
from .gptq import gptq_quantize, input_hessian
from .model import Model
from .progress import track
from .qlinear import ActRange, QuantLinear, quantize_weight
from .schemes import Scheme

PERCENTILE_SAMPLE = 1 << 18  # input values kept per Linear and batch for percentile ranges


def block_linears(model: Model) -> dict[str, nn.Linear]:
    """The Linears a scheme quantizes: every projection inside the decoder blocks."""
    return {f"layers.{name}": m for name, m in model.layers.named_modules() if isinstance(m, nn.Linear)}


@dataclass
class Calibration:
    ranges: dict[str, ActRange] = field(default_factory=dict)     # static activation ranges
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)  # sum x^T x per Linear (GPTQ)


@torch.inference_mode()
def calibrate(model: Model, windows: np.ndarray, scheme: Scheme, batch: int = 4) -> Calibration:
    """One pass of the float model over the windows, recording what the scheme needs per Linear.

    GPTQ Hessians come from the float model's inputs in this single pass (not layer-sequentially from
    already-quantized layers), which keeps calibration one forward per batch.
    """
    if windows is None or len(windows) == 0:
        raise QuantgateError(f"scheme {scheme.name} needs calibration windows, and none were given")
    linears = block_linears(model)
    lo = {n: float("inf") for n in linears}
    hi = {n: float("-inf") for n in linears}
    samples: dict[str, list] = {n: [] for n in linears}
    hessians: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)

    def hook_for(name):
        def hook(_m, args):
            x = args[0]
            if scheme.method == "gptq":
                h = input_hessian(x.detach())
                hessians[name] = h if name not in hessians else hessians[name] + h
            if scheme.act != "static":
                return
            if scheme.sink_aware:
                x = x[:, 1:]
            x = x.detach().float().reshape(-1)
            if scheme.calib == "percentile":
                idx = torch.randint(0, x.numel(), (min(x.numel(), PERCENTILE_SAMPLE),), generator=gen)
                samples[name].append(x[idx])
            else:
                lo[name] = min(lo[name], float(x.min()))
                hi[name] = max(hi[name], float(x.max()))
        return hook

    hooks = [m.register_forward_pre_hook(hook_for(n)) for n, m in linears.items()]
    try:
        model.eval()
        for i in track(range(0, len(windows), batch), "calibrate", total=-(-len(windows) // batch)):
            model(torch.as_tensor(windows[i:i + batch]))
    finally:
        for h in hooks:
            h.remove()
    cal = Calibration(hessians=hessians)
    if scheme.act == "static" and scheme.calib == "percentile":
        q = torch.tensor([(100 - scheme.percentile) / 100, scheme.percentile / 100])
        for n, s in samples.items():
            lo_hi = torch.quantile(torch.cat(s), q)
            cal.ranges[n] = ActRange(float(lo_hi[0]), float(lo_hi[1]))
    elif scheme.act == "static":
        cal.ranges = {n: ActRange(lo[n], hi[n]) for n in linears}
    return cal


def _bits_for(name: str, scheme: Scheme) -> int | None:
    if scheme.gate_bits is not None:
        if name.endswith("self_attn.g_proj") or (scheme.gate_scope == "q_and_gate" and name.endswith("self_attn.q_proj")):
            return scheme.gate_bits
    return scheme.weight_bits


def quantize_(model: Model, scheme: Scheme, calib_windows: np.ndarray | None = None) -> Model:
    """Replace every block Linear by a QuantLinear under `scheme`. Returns the same model object."""
    if scheme.gate_bits is not None and model.cfg.gate == "none":
        raise QuantgateError(f"scheme {scheme.name} keeps the gate at {scheme.gate_bits} bits, "
                             f"but this model has no attention gate")
    cal = calibrate(model, calib_windows, scheme) if scheme.needs_calibration else Calibration()
    for name, lin in block_linears(model).items():
        bits = _bits_for(name, scheme)
        w = lin.weight.detach().float()
        if bits is not None:
            g = scheme.group_size
            if g is not None and w.shape[1] % g:
                raise QuantgateError(f"{name}: group size {g} does not divide the layer's input width {w.shape[1]}")
            if scheme.method == "gptq":
                w = gptq_quantize(w, cal.hessians[name], bits, g)
            else:
                w = quantize_weight(w, bits, g)
        q = QuantLinear(w.to(lin.weight.dtype), act=scheme.act, act_bits=scheme.act_bits, act_range=cal.ranges.get(name),
                        symmetric=scheme.symmetric, skip_first_position=scheme.sink_aware,
                        weight_bits=bits, group_size=scheme.group_size)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, q)
    model.cfg.extra = {**model.cfg.extra, "quant_scheme": scheme.to_dict()}
    return model
