"""`quantgate report`: every cell scored, numbers and conclusion consistent, HTML self-contained, resumable."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import run_cli
from quantgate.formats import save_checkpoint
from quantgate.model import make_twins, preset
from quantgate.report.conclusion import verdict_tests
from quantgate.stats import holm
from quantgate.tokenizer import byte_tokenizer

SCHEMES = "torch:w8a8-static,onnx:int4,onnx:int4+gate8,gguf:Q4_0,gguf:kv-q8_0"


@pytest.fixture(scope="module")
def report_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    # head_dim 32: llama.cpp's quantized KV cache needs multiples of its 32-block
    base, gated = make_twins(preset("tiny", vocab_size=300, head_dim=32), "elementwise", seed=0)
    with torch.no_grad():  # larger weights than the init so quantization visibly costs something
        for m in (base, gated):
            for p in m.parameters():
                if p.dim() == 2:
                    p.mul_(3.0)
    tok = byte_tokenizer()
    save_checkpoint(base, d / "baseline", tok)
    save_checkpoint(gated, d / "gated", tok)
    (d / "text.txt").write_text(open(torch.__file__).read() * 3)
    args = ["report", "--models", str(d / "baseline"), str(d / "gated"), "--data", str(d / "text.txt"),
            "--schemes", SCHEMES, "--windows", "16", "--ctx", "64", "--calib-windows", "2", "--out", str(d / "rep")]
    r = run_cli(*args, env={"QUANTGATE_CACHE": str(d / "cache")})
    assert r.returncode == 0, r.stderr[-3000:]
    return d, args, r


def test_report_scores_every_cell_and_writes_three_files(report_run):
    d, _, r = report_run
    rep = json.loads((d / "rep" / "report.json").read_text())
    keys = set(rep["cells"])
    for twin in ("baseline", "gated"):
        assert {f"torch/{twin}/w8a8-static", f"onnx/{twin}/int4", f"gguf/{twin}/Q4_0", f"gguf/{twin}/kv-q8_0"} <= keys
    assert "onnx/gated/int4+gate8" in keys and "onnx/baseline/int4+gate8" not in keys
    for k, c in rep["cells"].items():
        if k.endswith("/fp32"):
            continue
        assert c["kld_mean"] > 0 and 0 < c["top1_agreement"] <= 1 and c["bits_per_weight"] > 0, k
    assert rep["cells"]["onnx/gated/int4"]["gate_survival"]["worst_mean_abs_diff"] > 0
    assert rep["cells"]["gguf/gated/Q4_0"]["prefill_tps"] > 0 and rep["cells"]["gguf/gated/kv-q8_0"]["kv_type"] == "q8_0"
    assert rep["versions"]["onnxruntime"] and rep["settings"]["windows"] == 16
    assert (d / "rep" / "report.md").read_text().count("| onnx | int4 |") == 3  # two cells, one comparison
    assert r.stdout.startswith("- Largest residual activation")


def test_conclusion_follows_the_numbers(report_run):
    d, _, _ = report_run
    rep = json.loads((d / "rep" / "report.json").read_text())
    for backend, scheme in (("onnx", "int4"), ("gguf", "Q4_0"), ("torch", "w8a8-static")):
        for twin in ("baseline", "gated"):
            c = rep["cells"][f"{backend}/{twin}/{scheme}"]
            lo, hi = c["kld_mean_ci95"]
            assert lo <= c["kld_mean"] <= hi and len(c["per_window"]["kld"]) == 16
        comp = rep["comparisons"][f"{backend}/{scheme}"]
        lo, hi = comp["kld_ratio_ci95"]
        want = "gated" if hi < 1 else "baseline" if lo > 1 else "not resolved"
        assert comp["kld_verdict"] == (want if comp["holm_kept"]["kld"] else "not resolved")
        assert comp["holm_kept"]["kld"] == holm(verdict_tests(rep))[f"comparisons/{backend}/{scheme}/kld"]
        line = next(c for c in rep["conclusion"] if c.startswith(f"{backend} {scheme}:"))
        assert f"{comp['kld_ratio']:.2f} [{lo:.2f}, {hi:.2f}]" in line
        if comp["verdict"] == "not resolved":
            assert "not resolved" in line
        elif comp["verdict"] in ("gated", "baseline"):
            assert f"the {comp['verdict']} twin loses less" in line
    o = rep["outliers"]
    assert f"{o['baseline']['max_abs']:.1f}" in rep["conclusion"][0]
    # one text file: too few documents, so blocks of consecutive windows are the bootstrap's units, and it says so
    assert rep["statistics"]["unit"] == "block of consecutive windows (fewer documents than units)"
    assert rep["statistics"]["correction"] == "Holm" and rep["statistics"]["verdicts"] == len(verdict_tests(rep))
    assert "Attention sinks (a head whose mean attention on BOS exceeds 0.3" in "\n".join(rep["conclusion"])


def test_html_is_self_contained_with_plots(report_run):
    d, _, _ = report_run
    page = (d / "rep" / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') >= 4  # outliers, BOS heatmaps, gate histograms, KLD vs bits
    assert "http://" not in page and "https://" not in page and "<script" not in page


@pytest.mark.slow  # ~48 s; a resumed report after SIGTERM stays in the default step (bad_inputs/test_signals.py)
def test_report_resumes_from_finished_cells(report_run):
    d, args, _ = report_run
    cell = d / "rep" / "cells" / "gguf-gated-Q4_0.json"
    cell.unlink()
    r = run_cli(*args, env={"QUANTGATE_CACHE": str(d / "cache")})
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((d / "rep" / "report.json").read_text())
    recomputed = {k for k, v in rep["timings_s"].items() if v > 0}
    assert recomputed == {"gguf gated Q4_0"} and cell.is_file()


@pytest.mark.slow  # 66 s: three report runs
def test_report_artifacts_are_keyed_by_what_made_them(cli_server, tmp_path):
    """Artifacts are rebuilt exactly when what produced them changed: the model's contents, the data's contents
    (same path) or the calibration settings; unchanged inputs reuse every artifact and cell."""
    from conftest import save_tiny_twins
    d = save_tiny_twins(tmp_path / "w")
    out = tmp_path / "rep"

    def run(calib: str = "2"):
        r = cli_server.run("report", "--models", d / "baseline", d / "gated", "--data", d / "text.txt",
                           "--backends", "torch,gguf",
                           "--schemes", "torch:w8a8-static,torch:w4a16-g32,gguf:Q4_0,gguf:Q8_0",
                           "--windows", "2", "--ctx", "64", "--calib-windows", calib, "--out", out, timeout=600)
        assert r.code == 0, r.stderr[-3000:]
        rep = json.loads((out / "report.json").read_text())
        return {k for k, v in rep["artifacts"].items() if v["built"]}, set(rep["artifacts"]), rep["timings_s"]

    built, every, _ = run()
    assert built == every and len(every) == 10  # torch 2 x 2, gguf (F32, Q4_0, Q8_0) x 2: F32 feeds two cells
    built, _, timings = run()
    assert built == set() and all(v == 0.0 for v in timings.values())  # nothing changed: everything reused
    built, _, timings = run(calib="3")
    assert built == {"torch/baseline-w8a8-static", "torch/gated-w8a8-static"}  # only the calibrated ones
    (d / "text.txt").write_text("def h(z):\n    return z - 3\n" * 400)  # new contents, same path
    built, _, timings = run(calib="3")
    assert built == {"torch/baseline-w8a8-static", "torch/gated-w8a8-static"}
    assert all(v > 0 for k, v in timings.items())  # every cell scored again on the new text
    from quantgate.formats import load_checkpoint
    g = load_checkpoint(d / "gated")
    with torch.no_grad():
        g.model.layers[0].mlp.up_proj.weight.mul_(1.01)
    save_checkpoint(g.model, d / "gated", g.tokenizer)  # the gated twin changed, the baseline did not
    built, _, _ = run(calib="3")
    assert built == {"torch/gated-w8a8-static", "torch/gated-w4a16-g32", "gguf/gated-F32.gguf", "gguf/gated-Q4_0.gguf",
                     "gguf/gated-Q8_0.gguf"}


def test_html_renders_its_plots_in_headless_chromium(report_run, tmp_path):
    """Open report.html in headless Chromium and check the screenshot shows the plots' colours."""
    import shutil
    import subprocess

    from PIL import Image
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium)")
    d, _, _ = report_run
    shot = tmp_path / "shot.png"
    subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,4000",
                    f"--screenshot={shot}", (d / "rep" / "report.html").as_uri()], capture_output=True, timeout=180,
                   check=False)
    assert shot.is_file()
    px = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3).astype(int)

    def near(rgb):  # matplotlib's tab:blue / tab:orange, used by the twins' markers and lines
        return int((np.abs(px - np.array(rgb)).sum(1) < 40).sum())
    assert near((31, 119, 180)) > 500 and near((255, 127, 14)) > 500
    assert (px.sum(1) < 600).mean() > 0.02  # not a blank page: text, tables and plots drew something


@pytest.mark.slow  # two report runs; the default step stays under its 25 minutes
def test_unpaired_report_compares_models_that_tokenize_differently(tmp_path):
    """Two models that are not twins (here: another tokenizer) are refused unless --unpaired; with it, each is
    scored against its own float model and the comparison resamples each model's windows on its own."""
    from quantgate.tokenizer import train_bpe
    text = open(torch.__file__).read() * 3
    (tmp_path / "text.txt").write_text(text)
    base, gated = make_twins(preset("tiny", vocab_size=300, head_dim=32), "elementwise", seed=0)
    save_checkpoint(base, tmp_path / "baseline", byte_tokenizer())
    save_checkpoint(gated, tmp_path / "gated", train_bpe([text[:50000]], 300))
    args = ["report", "--models", str(tmp_path / "baseline"), str(tmp_path / "gated"), "--data",
            str(tmp_path / "text.txt"), "--backends", "torch", "--schemes", "torch:w8a8-static", "--windows", "16",
            "--ctx", "64", "--calib-windows", "2", "--out", str(tmp_path / "rep")]
    r = run_cli(*args, env={"QUANTGATE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2 and "--unpaired" in r.stderr and not (tmp_path / "rep").exists(), r.stderr
    r = run_cli(*args, "--unpaired", env={"QUANTGATE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    c = rep["comparisons"]["torch/w8a8-static"]
    assert c["paired"] is False and c["kld_ratio_ci95"] is not None
    line = next(x for x in rep["conclusion"] if x.startswith("torch w8a8-static:"))
    assert "unpaired" in line
    assert rep["outlier_comparison"] == {"paired": False}
