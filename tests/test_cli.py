"""The command line as a user meets it, and the packaging promises of the design card."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest

from conftest import make_hf_qwen3_next, run_cli


def test_help_explains_every_command():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("demo", "train", "eval", "info"):
        assert cmd in r.stdout
    t = run_cli("train", "--help").stdout
    assert "--twins" in t and "--resume" in t and "torchrun" in t


def test_info_reports_layout_gate_and_dims(tmp_path):
    make_hf_qwen3_next(0.25).save_pretrained(tmp_path / "n")
    r = run_cli("info", str(tmp_path / "n"), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["layout"] == "qwen3_next" and info["gate"] == "elementwise"
    assert info["dims"]["rotary_dim"] == 4 and info["dims"]["gate_rows"] == 64
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "n")
    assert info["params"] == sum(p.numel() for p in hf.parameters())


def test_no_generic_top_level_names_installed():
    code = ("import importlib.util as u, quantgate.cli, quantgate.export, quantgate.calib_data; "
            "print([n for n in ('export', 'cli', 'calib_data') if u.find_spec(n) is not None])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    files = [str(f) for f in metadata.files("quantgate") if str(f).endswith(".py")]
    if files:  # a regular (non-editable) install lists its modules: all under quantgate/
        assert {f.split("/")[0] for f in files} == {"quantgate"}, files
        assert "quantgate/cli.py" in files
    eps = metadata.entry_points(group="console_scripts")
    assert any(ep.name == "quantgate" and ep.value == "quantgate.cli:main" for ep in eps)


@pytest.mark.slow
def test_demo_fast_trains_and_evaluates_twins(tmp_path):
    out = tmp_path / "demo"
    r = run_cli("demo", "--fast", "--out", str(out), timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["eval"]) == {"baseline", "gated"}
    for e in summary["eval"].values():
        assert 1 < e["ppl"] < 512 and e["split"] == "test"  # better than uniform over the 512-token vocab
    assert (out / "plots" / "bos_attention.png").is_file() and (out / "analysis.json").is_file()
    assert "largest |h|" in r.stderr
    assert (out / "report" / "report.html").is_file() and summary["stage_seconds"]["report_s"] > 0
    rep = json.loads((out / "report" / "report.json").read_text())
    assert {"torch/gated/w4a16-g32", "onnx/gated/int4", "gguf/gated/Q4_K_M"} <= set(rep["cells"])
    assert summary["generation"]["new_tokens"] > 0 and summary["generation"]["backend"].startswith("llama.cpp")
    # the sample is shown after its prompt, so it does not start mid-line
    assert f"prompt 'def ':\ndef {summary['generation']['text'][:20]}" in r.stderr
    trained = rep["training"]["gated"]  # the report says how the twins were trained, and why
    assert trained["steps"] == summary["recipe"]["steps"] and trained["lr"] == summary["recipe"]["lr"]
    md = (out / "report" / "report.md").read_text()
    assert f"gated: {trained['steps']} steps" in md and summary["recipe_note"] in md
    # the structural numbers (cell set, bits per weight, file bytes) depend on the code only: a fresh run gives the
    # committed ones, or the committed results are stale (regenerate: python benchmarks/demo_fast_structure.py)
    from quantgate.report.structure import report_structure, structure_differences
    committed = json.loads((Path(__file__).parents[1] / "docs" / "results" / "demo-fast" / "structure.json").read_text())
    assert structure_differences(report_structure(rep), committed) == []
    again = run_cli("demo", "--fast", "--out", str(out), timeout=900)  # finished stages are reused
    assert again.returncode == 0 and "reusing" in again.stderr
    assert json.loads((out / "summary.json").read_text())["eval"] == summary["eval"]


@pytest.mark.slow
def test_demo_with_seeds_states_its_verdicts_across_the_pairs(tmp_path):
    out = tmp_path / "demo"
    r = run_cli("demo", "--fast", "--seeds", "2", "--out", str(out), timeout=1500)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == 2 and summary["generation"]["new_tokens"] > 0
    for k in (0, 1):
        assert (out / f"seed-{k}" / "gated" / "config.json").is_file()
        assert (out / "report" / f"seed-{k}" / "report.json").is_file()
    rep = json.loads((out / "report" / "report.json").read_text())
    assert len(rep["seeds"]) == 2 and rep["aggregate"] and rep["conclusion"]
    b0 = json.loads((out / "seed-0" / "gated" / "config.json").read_text())
    b1 = json.loads((out / "seed-1" / "gated" / "config.json").read_text())
    assert b0 != b1 or (out / "seed-0" / "gated" / "model.safetensors").read_bytes() != \
        (out / "seed-1" / "gated" / "model.safetensors").read_bytes()  # two trainings, not one copied
