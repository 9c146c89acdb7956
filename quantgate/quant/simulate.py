"""`quantize_(model, scheme, calib_windows)`: apply a TorchScheme to a model in place (simulated quantization:
QuantLinear modules that round weights and activations as the scheme says, in PyTorch).

Static schemes first run the calibration windows through the float model and record, per Linear,
the range of its input (min-max, or percentiles of a bounded sample); sink-aware schemes leave
position 0 (BOS) out of that range and out of quantization.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

from ..errors import QuantgateError
from .gptq import gptq_quantize, input_hessian
from ..capture import capture
from ..model import Model, attention_only
from .qlinear import ActRange, QuantLinear, quantize_weight
from .smoothquant import smooth_
from .schemes import TorchScheme as Scheme

PERCENTILE_SAMPLE = 1 << 18  # input values kept per Linear and batch for percentile ranges


# A MoE's router and its shared expert's gate stay float under every scheme: llama.cpp keeps both F32 whatever the
# type (llama-quant.cpp), and MoE recipes elsewhere (llm-compressor's ignore of `mlp.gate`) do the same, since a
# rounded router changes which experts run.
FLOAT_LINEARS = (".mlp.gate", ".mlp.shared_expert_gate")


def block_linears(model: Model) -> dict[str, nn.Linear]:
    """The Linears a scheme quantizes: every projection inside the decoder blocks (a MoE's router and shared-expert
    gate aside: FLOAT_LINEARS)."""
    return {f"layers.{name}": m for name, m in model.layers.named_modules()
            if isinstance(m, (nn.Linear, QuantLinear)) and not f".{name}".endswith(FLOAT_LINEARS)}


@dataclass
class Calibration:
    ranges: dict[str, ActRange] = field(default_factory=dict)     # static activation ranges
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)  # sum x^T x per Linear (GPTQ)


class Calibrator:
    """What a scheme needs per Linear, recorded by forward pre-hooks while the float model runs: min-max or a
    sample of input values (static ranges), sum x^T x (GPTQ). `hooks()` for capture (whole model) or
    capture_layerwise (one block at a time); `take(names)` turns what those Linears saw into a Calibration and
    frees it, so a layer-by-layer pass holds one block's Hessians and samples at a time.

    Each Linear samples with its own generator (seeded from its name), so the sample does not depend on the
    order in which Linears run: a whole-model pass and a block-by-block pass sample the same values."""

    def __init__(self, linears: dict[str, nn.Module], scheme: Scheme):
        self.linears, self.scheme = linears, scheme
        self.lo = {n: float("inf") for n in linears}
        self.hi = {n: float("-inf") for n in linears}
        self.samples: dict[str, list] = {n: [] for n in linears}
        self.hessians: dict[str, torch.Tensor] = {}
        self.gens: dict[str, torch.Generator] = {}

    def _hook(self, name: str):
        scheme = self.scheme

        def hook(_m, args):
            x = args[0]
            if scheme.method == "gptq":
                h = input_hessian(x.detach())
                self.hessians[name] = h if name not in self.hessians else self.hessians[name] + h
            if scheme.act != "static":
                return
            if scheme.sink_aware:
                x = x[:, 1:]
            x = x.detach().float().reshape(-1)
            if scheme.calib == "percentile":
                if x.numel() <= PERCENTILE_SAMPLE:  # all of it: a sample would only add noise to a tail of few values
                    self.samples[name].append(x.clone())
                    return
                if name not in self.gens:
                    self.gens[name] = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                idx = torch.randint(0, x.numel(), (PERCENTILE_SAMPLE,), generator=self.gens[name])
                self.samples[name].append(x[idx])
            else:
                self.lo[name] = min(self.lo[name], float(x.min()))
                self.hi[name] = max(self.hi[name], float(x.max()))
        return hook

    def hooks(self) -> list:
        return [(m, self._hook(n)) for n, m in self.linears.items()]

    def take(self, names) -> Calibration:
        """The Calibration of these Linears (what was recorded for them is dropped)."""
        scheme = self.scheme
        cal = Calibration(hessians={n: self.hessians.pop(n) for n in names if n in self.hessians})
        if scheme.act == "static" and scheme.calib == "percentile":
            q = torch.tensor([(100 - scheme.percentile) / 100, scheme.percentile / 100])
            for n in names:
                s = self.samples.pop(n, [])
                if not s:  # a MoE expert no calibration token reached: quantize_ takes its siblings' range
                    continue
                lo_hi = torch.quantile(torch.cat(s), q)
                cal.ranges[n] = ActRange(float(lo_hi[0]), float(lo_hi[1]))
        elif scheme.act == "static":
            cal.ranges = {n: ActRange(self.lo[n], self.hi[n]) for n in names}
        return cal


def check_windows(scheme: Scheme, windows) -> None:
    if windows is None or len(windows) == 0:
        raise QuantgateError(f"scheme {scheme.name} needs calibration windows, and none were given")


@torch.inference_mode()
def calibrate(model: Model, windows: np.ndarray, scheme: Scheme, batch: int = 4) -> Calibration:
    """One pass of the float model over the windows, recording what the scheme needs per Linear.

    GPTQ Hessians come from the float model's inputs in this single pass (not layer-sequentially from
    already-quantized layers), which keeps calibration one forward per batch.
    """
    check_windows(scheme, windows)
    linears = block_linears(model)
    cal = Calibrator(linears, scheme)
    capture(model, windows, pre=cal.hooks(), batch=batch, label="calibrate")
    return cal.take(list(linears))


KEEP_SCOPE_LINEARS = {  # KeepAt scope -> the block Linears it names in our model (quantgate.quant.schemes.SCOPES)
    "gate": ("self_attn.g_proj",),
    "q_and_gate": ("self_attn.q_proj", "self_attn.g_proj", "linear_attn.in_proj_z"),  # SCOPES: a hybrid's z too
}


def _bits_for(name: str, scheme: Scheme) -> int | None:
    keep = scheme.keep
    if keep is not None and name.endswith(KEEP_SCOPE_LINEARS[keep.scope]):
        return keep.bits
    return scheme.weight_bits


def block_bits_per_weight(model: Model) -> float:
    """Bits per weight of the block Linears as stored: each Linear's own bits (32 where it stayed float) plus
    one fp16 scale per group, or per row where the scheme has no groups (quantize_weight's layout)."""
    total = bits = 0.0
    for lin in block_linears(model).values():
        n_out, n_in = lin.weight.shape
        b = getattr(lin, "weight_bits", None)
        per = 32.0 if b is None else b + 16 / (getattr(lin, "group_size", None) or n_in)
        total, bits = total + n_out * n_in, bits + per * n_out * n_in
    return bits / total


def _sibling_range(cal: Calibration, name: str) -> ActRange:
    """A static range for a MoE expert's projection that no calibration token reached: the union of the ranges the
    same projection of the layer's other experts saw (they read the same normed input, or the same kind of hidden).
    Written by hand: the alternative, routing every calibration token to every expert (llm-compressor's
    calibrate-all-experts), needs a second forward path through the MoE."""
    parts = name.split(".")  # layers.{i}.mlp.experts.{j}.{proj}
    if len(parts) != 6 or parts[2:4] != ["mlp", "experts"]:
        raise QuantgateError(f"{name}: no activation range was calibrated (no calibration token reached it)")
    prefix, proj = ".".join(parts[:4]) + ".", parts[5]
    seen = [r for n, r in cal.ranges.items() if n.startswith(prefix) and n.endswith("." + proj) and r.lo <= r.hi]
    if not seen:
        raise QuantgateError(f"{name}: no calibration token reached any expert of this layer; use more --calib-windows")
    return ActRange(min(r.lo for r in seen), max(r.hi for r in seen))


def check_applies(scheme: Scheme, cfg) -> None:
    """The scheme/model combinations refused before any work (one line each)."""
    if scheme.smooth_alpha is not None:
        attention_only(cfg, f"scheme {scheme.name} (SmoothQuant)")
    if scheme.sink_aware and cfg.is_moe:  # experts see routed tokens, flattened: no first position to skip
        raise QuantgateError(f"scheme {scheme.name} (sink-aware) does not apply to mixture-of-experts models: an "
                             f"expert's input has no first position")
    if scheme.gate_bits is not None and cfg.gate == "none":
        raise QuantgateError(f"scheme {scheme.name} keeps the gate at {scheme.gate_bits} bits, "
                             f"but this model has no attention gate")


def quantize_(model: Model, scheme: Scheme, calib_windows: np.ndarray | None = None,
              only: Callable[[str], bool] | None = None) -> Model:
    """Replace every block Linear by a QuantLinear under `scheme`. Returns the same model object.

    only(name) -> bool restricts quantization to some Linears (error attribution); the rest stay float.
    """
    check_applies(scheme, model.cfg)
    if scheme.smooth_alpha is not None:
        check_windows(scheme, calib_windows)
        smooth_(model, calib_windows, scheme.smooth_alpha)
    cal = calibrate(model, calib_windows, scheme) if scheme.needs_calibration else Calibration()
    quantize_linears(model, block_linears(model), scheme, cal, only)
    model.cfg.extra = {**model.cfg.extra, "quant_scheme": scheme.to_dict()}
    return model


def quantize_linears(model: nn.Module, linears: dict[str, nn.Module], scheme: Scheme, cal: Calibration,
                     only: Callable[[str], bool] | None = None) -> None:
    """Swap each of `linears` (block_linears names, all of a model's or one block's) for its QuantLinear in `model`."""
    if scheme.kv_only:
        return  # a KV-cache-only scheme leaves the Linears alone
    for name, lin in linears.items():
        if only is not None and not only(name):
            continue
        bits = _bits_for(name, scheme)
        w = lin.weight.detach().float()
        if bits is not None:
            g = scheme.group_size
            if g is not None and w.shape[1] % g:
                raise QuantgateError(f"{name}: group size {g} does not divide the layer's input width {w.shape[1]}")
            if scheme.method == "gptq" and name in cal.hessians:
                w = gptq_quantize(w, cal.hessians[name], bits, g)
            else:  # RTN; under GPTQ only for a MoE expert no calibration token was routed to (no Hessian)
                w = quantize_weight(w, bits, g)
        act_range = cal.ranges.get(name)
        if scheme.act == "static" and (act_range is None or act_range.lo > act_range.hi):  # nothing was observed
            act_range = _sibling_range(cal, name)
        q = QuantLinear(w.to(lin.weight.dtype), act=scheme.act, act_bits=scheme.act_bits, act_range=act_range,
                        symmetric=scheme.symmetric, skip_first_position=scheme.sink_aware,
                        weight_bits=bits, group_size=scheme.group_size)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, q)


# --- checkpoints that carry their scheme --------------------------------------------------------------
# Weights are stored already rounded (dequantized, float32) in the normal layout, so stock loaders open
# them as plain models; config.json's "quantgate" block holds the scheme and the calibrated activation
# ranges, which `load_checkpoint` re-applies so our runners see exactly what was evaluated.

def saved_kv_bits(model: Model) -> int | None:
    """The KV-cache bits the model's scheme asks runs to use (runners pass them to Model.forward), or None."""
    return (model.cfg.extra.get("quant_scheme") or {}).get("kv_bits")


def saved_quantization(model: Model) -> dict:
    return quant_state_of(model.layers.named_modules(prefix="layers"))


def quant_state_of(named_modules) -> dict:
    """config.json's quant_state for these (name, module) pairs: each QuantLinear's activation range, bits and group
    size (an allocation gives each Linear its own; a named scheme's are all the same)."""
    q = [(n, m) for n, m in named_modules if isinstance(m, QuantLinear)]
    return {"act_ranges": {n: [m.act_range.lo, m.act_range.hi] for n, m in q if m.act_range is not None},
            "weight_bits": {n: m.weight_bits for n, m in q}, "group_sizes": {n: m.group_size for n, m in q}}


def apply_saved_quantization(model: Model, extra: dict, where: str = "config.json") -> Model:
    """Wrap the block Linears of a freshly loaded model as its config.json's scheme says (every saved value
    checked first: the file may have been edited by hand)."""
    scheme = Scheme.from_saved(extra["quant_scheme"], where)
    state = extra.get("quant_state", {})
    if not isinstance(state, dict):
        raise QuantgateError(f"{where}: quant_state must be a JSON object")
    ranges, bits = state.get("act_ranges", {}), state.get("weight_bits", {})
    groups = state.get("group_sizes", {})  # older checkpoints: the scheme's group size for every Linear
    if not isinstance(ranges, dict) or not isinstance(bits, dict) or not isinstance(groups, dict):
        raise QuantgateError(f"{where}: quant_state.act_ranges, .weight_bits and .group_sizes must be JSON objects")
    linears = block_linears(model)
    for name, r in ranges.items():
        finite = isinstance(r, list) and len(r) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) for x in r)
        if name not in linears or not (finite and r[0] <= r[1]):
            raise QuantgateError(f"{where}: quant_state.act_ranges[{name[:60]!r}] must be [lo, hi] (finite, lo <= hi) "
                                 f"for a Linear of this model")
    for name, b in bits.items():
        if name not in linears or not (b is None or (isinstance(b, int) and not isinstance(b, bool) and 2 <= b <= 16)):
            raise QuantgateError(f"{where}: quant_state.weight_bits[{name[:60]!r}] must be 2..16 or null for a Linear "
                                 f"of this model")
    for name, g in groups.items():
        if name not in linears or not (g is None or (isinstance(g, int) and not isinstance(g, bool) and g >= 1
                                                     and linears[name].weight.shape[1] % g == 0)):
            raise QuantgateError(f"{where}: quant_state.group_sizes[{name[:60]!r}] must be null or a positive divisor "
                                 f"of the input width of a Linear of this model")
    if scheme.allocated and set(bits) != set(linears):
        raise QuantgateError(f"{where}: an allocated scheme needs quant_state.weight_bits for every block Linear "
                             f"({len(bits)} of {len(linears)} given)")
    if scheme.kv_only:
        return model
    for name, lin in linears.items():
        r = ranges.get(name)
        if scheme.act == "static" and r is None:
            raise QuantgateError(f"{where}: the {scheme.name} checkpoint has no activation range for {name}")
        q = QuantLinear(lin.weight.detach(), act=scheme.act, act_bits=scheme.act_bits,
                        act_range=None if r is None else ActRange(*r), symmetric=scheme.symmetric,
                        skip_first_position=scheme.sink_aware, weight_bits=bits.get(name),
                        group_size=groups.get(name, scheme.group_size))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, q)
    return model
