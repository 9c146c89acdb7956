"""The one model definition: a Qwen3-style decoder with an optional attention output gate.

Token embedding, pre-RMSNorm blocks, GQA attention with RoPE (optionally partial) and per-head
QK-RMSNorm, SwiGLU MLP, final RMSNorm, lm_head (tied or not), no biases.

The gate (G1 in Qiu et al. 2025) multiplies each head's SDPA output by sigmoid(X @ W_g) before
o_proj, X being the normed layer input. `headwise` has one gate value per head, `elementwise` one per
output channel. We keep W_g as its own Linear (`g_proj`): training and analysis see it as a separate
weight; checkpoint writers fuse it into q_proj in whatever row order each on-disk layout uses.

Parameter names follow HF Qwen3 (minus the `model.` prefix) so the mapping tables in
`checkpoint.py` stay short. Every RMSNorm weight here is the plain multiplier (Qwen3-Next stores
w with an implied 1+w; the loader converts).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .qlinear import fake_quant_per_token

GATE_MODES = ("none", "headwise", "elementwise")


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    dim: int = 128
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    ffn_dim: int = 512
    gate: str = "none"
    rope_theta: float = 10000.0
    partial_rotary: float = 1.0  # fraction of head_dim that is rotated (Qwen3-Next: 0.25)
    qk_norm: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    max_seq_len: int = 2048
    bos_id: int = 0
    eos_id: int = 1
    pad_id: int = 2
    extra: dict = field(default_factory=dict)  # provenance (source layout, model name), never read by forward

    def __post_init__(self) -> None:
        """Every shape and constant a forward pass relies on, checked once here (loaders turn the ValueError
        into one error line naming their file)."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.gate not in GATE_MODES:
            raise ValueError(f"gate must be one of {GATE_MODES}, got {self.gate!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        for name in ("rope_theta", "norm_eps", "partial_rotary"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
        if self.partial_rotary > 1:
            raise ValueError(f"partial_rotary must be at most 1, got {self.partial_rotary}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary {self.partial_rotary} x head_dim {self.head_dim} must give an even rotary dim")
        for name in ("bos_id", "eos_id", "pad_id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.vocab_size:
                raise ValueError(f"{name} {v!r} is not a token id of the {self.vocab_size}-token vocabulary")

    @property
    def rotary_dim(self) -> int:
        return int(round(self.head_dim * self.partial_rotary))

    @property
    def gate_dim(self) -> int:
        """Rows of W_g: one per head (headwise) or one per attention output channel (elementwise)."""
        return {"none": 0, "headwise": self.n_heads, "elementwise": self.n_heads * self.head_dim}[self.gate]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def with_gate(self, gate: str) -> "ModelConfig":
        return replace(self, gate=gate)


# Presets. `small` follows DESIGN section 6: 6 layers x d=128 (4 heads x 32, 2 KV) is the smallest shape
# that showed the baseline's BOS massive activation within ~16 minutes of 2-core CPU training.
# Its d=128 rows are not a multiple of 256, so llama.cpp k-quants fall back to 32-blocks on them.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                        ffn_dim=256, max_seq_len=512),
    "small": ModelConfig(vocab_size=4096, dim=128, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=32,
                         ffn_dim=512, max_seq_len=1024),
    "base": ModelConfig(vocab_size=32768, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64,
                        ffn_dim=2048, max_seq_len=2048),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


def rope_cache(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, rotary_dim] (or [B, T, rotary_dim] for [B, T] positions) in NEOX (rotate-half)
    order, computed in fp32."""
    r = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32, device=positions.device) / r))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, hd]; rotates the first rotary_dim channels of each head, passes the rest."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    if cos.dim() == 2:  # [T, r]: the same positions for every row
        cos, sin = cos[None], sin[None]
    c, s = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    return torch.cat([x_rot * c + rotated * s, x_pass], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, H * hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, KV * hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, KV * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, cfg.dim, bias=False)
        self.g_proj = nn.Linear(cfg.dim, cfg.gate_dim, bias=False) if cfg.gate != "none" else None
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.qg_proj: nn.Linear | None = None  # set by fuse_qg(): q and gate rows in one matmul (export)

    def fuse_qg(self) -> None:
        """One Linear for q and gate rows ([q; g]), as Qwen3-Next computes them; for exported graphs."""
        if self.g_proj is None or self.qg_proj is not None:
            return
        w = torch.cat([self.q_proj.weight, self.g_proj.weight], dim=0)
        self.qg_proj = nn.Linear(w.shape[1], w.shape[0], bias=False).to(w.device, w.dtype)
        self.qg_proj.weight = nn.Parameter(w.detach().clone(), requires_grad=False)

    def forward(self, x, cos, sin, past=None, probe=False, key_mask=None, kv_bits=None):
        """x: normed layer input [B, T, D]. past: (k, v) each [B, KV, P, hd] or None. key_mask: [B, P+T]
        (1 = attend, 0 = padding) or None. kv_bits: k and v rounded per token and head before they enter the
        cache, what a quantized KV cache holds (None: float).

        Returns (out, present_kv, attn_probs or None). `probe=True` computes attention explicitly so
        the probabilities can be returned (analysis path); otherwise SDPA does the work.
        """
        cfg = self.cfg
        B, T, _ = x.shape
        g = None
        if self.qg_proj is not None:
            q, g = self.qg_proj(x).split([cfg.n_heads * cfg.head_dim, cfg.gate_dim], dim=-1)
            q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
        else:
            q = self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_bits is not None:  # what a quantized KV cache would hold
            k, v = fake_quant_per_token(k, kv_bits), fake_quant_per_token(v, kv_bits)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        present = (k, v)
        P = k.shape[2] - T  # cached positions before this chunk
        probs = None
        if probe:
            rep = cfg.n_heads // cfg.n_kv_heads
            kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = (q.float() @ kk.float().transpose(-1, -2)) / math.sqrt(cfg.head_dim)
            mask = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(P)
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = scores.softmax(dim=-1)
            y = (probs @ vv.float()).to(q.dtype)
        elif key_mask is not None:  # exported graphs: causal (offset by the cache) and padding in one mask
            q_pos = torch.arange(T, device=x.device) + P
            causal = torch.arange(P + T, device=x.device)[None, :] <= q_pos[:, None]
            mask = causal[None, None] & key_mask[:, None, None, :].bool()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        elif P == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            # SDPA's is_causal aligns the mask top-left, which is wrong once a cache precedes the chunk.
            mask = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(P)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        y = y.transpose(1, 2)  # [B, T, H, hd]
        if g is None and self.g_proj is not None:
            g = self.g_proj(x)
        if g is not None:
            y = y * torch.sigmoid(g).view(B, T, cfg.n_heads, -1)  # -1: 1 (headwise) or hd
        return self.o_proj(y.reshape(B, T, -1)), present, probs


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, past=None, probe=False, key_mask=None, kv_bits=None):
        a, present, probs = self.self_attn(self.input_layernorm(h), cos, sin, past, probe, key_mask, kv_bits)
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, present, probs


class ModelOutput(NamedTuple):
    """What every `Model.forward` call returns (one type, HF's `CausalLMOutputWithPast` shape, as a NamedTuple so
    torch.compile, DDP and the ONNX exporter's tracer see plain tensors in a tuple).

    logits: [B, T, V] fp32. past: per-layer (k, v) [B, KV, P+T, hd], the cache to pass to the next call.
    attn_probs: per-layer [B, H, T, P+T] when called with probe=True, else empty. hidden: per-layer block outputs
    [B, T, D] when called with return_hidden=True, else empty (on_layer receives them instead when given).
    """
    logits: torch.Tensor
    past: list
    attn_probs: list
    hidden: list


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_weights(self, seed: int) -> None:
        """nanoGPT-style init, seeded: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        g = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    std = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, idx: torch.Tensor, past=None, start_pos: int = 0, probe: bool = False,
                return_hidden: bool = False, on_layer=None, position_ids: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None, kv_bits: int | None = None) -> ModelOutput:
        """idx: [B, T] token ids. Returns a ModelOutput (logits, the new cache, and what probe/return_hidden ask for).

        past: list of per-layer (k, v) from an earlier call (generation; None: an empty cache); start_pos: its length.
        on_layer(i, h, probs): called after each block with its output (and attention probabilities when
        probe=True) instead of collecting them, so analysis holds one layer's tensors at a time.
        position_ids [B, T] and key_mask [B, P+T] (exported graphs) replace start_pos and the implicit mask.
        kv_bits: a quantized KV cache, k and v rounded per token and head to that many bits (mlx-lm's quantized
        cache: an option of the run, which the runners pass, not state of the model).
        """
        B, T = idx.shape
        positions = position_ids if position_ids is not None else \
            torch.arange(start_pos, start_pos + T, device=idx.device)
        cos, sin = rope_cache(self.cfg, positions)
        h = self.embed_tokens(idx)
        presents, probs, hidden = [], [], []
        for i, layer in enumerate(self.layers):
            h, present, p = layer(h, cos, sin, None if past is None else past[i], probe, key_mask, kv_bits)
            presents.append(present)
            if on_layer is not None:
                on_layer(i, h, p)
                continue
            if probe:
                probs.append(p)
            if return_hidden:
                hidden.append(h)
        logits = self.lm_head(self.norm(h)).float()
        return ModelOutput(logits, presents, probs, hidden)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once by parameters()


def build_model(cfg: ModelConfig, seed: int | None = 0) -> Model:
    model = Model(cfg)
    if seed is not None:
        model.init_weights(seed)
    return model


def make_twins(cfg: ModelConfig, gate: str, seed: int) -> tuple[Model, Model]:
    """Baseline and gated model with identical values for every parameter they share.

    Only g_proj exists in the gated twin alone; it is drawn from its own seeded generator.
    """
    baseline = build_model(cfg.with_gate("none"), seed)
    gated = build_model(cfg.with_gate(gate), seed + 1)
    missing, unexpected = gated.load_state_dict(baseline.state_dict(), strict=False)
    assert not unexpected and all(".g_proj." in m for m in missing), (missing, unexpected)
    return baseline, gated
