"""report.md, report.html and the report's plots, from report.json's dict.

Both documents are written from one column spec per table (`CELL_COLUMNS`, `LAYER_COLUMNS`): a column is added,
renamed or formatted in one place and appears the same in Markdown and HTML.
"""
from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend chosen

from ..analyze import save_figure
from .conclusion import training_lines


@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[[dict], object]  # a row -> the value to show (None: "-")
    spec: str = ""                   # format spec for numbers ("" prints the value as it is)

    def text(self, row: dict) -> str:
        v = self.value(row)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return format(v, self.spec) if self.spec and isinstance(v, (int, float)) else str(v)


def _get(key: str) -> Callable[[dict], object]:
    return lambda row: row.get(key)


def _interval(key: str, spec: str) -> Callable[[dict], object]:
    return lambda row: f"[{row[key][0]:{spec}}, {row[key][1]:{spec}}]" if row.get(key) else None


def _ratio(prefix: str, spec: str) -> Callable[[dict], object]:
    """A comparison's point estimate and its interval in one cell."""
    def value(row):
        if row.get(prefix) is None:
            return None
        ci = row.get(f"{prefix}_ci95")
        return f"{row[prefix]:{spec}}" + (f" [{ci[0]:{spec}}, {ci[1]:{spec}}]" if ci else "")
    return value


COMPARISON_COLUMNS = (  # the gated twin against the baseline, paired over the same windows
    Column("backend", _get("backend")), Column("scheme", _get("scheme")),
    Column("KLD gated/baseline [95%]", _ratio("kld_ratio", ".2f")),
    Column("delta ppl gated - baseline, points [95%]", _ratio("delta_ppl_diff", "+.2f")),
    Column("top-1 gated - baseline [95%]", _ratio("top1_diff", "+.4f")),
    Column("by KLD", _get("kld_verdict")), Column("by ppl", _get("ppl_verdict")), Column("verdict", _get("verdict")),
)
CELL_COLUMNS = (
    Column("backend", _get("backend")), Column("scheme", _get("scheme")), Column("twin", _get("twin")),
    Column("bits/weight", _get("bits_per_weight"), ".2f"), Column("bytes", _get("bytes"), ","),
    Column("ppl", _get("ppl"), ".2f"), Column("delta ppl %", _get("delta_ppl_pct"), "+.2f"),
    Column("95% interval", _interval("delta_ppl_pct_ci95", "+.2f")),
    Column("KLD", _get("kld_mean"), ".5f"), Column("95% interval", _interval("kld_mean_ci95", ".5f")),
    Column("top-1", _get("top1_agreement"), ".4f"), Column("KV scored", _get("kv_type")),
    Column("prefill tok/s", _get("prefill_tps"), ".0f"), Column("decode tok/s", _get("decode_tps"), ".0f"),
    Column("KV timed", _get("speed_kv")),
    Column("gate mean abs diff", lambda r: (r.get("gate_survival") or {}).get("worst_mean_abs_diff"), ".5f"),
)
LAYER_COLUMNS = (  # o_proj: the mixer's output projection (a Gated DeltaNet layer's out_proj); gate: which one
    Column("layer", _get("layer")), Column("kind", _get("kind")), Column("max abs h", _get("max_abs"), ".1f"),
    Column("max/median", _get("max_over_median"), ".1f"), Column("BOS attention", _get("bos_attention_mean"), ".3f"),
    Column("o_proj inf-norm", _get("o_proj_inf_norm"), ".1f"),
    Column("o_proj kurtosis", _get("o_proj_kurtosis"), ".1f"),
    Column("down_proj inf-norm", _get("down_proj_inf_norm"), ".1f"),
    Column("down_proj kurtosis", _get("down_proj_kurtosis"), ".1f"),
    Column("gate", _get("gate")), Column("gate mean", _get("gate_mean"), ".3f"),
    Column("gate < 0.1", _get("gate_frac_below_0.1"), ".1%"),
)


def cell_rows(rep: dict) -> list[dict]:
    """One row per cell, ordered by backend, scheme, then twin (the twins of a scheme side by side)."""
    rows = []
    for key in sorted(rep["cells"], key=lambda k: (k.split("/")[0], k.split("/")[2], k.split("/")[1])):
        backend, twin, scheme = key.split("/")
        rows.append({"backend": backend, "scheme": scheme, "twin": twin, **rep["cells"][key]})
    return rows


def comparison_rows(rep: dict) -> list[dict]:
    rows = []
    for key, c in (rep.get("comparisons") or {}).items():
        backend, scheme = key.split("/")
        rows.append({"backend": backend, "scheme": scheme, **({"verdict": c["error"]} if "error" in c else c)})
    return rows


def markdown_table(columns: tuple[Column, ...], rows: list[dict]) -> list[str]:
    return (["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(c.text(r) for c in columns) + " |" for r in rows])


def html_table(columns: tuple[Column, ...], rows: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(c.header)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c.text(r))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _outlier_summary(o: dict) -> str:
    return (f"max |h| {o['max_abs']:.1f}, max kurtosis {o['max_kurtosis']:.0f}, max linear inf-norm "
            f"{o['max_linear_inf_norm']:.1f}")


def _setting_line(rep: dict) -> str:
    s = rep["settings"]
    return (f"quantgate {rep['quantgate_version']}, {rep['created']}, {rep['machine']['processor']}; data "
            f"`{s['data']}`, {s['windows']} held-out windows x {s['ctx']} tokens.")


def _stats_line(rep: dict) -> str:
    st = rep.get("statistics") or {}
    holm = (f" and Holm's step-down correction over the report's {st['verdicts']} verdicts keeps it"
            if st.get("correction") == "Holm" else "")
    return (f"Intervals: {st.get('level', 0.95):.0%}, {st.get('method', 'bootstrap')}, unit: one {st.get('unit', 'window')}"
            f" ({st.get('resamples', '?')} resamples, seed {st.get('seed', 0)}). A verdict names a twin only where "
            f"the interval excludes no difference{holm}; verdicts are about these two checkpoints (another training "
            "run can differ: `train --seeds` and a report across seeds carry that). Speed: every cell by the runners' one protocol (each cell's "
            "speed_protocol in report.json), cells timed one after another; `KV timed` is the cache the speed runs "
            "used, `KV scored` the one accuracy was scored with where they differ.")


def render_markdown(rep: dict) -> str:
    s = rep["settings"]
    lines = [f"# quantgate report: {s['baseline']} vs {s['gated']}", "", _setting_line(rep), "", "## Conclusion", ""]
    lines += [f"- {c}" for c in rep["conclusion"]]
    lines += ["", "## How the twins were trained", ""] + [f"- {t}" for t in training_lines(rep)]
    lines += ["", "## The twins compared (gated against baseline, same windows)", "", _stats_line(rep), ""]
    lines += markdown_table(COMPARISON_COLUMNS, comparison_rows(rep))
    lines += ["", "## Accuracy, size and speed", ""] + markdown_table(CELL_COLUMNS, cell_rows(rep))
    lines += ["", "## Outliers per layer", ""]
    for t, o in rep["outliers"].items():
        lines += [f"**{t}**: {_outlier_summary(o)}", ""] + markdown_table(LAYER_COLUMNS, o["per_layer"]) + [""]
    lines += ["## Plots", ""] + [f"![{Path(p).stem}](plots/{Path(p).name})" for p in rep.get("plots", [])]
    return "\n".join(lines) + "\n"


def _img(path: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<figure><img alt="{html.escape(Path(path).stem)}" src="data:image/png;base64,{data}"></figure>'


def render_html(rep: dict) -> str:
    """Self-contained: plots embedded as data URIs, so the page opens offline and travels as one file."""
    s = rep["settings"]
    concl = "".join(f"<li>{html.escape(c)}</li>" for c in rep["conclusion"])
    trained = "".join(f"<li>{html.escape(t)}</li>" for t in training_lines(rep))
    outl = "".join(f"<h3>{html.escape(t)}</h3><p>{html.escape(_outlier_summary(o))}</p>"
                   + html_table(LAYER_COLUMNS, o["per_layer"]) for t, o in rep["outliers"].items())
    imgs = "".join(_img(p) for p in rep.get("plots", []) if Path(p).is_file())
    setting = html.escape(_setting_line(rep)).replace(f"`{html.escape(s['data'])}`",
                                                      f"<code>{html.escape(s['data'])}</code>")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>quantgate report</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}}table{{border-collapse:collapse;
font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}img{{max-width:100%}}</style></head>
<body><h1>quantgate report</h1>
<p>{html.escape(s['baseline'])} vs {html.escape(s['gated'])}</p>
<p>{setting}</p>
<h2>Conclusion</h2><ul>{concl}</ul>
<h2>How the twins were trained</h2><ul>{trained}</ul>
<h2>The twins compared (gated against baseline, same windows)</h2><p>{html.escape(_stats_line(rep))}</p>
{html_table(COMPARISON_COLUMNS, comparison_rows(rep))}
<h2>Accuracy, size and speed</h2>{html_table(CELL_COLUMNS, cell_rows(rep))}
<h2>Outliers per layer</h2>{outl}
<h2>Plots</h2>{imgs}
</body></html>
"""


# --- plots ---------------------------------------------------------------------------------------------------

def _plotted(rep: dict, backend: str, twin: str) -> list[tuple]:
    """(bits/weight, KLD, scheme) of the quantized cells: the float references and KV-only cells have no place on a
    bits axis."""
    return sorted((c["bits_per_weight"], c["kld_mean"], k.split("/")[2]) for k, c in rep["cells"].items()
                  if k.startswith(f"{backend}/{twin}/") and c.get("kld_mean") and c.get("bits_per_weight")
                  and not k.endswith(("/fp32", "/F16")) and not k.split("/")[2].startswith("kv-"))


def report_plots(rep: dict, out_dir: Path) -> list[Path]:
    paths = []
    backends = sorted({k.split("/")[0] for k in rep["cells"]})
    fig = Figure(figsize=(4.8 * len(backends), 3.8))
    axes = fig.subplots(1, len(backends), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        for twin, color in (("baseline", "tab:blue"), ("gated", "tab:orange")):
            pts = _plotted(rep, backend, twin)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=color, label=twin)
                for x, y, name in pts:
                    ax.annotate(name, (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        stored = " (as stored, block Linears)" if backend == "torch" else " (whole file, embeddings included)"
        ax.set(yscale="log", xlabel="bits per weight" + stored, ylabel="KL divergence vs float", title=backend)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(save_figure(fig, out_dir / "kld_vs_bits.png"))
    if any(rep["link"].values()):
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        for twin, color in (("baseline", "tab:blue"), ("gated", "tab:orange")):
            link = rep["link"].get(twin)
            if link:
                ax.scatter([p["inf_norm"] for p in link["points"]], [p["sqnr_db"] for p in link["points"]], c=color,
                           label=f"{twin} (Spearman {link['spearman']:+.2f})", s=18)
        ax.set(xscale="log", xlabel="linear-layer input inf-norm (max |x|)", ylabel="W8A8-static output SQNR (dB)",
               title="larger activations, larger quantization error?\n(one point per distinct Linear input)")
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir / "sqnr_vs_infnorm.png"))
    return paths
