"""Outlier metrics on hand-set weights: planted structure must be reported exactly where it is."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quantgate.model import build_model, preset
from conftest import BOS_CH, CONST_CH, plant_bos_spike
from quantgate.outliers import Moments, analyze_model

def planted_model(gate="elementwise", spike_layer=1, spike_channel=7, sink_layer=0, sink_head=0, closed_head=2):
    cfg = preset("tiny", vocab_size=64, n_layers=3, gate=gate)
    m = build_model(cfg, seed=0).eval()
    hd, H = cfg.head_dim, cfg.n_heads
    with torch.no_grad():
        E = m.embed_tokens.weight
        E[:, CONST_CH] = 1.0
        E[cfg.bos_id].zero_()
        for layer in m.layers:  # nothing writes into the constant channel either
            layer.self_attn.o_proj.weight[CONST_CH] = 0.0
            layer.mlp.down_proj.weight[CONST_CH] = 0.0
    plant_bos_spike(m, spike_layer, spike_channel)  # BOS embedding becomes the one-hot marker
    with torch.no_grad():
        # attention sink: in one layer only `sink_head` has a non-zero query, aimed at BOS's key;
        # dim hd/2-1 pairs with the slowest RoPE frequency, so the match barely rotates with position
        att = m.layers[sink_layer].self_attn
        att.q_proj.weight.zero_(); att.k_proj.weight.zero_()
        d = hd // 2 - 1
        att.q_proj.weight[sink_head * hd + d, CONST_CH] = 1.0
        kv = sink_head // (H // cfg.n_kv_heads)
        att.k_proj.weight[kv * hd + d, BOS_CH] = 1.0
        att.q_norm.weight.fill_(1.0); att.k_norm.weight.fill_(1.0)
        att.q_norm.weight[d] = 10.0; att.k_norm.weight[d] = 10.0
        if gate != "none":  # one head's gate closed everywhere
            g = att.g_proj.weight
            rows = g.shape[0] // H
            g[closed_head * rows:(closed_head + 1) * rows] = 0.0
            g[closed_head * rows:(closed_head + 1) * rows, CONST_CH] = -100.0
    return m


def windows(n=6, T=32, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.integers(3, 60, size=(n, T))
    w[:, 0] = 0
    return w


def test_planted_massive_activation_is_found_at_its_layer_position_and_channel():
    rep = analyze_model(planted_model(spike_layer=1, spike_channel=7), windows())
    L = rep["layers"]
    assert L[1]["max_position"] == 0 and L[1]["max_channel"] == 7
    assert L[1]["max_abs"] > 1000 and L[1]["max_over_median"] > 1000
    assert L[1]["top_channels"][0]["channel"] == 7
    assert L[0]["max_abs"] < 100  # before the planted layer there is no spike
    assert rep["linear_inputs"]["layers.1.mlp.down_proj"]["max_abs"] > 1000
    assert rep["linear_inputs"]["layers.1.mlp.down_proj"]["kurtosis"] > 100
    assert rep["linear_inputs"]["layers.0.mlp.down_proj"]["max_abs"] < 100


def test_planted_sink_head_is_reported():
    rep = analyze_model(planted_model(sink_layer=0, sink_head=0), windows())
    bos = rep["layers"][0]["bos_attention"]
    assert bos[0] > 0.9
    for h in (1, 2, 3):  # zero queries: uniform causal attention
        assert bos[h] == pytest.approx(rep["uniform_bos_share"], rel=1e-4)


def test_gate_statistics_per_head():
    rep = analyze_model(planted_model(gate="headwise", closed_head=2), windows())
    g = rep["layers"][0]
    # closed on every token that carries the constant channel, i.e. all but BOS (where the gate is 0.5)
    assert g["gate_mean"][2] == pytest.approx(0.5 / 32, abs=1e-4)
    assert g["gate_frac_below_0.1"][2] == pytest.approx(31 / 32)
    assert g["gate_frac_below_0.1"][0] == 0.0 and g["gate_mean"][0] == pytest.approx(0.5, abs=0.05)  # random small weights
    assert sum(g["gate_histogram"]["counts"]) == 6 * 32 * 4  # windows x tokens x heads (headwise)
    assert "gate_mean" not in analyze_model(planted_model(gate="none"), windows())["layers"][0]


def test_kurtosis_and_max():
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0)) * 2 + 1
    m = Moments()
    for chunk in x.split(30_000):
        m.add(chunk)
    assert m.kurtosis() == pytest.approx(3.0, abs=0.05)
    assert m.max_abs == pytest.approx(float(x.abs().max()))
    heavy = Moments()
    heavy.add(torch.cat([torch.zeros(10_000), torch.tensor([100.0])]))
    assert heavy.kurtosis() > 1000


def test_analyze_cli_compares_twins_with_plots_and_json(tmp_path):
    import json

    import tokenizers

    from conftest import run_cli
    from quantgate.formats import save_checkpoint
    # the planted models have 64 embedding rows: a one-character-per-token tokenizer over ids 3..63
    vocab = {chr(i): i for i in range(3, 64)}
    vocab.update({"<|bos|>": 0, "<|eos|>": 1, "<|pad|>": 2})
    wl = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|pad|>"))
    wl.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    for gate in ("none", "elementwise"):
        save_checkpoint(planted_model(gate=gate), tmp_path / gate)
        wl.save(str(tmp_path / gate / "tokenizer.json"))
    text = tmp_path / "t.txt"
    text.write_text("".join(chr(33 + (i * 7) % 30) for i in range(6000)))
    r = run_cli("analyze", str(tmp_path / "none"), "--compare", str(tmp_path / "elementwise"), "--data", str(text),
                "--windows", "4", "--ctx", "32", "--json", str(tmp_path / "rep.json"), "--plots", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    assert "max|h|" in r.stdout and "highest linear-input kurtosis" in r.stdout
    rep = json.loads((tmp_path / "rep.json").read_text())["reports"]
    assert set(rep) == {"none", "elementwise"}
    assert rep["none"]["layers"][1]["max_channel"] == 7 and rep["none"]["layers"][1]["max_position"] == 0
    assert "gate_mean" in rep["elementwise"]["layers"][0] and "gate_mean" not in rep["none"]["layers"][0]
    for name in ("max_activation.png", "bos_attention.png", "gate_histograms.png"):
        assert (tmp_path / "p" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
