"""Our loader against independent implementations: transformers' Qwen3 and Qwen3-Next, and a
reference of the official gated-attention forward written here from its published semantics."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from conftest import TINY_HF, make_hf_qwen3, make_hf_qwen3_next, rel_err
from quantgate.formats import load_checkpoint, save_checkpoint
from quantgate.model import build_model, preset

IDS = torch.tensor([[0, 5, 17, 250, 3, 99, 42, 7, 7, 128, 64, 2, 200, 11, 31, 8]])


def _ours(path):
    return load_checkpoint(path).model(IDS).logits.detach()


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_loader_matches_transformers(tmp_path, tie):
    hf = make_hf_qwen3(tie=tie)
    hf.save_pretrained(tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded.layout == "qwen3" and loaded.model.cfg.gate == "none"
    assert rel_err(loaded.model(IDS).logits.detach(), hf(IDS, use_cache=False).logits.detach()) <= 1e-5


@pytest.mark.parametrize("partial_rotary", [1.0, 0.25])
def test_qwen3_next_loader_matches_transformers(tmp_path, partial_rotary):
    hf = make_hf_qwen3_next(partial_rotary)
    hf.save_pretrained(tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded.layout == "qwen3_next" and loaded.model.cfg.gate == "elementwise"
    assert loaded.model.cfg.rotary_dim == int(16 * partial_rotary)
    assert rel_err(loaded.model(IDS).logits.detach(), hf(IDS, use_cache=False).logits.detach()) <= 1e-5


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf_qwen3()
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert rel_err(_ours(tmp_path), hf(IDS, use_cache=False).logits.detach()) <= 1e-5


def _tiny_cfg(gate, **kw):
    return preset("tiny", vocab_size=300, gate=gate, **kw)


@pytest.mark.parametrize("gate,cls_name", [("none", "Qwen3ForCausalLM"), ("elementwise", "Qwen3NextForCausalLM")])
def test_saved_twins_open_in_stock_transformers(tmp_path, gate, cls_name):
    import transformers
    from conftest import randomize_
    model = build_model(_tiny_cfg(gate), seed=3).eval()
    randomize_(model, 3)
    save_checkpoint(model, tmp_path / "m")
    hf = getattr(transformers, cls_name).from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    assert rel_err(hf(IDS, use_cache=False).logits.detach(), model(IDS).logits.detach()) <= 1e-5
    # and back through our loader, bit-for-bit the same weights
    assert torch.equal(_ours(tmp_path / "m"), model(IDS).logits.detach())


# --- the official layout: an independent reference of its forward pass --------------------------

def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def official_reference_logits(sd: dict, cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """The official modeling_qwen3.py forward (eager path), restated: q_proj output viewed as
    [B, T, KV, -1] and split into the q of the group's heads and their gate scores."""
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = H // KV
    headwise = cfg["headwise_attn_output_gate"]
    B, T = ids.shape
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).double() / hd))
    fr = torch.arange(T).double()[:, None] * inv[None]
    emb = torch.cat([fr, fr], -1)
    cos, sin = emb.cos(), emb.sin()

    def rope(x):  # [B, h, T, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    W = {k: v.double() for k, v in sd.items()}
    h = W["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, W[p + "input_layernorm.weight"])
        qs = (x @ W[p + "self_attn.q_proj.weight"].T).view(B, T, KV, -1)
        if headwise:
            q, gate = torch.split(qs, [hd * g, g], dim=-1)
            gate = gate.reshape(B, T, -1, 1)
        else:
            q, gate = torch.split(qs, [hd * g, hd * g], dim=-1)
            gate = gate.reshape(B, T, -1, hd)
        q = q.reshape(B, T, -1, hd).transpose(1, 2)
        k = (x @ W[p + "self_attn.k_proj.weight"].T).view(B, T, -1, hd).transpose(1, 2)
        v = (x @ W[p + "self_attn.v_proj.weight"].T).view(B, T, -1, hd).transpose(1, 2)
        q, k = _rms(q, W[p + "self_attn.q_norm.weight"]), _rms(k, W[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = q @ k.transpose(2, 3) / math.sqrt(hd)
        s = s + torch.full((T, T), float("-inf")).double().triu(1)
        a = (s.softmax(-1) @ v).transpose(1, 2)
        a = (a * torch.sigmoid(gate)).reshape(B, T, -1)
        h = h + a @ W[p + "self_attn.o_proj.weight"].T
        x = _rms(h, W[p + "post_attention_layernorm.weight"])
        mlp = torch.nn.functional.silu(x @ W[p + "mlp.gate_proj.weight"].T) * (x @ W[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ W[p + "mlp.down_proj.weight"].T
    h = _rms(h, W["model.norm.weight"])
    return (h @ W["lm_head.weight"].T).float()


def _official_checkpoint(path, headwise: bool, seed: int = 0):
    c = dict(TINY_HF, model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False,
             headwise_attn_output_gate=headwise, elementwise_attn_output_gate=not headwise,
             use_qk_norm=True, qkv_bias=False, hidden_act="silu")
    H, KV, hd, D, F, V = 4, 2, 16, 64, 128, 300
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen) * 0.1  # noqa: E731
    n = lambda s: 1 + 0.3 * torch.randn(s, generator=gen)  # noqa: E731
    q_rows = H * hd + (H if headwise else H * hd)
    sd = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": n(D), "lm_head.weight": r(V, D)}
    for i in range(2):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": n(D), p + "post_attention_layernorm.weight": n(D),
                   p + "self_attn.q_proj.weight": r(q_rows, D), p + "self_attn.k_proj.weight": r(KV * hd, D),
                   p + "self_attn.v_proj.weight": r(KV * hd, D), p + "self_attn.o_proj.weight": r(D, H * hd),
                   p + "self_attn.q_norm.weight": n(hd), p + "self_attn.k_norm.weight": n(hd),
                   p + "mlp.gate_proj.weight": r(F, D), p + "mlp.up_proj.weight": r(F, D),
                   p + "mlp.down_proj.weight": r(D, F)})
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c))
    return sd, c


@pytest.mark.parametrize("headwise", [True, False])
def test_official_layout_matches_reference(tmp_path, headwise):
    sd, c = _official_checkpoint(tmp_path, headwise)
    loaded = load_checkpoint(tmp_path)
    assert loaded.layout == "official"
    assert loaded.model.cfg.gate == ("headwise" if headwise else "elementwise")
    assert rel_err(loaded.model(IDS).logits.detach(), official_reference_logits(sd, c, IDS)) <= 1e-5


@pytest.mark.parametrize("headwise", [True, False])
def test_official_layout_round_trips(tmp_path, headwise):
    sd, _ = _official_checkpoint(tmp_path / "src", headwise)
    model = load_checkpoint(tmp_path / "src").model
    save_checkpoint(model, tmp_path / "out", layout="official")
    from safetensors.torch import load_file
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_headwise_written_interleaved_equals_elementwise(tmp_path):
    """A headwise gate is an elementwise gate whose hd rows per head are equal (how it enters
    formats that only know elementwise); the Qwen3-Next copy must give the same logits."""
    from conftest import randomize_
    model = build_model(_tiny_cfg("headwise"), seed=1).eval()
    randomize_(model, 1)
    save_checkpoint(model, tmp_path / "n", layout="qwen3_next")
    loaded = load_checkpoint(tmp_path / "n")
    assert loaded.model.cfg.gate == "elementwise"
    assert rel_err(loaded.model(IDS).logits.detach(), model(IDS).logits.detach()) <= 1e-6
