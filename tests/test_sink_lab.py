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
        assert s["epsilon"] == 0.3 and s["heads"] == 1 and s["worst"]["ci95"] is not None
        # Guo et al.'s reading beside Gu et al.'s: the share over non-trigger queries, with its own interval
        assert s["worst_nontrigger"]["ci95"] is not None
        assert "worst_bos_nontrigger_diff" in seed_rep["outlier_comparison"]
    agg = rep["aggregate"]["outliers"]["baseline"]
    assert agg["worst_head_bos_nontrigger"]["n"] == 2 and "non-trigger queries" in summary["conclusion"][0]
    assert summary["conclusion"][0].startswith("Across 2 seeds")
    again = demo.run_lab(tmp_path / "lab", seeds=2, threads=2)  # the trained seeds and scored cells are reused
    assert again["stage_seconds"]["train_s"] < summary["stage_seconds"]["train_s"]


def test_unknown_lab_and_lab_with_fast_are_one_line_errors(tmp_path):
    r = run_cli("demo", "--lab", "sinks", "--fast", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "choose one" in r.stderr and not (tmp_path / "x").exists()
    r = run_cli("demo", "--lab", "nope", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and not (tmp_path / "x").exists()


def test_the_lab_model_is_quantgates_with_learned_positions_and_runs_in_pytorch_only(tmp_path):
    """The lab's one switch (ModelConfig.positions = "learned"): saved in the quantgate_lab layout and read back
    bit for bit, scored by the torch backend, refused by the exporters and the layer-by-layer path in one line."""
    import torch
    from conftest import run_cli
    from quantgate.errors import QuantgateError
    from quantgate.formats import load_checkpoint, save_checkpoint
    from quantgate.formats.hf import open_hf
    from quantgate.layerwise import LayerwiseModel
    from quantgate.model import make_twins, preset
    from quantgate.tokenizer import byte_tokenizer
    o = demo.LAB_RECIPES["sinks"]["model_overrides"]
    assert o["positions"] == "learned"
    b, g = make_twins(preset("tiny", vocab_size=259, **o), "elementwise", 0)
    ids = torch.randint(3, 259, (2, 40))
    for name, m in (("b", b), ("g", g)):
        save_checkpoint(m.eval(), tmp_path / name, byte_tokenizer())
        back = load_checkpoint(tmp_path / name)
        assert back.layout == "quantgate_lab" and back.model.cfg.positions == "learned"
        assert torch.equal(back.model(ids).logits, m(ids).logits)
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    assert cfg["model_type"] == "quantgate_lab"  # no stock loader runs it as a rope model
    # positions matter: the same weights with the position table zeroed give other logits
    with torch.no_grad():
        g.embed_positions.weight.zero_()
    assert not torch.allclose(g(ids).logits, load_checkpoint(tmp_path / "g").model(ids).logits)
    for argv in (["export", "gguf", str(tmp_path / "g"), "--out", str(tmp_path / "x.gguf")],
                 ["export", "onnx", str(tmp_path / "g"), "--out", str(tmp_path / "x-onnx")]):
        r = run_cli(*argv)
        assert r.returncode == 2 and "sink-lab models" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(QuantgateError, match="sink-lab models"):
        LayerwiseModel(open_hf(tmp_path / "g"))
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x-onnx").exists()


def test_non_trigger_bos_share_reads_only_non_trigger_queries(tmp_path):
    """analyze's second BOS share averages over the queries whose token is not a trigger: checked against the
    attention probabilities computed here from the model itself."""
    import numpy as np
    import torch
    from quantgate.analyze import analyze
    from quantgate.calib_data import load_corpus, sample_windows, tokenize_corpus
    from quantgate.calib_data.synthetic import BIGRAM_BACKCOPY, TRIGGERS
    from quantgate.formats import load_checkpoint, save_checkpoint
    from quantgate.model import build_model, preset
    from quantgate.tokenizer import byte_tokenizer
    tok = byte_tokenizer()
    m = build_model(preset("tiny", vocab_size=259, **demo.LAB_RECIPES["sinks"]["model_overrides"]), seed=3).eval()
    save_checkpoint(m, tmp_path / "m", tok)
    rep = analyze(str(tmp_path / "m"), BIGRAM_BACKCOPY, ctx=32, n_windows=8)
    windows = sample_windows(tokenize_corpus(load_corpus(BIGRAM_BACKCOPY).split("test"), tok), 8, 32, 0)
    with torch.no_grad():
        probs = load_checkpoint(tmp_path / "m").model(torch.as_tensor(windows), probe=True).attn_probs[0]
    bos = probs[:, 0, 1:, 0].numpy()  # [N, T-1], one head
    nontrig = ~np.isin(windows[:, 1:], tok.encode(TRIGGERS))
    assert 0.5 < nontrig.mean() < 0.9  # both kinds of query are present
    want = float((bos * nontrig).sum() / nontrig.sum())
    assert rep["layers"][0]["bos_attention_nontrigger"][0] == pytest.approx(want, rel=1e-5)
    assert rep["layers"][0]["bos_attention"][0] == pytest.approx(float(bos.mean()), rel=1e-5)
    assert rep["nontrigger_query_share"] == pytest.approx(float(nontrig.mean()))
