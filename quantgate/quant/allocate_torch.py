"""Int bits and group size per block Linear under a bits-per-weight budget, for a PyTorch checkpoint (issue 36's
torch side).

    from quantgate.quant.allocate_torch import allocate_torch
    allocate_torch("runs/a/gated", "gated-auto5", target_bpw=5.0)

The GGUF and ONNX allocators' method (quant.allocate) on the PyTorch simulation (quant.qlinear's round-to-nearest
weights, one fp16 scale per group):

1. Units: every block Linear the torch schemes quantize (quant.simulate.block_linears), a MoE layer's experts'
   same projection as one unit (as llama.cpp stacks them). The gates are units of their own: the attention gate rows
   `g_proj` and a Gated DeltaNet's `in_proj_z`, `in_proj_a`, `in_proj_b` and `out_proj` (GGUF's attn_gate, ssm_alpha,
   ssm_beta and ssm_out, quant.allocate.GATE_UNITS). Options: OPTIONS, 3 to 8 bits in groups of 32, 64 or 128 along
   the input (each group's fp16 scale counts: int4 in groups of 32 is 4.5 bits per weight, int8/128 8.125). A Linear
   whose width no group divides stays float and counts 32 bits.
2. Sensitivity, measured: every unit at BASE, then each unit alone at each option, the model's logits on calibration
   windows against its float logits: delta(u, o) = KLD - KLD(base); cached by content. Above MEASURE_ABOVE weights
   `--sensitivity auto` takes the weight error instead (proxy_sensitivity).
3. Allocation: quant.allocate's multiple-choice knapsack on the predicted KLD; `hold_gates` the A/B's held arm.
4. The checkpoint: weights stored rounded (as every torch scheme stores them), config.json's quant_scheme a
   TorchScheme with `allocated` set and quant_state each Linear's bits and group size; `allocation.json` in the
   folder holds the target, the options per unit and the sensitivity.

The budget counts the block Linears only (`quantgate info`'s block_bits_per_weight): embeddings, norms and the head
stay float under every torch scheme. No decode floor: the simulation has no integer kernel whose speed a floor could
name. Written by hand: torchao and the simulation take one bit width and group size for a whole model, and no library
chooses them per Linear from measured KLD.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..calib_data import calibration_windows, check_ctx, data_paths
from ..errors import QuantgateError
from ..formats import artifact_kind, load_checkpoint, save_checkpoint
from ..fsio import check_output, write_json
from ..identity import code_id, content_id, key
from ..layouts import DEFAULT_LAYOUT_FOR_GATE
from ..metrics import window_scores
from ..progress import track
from ..reference import cache_dir
from ..runners import TorchRunner
from .allocate import Allocation, Sensitivity, allocate, held_gates
from .qlinear import QuantLinear, quantize_weight
from .schemes import TorchScheme
from .simulate import block_linears, saved_quantization

OPTIONS = tuple(f"int{b}/{g}" for b in (3, 4, 5, 6, 8) for g in (128, 64, 32))  # bits/group of quantize_weight
BASE = "int8/32"  # every unit's option while another one is measured
SCALE_BITS = 16  # an fp16 scale per group, as block_bits_per_weight counts it
MEASURE_ABOVE = 100_000_000  # weights: --sensitivity auto measures below, takes the proxy above
GATE_LINEARS = ("self_attn.g_proj", "linear_attn.in_proj_z", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                "linear_attn.out_proj")
EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.\d+\.(\w+)")


def spec(option: str) -> tuple[int, int]:
    """"int4/32" -> (4, 32)."""
    bits, group = option.removeprefix("int").split("/")
    return int(bits), int(group)


@dataclass(frozen=True)
class TorchUnit:
    """One allocation unit: a block Linear, or a MoE layer's experts' same projection (`linears`, one option for all);
    k: the input width groups run along, n: the output rows of all its Linears together."""
    name: str
    linears: tuple[str, ...]
    k: int
    n: int

    @property
    def n_elements(self) -> int:
        return self.k * self.n

    @property
    def is_gate(self) -> bool:
        return self.name.endswith(GATE_LINEARS)

    def candidates(self) -> tuple[str, ...]:
        return tuple(o for o in OPTIONS if self.k % spec(o)[1] == 0)

    def bytes(self, option: str) -> int:
        bits, group = spec(option)
        return self.n * (self.k * bits + self.k // group * SCALE_BITS) // 8

    def bits(self, option: str) -> float:
        return 8 * self.bytes(option) / self.n_elements


def units_of(model) -> tuple[list[TorchUnit], int]:
    """The allocation units of a model, and the block-Linear weights no option fits (kept float)."""
    groups: dict[str, list[str]] = {}
    shapes: dict[str, tuple[int, int]] = {}
    for name, lin in block_linears(model).items():
        m = EXPERT.fullmatch(name)
        unit = f"{m.group(1)}.*.{m.group(2)}" if m else name
        groups.setdefault(unit, []).append(name)
        shapes[name] = tuple(lin.weight.shape)
    units, kept_float = [], 0
    for unit, names in groups.items():
        k = shapes[names[0]][1]
        u = TorchUnit(unit, tuple(names), k, sum(shapes[n][0] for n in names))
        if u.candidates():
            units.append(u)
        else:
            kept_float += u.n_elements
    if not units:
        raise QuantgateError("no block Linear has an input width divisible by 32: nothing to allocate")
    return units, kept_float


class _Weights:
    """The block Linears' float weights, kept aside so each unit can be set to any option and back."""

    def __init__(self, model, units: list[TorchUnit]):
        self.linears = block_linears(model)
        self.float = {n: self.linears[n].weight.detach().clone() for u in units for n in u.linears}

    def set(self, unit: TorchUnit, option: str | None) -> None:
        for n in unit.linears:
            w = self.float[n]
            self.linears[n].weight.data = w if option is None else quantize_weight(w.float(), *spec(option)).to(w.dtype)


def measure_sensitivity(model, model_path: Path, units: list[TorchUnit], windows: np.ndarray,
                        calib_data: str) -> Sensitivity:
    """Each unit's KLD increase over the base (every unit at BASE) when it alone takes each option (module docstring),
    measured by the PyTorch runner and cached by content. The model's weights are float again afterwards."""
    k = key("sensitivity-torch", content_id(model_path), code_id(), BASE,
            [(u.name, u.candidates()) for u in units], hashlib.sha256(windows.tobytes()).hexdigest())
    cached = cache_dir() / f"sens-torch-{k}.json"
    if cached.is_file():
        d = json.loads(cached.read_text())
        return Sensitivity(d["base_kld"], d["delta"], d["windows"], d["ctx"], d["data"], base=BASE)
    runner = TorchRunner(model, name="sensitivity")
    ref = runner.logits(windows)
    weights = _Weights(model, units)

    def kld() -> float:
        lg = runner.logits(windows)
        return float(np.mean([window_scores(ref[i], lg[i], windows[i])["kld"].mean() for i in range(len(windows))]))

    try:
        for u in units:
            weights.set(u, BASE)
        base_kld = kld()
        delta: dict[str, dict[str, float]] = {u.name: {BASE: 0.0} for u in units}
        runs = [(u, o) for u in units for o in u.candidates() if o != BASE]
        for u, o in track(runs, "sensitivity: one Linear at a time", total=len(runs)):
            weights.set(u, o)
            delta[u.name][o] = kld() - base_kld
            weights.set(u, BASE)
    finally:
        for u in units:
            weights.set(u, None)
    sens = Sensitivity(base_kld, delta, len(windows), windows.shape[1], calib_data, base=BASE)
    write_json(cached, sens.to_dict())
    return sens


@torch.inference_mode()
def proxy_sensitivity(model, units: list[TorchUnit]) -> Sensitivity:
    """Each unit's squared weight error at each option over its error at BASE (no calibration run): the stand-in for
    models too large to measure, as weak as the GGUF and ONNX proxies (it weighs every weight alike)."""
    linears = block_linears(model)
    delta = {}
    for u in track(units, "weight error: one Linear at a time", total=len(units)):
        err = {o: 0.0 for o in u.candidates()}
        for n in u.linears:
            w = linears[n].weight.detach().float()
            for o in err:
                err[o] += float(((w - quantize_weight(w, *spec(o))) ** 2).sum())
        delta[u.name] = {o: e - err[BASE] for o, e in err.items()}
    return Sensitivity(0.0, delta, 0, 0, "weights", "proxy", base=BASE)


def budget_bytes(units: list[TorchUnit], kept_float: int, target_bpw: float) -> int:
    """The units' byte budget for a target in bits per weight over the block Linears; one line naming the reachable
    range when the target is outside it."""
    total = sum(u.n_elements for u in units) + kept_float
    other = 4 * kept_float
    lo = sum(min(u.bytes(o) for o in u.candidates()) for u in units) + other
    hi = sum(max(u.bytes(o) for o in u.candidates()) for u in units) + other
    want = int(target_bpw * total / 8)
    if want < lo:
        raise QuantgateError(f"target {target_bpw:g} bpw is below the smallest the options give ({8 * lo / total:.2f} "
                             f"bpw: every Linear at 3 bits in its largest group); nothing was written")
    if target_bpw >= 32:
        raise QuantgateError(f"target {target_bpw:g} bpw is not below float (32): nothing to allocate; nothing was "
                             f"written")
    return min(want, hi) - other


def allocate_torch(src: str | Path, out: str | Path, target_bpw: float, calib_data: str = "embedded",
                   calib_windows: int = 8, ctx: int = 128, seed: int = 0, hold_gates: bool = False,
                   sensitivity: str = "auto") -> dict:
    """Write the checkpoint `out` from the float model directory `src` with each block Linear's bits and group size
    chosen under `target_bpw` (bits per weight over the block Linears, scales included) to minimise the measured KLD;
    `hold_gates`: the gate units at the allocation's base option (the A/B's held arm); `sensitivity`: "measured",
    "proxy" (weight error) or "auto" (measured up to MEASURE_ABOVE weights). Returns the summary, also written to
    `out`/allocation.json."""
    if not 1.0 <= target_bpw <= 32.0:
        raise QuantgateError(f"--target-bpw must be between 1 and 32, got {target_bpw}")
    if sensitivity not in ("auto", "measured", "proxy"):
        more = " (gradient and calibrated score llama.cpp types: a GGUF allocation)" if sensitivity in (
            "gradient", "calibrated") else ""
        raise QuantgateError(f"--sensitivity for a torch allocation must be auto, measured or proxy, got {sensitivity!r}{more}")
    if artifact_kind(src) != "hf":
        raise QuantgateError(f"{src}: a torch allocation reads a model directory, not a {artifact_kind(src)} file")
    inputs = (src, *data_paths(calib_data))
    check_output(out, "checkpoint", inputs)
    loaded = load_checkpoint(src)
    model = loaded.model
    if "quant_scheme" in model.cfg.extra:
        raise QuantgateError(f"{src} is already quantized ({model.cfg.extra['quant_scheme']['name']}); allocate from "
                             f"the float checkpoint")
    units, kept_float = units_of(model)
    budget = budget_bytes(units, kept_float, target_bpw)
    weights = sum(u.n_elements for u in units)
    if sensitivity == "auto":
        sensitivity = "proxy" if weights > MEASURE_ABOVE else "measured"
    if sensitivity == "proxy":
        sens = proxy_sensitivity(model, units)
    else:
        if loaded.tokenizer is None:
            raise QuantgateError(f"{src}: no tokenizer.json, cannot tokenize calibration text")
        check_ctx(ctx, model.cfg.max_seq_len, src)
        windows = calibration_windows(loaded.tokenizer, calib_data, calib_windows, ctx, seed)
        sens = measure_sensitivity(model, Path(src), units, windows, calib_data)
    plan: Allocation = allocate(units, sens, budget)
    if hold_gates:
        plan = allocate(units, sens, budget, held_gates(units, plan))
    _apply(model, units, plan.types)
    total = weights + kept_float
    bpw = round(8 * (plan.unit_bytes + 4 * kept_float) / total, 4)
    measured = sens.kind == "measured"
    record = {"target_bpw": target_bpw, "bits_per_weight": bpw, "hold_gates": hold_gates, "sensitivity_kind": sens.kind,
              "predicted_kld": plan.predicted_kld if measured else None,
              "calibration": f"{calib_data}: {sens.windows} windows of {sens.ctx} tokens" if measured else "weights"}
    scheme = TorchScheme(f"auto@{target_bpw:g}" + ("+held" if hold_gates else ""), weight_bits=None, allocated=True)
    model.cfg.extra = {**model.cfg.extra, "quant_scheme": scheme.to_dict(), "quant_state": saved_quantization(model),
                       "quantized_from": str(src), "allocation": record}
    summary = {"src": str(src), "out": str(out), **record,
               **({} if measured else {"predicted_proxy_error": plan.predicted_kld}),
               "types": plan.types, "gate_types": {u.name: plan.types[u.name] for u in units if u.is_gate},
               "kept_float_weights": kept_float, "sensitivity": sens.to_dict()}
    layout = loaded.layout if loaded.layout != DEFAULT_LAYOUT_FOR_GATE[model.cfg.gate] else None
    save_checkpoint(model, out, loaded.tokenizer, layout=layout, inputs=inputs,
                    side_json={"allocation.json": {"quantgate_artifact": "allocation", **summary}})
    return summary


def _apply(model, units: list[TorchUnit], options: dict[str, str]) -> None:
    """Every block Linear becomes a QuantLinear holding its unit's rounded weight (a Linear no option fits: its float
    weight, bits None), as quant.simulate.quantize_linears swaps them for a named scheme."""
    of = {n: u.name for u in units for n in u.linears}
    for name, lin in block_linears(model).items():
        w = lin.weight.detach()
        bits = group = None
        if name in of:
            bits, group = spec(options[of[name]])
            w = quantize_weight(w.float(), bits, group).to(w.dtype)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, QuantLinear(w, weight_bits=bits, group_size=group))
