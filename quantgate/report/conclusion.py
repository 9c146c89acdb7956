"""From the cells' numbers to the report's dict and its conclusion: sentences written from the numbers, so no
fixed wording can contradict them."""
from __future__ import annotations

import platform
import time
from dataclasses import asdict

import numpy as np
import onnxruntime
import torch

from .. import __version__
from ..quant import SCHEMES, SCOPES, plain_of
from .settings import TIE_RATIO, TWINS, ReportSettings, gated_only


def sqnr_link(analysis: dict, cells: dict, twin: str) -> dict | None:
    """Per Linear: W8A8-static output SQNR against that layer's input inf-norm, with their correlation."""
    cell = cells.get(f"torch/{twin}/w8a8-static")
    if not cell or not cell.get("layer_sqnr_db"):
        return None
    pts = []
    for name, v in cell["layer_sqnr_db"].items():
        li = analysis[twin]["linear_inputs"].get(name)
        if li and v.get("output_db") is not None:
            pts.append((name, li["max_abs"], v["output_db"]))
    if len(pts) < 3:
        return None
    x, y = np.log10([p[1] for p in pts]), np.array([p[2] for p in pts])
    return {"points": [{"linear": n, "inf_norm": a, "sqnr_db": b} for n, a, b in pts],
            "pearson_log_infnorm_vs_sqnr": float(np.corrcoef(x, y)[0, 1])}


def layer_inputs(linear_inputs: dict, layer: int, kind: str = "full_attention") -> dict:
    """The layer's mixer output projection (attention o_proj, or a Gated DeltaNet's out_proj) and down_proj inputs:
    inf-norm and kurtosis (where outliers hurt W8A8)."""
    out = {}
    mixer = "linear_attn.out_proj" if kind == "linear_attention" else "self_attn.o_proj"
    for short, name in (("o_proj", f"layers.{layer}.{mixer}"), ("down_proj", f"layers.{layer}.mlp.down_proj")):
        v = linear_inputs.get(name)
        if v:
            out[f"{short}_inf_norm"], out[f"{short}_kurtosis"] = v["max_abs"], v["kurtosis"]
    return out


def training(extra: dict) -> dict | None:
    """What a checkpoint says of its own training (quantgate train records it; other checkpoints: None)."""
    if extra.get("trained_by") != "quantgate train":
        return None
    return {"steps": extra.get("steps"), "corpus": extra.get("corpus"), **(extra.get("recipe") or {})}


def training_lines(rep: dict) -> list[str]:
    tr = rep.get("training") or {}
    lines = []
    for t, r in tr.items():
        if not r:
            lines.append(f"{t}: not trained by quantgate (no recipe recorded).")
            continue
        tokens = f", {r['tokens'] / 1e6:.2f}M tokens" if r.get("tokens") else ""
        extra = ", ".join(f"{k} {r[k]}" for k in ("batch_size", "ctx", "lr", "warmup", "weight_decay") if k in r)
        lines.append(f"{t}: {r.get('steps')} steps{tokens} on {r.get('corpus')}" + (f" ({extra})" if extra else "") + ".")
    if rep["settings"].get("recipe_note"):
        lines.append(rep["settings"]["recipe_note"])
    return lines


def _layer_row(rep: dict, l: dict) -> dict:
    """One row of the per-layer table: the layer's kind, outliers, mixer/MLP inputs, and its gate (attention:
    sigmoid(X W_g); a Gated DeltaNet layer: silu(X W_z))."""
    kind = l.get("kind", "full_attention")
    row = {k: l.get(k) for k in ("layer", "max_abs", "max_over_median", "bos_attention_mean")}
    row["kind"] = "gdn" if kind == "linear_attention" else "attention"
    row |= layer_inputs(rep["linear_inputs"], l["layer"], kind)
    for prefix, gate in (("", "sigmoid(g)"), ("gdn_", "silu(z)")):
        if f"{prefix}gate_mean" in l:
            row |= {"gate": gate, "gate_mean": float(np.mean(l[f"{prefix}gate_mean"])),
                    "gate_frac_below_0.1": float(np.mean(l[f"{prefix}gate_frac_below_0.1"]))}
    return row


def build_report(s: ReportSettings, analysis: dict, cells: dict, timings: dict, plot_files: list,
                 memory: dict | None = None) -> dict:
    """report.json's dict. memory: twin -> its cache sizes (quantgate.info.cache_bytes), for the memory sentence."""
    try:
        import llama_cpp
        llama_version = llama_cpp.__version__
    except ImportError:
        llama_version = None
    outliers = {}
    for t, rep in analysis.items():
        L = rep["layers"]
        bos = [l["bos_attention_mean"] for l in L if l.get("bos_attention_mean") is not None]  # attention layers
        outliers[t] = {"max_abs": max(l["max_abs"] for l in L), "max_over_median": max(l["max_over_median"] for l in L),
                       "bos_attention_max_layer_mean": max(bos),
                       "bos_attention_layers": len(bos), "layers": len(L),
                       "uniform_bos_share": rep["uniform_bos_share"],
                       "max_kurtosis": max(v["kurtosis"] for v in rep["linear_inputs"].values()),
                       "max_linear_inf_norm": max(v["max_abs"] for v in rep["linear_inputs"].values()),
                       "per_layer": [_layer_row(rep, l) for l in L]}
    rep = {"quantgate_version": __version__, "settings": asdict(s), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                       "python": platform.python_version()},
           "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
                        "llama_cpp_python": llama_version},
           "cells": {k: {kk: vv for kk, vv in v.items() if kk != "layer_sqnr_db"} for k, v in cells.items()},
           "outliers": outliers, "link": {t: sqnr_link(analysis, cells, t) for t in TWINS}, "timings_s": timings,
           **({"memory": memory} if memory else {})}
    rep["conclusion"] = conclusion(rep)
    return rep


def conclusion(rep: dict) -> list[str]:
    """Sentences written from the numbers: nothing here is fixed wording that could contradict them."""
    lines = []
    o = rep["outliers"]
    b, g = o["baseline"], o["gated"]
    ratio = b["max_abs"] / g["max_abs"]
    lines.append(f"Largest residual activation: baseline {b['max_abs']:.1f} vs gated {g['max_abs']:.1f} "
                 f"({ratio:.2f}x); largest max/median ratio {b['max_over_median']:.1f} vs {g['max_over_median']:.1f}.")
    uni = b["uniform_bos_share"]
    sink = "none of either twin's layers is an attention sink" if max(b["bos_attention_max_layer_mean"],
                                                                    g["bos_attention_max_layer_mean"]) < 0.2 \
        else "at least one layer puts most of its attention on BOS"
    hybrid = b.get("bos_attention_layers", b.get("layers")) != b.get("layers")
    where = f" (the {b['bos_attention_layers']} full-attention layers of {b['layers']}; Gated DeltaNet layers have " \
            f"no attention to read)" if hybrid else ""
    lines.append(f"Attention on BOS, worst layer (head mean){where}: baseline {b['bos_attention_max_layer_mean']:.3f} "
                 f"vs gated {g['bos_attention_max_layer_mean']:.3f} (uniform {uni:.3f}): {sink}.")
    mem = rep.get("memory") or {}
    if hybrid and mem.get("gated"):
        m = mem["gated"]
        lines.append(f"Memory per sequence (gated twin): {m['kv_cache_bytes_per_token']:,} bytes of fp16 KV cache per "
                     f"token on the full-attention layers, plus a fixed {m['recurrent_state_bytes']:,}-byte recurrent "
                     f"state for the Gated DeltaNet layers, whatever the length.")
    wins = {"baseline": 0, "gated": 0, "tie": 0}
    for key, cell in rep["cells"].items():
        backend, twin, scheme = key.split("/")
        if twin != "gated" or gated_only(backend, scheme) or scheme in ("fp32", "F16"):
            continue
        other = rep["cells"].get(f"{backend}/baseline/{scheme}")
        if not other or other.get("kld_mean") is None or cell.get("kld_mean") is None:
            continue
        kb, kg = other["kld_mean"], cell["kld_mean"]
        if kb <= 0 or kg <= 0:
            continue
        ratio = max(kb, kg) / min(kb, kg)
        better = "tie" if ratio < TIE_RATIO else "gated" if kg < kb else "baseline"
        wins[better] += 1
        verdict = (f"the twins lose the same within {TIE_RATIO - 1:.0%}" if better == "tie"
                   else f"the {better} twin loses less")
        lines.append(f"{backend} {scheme}: {verdict} (KLD {kb:.5f} baseline vs {kg:.5f} gated, "
                     f"{ratio:.2f}x; delta ppl {other['delta_ppl_pct']:+.2f}% vs {cell['delta_ppl_pct']:+.2f}%).")
    for key, a in rep["cells"].items():  # each gate-aware cell beside the same scheme without its override
        backend, twin, scheme = key.split("/")
        sch = SCHEMES.get(f"{backend}:{scheme}")
        aware = twin == "gated" and gated_only(backend, scheme)
        p = rep["cells"].get(f"{backend}/gated/{plain_of(sch)}") if aware else None
        if p:
            lines.append(f"{backend}: keeping {SCOPES[sch.keep.scope]} at {sch.keep.bits} bits under {plain_of(sch)} "
                         f"changes the gated twin's KLD from {p['kld_mean']:.5f} to {a['kld_mean']:.5f}.")
    total = sum(wins.values())
    if total:
        ties = f", {wins['tie']} within {TIE_RATIO - 1:.0%}" if wins["tie"] else ""
        lines.insert(2, f"Across {total} quantized configurations the gated twin loses less in {wins['gated']} and the "
                        f"baseline in {wins['baseline']}{ties} (KL divergence against each twin's own float model).")
    for t, link in rep["link"].items():
        if link:
            r = link["pearson_log_infnorm_vs_sqnr"]
            reading = ("layers with larger inputs lose more signal to W8A8" if r < -0.3 else
                       "layers with larger inputs keep more signal under W8A8, the opposite of the outlier story"
                       if r > 0.3 else "no clear relation between input size and W8A8 error across layers")
            lines.append(f"{t}: per-layer W8A8 output SQNR against the layer's input inf-norm: Pearson r = {r:+.2f} "
                         f"(log10 inf-norm, {len(link['points'])} layers): {reading}.")
    return lines
