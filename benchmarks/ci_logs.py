"""Summarise the committed clean-clone CI logs (`.ci/run` output kept in results/logs/) into results/ci_logs.json.

    python benchmarks/ci_logs.py

Per log: each pytest step's passed/skipped/failed counts and seconds, the script's exit code and wall time
(where the run recorded them), and the fuzz sweep's printed ending classes. Numbers come from the logs only.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).parent / "results"


def summarise(text: str) -> dict:
    steps = []
    for m in re.finditer(r"^(?:=+ )?(\d+ (?:passed|failed).*?) in ([\d.]+)s", text, re.M):
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|skipped|failed|deselected|error)", m[1])}
        steps.append({**counts, "seconds": float(m[2])})
    end = re.search(r"^rc=(\d+) wall=(\d+)$", text, re.M)
    fuzz = {}
    for m in re.finditer(r"fuzz sweep \(seed (\d+)\): (\d+) mutated inputs", text):
        block = text[m.end():].split("\n\n")[0]
        fuzz[m[1]] = {"cases": int(m[2]), "classes": {c.strip(): e.strip() for c, e in
                                                      re.findall(r"^  (.+?)\s+\d+: (.+)$", block, re.M)}}
    return {"steps": steps, "rc": int(end[1]) if end else None, "wall_s": int(end[2]) if end else None, "fuzz": fuzz}


def main() -> None:
    out = {p.stem: summarise(p.read_text()) for p in sorted((HERE / "logs").glob("*.txt"))}
    (HERE / "ci_logs.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
