"""How the report's 95% intervals narrow as held-out windows are added: the measurement the report's default
window count is chosen from.

For a trained twin pair (default: a `quantgate demo` directory) each scheme below is built with the library's own
functions and scored against its float twin on the first N held-out windows of the embedded corpus's test split,
for N up to --max-windows. For each N it records the width of the paired-bootstrap interval (quantgate.stats, the
report's own) of each cell's KLD (relative to the KLD) and of the twins' KLD ratio and delta-perplexity
difference, and which verdict the interval supports. The windows of a smaller N are a prefix of a larger N's, as
the report took them when the committed result was measured; since then `eval_windows` spreads N windows evenly
over the split, because these prefixes (the first few files) moved the ratio past their own intervals.

    python benchmarks/interval_width.py [--run quantgate-demo] [--max-windows 128]
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

SCHEMES = ["w8a8-static", "w4a16-g32", "kv-int4"]
COUNTS = [8, 16, 32, 64, 128, 256]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="quantgate-demo", help="folder holding baseline/ and gated/")
    ap.add_argument("--max-windows", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "interval_width.json"))
    args = ap.parse_args()

    from quantgate.evaluate import evaluate_model
    from quantgate.quant import get
    from quantgate.quant.build import CalibSettings, quantize
    from quantgate.report.compare import compare_cells
    from quantgate.stats import cell_intervals

    t0 = time.time()
    run = Path(args.run)
    counts = [n for n in COUNTS if n <= args.max_windows]
    result = {"run": str(run.resolve()), "ctx": args.ctx, "counts": counts, "schemes": {},
              "command": f"python benchmarks/interval_width.py --run {args.run} --max-windows {args.max_windows}"}
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in SCHEMES:
            evs = {}
            for twin in ("baseline", "gated"):
                src = str(run / twin)
                art = Path(tmp) / f"{twin}-{scheme}"
                quantize(src, get("torch", scheme), art, CalibSettings("embedded", 16, args.ctx))
                evs[twin] = evaluate_model(str(art), "embedded", args.ctx, max_windows=args.max_windows, reference=src)
            rows = []
            for n in counts:
                cut = {t: {**e, "per_window": {k: v[:n] for k, v in e["per_window"].items()}} for t, e in evs.items()}
                if len(cut["baseline"]["per_window"]["kld"]) < n:
                    break
                row = {"windows": n}
                for t, e in cut.items():
                    pw = e["per_window"]
                    kld = sum(pw["kld"]) / n
                    lo, hi = cell_intervals(pw)["kld_mean_ci95"]
                    row[f"{t}_kld"] = kld
                    row[f"{t}_kld_rel_halfwidth"] = (hi - lo) / 2 / kld
                c = compare_cells(cut["gated"], cut["baseline"])
                lo, hi = c["kld_ratio_ci95"]
                dlo, dhi = c["delta_ppl_diff_ci95"]
                row |= {"kld_ratio": c["kld_ratio"], "kld_ratio_ci95": [lo, hi], "kld_ratio_halfwidth": (hi - lo) / 2,
                        "delta_ppl_diff": c["delta_ppl_diff"], "delta_ppl_diff_ci95": [dlo, dhi],
                        "delta_ppl_diff_halfwidth": (dhi - dlo) / 2, "verdict": c["verdict"]}
                rows.append(row)
                print(f"{scheme} n={n}: ratio {c['kld_ratio']:.3f} [{lo:.3f}, {hi:.3f}] dppl "
                      f"{c['delta_ppl_diff']:+.3f} [{dlo:+.3f}, {dhi:+.3f}] {c['verdict']}")
            result["schemes"][scheme] = rows
    result["seconds"] = round(time.time() - t0, 1)
    result["machine"] = {"platform": platform.platform()}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
