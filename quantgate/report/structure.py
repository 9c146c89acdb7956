"""A report's structural numbers: the cells it holds, and each cell's bits per weight and file bytes.

They depend on the code and the model shapes only, never on trained values or the machine, so a fresh
`quantgate demo --fast` must reproduce the committed ones exactly (tests/test_cli.py); when the code changes them,
the committed results are regenerated (benchmarks/demo_fast_structure.py, benchmarks/demo_twice.py).
"""
from __future__ import annotations


def report_structure(report: dict) -> dict:
    """{"cells": {backend/twin/scheme: {"bits_per_weight", "bytes"}}} of a report.json's dict (failed cells: their
    error's first words)."""
    cells = {}
    for key, c in sorted((report.get("cells") or {}).items()):
        if "error" in c:
            cells[key] = {"error": str(c["error"])[:60]}
            continue
        cells[key] = {"bits_per_weight": None if c.get("bits_per_weight") is None else round(c["bits_per_weight"], 6),
                      "bytes": c.get("bytes")}
    return {"cells": cells}


def structure_differences(fresh: dict, committed: dict) -> list[str]:
    """Where two structures differ, one line each (empty when they agree)."""
    a, b = fresh["cells"], committed["cells"]
    out = [f"{k}: only in the fresh report" for k in sorted(set(a) - set(b))]
    out += [f"{k}: only in the committed report" for k in sorted(set(b) - set(a))]
    out += [f"{k}: fresh {a[k]} vs committed {b[k]}" for k in sorted(set(a) & set(b)) if a[k] != b[k]]
    return out
