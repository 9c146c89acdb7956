"""What `quantgate demo` costs on this machine: the whole command and its `small` twin training, timed.

Runs `quantgate demo` as a user would, timed end to end (or reads a finished demo directory with --from DIR),
and writes the wall time against the 20-minute goal, the stage times, peak memory, the measured training
tokens/s and the held-out perplexities of both twins.

    python benchmarks/small_twins_run.py [--out-dir quantgate-demo] [--from DIR] [--fast]

`--fast` times `quantgate demo --fast` instead (tiny twins) and writes results/small_twins_run_fast.json;
`--lab sinks` times `quantgate demo --lab sinks` (the sink lab's seeds and its report across them) and writes
results/sinks_lab_run.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_S = 20 * 60  # issue 6: the whole demo in <= 20 minutes on a 2-core CPU


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="quantgate-demo")
    ap.add_argument("--from", dest="existing", default=None, help="read a finished demo directory instead")
    ap.add_argument("--fast", action="store_true", help="time `quantgate demo --fast`")
    ap.add_argument("--lab", default=None, help="time `quantgate demo --lab LAB`")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    name = f"{args.lab}_lab_run.json" if args.lab else "small_twins_run_fast.json" if args.fast else "small_twins_run.json"
    args.out = args.out or str(Path(__file__).parent / "results" / name)
    run_dir = Path(args.existing or args.out_dir)
    flags = ["--fast"] if args.fast else ["--lab", args.lab] if args.lab else []
    wall = None
    if not args.existing:  # the command a user runs, timed end to end (imports and start-up included)
        t = time.time()
        subprocess.run([sys.executable, "-m", "quantgate.cli", "demo", "--out", str(run_dir.resolve()), *flags],
                       check=True, cwd=tempfile.gettempdir())
        wall = round(time.time() - t, 1)
        print(f"demo wall time {wall:.0f} s")
    summary = json.loads((run_dir / "summary.json").read_text())
    if args.lab:
        write(args.out, lab_result(summary, run_dir, wall, flags))
        return
    log = json.loads((run_dir / "state" / "train_log.json").read_text())
    run = json.loads((run_dir / "state" / "run.json").read_text())
    result = {
        "recipe": summary["recipe"], "gate": summary["gate"],
        "train_minutes": round(log[-1]["elapsed_s"] / 60, 1),
        "median_tokens_per_s_each_twin": statistics.median(e["tokens_per_s"] for e in log),
        "train_tokens_seen_per_model": summary["recipe"]["steps"] * summary["recipe"]["batch_size"]
        * (summary["recipe"]["ctx"] - 1),
        "corpus": run["corpus"], "corpus_fingerprint": run["corpus_fingerprint"],
        "corpus_train_tokens": run["train_tokens"], "params": run["params"],
        "final_train_loss": log[-1]["loss"],
        "held_out": {k: {"ppl": round(v["ppl"], 3), "tokens": v["n_tokens"]} for k, v in summary["eval"].items()},
        "stage_seconds": summary["stage_seconds"],
        "command": "quantgate demo" + (" --fast" if args.fast else ""),
        "demo_wall_s": wall, "goal_s": GOAL_S, "meets_goal": None if wall is None else wall <= GOAL_S,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024) if wall else None,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    write(args.out, result)


def write(path: str, result: dict) -> None:
    print(json.dumps(result, indent=2))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def lab_result(summary: dict, run_dir: Path, wall: float | None, flags: list) -> dict:
    """The sink lab's timing, its seeds' training logs and the numbers its report gives across seeds."""
    logs = [json.loads((run_dir / f"seed-{k}" / "state" / "train_log.json").read_text())
            for k in range(summary["seeds"])]
    agg = json.loads((run_dir / "report" / "report.json").read_text())["aggregate"]
    return {"command": "quantgate demo " + " ".join(flags), "recipe": summary["recipe"], "seeds": summary["seeds"],
            "train_seconds_per_pair": [round(log[-1]["elapsed_s"], 1) for log in logs],
            "final_train_loss": [log[-1]["loss"] for log in logs], "stage_seconds": summary["stage_seconds"],
            "outliers_across_seeds": agg["outliers"], "outlier_diff_across_seeds": agg["outlier_diff"],
            "comparisons_across_seeds": agg["comparisons"], "conclusion": summary["conclusion"],
            "demo_wall_s": wall, "goal_s": GOAL_S, "meets_goal": None if wall is None else wall <= GOAL_S,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024) if wall else None,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}


if __name__ == "__main__":
    main()
