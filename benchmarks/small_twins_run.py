"""What one `small` twin pair costs on this machine: the demo's training recipe, timed end to end.

Runs `quantgate demo` (or reads a finished demo directory with --from DIR) and writes the wall time of
training, the measured tokens/s, and the held-out perplexities of both twins.

    python benchmarks/small_twins_run.py [--out-dir quantgate-demo] [--from DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="quantgate-demo")
    ap.add_argument("--from", dest="existing", default=None, help="read a finished demo directory instead")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "small_twins_run.json"))
    args = ap.parse_args()
    run_dir = Path(args.existing or args.out_dir)
    if not args.existing:
        from quantgate.demo import run_demo
        t = time.time()
        run_demo(run_dir)
        print(f"demo wall time {time.time() - t:.0f} s")
    summary = json.loads((run_dir / "summary.json").read_text())
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
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
