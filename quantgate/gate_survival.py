"""Did the gate survive export and quantization? Compare an artifact's gate values with the float model's.

The gate rows are read back from the artifact (GGUF tensors dequantized with gguf-py; ONNX initializers)
and applied to the same calibration inputs X (the float model's normed layer inputs), so the only
difference is what export and quantization did to W_g. Per layer: mean and max |sigmoid(X W_g') -
sigmoid(X W_g)|, the fraction of gate values that crossed 0.5 (a gate that opened or closed), and the
mean gate and fraction below 0.1 on both sides. A wrong row order in an exporter shows up here as a
large difference even at F32. A hybrid has a second gate, the Gated DeltaNet's silu(X W_z) (`in_proj_z`), checked
the same way on its layers ("kind": "gdn"; crossing 0.5 for sigmoid is a sign flip of X W_g, the same statistic
as a sign flip of X W_z; "below 0.1" is |silu| < 0.1).
"""
from __future__ import annotations

import numpy as np
import torch

from .calib_data import calibration_windows, check_ctx
from .capture import capture
from .errors import QuantgateError
from .formats import load_checkpoint


def gate_modules(model) -> dict[int, tuple[str, torch.nn.Module]]:
    """Layer -> (kind, the Linear whose output is the gate's pre-activation): the attention gate g_proj ("attention")
    or a Gated DeltaNet's in_proj_z ("gdn"); layers without a gate are absent."""
    out = {}
    for i, layer in enumerate(model.layers):
        if layer.is_linear:
            out[i] = ("gdn", layer.linear_attn.in_proj_z)
        elif layer.self_attn.g_proj is not None:
            out[i] = ("attention", layer.self_attn.g_proj)
    return out


ACTIVATION = {"attention": torch.sigmoid, "gdn": torch.nn.functional.silu}


def _gate_inputs(model, windows: np.ndarray) -> dict[int, torch.Tensor]:
    """Layer -> X fed to its gate (the normed layer input), [N, D], from the float model."""
    xs: dict[int, list] = {}

    def hook_for(i: int):
        def hook(_m, args):
            xs.setdefault(i, []).append(args[0].detach().float().reshape(-1, args[0].shape[-1]))
        return hook

    capture(model, windows, pre=[(mod, hook_for(i)) for i, (_kind, mod) in gate_modules(model).items()])
    return {i: torch.cat(v) for i, v in xs.items()}


def _elementwise_rows(w: torch.Tensor, cfg) -> torch.Tensor:
    """Gate rows as one per attention output channel (a headwise gate repeats its row head_dim times)."""
    return w.repeat_interleave(cfg.head_dim, dim=0) if cfg.gate == "headwise" else w


def gate_survival(artifact_model, reference_model, windows: np.ndarray) -> dict:
    """Per-layer comparison of the artifact's gate values with the reference's on the same inputs."""
    ref_cfg, art_cfg = reference_model.cfg, artifact_model.cfg
    if not gate_modules(reference_model):
        raise QuantgateError("the reference model has no attention gate: nothing to check")
    if art_cfg.gate == "none" and ref_cfg.gate != "none":
        raise QuantgateError("the artifact has no attention gate although its reference has one: the gate was lost")
    if (ref_cfg.n_layers, ref_cfg.dim, ref_cfg.n_heads * ref_cfg.head_dim, ref_cfg.layer_types) != \
            (art_cfg.n_layers, art_cfg.dim, art_cfg.n_heads * art_cfg.head_dim, art_cfg.layer_types):
        raise QuantgateError("the artifact's shape does not match the reference model's")
    xs = _gate_inputs(reference_model, windows)
    ref_mods, art_mods = gate_modules(reference_model), gate_modules(artifact_model)
    layers = []
    for i, x in xs.items():
        kind = ref_mods[i][0]
        w_ref = ref_mods[i][1].weight.detach().float()
        w_art = art_mods[i][1].weight.detach().float()
        if kind == "attention" and ref_cfg.gate != art_cfg.gate:  # compare per channel
            w_ref, w_art = _elementwise_rows(w_ref, ref_cfg), _elementwise_rows(w_art, art_cfg)
        z_ref, z_art = x @ w_ref.T, x @ w_art.T
        g_ref, g_art = ACTIVATION[kind](z_ref), ACTIVATION[kind](z_art)
        d = (g_art - g_ref).abs()
        layers.append({
            "layer": i, "kind": kind, "mean_abs_diff": float(d.mean()), "max_abs_diff": float(d.max()),
            "frac_crossed_0.5": float(((z_ref > 0) != (z_art > 0)).float().mean()),
            "gate_mean_ref": float(g_ref.mean()), "gate_mean_artifact": float(g_art.mean()),
            "frac_below_0.1_ref": float((g_ref.abs() < 0.1).float().mean()),
            "frac_below_0.1_artifact": float((g_art.abs() < 0.1).float().mean()),
            "weight_rel_err": float((w_art - w_ref).norm() / w_ref.norm()),
        })
    worst = max(layers, key=lambda l: l["mean_abs_diff"])
    return {"layers": layers, "tokens": int(next(iter(xs.values())).shape[0]),
            "worst_layer": worst["layer"], "worst_mean_abs_diff": worst["mean_abs_diff"],
            "max_frac_crossed_0.5": max(l["frac_crossed_0.5"] for l in layers)}


def check_gate_survival(artifact: str, reference: str, data: str = "embedded", n_windows: int = 8, ctx: int = 256,
                        seed: int = 0) -> dict:
    """`quantgate analyze ARTIFACT --reference MODEL`: load both, draw calibration windows, compare."""

    ref = load_checkpoint(reference)
    art = load_checkpoint(artifact)
    if ref.tokenizer is None:
        raise QuantgateError(f"{reference}: no tokenizer.json, cannot tokenize calibration text")
    check_ctx(ctx, ref.model.cfg.max_seq_len, reference)
    windows = calibration_windows(ref.tokenizer, data, n_windows, ctx, seed)
    rep = gate_survival(art.model, ref.model, windows)
    rep.update(artifact=str(artifact), reference=str(reference), windows=int(len(windows)), ctx=ctx)
    return rep
