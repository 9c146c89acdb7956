"""Regenerate docs/results/demo-fast/: a fresh `quantgate demo --fast` report's structural numbers (the cell set,
each cell's bits per weight and file bytes: quantgate.report.structure), which the slow test of the fast demo
(tests/test_cli.py) compares with its own run, plus that run's report.md for a reader.

    python benchmarks/demo_fast_structure.py
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from quantgate.report.structure import report_structure

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    dest = ROOT / "docs" / "results" / "demo-fast"
    with tempfile.TemporaryDirectory(prefix="quantgate-demo-fast-") as tmp:
        out = Path(tmp) / "demo"
        subprocess.run([sys.executable, "-m", "quantgate.cli", "demo", "--fast", "--out", str(out)], check=True,
                       cwd=tempfile.gettempdir())
        rep = json.loads((out / "report" / "report.json").read_text())
        dest.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip()
        (dest / "structure.json").write_text(json.dumps({"command": "quantgate demo --fast", "commit": commit,
                                                         **report_structure(rep)}, indent=1) + "\n")
        shutil.copy2(out / "report" / "report.md", dest / "report.md")
    print(f"wrote {dest / 'structure.json'}")


if __name__ == "__main__":
    main()
