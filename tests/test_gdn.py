"""Gated DeltaNet layers (Qwen3.5 hybrids): chunked = recurrent, cached decode = full forward, and the layer equal to
transformers' own Gated DeltaNet (Qwen3-Next's: the same math with fused projections)."""
from __future__ import annotations

import pytest
import torch

from conftest import randomize_, rel_err
from quantgate.model import (GatedDeltaNet, ModelOutput, build_model, gated_delta_chunked, gated_delta_recurrent,
                             hybrid, l2norm, make_twins, preset)

IDS = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))


def _rule_inputs(B=2, T=37, H=4, dk=8, dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, dk, generator=g)) * dk ** -0.5
    k = l2norm(torch.randn(B, T, H, dk, generator=g))
    v = torch.randn(B, T, H, dv, generator=g)
    decay = -torch.rand(B, T, H, generator=g) * 2          # log-decay in [-2, 0]
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("chunk", [64, 8, 5])
def test_chunked_rule_equals_the_token_loop(chunk):
    """T = 37 over chunks of 64 (one partial chunk), 8 and 5 (several, the last partial), from a non-zero state."""
    q, k, v, g, beta, s0 = _rule_inputs()
    o_ref, s_ref = gated_delta_recurrent(q, k, v, g, beta, s0)
    o, s = gated_delta_chunked(q, k, v, g, beta, s0, chunk=chunk)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("r", [1, 2])
def test_hybrid_cache_equals_full_forward(r):
    """Prefill 10, a 7-token chunk on the cache, then one decode step: the conv and recurrent states carry over."""
    cfg = hybrid(preset("tiny", n_layers=4, gate="elementwise"), value_heads_per_key_head=r)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    m = build_model(cfg, seed=0).eval()
    randomize_(m)
    with torch.inference_mode():
        full = m(IDS).logits
        first = m(IDS[:, :10])
        chunk = m(IDS[:, 10:17], past=first.past, start_pos=10)
        step = m(IDS[:, 17:18], past=chunk.past, start_pos=17)
        loop = m.layers[0].linear_attn(torch.randn(2, 9, cfg.dim), recurrent=True)[0]
        chunked = m.layers[0].linear_attn(torch.randn(2, 9, cfg.dim), recurrent=False)[0]
    assert type(first) is ModelOutput and len(first.past[0]) == 2
    assert first.past[0][0].shape == (2, cfg.linear_conv_dim, 3)
    assert first.past[0][1].shape == (2, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim)
    assert first.past[3][0].shape[2] == 10  # the full-attention layer keeps a KV cache
    assert rel_err(chunk.logits, full[:, 10:17]) < 1e-5
    assert rel_err(step.logits, full[:, 17:18]) < 1e-5
    assert loop.shape == chunked.shape


def _hf_qwen3next_gdn(ours: GatedDeltaNet):
    """transformers' Qwen3NextGatedDeltaNet holding our layer's weights in its fused per-key-head order:
    in_proj_qkvz rows [q_h | k_h | v of the r value heads of h | z of them] and in_proj_ba rows [b (r) | a (r)]."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    c = ours.cfg
    Hk, Hv, dk, dv = c.linear_key_heads, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim
    r = Hv // Hk
    hf_cfg = Qwen3NextConfig(hidden_size=c.dim, linear_num_key_heads=Hk, linear_num_value_heads=Hv,
                             linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=4,
                             rms_norm_eps=c.norm_eps, hidden_act="silu")
    hf = Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=0).eval()
    q, k, v = ours.in_proj_qkv.weight.split([Hk * dk, Hk * dk, Hv * dv])
    z = ours.in_proj_z.weight
    qkvz = torch.cat([q.view(Hk, dk, -1), k.view(Hk, dk, -1), v.view(Hk, r * dv, -1), z.view(Hk, r * dv, -1)], 1)
    ba = torch.cat([ours.in_proj_b.weight.view(Hk, r, -1), ours.in_proj_a.weight.view(Hk, r, -1)], 1)
    with torch.no_grad():
        hf.in_proj_qkvz.weight.copy_(qkvz.reshape(-1, c.dim))
        hf.in_proj_ba.weight.copy_(ba.reshape(-1, c.dim))
        for name in ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"):
            hf.get_parameter(name).copy_(ours.get_parameter(name))
    return hf


@pytest.mark.parametrize("r", [1, 2])
def test_gdn_layer_equals_transformers(r):
    """Our split-projection layer (Qwen3.5's names) against transformers' Qwen3-Next layer, its torch fallbacks
    (chunked prefill); and our recurrent step against its recurrent rule on the same inputs."""
    pytest.importorskip("transformers.models.qwen3_next")
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule
    cfg = hybrid(preset("tiny", n_layers=4, gate="elementwise"), value_heads_per_key_head=r)
    m = build_model(cfg, seed=1).eval()
    randomize_(m, 1)
    ours = m.layers[0].linear_attn
    hf = _hf_qwen3next_gdn(ours)
    x = torch.randn(2, 19, cfg.dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mine, _ = ours(x)
        theirs = hf(x)
    assert rel_err(mine, theirs) < 1e-5
    q, k, v, g, beta, s0 = _rule_inputs(T=6, H=cfg.linear_value_heads)
    dk = q.shape[-1]  # transformers scales q by dk^-0.5 itself
    o_hf, s_hf = torch_recurrent_gated_delta_rule(q * dk ** 0.5, k, v, g, beta, s0, output_final_state=True)
    o, s = gated_delta_recurrent(q, k, v, g, beta, s0)
    assert rel_err(o, o_hf) < 1e-6 and rel_err(s, s_hf) < 1e-6


def test_hybrid_twins_differ_only_in_the_attention_gate():
    cfg = hybrid(preset("tiny", n_layers=4))
    base, gated = make_twins(cfg, "elementwise", seed=0)
    sb, sg = base.state_dict(), gated.state_dict()
    assert set(sg) - set(sb) == {"layers.3.self_attn.g_proj.weight"}
    assert all(torch.equal(sb[k], sg[k]) for k in sb)
    assert any(".linear_attn.in_proj_z." in k for k in sb)  # both twins keep the GDN's own output gate


def test_bad_layer_types_are_refused():
    with pytest.raises(ValueError, match="layer_types must name one of"):
        hybrid(preset("tiny")).__class__(**{**preset("tiny").to_dict(), "layer_types": ["linear_attention"]})
    with pytest.raises(ValueError, match="linear_key_heads must be a positive integer"):
        preset("tiny", layer_types=("linear_attention", "full_attention"))


def test_analysis_of_a_hybrid_reads_each_layer_kind(tmp_path):
    """Massive activations on every layer; attention on BOS only where there is attention; the attention gate on
    full-attention layers and the GDN's silu(z) gate on linear ones; the plots take the blank GDN rows."""
    import numpy as np

    from quantgate.analyze import plot_reports
    from quantgate.outliers import analyze_model
    m = build_model(hybrid(preset("tiny", n_layers=4, gate="elementwise")), seed=0).eval()
    randomize_(m)
    rep = analyze_model(m, np.asarray(IDS[:, :16]))
    kinds = [l["kind"] for l in rep["layers"]]
    assert kinds == ["linear_attention"] * 3 + ["full_attention"]
    for l in rep["layers"]:
        assert l["max_abs"] > 0
        gdn = l["kind"] == "linear_attention"
        assert (l["bos_attention"] is None) == gdn and ("gdn_gate_mean" in l) == gdn and ("gate_mean" in l) != gdn
    assert len(rep["layers"][0]["gdn_gate_mean"]) == m.cfg.linear_value_heads
    assert 0 <= rep["layers"][3]["bos_attention_mean"] <= 1
    names = {p.name for p in plot_reports({"gated": rep}, tmp_path / "plots")}
    assert {"max_activation.png", "bos_attention.png", "gate_histograms.png"} <= names
