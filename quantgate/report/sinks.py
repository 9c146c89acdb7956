"""Attention sinks and massive activations read as the literature defines them, with intervals over windows.

- Attention sink (Gu et al. 2024, "When Attention Sink Emerges in Language Models", ICLR 2025): a head sinks when
  its mean attention on the first token exceeds epsilon = 0.3; their sink rate is the share of (layer, head)
  pairs that do. We average over queries >= 1 (the query at position 0 can only attend to itself). Uniform
  attention at context T already puts mean(1/(q+1)) on BOS; where that reaches epsilon the threshold cannot tell a
  sink from uniform attention, and no sink is claimed either way.
- Massive activation (Sun et al. 2024, "Massive Activations in Large Language Models"): a residual-stream value
  whose magnitude exceeds 100 and is about 1,000x the median magnitude. We take the layer's median |h| over the
  analysed windows (quantgate.outliers).

Intervals resample the documents the analysis windows come from (quantgate.stats); two twins analysed on the same
windows are paired.
"""
from __future__ import annotations

import numpy as np

from ..stats import NOT_RESOLVED, bootstrap_test, interval, resolved

SINK_EPSILON = 0.3       # Gu et al. 2024
MASSIVE_ABS = 100.0      # Sun et al. 2024: magnitude above 100 ...
MASSIVE_RATIO = 1000.0   # ... and about 1,000x the median magnitude


def bos_grid(analysis: dict, key: str = "bos_attention_windows") -> tuple[np.ndarray, list[tuple[int, int]]] | None:
    """[windows, heads] BOS shares over every attention layer's heads, with each column's (layer, head); `key`
    bos_attention_nontrigger_windows: over non-trigger queries only (Bigram-Backcopy)."""
    cols, where = [], []
    for l in analysis["layers"]:
        w = l.get(key)
        if w:
            a = np.asarray(w, dtype=np.float64)
            cols.append(a)
            where += [(l["layer"], h) for h in range(a.shape[1])]
    return (np.concatenate(cols, axis=1), where) if cols else None


def _worst(g: np.ndarray) -> np.ndarray:
    return g.mean(axis=1).max(axis=-1)


def sink_summary(analysis: dict) -> dict | None:
    """Per-head BOS shares against epsilon and against uniform attention: how many heads sink, the worst head."""
    grid = bos_grid(analysis)
    if grid is None:
        return None
    g, where = grid
    share = g.mean(axis=0)
    i = int(share.argmax())
    uniform = float(analysis["uniform_bos_share"])
    sinks = [f"L{l}.H{h}" for (l, h), s in zip(where, share) if s > SINK_EPSILON]
    return {"epsilon": SINK_EPSILON, "uniform": uniform, "readable": uniform < SINK_EPSILON, "heads": len(where),
            "sink_heads": len(sinks), "sink_head_names": sinks, "sink_rate": len(sinks) / len(where),
            "worst": {"layer": where[i][0], "head": where[i][1], "share": float(share[i]),
                      "ci95": interval(_worst, g, groups=analysis.get("window_docs"))},
            "mean_share": float(share.mean()), "windows": int(g.shape[0]),
            **({"worst_nontrigger": _worst_of(nt, analysis)} if (nt := bos_grid(
                analysis, "bos_attention_nontrigger_windows")) else {})}


def _worst_of(grid, analysis: dict) -> dict:
    """The worst head of a [windows, heads] grid: where, its share and interval over documents."""
    g, where = grid
    share = g.mean(axis=0)
    i = int(share.argmax())
    return {"layer": where[i][0], "head": where[i][1], "share": float(share[i]),
            "ci95": interval(_worst, g, groups=analysis.get("window_docs"))}


def massive_summary(analysis: dict) -> dict:
    """The largest |h| (where, against the median), the layers that hold massive activations by Sun et al.'s rule,
    and the per-window largest |h| with its interval (the number the twins are compared on)."""
    L = analysis["layers"]
    top = max(L, key=lambda l: l["max_abs"])
    per_window = np.max([l["max_abs_windows"] for l in L], axis=0) if L[0].get("max_abs_windows") else None
    massive = [l["layer"] for l in L if l["max_abs"] > MASSIVE_ABS and l["max_over_median"] >= MASSIVE_RATIO]
    out = {"max_abs": top["max_abs"], "layer": top["layer"], "position": top.get("max_position"),
           "max_over_median": top["max_over_median"], "massive_layers": massive,
           "rule": f"|h| > {MASSIVE_ABS:g} and >= {MASSIVE_RATIO:g}x the layer's median |h|"}
    if per_window is not None:
        out |= {"window_max_mean": float(per_window.mean()),
                "window_max_ci95": interval(lambda a: a.mean(axis=1), per_window, groups=analysis.get("window_docs")),
                "window_max": per_window.tolist()}
    return out


def paired(a: dict, b: dict) -> bool:
    """Two analyses ran on the same windows (same tokens), so their per-window numbers pair."""
    return a.get("windows_id") is not None and a.get("windows_id") == b.get("windows_id")


def twin_outliers(baseline: dict, gated: dict) -> dict:
    """baseline/gated ratio of the per-window largest |h| and the baseline-minus-gated worst-head BOS share, paired
    over windows, each with its interval and what it resolves."""
    out: dict = {"paired": paired(baseline, gated)}
    if not out["paired"]:
        return out
    docs = baseline.get("window_docs")
    mb, mg = (massive_summary(x).get("window_max") for x in (baseline, gated))
    if mb and mg:
        ci, p = bootstrap_test(lambda a, b: a.mean(axis=1) / b.mean(axis=1), mb, mg, null=1.0, groups=docs)
        out["max_abs_ratio"] = settle_outlier({"point": float(np.mean(mb) / np.mean(mg)), "ci95": ci, "p": p,
                                               "null": 1.0, "names": ["gated larger", "baseline larger"]})
    gb, gg = bos_grid(baseline), bos_grid(gated)
    if gb and gg:
        ci, p = bootstrap_test(lambda a, b: _worst(a) - _worst(b), gb[0], gg[0], null=0.0, groups=docs)
        out["worst_bos_diff"] = settle_outlier({"point": float(gb[0].mean(0).max() - gg[0].mean(0).max()), "ci95": ci,
                                                "p": p, "null": 0.0, "names": ["gated higher", "baseline higher"]})
    key = "bos_attention_nontrigger_windows"
    nb, ng = bos_grid(baseline, key), bos_grid(gated, key)
    if nb and ng:  # Bigram-Backcopy: the share over non-trigger queries, where Guo et al. read the sink
        ci, p = bootstrap_test(lambda a, b: _worst(a) - _worst(b), nb[0], ng[0], null=0.0, groups=docs)
        out["worst_bos_nontrigger_diff"] = settle_outlier(
            {"point": float(nb[0].mean(0).max() - ng[0].mean(0).max()), "ci95": ci, "p": p, "null": 0.0,
             "names": ["gated higher", "baseline higher"]})
    return out


def settle_outlier(d: dict, keep: bool = True) -> dict:
    """The verdict of one outlier difference: what its interval resolves, unless Holm's correction over the
    report does not keep it (`keep` False)."""
    v = resolved(d["ci95"], d["null"], *d["names"]) if keep else NOT_RESOLVED
    return {**d, "verdict": v}


def _ci(ci, spec: str = ".3f") -> str:
    return f" [{ci[0]:{spec}}, {ci[1]:{spec}}]" if ci else ""


def sink_sentence(name: str, s: dict | None) -> str:
    """One twin's sink reading, right on uniform attention and on a single sink head among many."""
    if s is None:
        return f"{name}: no attention layer to read"
    w = s["worst"]
    worst = f"worst head L{w['layer']}.H{w['head']} {w['share']:.3f}{_ci(w['ci95'])}"
    if not s["readable"]:
        return (f"{name}: {worst}, but uniform attention at this context already puts {s['uniform']:.3f} >= "
                f"{s['epsilon']} on BOS, so a sink cannot be told from uniform attention")
    heads = ", ".join(s["sink_head_names"][:6]) + (" ..." if len(s["sink_head_names"]) > 6 else "")
    which = f" ({heads})" if s["sink_heads"] else ""
    nt = s.get("worst_nontrigger")
    over = (f" over all queries; over non-trigger queries (Guo et al.'s reading) L{nt['layer']}.H{nt['head']} "
            f"{nt['share']:.3f}{_ci(nt['ci95'])}") if nt else ""
    return f"{name}: {s['sink_heads']} of {s['heads']} heads sink{which}; {worst}{over}"


ONE_PAIR = " (this trained pair of checkpoints; another training run may differ: `--seeds` for that)"


def pair_verdict(verdict: str) -> str:
    """A verdict about one pair of checkpoints, saying so when it names a side (the intervals resample held-out
    text, not training runs: independently trained pairs can disagree, as two runs of the demo did)."""
    return "not resolved" if verdict == NOT_RESOLVED else f"{verdict}{ONE_PAIR}"


def outlier_sentences(outliers: dict, comparison: dict) -> list[str]:
    """The conclusion's lines on massive activations and sinks."""
    b, g = outliers["baseline"], outliers["gated"]
    mb, mg = b["massive"], g["massive"]
    lines = []
    per = ""
    if mb.get("window_max_mean") is not None:
        per = (f"; per window, the largest |h| averages {mb['window_max_mean']:.1f}{_ci(mb['window_max_ci95'], '.1f')} "
               f"vs {mg['window_max_mean']:.1f}{_ci(mg['window_max_ci95'], '.1f')}")
    r = comparison.get("max_abs_ratio")
    ratio = (f", baseline/gated {r['point']:.2f}{_ci(r['ci95'], '.2f')}: "
             f"{pair_verdict(r['verdict'])}") if r else ""
    massive = {t: (f"layers {o['massive']['massive_layers']}" if o["massive"]["massive_layers"] else "none")
               for t, o in outliers.items()}
    lines.append(f"Largest residual activation: baseline {mb['max_abs']:.1f} (layer {mb['layer']}, "
                 f"{mb['max_over_median']:.0f}x its median) vs gated {mg['max_abs']:.1f} (layer {mg['layer']}, "
                 f"{mg['max_over_median']:.0f}x){per}{ratio}. Massive activations by Sun et al.'s rule ({mb['rule']}): "
                 f"baseline {massive['baseline']}, gated {massive['gated']}.")
    sb, sg = b["sinks"], g["sinks"]
    if sb or sg:
        ref = sb or sg
        h = next((x for x in (b, g) if x.get("bos_attention_layers", x.get("layers")) != x.get("layers")), None)
        where = (f" on the {h['bos_attention_layers']} full-attention layers of {h['layers']} (Gated DeltaNet layers "
                 f"have no attention to read)") if h else ""
        d = comparison.get("worst_bos_diff")
        diff = (f" Worst-head share, baseline minus gated: {d['point']:+.3f}{_ci(d['ci95'])}: "
                f"{pair_verdict(d['verdict'])}.") if d else ""
        n = comparison.get("worst_bos_nontrigger_diff")
        diff += (f" Over non-trigger queries: {n['point']:+.3f}{_ci(n['ci95'])}: "
                 f"{pair_verdict(n['verdict'])}.") if n else ""
        lines.append(f"Attention sinks (a head whose mean attention on BOS exceeds {ref['epsilon']}, Gu et al. 2024; "
                     f"uniform attention gives {ref['uniform']:.3f}){where}: {sink_sentence('baseline', sb)}; "
                     f"{sink_sentence('gated', sg)}.{diff}")
    return lines
