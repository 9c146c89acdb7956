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
from ..quant import SCHEMES, plain_of, scope_words
from ..stats import LEVEL, MIN_UNITS, NOT_RESOLVED, RESAMPLES, SEED, direction, holm
from .compare import DISAGREE, compare_cells, link_reading, settle, sqnr_link
from .settings import TWINS, ReportSettings, gated_only
from .sinks import ONE_PAIR, massive_summary, outlier_sentences, settle_outlier, sink_summary, twin_outliers


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


def cell_failures(cells: dict) -> list[str]:
    """Cells that failed or were skipped, named: a conclusion counts them, it never drops them silently."""
    return [f"{k} ({c['error']})" for k, c in cells.items() if "error" in c]


def twin_comparisons(cells: dict) -> dict:
    """Every scheme both twins ran: the gated cell against the baseline's, paired over windows."""
    out = {}
    for key, cell in cells.items():
        backend, twin, scheme = key.split("/")
        if twin != "gated" or gated_only(backend, scheme) or scheme in ("fp32", "F16"):
            continue
        other = cells.get(f"{backend}/baseline/{scheme}")
        if other is None:
            continue
        out[f"{backend}/{scheme}"] = ({"error": "a twin's cell failed"} if "error" in cell or "error" in other
                                      else compare_cells(cell, other))
    return out


def gate_aware_comparisons(cells: dict, hybrid: bool | None = None) -> dict:
    """Each gate-aware cell of the gated twin against the same scheme without its override; `hybrid`: whether the
    gated twin has Gated DeltaNet layers (the scope's words name their in_proj_z only then)."""
    out = {}
    for key, a in cells.items():
        backend, twin, scheme = key.split("/")
        sch = SCHEMES.get(f"{backend}:{scheme}")
        if twin != "gated" or not gated_only(backend, scheme):
            continue
        p = cells.get(f"{backend}/gated/{plain_of(sch)}")
        if p and "error" not in p and "error" not in a:
            out[f"{backend}/{scheme}"] = {"plain": plain_of(sch), "scope": scope_words(sch.keep.scope, hybrid),
                                          "bits": sch.keep.bits, **compare_cells(a, p, ("gate-aware", "plain"))}
    return out


def twin_outlier_summary(analysis: dict) -> dict:
    outliers = {}
    for t, rep in analysis.items():
        L = rep["layers"]
        bos = [l["bos_attention_mean"] for l in L if l.get("bos_attention_mean") is not None]  # attention layers
        outliers[t] = {"max_abs": max(l["max_abs"] for l in L), "max_over_median": max(l["max_over_median"] for l in L),
                       "bos_attention_max_layer_mean": max(bos) if bos else None,
                       "bos_attention_layers": len(bos), "layers": len(L),
                       "uniform_bos_share": rep["uniform_bos_share"],
                       "sinks": sink_summary(rep), "massive": massive_summary(rep),
                       "max_kurtosis": max(v["kurtosis"] for v in rep["linear_inputs"].values()),
                       "max_linear_inf_norm": max(v["max_abs"] for v in rep["linear_inputs"].values()),
                       "per_layer": [_layer_row(rep, l) for l in L]}
    return outliers


def _is_hybrid(memory: dict | None) -> bool | None:
    """Whether the gated twin has Gated DeltaNet layers (a fixed recurrent state), from its cache sizes."""
    if not memory or "gated" not in memory:
        return None
    return bool(memory["gated"].get("recurrent_state_bytes"))


def build_report(s: ReportSettings, analysis: dict, cells: dict, timings: dict, plot_files: list,
                 memory: dict | None = None) -> dict:
    """report.json's dict. memory: twin -> its cache sizes (quantgate.info.cache_bytes), for the memory sentence."""
    try:
        import llama_cpp
        llama_version = llama_cpp.__version__
    except ImportError:
        llama_version = None
    rep = {"quantgate_version": __version__, "settings": asdict(s), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                       "python": platform.python_version()},
           "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
                        "llama_cpp_python": llama_version},
           "statistics": {"method": "paired percentile bootstrap", "level": LEVEL, "resamples": RESAMPLES,
                          "seed": SEED},
           "cells": {k: {kk: vv for kk, vv in v.items() if kk != "layer_sqnr_db"} for k, v in cells.items()},
           "comparisons": twin_comparisons(cells), "gate_aware": gate_aware_comparisons(cells, _is_hybrid(memory)),
           "failed_cells": cell_failures(cells),
           "outliers": twin_outlier_summary(analysis),
           "outlier_comparison": twin_outliers(analysis["baseline"], analysis["gated"]),
           "link": {t: sqnr_link(analysis[t], cells.get(f"torch/{t}/w8a8-static")) for t in TWINS},
           "timings_s": timings, **({"memory": memory} if memory else {})}
    rep["statistics"] |= correct_verdicts(rep)
    rep["statistics"]["unit"] = _units(rep)
    rep["conclusion"] = conclusion(rep)
    return rep


def verdict_tests(rep: dict) -> dict:
    """Every "no difference" a report's sentences could reject, by a stable name: p-value. A twin comparison is two
    verdicts (KLD and delta perplexity), a gate-aware cell one (KLD), the outlier comparison two, each twin's
    input-size/W8A8 link one."""
    tests = {}
    for k, c in (rep.get("comparisons") or {}).items():
        if "error" not in c:
            tests[f"comparisons/{k}/kld"], tests[f"comparisons/{k}/ppl"] = c["kld_ratio_p"], c["delta_ppl_diff_p"]
    for k, c in (rep.get("gate_aware") or {}).items():
        tests[f"gate_aware/{k}/kld"] = c["kld_ratio_p"]
    for k, d in (rep.get("outlier_comparison") or {}).items():
        if isinstance(d, dict) and "p" in d:
            tests[f"outlier_comparison/{k}"] = d["p"]
    for t, link in (rep.get("link") or {}).items():
        if link and "spearman_p" in link:
            tests[f"link/{t}"] = link["spearman_p"]
    return tests


def correct_verdicts(rep: dict) -> dict:
    """Holm's step-down correction over every verdict the report can print (verdict_tests): a difference whose 95%
    interval excludes none but which the correction does not keep is printed as not resolved. Rewrites the verdicts
    in place; returns what the statistics block records of it."""
    tests = verdict_tests(rep)
    keep = holm(tests)
    for k, c in (rep.get("comparisons") or {}).items():
        if "error" not in c:
            rep["comparisons"][k] = settle(c, {m: keep[f"comparisons/{k}/{m}"] for m in ("kld", "ppl")})
    for k, c in (rep.get("gate_aware") or {}).items():
        rep["gate_aware"][k] = settle(c, {"kld": keep[f"gate_aware/{k}/kld"], "ppl": False})
    for k, d in (rep.get("outlier_comparison") or {}).items():
        if isinstance(d, dict) and "p" in d:
            rep["outlier_comparison"][k] = settle_outlier(d, keep[f"outlier_comparison/{k}"])
    for t, link in (rep.get("link") or {}).items():
        if link and "spearman_p" in link:
            link["holm_kept"] = keep[f"link/{t}"]
    return {"correction": "Holm", "verdicts": len(tests),
            "dropped_by_correction": sorted(k for k, v in keep.items() if not v and tests[k] < 1 - LEVEL)}


def _units(rep: dict) -> str:
    """What the intervals resampled (documents, or blocks of windows where the text has too few documents)."""
    units = {c.get("interval_unit") for c in (rep.get("comparisons") or {}).values() if c.get("interval_unit")}
    return " / ".join(sorted(units)) or "held-out window"


def _ci(ci, spec: str, units: str = "windows") -> str:
    return f" [{ci[0]:{spec}}, {ci[1]:{spec}}]" if ci else f" [no interval: fewer than {MIN_UNITS} {units}]"


def comparison_line(name: str, c: dict, a: dict, b: dict) -> str:
    """One scheme's twin comparison: each measure with its interval, then what they resolve."""
    if "error" in c:
        return f"{name}: not compared ({c['error']})."
    kld = (f"KLD baseline {b['kld_mean']:.5f} vs gated {a['kld_mean']:.5f}, gated/baseline "
           f"{c['kld_ratio']:.2f}{_ci(c['kld_ratio_ci95'], '.2f')}")
    ppl = (f"delta ppl {b['delta_ppl_pct']:+.2f}% vs {a['delta_ppl_pct']:+.2f}%, difference "
           f"{c['delta_ppl_diff']:+.2f}{_ci(c['delta_ppl_diff_ci95'], '+.2f')} points")
    v = c["verdict"]
    if v == DISAGREE:
        reading = (f"KLD and perplexity disagree (by KLD the {c['kld_verdict']} twin loses less, by delta "
                   f"perplexity the {c['ppl_verdict']} twin)")
    elif v == NOT_RESOLVED:
        dropped = [m for m, ci, null in (("KLD", c["kld_ratio_ci95"], 1.0), ("delta ppl", c["delta_ppl_diff_ci95"], 0.0))
                   if direction(ci, null)]
        reading = ("not resolved (both intervals hold no difference)" if not dropped else
                   f"not resolved (the {' and '.join(dropped)} interval excludes no difference, but Holm's correction "
                   f"over the report's verdicts does not keep it)")
    elif c["kld_verdict"] == c["ppl_verdict"]:
        reading = f"the {v} twin loses less by both measures"
    else:
        which = "KLD" if c["kld_verdict"] != NOT_RESOLVED else "delta perplexity"
        other = "delta perplexity" if which == "KLD" else "KLD"
        reading = f"the {v} twin loses less by {which}; {other} does not resolve a difference"
    if v != NOT_RESOLVED:
        reading += ONE_PAIR
    unpaired = "" if c.get("paired", True) else "; unpaired: the two models were scored on different windows"
    rot = {t: x.get("kv_rotation") for t, x in (("gated", a), ("baseline", b)) if x.get("kv_rotation")}
    if rot and "not quantized" not in " ".join(rot.values()):
        same = len(set(rot.values())) == 1
        unpaired += ("; " + (f"{next(iter(rot.values()))} for both twins" if same else
                             "; ".join(f"{t}: {r}" for t, r in rot.items())))
    return f"{name}: {reading} ({kld}; {ppl}{unpaired})."


def _plural(unit: str) -> str:
    """"window" -> "windows", "block of consecutive windows (...)" -> "blocks of consecutive windows (...)"."""
    return " / ".join("blocks" + u[len("block"):] if u.startswith("block") else u + "s" for u in unit.split(" / "))


def conclusion(rep: dict) -> list[str]:
    """Sentences written from the numbers and their intervals: a difference is named only where its 95% interval
    excludes none; nothing here is fixed wording that could contradict them."""
    o = rep["outliers"]
    lines = outlier_sentences(o, rep.get("outlier_comparison") or {})
    hybrid = any(x.get("bos_attention_layers", x.get("layers")) != x.get("layers") for x in o.values())
    mem = rep.get("memory") or {}
    if hybrid and mem.get("gated"):
        m = mem["gated"]
        lines.append(f"Memory per sequence (gated twin): {m['kv_cache_bytes_per_token']:,} bytes of fp16 KV cache per "
                     f"token on the full-attention layers, plus a fixed {m['recurrent_state_bytes']:,}-byte recurrent "
                     f"state for the Gated DeltaNet layers, whatever the length.")
    comps = rep.get("comparisons") or {}
    cells = rep["cells"]
    scored = {k: c for k, c in comps.items() if "error" not in c}
    count = {v: sum(c["verdict"] == v for c in scored.values()) for v in ("gated", "baseline", NOT_RESOLVED, DISAGREE)}
    if comps:
        st = rep.get("statistics") or {}
        failed = rep.get("failed_cells") or []
        tail = f"; {len(failed)} cells failed or were skipped: {'; '.join(failed)}" if failed else ""
        unpaired = len(comps) - len(scored)
        lines.append(f"Across {len(comps)} quantized configurations both twins ran, with 95% intervals from a "
                     f"{st.get('method', 'bootstrap')} over held-out {_plural(st.get('unit', 'window'))} and "
                     f"verdicts kept by Holm's correction over the report's {st.get('verdicts', len(comps))} "
                     f"verdicts, about these two checkpoints (not about training runs in general: "
                     f"train seeds, `--seeds`, for that): the gated twin loses less in "
                     f"{count['gated']}, the baseline in {count['baseline']}, {count[NOT_RESOLVED]} not resolved, "
                     f"{count[DISAGREE]} where KLD and perplexity disagree"
                     + (f", {unpaired} not compared" if unpaired else "") + f"{tail}.")
    for k, c in comps.items():
        backend, scheme = k.split("/")
        lines.append(comparison_line(f"{backend} {scheme}", c, cells.get(f"{backend}/gated/{scheme}", {}),
                                     cells.get(f"{backend}/baseline/{scheme}", {})))
    for k, c in (rep.get("gate_aware") or {}).items():
        backend, scheme = k.split("/")
        a, p = cells[f"{backend}/gated/{scheme}"], cells[f"{backend}/gated/{c['plain']}"]
        v = {"gate-aware": "lower", "plain": "higher"}.get(c["kld_verdict"], "not resolved: the interval holds 1")
        lines.append(f"{backend}: keeping {c['scope']} at {c['bits']} bits under {c['plain']} changes the gated twin's "
                     f"KLD from {p['kld_mean']:.5f} to {a['kld_mean']:.5f} (ratio {c['kld_ratio']:.3f}"
                     f"{_ci(c['kld_ratio_ci95'], '.3f')}: {v}).")
    for t, link in rep["link"].items():
        if link:
            lines.append(f"{t}: W8A8-static output SQNR against the input's inf-norm, one point per distinct Linear "
                         f"input ({len(link['points'])} inputs): Spearman {link['spearman']:+.2f}{_ci(link['spearman_ci95'], '+.2f', 'inputs')}, "
                         f"Pearson on log10 inf-norm {link['pearson']:+.2f}{_ci(link['pearson_ci95'], '+.2f', 'inputs')} "
                         f"(intervals: bootstrap over the inputs): {link_reading(link)}.")
    return lines
