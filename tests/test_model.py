"""The model's own invariants: probe path = SDPA path, cache = full forward, twins, presets."""
from __future__ import annotations

import pytest
import torch

from conftest import randomize_, rel_err
from quantgate.model import PRESETS, ModelConfig, ModelOutput, build_model, make_twins, preset

IDS = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("gate", ["none", "headwise", "elementwise"])
@pytest.mark.parametrize("partial", [1.0, 0.25])
def test_probe_path_equals_sdpa_path(gate, partial):
    m = build_model(preset("tiny", gate=gate, partial_rotary=partial), seed=0).eval()
    randomize_(m)
    fast = m(IDS).logits
    out = m(IDS, probe=True)
    assert rel_err(out.logits, fast) < 1e-5
    probs = out.attn_probs
    assert len(probs) == m.cfg.n_layers and probs[0].shape == (2, m.cfg.n_heads, 24, 24)
    assert torch.allclose(probs[0].sum(-1), torch.ones(2, m.cfg.n_heads, 24))
    assert (probs[0].triu(1) == 0).all()  # causal


@pytest.mark.parametrize("gate", ["none", "elementwise"])
def test_kv_cache_equals_full_forward(gate):
    m = build_model(preset("tiny", gate=gate), seed=0).eval()
    randomize_(m)
    full = m(IDS).logits
    first = m(IDS[:, :10], past=None, start_pos=0, return_hidden=True)
    chunk = m(IDS[:, 10:17], past=first.past, start_pos=10)  # a multi-token step on a cache
    step = m(IDS[:, 17:18], past=chunk.past, start_pos=17)   # one decode step
    assert rel_err(chunk.logits, full[:, 10:17]) < 1e-5
    assert rel_err(step.logits, full[:, 17:18]) < 1e-5


def test_headwise_gate_scales_whole_heads():
    cfg = preset("tiny", gate="headwise")
    m = build_model(cfg, seed=0).eval()
    assert m.layers[0].self_attn.g_proj.weight.shape == (cfg.n_heads, cfg.dim)
    with torch.no_grad():  # a gate of sigmoid(-inf)=0 on every head removes attention entirely
        for layer in m.layers:
            layer.self_attn.g_proj.weight.zero_()
            layer.self_attn.o_proj.weight.normal_()
    ref = build_model(cfg, seed=0).eval()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(1, 5, cfg.dim)
    attn = m.layers[0].self_attn
    from quantgate.model import rope_cache
    cos, sin = rope_cache(cfg, torch.arange(5))
    out_half, _, _ = attn(x, cos, sin)  # gate = sigmoid(0) = 0.5
    attn.g_proj = None
    out_full, _, _ = attn(x, cos, sin)
    assert torch.allclose(out_half, 0.5 * out_full, atol=1e-6)


def test_twins_share_every_shared_parameter():
    cfg = preset("tiny")
    base, gated = make_twins(cfg, "elementwise", seed=5)
    gsd = gated.state_dict()
    for k, v in base.state_dict().items():
        assert torch.equal(v, gsd[k]), k
    assert {k for k in gsd if k not in base.state_dict()} == {f"layers.{i}.self_attn.g_proj.weight"
                                                            for i in range(cfg.n_layers)}


def test_tied_head_shares_storage():
    m = build_model(preset("tiny"), seed=0)
    assert m.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    untied = build_model(preset("tiny", tie_embeddings=False), seed=0)
    assert untied.lm_head.weight.data_ptr() != untied.embed_tokens.weight.data_ptr()


def test_presets_sizes():
    assert build_model(PRESETS["tiny"], seed=None).num_params() < 2_000_000
    small = PRESETS["small"]
    assert (small.n_layers, small.dim, small.n_heads, small.head_dim, small.n_kv_heads) == (6, 128, 4, 32, 2)
    medium = PRESETS["medium"]  # every Linear's input width a multiple of 256: llama.cpp's k-quants apply
    assert all(w % 256 == 0 for w in (medium.dim, medium.n_heads * medium.head_dim, medium.ffn_dim))
    assert 5_000_000 < build_model(medium, seed=None).num_params() < 15_000_000
    base = build_model(PRESETS["base"], seed=None).num_params()
    assert 80_000_000 < base < 130_000_000


def test_bad_config_rejected():
    with pytest.raises(ValueError, match="gate"):
        ModelConfig(gate="sometimes")
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(n_heads=4, n_kv_heads=3)


def test_forward_has_one_return_type():
    """Whatever a call asks for (cache, probes, hidden states, a layer callback), it gets a ModelOutput back;
    what it did not ask for is empty, and the cache is always there for the next call."""
    m = build_model(preset("tiny", gate="elementwise"), seed=0).eval()
    calls = [{}, {"past": None}, {"probe": True}, {"return_hidden": True}, {"on_layer": lambda i, h, p: None},
             {"kv_bits": 8}]
    with torch.inference_mode():
        for kw in calls:
            out = m(IDS[:, :6], **kw)
            assert type(out) is ModelOutput, kw
            assert out.logits.shape == (2, 6, m.cfg.vocab_size) and len(out.past) == m.cfg.n_layers, kw
            assert len(out.attn_probs) == (m.cfg.n_layers if kw.get("probe") else 0), kw
            assert len(out.hidden) == (m.cfg.n_layers if kw.get("return_hidden") else 0), kw
        nxt = m(IDS[:, 6:7], past=out.past, start_pos=6)
        assert type(nxt) is ModelOutput and nxt.past[0][0].shape[2] == 7
