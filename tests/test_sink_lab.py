"""`quantgate demo --lab sinks`: seeds trained on the synthetic corpus, one report each, the report across them."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli
from quantgate import demo


@pytest.mark.slow  # 2 seeds x (training + a torch report): a few minutes on 2 cores
def test_sink_lab_trains_seeds_and_reports_across_them(tmp_path, monkeypatch):
    monkeypatch.setitem(demo.LAB_RECIPES, "sinks", {**demo.LAB_RECIPES["sinks"], "steps": 20})
    monkeypatch.setattr(demo, "LAB_WINDOWS", 16)
    summary = demo.run_lab(tmp_path / "lab", seeds=2, threads=2)
    rep = json.loads((tmp_path / "lab" / "report" / "report.json").read_text())
    assert rep["aggregate"]["seeds"] == 2 and len(rep["seeds"]) == 2
    for k in (0, 1):
        seed_rep = json.loads((tmp_path / "lab" / "report" / f"seed-{k}" / "report.json").read_text())
        assert seed_rep["settings"]["data"] == "synthetic:bigram-backcopy"
        assert set(seed_rep["comparisons"]) == {f"torch/{s}" for s in demo.LAB_SCHEMES["torch"]}
        s = seed_rep["outliers"]["baseline"]["sinks"]
        assert s["epsilon"] == 0.3 and s["heads"] == 4 and s["worst"]["ci95"] is not None
    assert summary["conclusion"][0].startswith("Across 2 seeds")
    again = demo.run_lab(tmp_path / "lab", seeds=2, threads=2)  # the trained seeds and scored cells are reused
    assert again["stage_seconds"]["train_s"] < summary["stage_seconds"]["train_s"]


def test_unknown_lab_and_lab_with_fast_are_one_line_errors(tmp_path):
    r = run_cli("demo", "--lab", "sinks", "--fast", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "choose one" in r.stderr and not (tmp_path / "x").exists()
    r = run_cli("demo", "--lab", "nope", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and not (tmp_path / "x").exists()
