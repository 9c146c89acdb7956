"""`quantgate report` on hybrid twins (Gated DeltaNet + gated attention): cells on torch, ONNX and GGUF, BOS attention
read on the full-attention layers only, both gates per layer, the memory a sequence holds, and twins whose layers
differ refused."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import randomize_, run_cli
from quantgate.formats import save_checkpoint
from quantgate.model import hybrid, make_twins, preset
from quantgate.tokenizer import byte_tokenizer

pytestmark = pytest.mark.slow  # two hybrid ONNX exports, two GGUFs and the twins' analysis: about 3 minutes

SCHEMES = "torch:w8a8-static,onnx:int4,onnx:int4+gate8,gguf:Q8_0,gguf:Q4_0+gate8"


@pytest.fixture(scope="module")
def hybrid_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("report-hybrid")
    cfg = hybrid(preset("tiny", vocab_size=300, n_layers=4, head_dim=32))
    base, gated = make_twins(cfg, "elementwise", seed=0)
    randomize_(base, 1)
    randomize_(gated, 2)
    save_checkpoint(base.eval(), d / "baseline", byte_tokenizer())
    save_checkpoint(gated.eval(), d / "gated", byte_tokenizer())
    (d / "text.txt").write_text(open(torch.__file__).read() * 3)
    r = run_cli("report", "--models", str(d / "baseline"), str(d / "gated"), "--data", str(d / "text.txt"),
                "--schemes", SCHEMES, "--windows", "2", "--ctx", "64", "--calib-windows", "2", "--out", str(d / "rep"),
                env={"QUANTGATE_CACHE": str(d / "cache")}, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, json.loads((d / "rep" / "report.json").read_text())


def test_hybrid_report_scores_every_backend(hybrid_report):
    _, rep = hybrid_report
    for twin in ("baseline", "gated"):
        for key in ("torch/{}/w8a8-static", "onnx/{}/int4", "gguf/{}/Q8_0"):
            cell = rep["cells"][key.format(twin)]
            assert "error" not in cell, cell
            assert cell["kld_mean"] > 0 and 0 < cell["top1_agreement"] <= 1, key
    for key in ("onnx/gated/int4+gate8", "gguf/gated/Q4_0+gate8"):
        assert rep["cells"][key]["kld_mean"] > 0 and rep["cells"][key]["gate_survival"]["worst_mean_abs_diff"] > 0
    assert rep["cells"]["onnx/gated/int4"]["decode_tps"] > 0 and rep["cells"]["gguf/gated/Q8_0"]["decode_tps"] > 0


def test_hybrid_report_reads_each_layer_kind_as_what_it_is(hybrid_report):
    d, rep = hybrid_report
    for twin in ("baseline", "gated"):
        rows = rep["outliers"][twin]["per_layer"]
        assert [r["kind"] for r in rows] == ["gdn", "gdn", "gdn", "attention"]
        assert [r["bos_attention_mean"] is None for r in rows] == [True, True, True, False]
        assert all(r["o_proj_inf_norm"] > 0 for r in rows)  # a GDN layer's out_proj input in the same column
        assert [r.get("gate") for r in rows] == ["silu(z)"] * 3 + [None if twin == "baseline" else "sigmoid(g)"]
        assert rep["outliers"][twin]["bos_attention_layers"] == 1
    mem = rep["memory"]["gated"]
    assert mem["kv_cache_bytes_per_token"] == 2 * 2 * 2 * 32 and mem["recurrent_state_bytes"] > 0
    text = "\n".join(rep["conclusion"])
    assert "the 1 full-attention layers of 4" in text and "recurrent state" in text
    md = (d / "rep" / "report.md").read_text()
    assert "| 0 | gdn |" in md and "| 3 | attention |" in md


def test_twins_with_different_layers_are_refused(hybrid_report, tmp_path):
    d, _ = hybrid_report
    base, _ = make_twins(preset("tiny", vocab_size=300, head_dim=32), "elementwise", seed=0)
    save_checkpoint(base, tmp_path / "attn-baseline", byte_tokenizer())
    r = run_cli("report", "--models", str(tmp_path / "attn-baseline"), str(d / "gated"), "--data", str(d / "text.txt"),
                "--out", str(tmp_path / "rep"))
    assert r.returncode == 2 and "same layers" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "rep").exists()
