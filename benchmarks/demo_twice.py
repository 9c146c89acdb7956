"""The README's demo command twice, with 1 and 2 threads: do its verdicts hold on a second run, and does its log
show progress at least every 30 s?

Each run is `quantgate demo --out DIR --threads T` in a subprocess with stdout and stderr going to a pipe (as in
`quantgate demo > log 2>&1`); every line is stamped with the second it arrived, and the log is kept. The two runs
train their own twins (the thread count changes the floating-point summation order, so the checkpoints differ
as they do between two machines). Written afterwards:

- results/demo_twice.json: per run the wall time, the largest gap between two log lines, the held-out
  perplexities and the largest activations; then every verdict of both reports side by side (the twin comparison
  of each quantized configuration, the outlier comparisons), and which of them differ;
- results/demo_twice.md: the verdict table;
- results/logs/demo_threads{1,2}.log: the stamped logs;
- docs/results/demo-small (2 threads, the committed demo) and docs/results/demo-small-threads1: each run's report,
  summary, analysis and plots (no checkpoints or exports).

    python benchmarks/demo_twice.py [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
KEEP = {"summary.json": "summary.json", "analysis.json": "analysis.json", "plots": "plots",  # source -> kept as
        "report/report.html": "report.html", "report/report.md": "report.md", "report/report.json": "report.json",
        "report/plots": "plots"}


def run_demo(out: Path, threads: int, log: Path) -> dict:
    """The demo as a user runs it, its stdout+stderr stamped line by line on arrival."""
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "quantgate.cli", "demo", "--out", str(out), "--threads", str(threads)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tempfile.gettempdir())
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic() - t0, ln.rstrip("\n"))) for ln in p.stdout])
    reader.start()
    rc = p.wait()
    reader.join()
    wall = time.monotonic() - t0
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(f"{t:8.1f}s  {ln}\n" for t, ln in lines))
    times = [0.0] + [t for t, _ in lines] + [wall]
    gaps = [b - a for a, b in zip(times, times[1:])]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return {"threads": threads, "exit_code": rc, "wall_s": round(wall, 1), "log_lines": len(lines),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],  # other work on the machine meanwhile
            "max_gap_s": round(gaps[worst], 1),
            "max_gap_after": lines[worst - 1][1][:160] if worst > 0 else "(start)",
            "gaps_over_30s": sum(g > 30 for g in gaps), "log": str(log.relative_to(ROOT))}


def verdicts(report: dict) -> dict:
    """Every verdict the report states: each quantized configuration's twin comparison, the outlier comparisons."""
    out = {}
    for k, c in (report.get("comparisons") or {}).items():
        out[f"twins {k}"] = c.get("verdict", f"not compared ({c.get('error', '?')})")
    for k, d in (report.get("outlier_comparison") or {}).items():
        if isinstance(d, dict) and "verdict" in d:
            out[f"outliers {k}"] = d["verdict"]
    for k, c in (report.get("gate_aware") or {}).items():
        out[f"gate-aware {k}"] = c.get("kld_verdict")
    return out


def facts(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    rep = json.loads((out / "report" / "report.json").read_text())
    return {"ppl": {k: round(v["ppl"], 3) for k, v in summary["eval"].items()},
            "max_abs": {t: round(o["max_abs"], 2) for t, o in rep["outliers"].items()},
            "verdicts": verdicts(rep), "stage_seconds": summary["stage_seconds"],
            "generation": (summary.get("generation") or {}).get("text")}


def keep(out: Path, dest: Path) -> None:
    """The run's report, summary, analysis and plots (no checkpoints or exports) into `dest`, replaced whole (its
    README.md, written by hand about the run, is kept)."""
    readme = (dest / "README.md").read_text() if (dest / "README.md").is_file() else None
    if dest.exists():
        shutil.rmtree(dest)
    if readme is not None:
        dest.mkdir(parents=True)
        (dest / "README.md").write_text(readme)
    for rel, to in KEEP.items():
        src = out / rel
        if src.is_dir():
            shutil.copytree(src, dest / to, dirs_exist_ok=True)
        elif src.is_file():
            (dest / to).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / to)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=None, help="parent of the runs' folders (removed afterwards)")
    ap.add_argument("--log-only", type=int, default=None, metavar="THREADS",
                    help="one run with THREADS threads for its log alone: results/demo_log.json and "
                         "logs/demo_log.log (the gaps between lines); nothing else is kept")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    if args.log_only:
        with tempfile.TemporaryDirectory(prefix="quantgate-demo-log-", dir=args.work) as tmp:
            r = run_demo(Path(tmp) / "demo", args.log_only, RESULTS / "logs" / "demo_log.log")
        (RESULTS / "demo_log.json").write_text(json.dumps({"command": f"python benchmarks/demo_twice.py --log-only "
                                                                      f"{args.log_only}", "commit": commit, **r},
                                                          indent=1) + "\n")
        print(json.dumps(r))
        return
    runs = {}
    with tempfile.TemporaryDirectory(prefix="quantgate-demo-twice-", dir=args.work) as tmp:
        for threads in (1, 2):
            out = Path(tmp) / f"demo-threads{threads}"
            r = run_demo(out, threads, RESULTS / "logs" / f"demo_threads{threads}.log")
            if r["exit_code"] == 0:
                r.update(facts(out))
                keep(out, ROOT / "docs" / "results" / ("demo-small" if threads == 2 else "demo-small-threads1"))
            runs[threads] = r
            print(json.dumps({k: v for k, v in r.items() if k != "verdicts"}), flush=True)
    a, b = (runs[t].get("verdicts", {}) for t in (1, 2))
    table = [{"verdict": k, "threads_1": a.get(k), "threads_2": b.get(k), "same": a.get(k) == b.get(k)}
             for k in sorted(set(a) | set(b))]
    result = {"command": "python benchmarks/demo_twice.py", "commit": commit,
              "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
              "runs": {str(t): {k: v for k, v in r.items() if k != "verdicts"} for t, r in runs.items()},
              "verdicts": table, "verdicts_differing": sum(not row["same"] for row in table),
              "verdicts_total": len(table)}
    (RESULTS / "demo_twice.json").write_text(json.dumps(result, indent=1) + "\n")
    md = ["| verdict | 1 thread | 2 threads | same |", "|---|---|---|---|"]
    md += [f"| {r['verdict']} | {r['threads_1']} | {r['threads_2']} | {'yes' if r['same'] else '**no**'} |" for r in table]
    (RESULTS / "demo_twice.md").write_text(
        f"# The demo twice (commit {commit}): {result['verdicts_differing']} of {len(table)} verdicts differ\n\n"
        "Each verdict is about one trained pair of checkpoints (the intervals resample held-out text, not training "
        "runs); the two runs trained their own pairs.\n\n" + "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
