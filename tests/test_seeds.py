"""Seeds: `train --twins --seeds N` trains N pairs; `report` with one --models per pair reports across them."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from quantgate.report.seeds import aggregate, seed_conclusion


@pytest.mark.slow  # 3 min on 2 cores: two trainings and two reports
def test_train_seeds_then_report_across_them(tmp_path):
    (tmp_path / "text.txt").write_text(open(torch.__file__).read() * 2)
    runs = tmp_path / "runs"
    r = run_cli("train", "--twins", "--seeds", "2", "--preset", "tiny", "--steps", "4", "--batch-size", "2",
                "--ctx", "64", "--byte-tokenizer", "--data", str(tmp_path / "text.txt"), "--out", str(runs))
    assert r.returncode == 0, r.stderr[-2000:]
    for k in (0, 1):
        cfg = json.loads((runs / f"seed-{k}" / "gated" / "config.json").read_text())
        assert cfg["quantgate"]["train_config"]["seed"] == k
    w0 = (runs / "seed-0" / "gated" / "model.safetensors").read_bytes()
    assert w0 != (runs / "seed-1" / "gated" / "model.safetensors").read_bytes()  # another seed, another pair
    assert "report across seeds: quantgate report --models" in r.stdout
    rep_dir = tmp_path / "rep"
    args = ["report"]
    for k in (0, 1):
        args += ["--models", str(runs / f"seed-{k}" / "baseline"), str(runs / f"seed-{k}" / "gated")]
    r = run_cli(*args, "--data", str(tmp_path / "text.txt"), "--backends", "torch", "--schemes",
                "torch:w8a8-static", "--windows", "16", "--ctx", "64", "--calib-windows", "2", "--out", str(rep_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((rep_dir / "report.json").read_text())
    per_seed = [json.loads((rep_dir / f"seed-{k}" / "report.json").read_text()) for k in (0, 1)]
    c = rep["aggregate"]["comparisons"]["torch/w8a8-static"]["kld_ratio"]
    assert c["values"] == [p["comparisons"]["torch/w8a8-static"]["kld_ratio"] for p in per_seed]
    assert c["n"] == 2 and c["min"] <= c["mean"] <= c["max"] and c["below"] + c["above"] == 2
    assert rep["conclusion"][0].startswith("Across 2 seeds") and (rep_dir / "report.html").is_file()


def test_seed_aggregate_names_a_winner_only_when_the_seeds_agree():
    def rep(ratio, share_b=0.5, share_g=0.05):
        sinks = lambda s: {"worst": {"share": s}, "sink_heads": int(s > 0.3), "heads": 8}  # noqa: E731
        return {"comparisons": {"torch/w8a8-static": {"kld_ratio": ratio, "delta_ppl_diff": 0.0, "verdict": "x"}},
                "cells": {}, "outliers": {"baseline": {"max_abs": 40.0, "sinks": sinks(share_b), "uniform_bos_share": .03},
                                          "gated": {"max_abs": 10.0, "sinks": sinks(share_g), "uniform_bos_share": .03}}}
    agree = aggregate([rep(0.80), rep(0.82), rep(0.79)])
    assert agree["comparisons"]["torch/w8a8-static"]["verdict"] == "gated"
    mixed = aggregate([rep(0.8), rep(1.3), rep(0.9)])
    assert mixed["comparisons"]["torch/w8a8-static"]["verdict"] == "not resolved"
    text = "\n".join(seed_conclusion(mixed))
    assert "gated lower in 2 of 3 seeds" in text and "not resolved across seeds" in text
    assert agree["outlier_diff"]["worst_bos_diff"]["above"] == 3
