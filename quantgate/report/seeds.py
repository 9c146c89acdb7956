"""A report over several seeds: one full report per twin pair (OUT/seed-K/), then the numbers across seeds.

Within a seed the intervals resample documents (how sure one pair's numbers are); across seeds the unit is the
trained pair (whether another training run would give the same answer). Across seeds we give the mean, the
spread (min..max), a Student-t 95% interval of the mean (ratios on the log scale: geometric mean), and how many
seeds agree in sign; a verdict across seeds is named only where that interval excludes no difference and Holm's
correction over the comparisons keeps it.
"""
from __future__ import annotations

import html
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..fsio import atomic_file, check_output, claim_folder, write_json
from ..stats import NOT_RESOLVED, across_seeds, direction, holm, t_test_p
from .render import Column, html_table, markdown_table
from .run import run_report
from .settings import ReportSettings, check_settings


def _across(values: list, null: float, ratio: bool = False) -> dict:
    """across_seeds with the sign count against `null`; a ratio is averaged on the log scale (its mean is the
    geometric mean and its interval stays positive)."""
    vals = [v for v in values if v is not None and np.isfinite(v) and (v > 0 or not ratio)]
    if ratio:
        a = across_seeds(np.log(vals)) if vals else {"n": 0, "values": []}
        for k in ("mean", "min", "max"):
            if k in a:
                a[k] = float(np.exp(a[k]))
        if "ci95" in a:
            a["ci95"] = [float(np.exp(x)) for x in a["ci95"]]
        a["values"] = [float(v) for v in vals]
        a["scale"] = "log (geometric mean)"
    else:
        a = across_seeds(vals)
    a["above"] = sum(v > null for v in a["values"])
    a["below"] = sum(v < null for v in a["values"])
    a["direction"] = direction(a.get("ci95"), null)
    return a


def aggregate(reports: list[dict]) -> dict:
    """Per comparison, cell and outlier number: every seed's value beside their mean, spread, interval and sign count."""
    comps = {}
    for key in reports[0].get("comparisons", {}):
        cs = [r["comparisons"].get(key, {}) for r in reports]
        ok = [c for c in cs if "error" not in c and c]
        comps[key] = {"kld_ratio": _across([c["kld_ratio"] for c in ok], 1.0, ratio=True),
                      "delta_ppl_diff": _across([c["delta_ppl_diff"] for c in ok], 0.0),
                      "per_seed_verdicts": [c.get("verdict", c.get("error")) for c in cs]}
        logs = [np.log(c["kld_ratio"]) for c in ok if c["kld_ratio"] and c["kld_ratio"] > 0]
        comps[key]["kld_ratio"]["p"] = t_test_p(logs, 0.0)
    keep = holm({k: c["kld_ratio"]["p"] for k, c in comps.items()})  # Holm over the verdicts printed across seeds
    for key, c in comps.items():
        d = c["kld_ratio"]["direction"] if keep[key] else 0
        c["holm_kept"] = keep[key]
        c["verdict"] = "gated" if d < 0 else "baseline" if d > 0 else NOT_RESOLVED
    cells = {k: across_seeds([r["cells"].get(k, {}).get("kld_mean") for r in reports]) for k in reports[0]["cells"]}
    outl = {}
    for t in ("baseline", "gated"):
        o = [r["outliers"][t] for r in reports]
        outl[t] = {"max_abs": across_seeds([x["max_abs"] for x in o]),
                   "worst_head_bos": across_seeds([(x.get("sinks") or {}).get("worst", {}).get("share") for x in o]),
                   "worst_head_bos_nontrigger": across_seeds([(x.get("sinks") or {}).get("worst_nontrigger", {})
                                                              .get("share") for x in o]),
                   "sink_heads": across_seeds([(x.get("sinks") or {}).get("sink_heads") for x in o]),
                   "heads": (o[0].get("sinks") or {}).get("heads"), "uniform": o[0]["uniform_bos_share"]}
    diff = {"max_abs_ratio": _across([r["outliers"]["baseline"]["max_abs"] / r["outliers"]["gated"]["max_abs"]
                                      for r in reports], 1.0, ratio=True),
            "worst_bos_diff": _across([(r["outliers"]["baseline"].get("sinks") or {}).get("worst", {}).get("share", 0)
                                       - (r["outliers"]["gated"].get("sinks") or {}).get("worst", {}).get("share", 0)
                                       for r in reports], 0.0)}
    return {"seeds": len(reports), "comparisons": comps, "cells_kld": cells, "outliers": outl, "outlier_diff": diff,
            "failed_cells": [f"seed {i}: {f}" for i, r in enumerate(reports) for f in r.get("failed_cells", [])]}


def _fmt(a: dict, spec: str) -> str:
    if not a.get("n"):
        return "-"
    ci = f" [{a['ci95'][0]:{spec}}, {a['ci95'][1]:{spec}}]" if a.get("ci95") else ""
    return f"{a['mean']:{spec}}{ci} (range {a['min']:{spec}}..{a['max']:{spec}})"


def seed_conclusion(agg: dict) -> list[str]:
    n = agg["seeds"]
    lines = []
    ob, og = agg["outliers"]["baseline"], agg["outliers"]["gated"]
    d = agg["outlier_diff"]
    lines.append(f"Across {n} seeds (unit: one trained twin pair; mean [Student-t 95% interval] (range)): worst-head "
                 f"BOS share baseline {_fmt(ob['worst_head_bos'], '.3f')} vs gated {_fmt(og['worst_head_bos'], '.3f')}"
                 f" (uniform {ob['uniform']:.3f})"
                 + (f"; over non-trigger queries baseline {_fmt(ob['worst_head_bos_nontrigger'], '.3f')} vs gated "
                    f"{_fmt(og['worst_head_bos_nontrigger'], '.3f')}" if ob["worst_head_bos_nontrigger"].get("n") else "")
                 + f"; heads above the sink threshold: baseline "
                 f"{_fmt(ob['sink_heads'], '.1f')} vs gated {_fmt(og['sink_heads'], '.1f')} of {ob['heads']}; "
                 f"baseline minus gated worst-head share {_fmt(d['worst_bos_diff'], '+.3f')}, positive in "
                 f"{d['worst_bos_diff']['above']} of {n} seeds.")
    lines.append(f"Largest residual activation: baseline {_fmt(ob['max_abs'], '.1f')} vs gated "
                 f"{_fmt(og['max_abs'], '.1f')}; baseline/gated {_fmt(d['max_abs_ratio'], '.2f')}, above 1 in "
                 f"{d['max_abs_ratio']['above']} of {n} seeds.")
    for k, c in agg["comparisons"].items():
        r = c["kld_ratio"]
        verdict = {"gated": "the gated twin loses less", "baseline": "the baseline loses less"}.get(
            c["verdict"], "not resolved across seeds (the interval holds 1)" if not r.get("direction") else
            "not resolved across seeds (the interval excludes 1, but Holm's correction over the comparisons does not "
            "keep it)")
        lines.append(f"{k.replace('/', ' ')}: KLD gated/baseline {_fmt(r, '.2f')}, gated lower in {r['below']} of "
                     f"{r['n']} seeds: {verdict}; delta ppl difference {_fmt(c['delta_ppl_diff'], '+.2f')} points; "
                     f"per seed: {', '.join(str(v) for v in c['per_seed_verdicts'])}.")
    if agg["failed_cells"]:
        lines.append(f"{len(agg['failed_cells'])} cells failed or were skipped: {'; '.join(agg['failed_cells'])}.")
    return lines


SEED_COLUMNS = (
    Column("comparison", lambda r: r["key"]),
    Column("KLD gated/baseline across seeds", lambda r: _fmt(r["kld_ratio"], ".2f")),
    Column("gated lower in", lambda r: f"{r['kld_ratio']['below']} of {r['kld_ratio']['n']}"),
    Column("delta ppl difference, points", lambda r: _fmt(r["delta_ppl_diff"], "+.2f")),
    Column("verdict across seeds", lambda r: r["verdict"]),
    Column("per seed", lambda r: ", ".join(str(v) for v in r["per_seed_verdicts"])),
)


def render_seeds(rep: dict) -> tuple[str, str]:
    rows = [{"key": k, **c} for k, c in rep["aggregate"]["comparisons"].items()]
    links = [f"seed-{i}/report.md" for i in range(rep["aggregate"]["seeds"])]
    md = ["# quantgate report across seeds", "", "## Conclusion", ""] + [f"- {c}" for c in rep["conclusion"]]
    md += ["", "## Comparisons across seeds", ""] + markdown_table(SEED_COLUMNS, rows)
    md += ["", "## Per-seed reports", ""] + [f"- [{p}]({p})" for p in links]
    concl = "".join(f"<li>{html.escape(c)}</li>" for c in rep["conclusion"])
    page = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>quantgate report across seeds</title>'
            f"<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}}table{{border-collapse:collapse;"
            f"font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 6px}}</style></head><body>"
            f"<h1>quantgate report across seeds</h1><h2>Conclusion</h2><ul>{concl}</ul>"
            f"<h2>Comparisons across seeds</h2>{html_table(SEED_COLUMNS, rows)}<h2>Per-seed reports</h2><ul>"
            + "".join(f'<li><a href="{p.replace(".md", ".html")}">{p.replace(".md", ".html")}</a></li>' for p in links)
            + "</ul></body></html>\n")
    return "\n".join(md) + "\n", page


def run_seeds_report(pairs: list[tuple[str, str]], s: ReportSettings) -> dict:
    """One report per (baseline, gated) pair into OUT/seed-K/, then report.json/.md/.html across them in OUT."""
    per_seed = [replace(s, baseline=b, gated=g, out=str(Path(s.out) / f"seed-{i}")) for i, (b, g) in enumerate(pairs)]
    check_output(s.out, "report", [p for pair in pairs for p in pair])
    for ps in per_seed:
        check_settings(ps)
    out = claim_folder(s.out, "report")
    reports = [run_report(ps) for ps in per_seed]
    agg = aggregate(reports)
    rep = {"seeds": [{"baseline": ps.baseline, "gated": ps.gated, "report": f"seed-{i}/report.json"}
                     for i, ps in enumerate(per_seed)], "aggregate": agg,
           "per_seed_conclusions": [r["conclusion"] for r in reports]}
    rep["conclusion"] = seed_conclusion(agg)
    md, page = render_seeds(rep)
    write_json(out / "report.json", rep)
    with atomic_file(out / "report.md", "w") as f:
        f.write(md)
    with atomic_file(out / "report.html", "w") as f:
        f.write(page)
    return rep
