"""Twin against twin, and a gate-aware cell against its plain partner: differences with paired intervals over
the held-out windows, and the verdict each interval supports (quantgate.stats).

KL divergence and delta perplexity are judged separately. KLD (against each twin's own float model) is the
primary measure of what quantization loses; delta perplexity is what a user feels and can move the other way.
Where both resolve and point opposite ways the comparison says they disagree; it never picks one silently.
"""
from __future__ import annotations

import numpy as np

from ..stats import (LEVEL, NOT_RESOLVED, percentiles, bootstrap, bootstrap_unpaired, correlation_intervals,
                     delta_ppl_pct, direction, p_value, ratio_of_means, unit_name)

DISAGREE = "KLD and perplexity disagree"


def _pw(cell: dict) -> dict | None:
    return cell.get("per_window") if cell and "error" not in cell else None


def _dppl(n, r):
    return 100 * np.expm1((n - r).mean(axis=1))


def _paired_or_not(stat, a: tuple, b: tuple, paired: bool, groups: tuple, null: float) -> tuple:
    """(interval, p-value against `null`): paired over the same units when both cells were scored on the same
    windows, else each resampled on its own."""
    values = (bootstrap(stat, *a, *b, groups=groups[0]) if paired
              else bootstrap_unpaired(stat, a, b, groups=groups))
    return percentiles(values, LEVEL), p_value(values, null)


def _differences(pt: dict, pb: dict, paired: bool) -> dict:
    """KLD ratio test/base, delta-ppl difference and top-1 difference (test minus base) with their intervals and
    p-values: paired over documents when both were scored on the same windows, else each resampled on its own."""
    g = (pt.get("doc"), pb.get("doc"))
    r = ratio_of_means(pt["kld"], pb["kld"])[0]
    rci, rp = _paired_or_not(lambda a, b: a.mean(axis=1) / b.mean(axis=1), (pt["kld"],), (pb["kld"],), paired, g, 1.0)
    d = delta_ppl_pct(pt["nll"], pt["ref_nll"])[0] - delta_ppl_pct(pb["nll"], pb["ref_nll"])[0]
    dci, dp = _paired_or_not(lambda an, ar, bn, br: _dppl(an, ar) - _dppl(bn, br), (pt["nll"], pt["ref_nll"]),
                             (pb["nll"], pb["ref_nll"]), paired, g, 0.0)
    t = float(np.mean(pt["top1"]) - np.mean(pb["top1"]))
    tci, _ = _paired_or_not(lambda a, b: a.mean(axis=1) - b.mean(axis=1), (pt["top1"],), (pb["top1"],), paired, g,
                            0.0)
    return {"kld_ratio": r, "kld_ratio_ci95": rci, "kld_ratio_p": rp, "delta_ppl_diff": d, "delta_ppl_diff_ci95": dci,
            "delta_ppl_diff_p": dp, "top1_diff": t, "top1_diff_ci95": tci,
            "interval_unit": unit_name(g[0], len(pt["kld"]))}


def compare_cells(test: dict, base: dict, names: tuple[str, str] = ("gated", "baseline")) -> dict:
    """`test` against `base`: KLD ratio test/base, delta-ppl and top-1 differences (test minus base), each with its
    95% interval (paired over windows when both cells were scored on the same windows; two models that tokenize
    the text differently are compared unpaired); per measure the name of the one that loses less, or "not
    resolved"; and one overall verdict (the shared one, a disagreement, or the one measure that resolves)."""
    pt, pb = _pw(test), _pw(base)
    if pt is None or pb is None:
        return {"error": "a cell has no per-window numbers (it failed or predates them)"}
    paired = test.get("windows_id") == base.get("windows_id")
    c = {**_differences(pt, pb, paired), "names": list(names), "paired": paired, "windows": len(pt["kld"])}
    return settle(c)


def settle(c: dict, keep: dict | None = None) -> dict:
    """`c`'s verdicts from its intervals: per measure (kld, ppl) the name of the one that loses less, or "not
    resolved"; `keep` (measure -> bool, from Holm's correction over the whole report) turns a measure whose
    difference the correction does not keep into "not resolved". Then one overall verdict: the shared one, a
    disagreement, or the one measure that resolves."""
    names = c["names"]
    by = {"kld": direction(c["kld_ratio_ci95"], 1.0), "ppl": direction(c["delta_ppl_diff_ci95"], 0.0)}  # -1: test
    if keep is not None:
        by = {k: v if keep.get(k, False) else 0 for k, v in by.items()}
    verdicts = {k: names[0] if v < 0 else names[1] if v > 0 else NOT_RESOLVED for k, v in by.items()}
    if by["kld"] and by["ppl"] and by["kld"] != by["ppl"]:
        overall = DISAGREE
    else:
        overall = verdicts["kld"] if by["kld"] else verdicts["ppl"]
    return {**c, "kld_verdict": verdicts["kld"], "ppl_verdict": verdicts["ppl"], "verdict": overall,
            **({"holm_kept": dict(keep)} if keep is not None else {})}


# Linears that read the same tensor (the explicit table, as llama.cpp's name maps are): one point per distinct
# input in the per-layer link, since q/k/v/gate (and gate/up, and a GDN's in_proj_*) see identical activations.
SHARED_INPUT = {
    "self_attn.q_proj": "self_attn.input", "self_attn.k_proj": "self_attn.input",
    "self_attn.v_proj": "self_attn.input", "self_attn.g_proj": "self_attn.input",
    "self_attn.qg_proj": "self_attn.input",
    "mlp.gate_proj": "mlp.input", "mlp.up_proj": "mlp.input",
    "linear_attn.in_proj_qkv": "linear_attn.input", "linear_attn.in_proj_z": "linear_attn.input",
    "linear_attn.in_proj_a": "linear_attn.input", "linear_attn.in_proj_b": "linear_attn.input",
}


def input_of(linear: str) -> str:
    """layers.3.self_attn.k_proj -> layers.3.self_attn.input; a Linear with its own input keeps its name."""
    layer, _, rest = linear.partition(".")
    idx, _, tail = rest.partition(".")
    shared = SHARED_INPUT.get(tail)
    return f"{layer}.{idx}.{shared}" if shared else linear


def sqnr_link(analysis: dict, cell: dict | None) -> dict | None:
    """Per distinct Linear input: its inf-norm (max |x|) against the mean W8A8-static output SQNR of the Linears
    reading it; Pearson (on log10 inf-norm) and Spearman correlation with intervals over those points."""
    if not cell or not cell.get("layer_sqnr_db"):
        return None
    groups: dict[str, dict] = {}
    for name, v in cell["layer_sqnr_db"].items():
        li = analysis["linear_inputs"].get(name)
        if li and v.get("output_db") is not None:
            g = groups.setdefault(input_of(name), {"inf_norm": li["max_abs"], "db": [], "linears": []})
            g["db"].append(v["output_db"])
            g["linears"].append(name)
    pts = [{"input": k, "inf_norm": g["inf_norm"], "sqnr_db": float(np.mean(g["db"])), "linears": g["linears"]}
           for k, g in groups.items()]
    if len(pts) < 4:
        return None
    corr = correlation_intervals(np.log10([p["inf_norm"] for p in pts]), [p["sqnr_db"] for p in pts])
    return {"points": pts, **corr, "unit": "distinct Linear input (linears sharing an input averaged)"}


def link_reading(link: dict) -> str:
    """What the rank correlation's interval supports."""
    d = direction(link["spearman_ci95"], 0.0)
    if d and not link.get("holm_kept", True):
        return "the interval excludes zero, but Holm's correction over the report's verdicts does not keep it"
    return ("Linears with larger inputs lose more signal to W8A8" if d < 0 else
            "Linears with larger inputs keep more signal under W8A8, the opposite of the outlier story" if d > 0 else
            "the interval holds zero: no relation between input size and W8A8 error is resolved")
