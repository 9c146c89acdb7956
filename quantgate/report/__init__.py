"""`quantgate report`: the twins side by side, model x backend x scheme, with outliers and the link between them.

Every cell (one twin, one backend, one scheme) builds its artifact once under `OUT/artifacts/` with the same
functions `quantgate quantize` and `quantgate export` call, scores it against the twin's float PyTorch logits
on the same held-out windows, and stores its numbers with the settings that produced them in `OUT/cells/*.json`.
A re-run (or a run after an interruption) reuses every cell whose settings match, so only missing cells are
computed. The report itself is written from the cells: `report.json` (every number, settings, versions, machine),
`report.md`, and `report.html` (self-contained: plots embedded as data URIs, opens offline). The conclusion is
generated from the numbers.

- `settings`: ReportSettings, the default schemes, the identity cached results are keyed by
- `cells`: building, scoring and timing one cell
- `compare`: twin against twin (and gate-aware against plain) with paired intervals, and the per-layer link
- `sinks`: attention sinks and massive activations as the literature defines them, with intervals
- `conclusion`: the report's dict and the sentences written from its numbers
- `render`: report.md, report.html (one column spec for both) and the plots
- `run`: `run_report`, which runs the rest
- `seeds`: `run_seeds_report`, one report per seed's twin pair and the numbers across seeds
"""
from .cells import Artifacts, score_cell
from .conclusion import build_report, conclusion
from .render import CELL_COLUMNS, LAYER_COLUMNS, render_html, render_markdown, report_plots
from .run import run_report
from .seeds import run_seeds_report
from .settings import DEFAULT_SCHEMES, TWINS, ReportSettings, check_settings, gated_only

__all__ = ["Artifacts", "CELL_COLUMNS", "DEFAULT_SCHEMES", "LAYER_COLUMNS", "ReportSettings", "TWINS",
           "build_report", "check_settings", "conclusion", "gated_only", "render_html", "render_markdown",
           "report_plots", "run_report", "run_seeds_report", "score_cell"]
