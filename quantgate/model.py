"""The one model definition: a Qwen3-style decoder with an optional attention output gate.

Token embedding, pre-RMSNorm blocks, GQA attention with RoPE (optionally partial) and per-head
QK-RMSNorm, SwiGLU MLP, final RMSNorm, lm_head (tied or not), no biases.

The gate (G1 in Qiu et al. 2025) multiplies each head's SDPA output by sigmoid(X @ W_g) before
o_proj, X being the normed layer input. `headwise` has one gate value per head, `elementwise` one per
output channel. We keep W_g as its own Linear (`g_proj`): training and analysis see it as a separate
weight; checkpoint writers fuse it into q_proj in whatever row order each on-disk layout uses.

A hybrid (Qwen3.5 / Qwen3-Next) swaps the attention of some layers (`cfg.layer_types`) for a Gated DeltaNet
(`GatedDeltaNet`, linear attention with a recurrent state and its own output gate); the rest is the same block.

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

from .errors import QuantgateError
from .quant.qlinear import fake_quant_per_token

GATE_MODES = ("none", "headwise", "elementwise")
LAYER_TYPES = ("full_attention", "linear_attention")
POSITIONS = ("rope", "learned")


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
    # Hybrid models (Qwen3.5 / Qwen3-Next): per-layer mixer, "full_attention" (the gated attention above) or
    # "linear_attention" (Gated DeltaNet); None: every layer is full attention. The linear_* fields shape GDN layers.
    layer_types: tuple[str, ...] | None = None
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 4
    # Mixture of experts (Qwen3.5-MoE / Qwen3.6-35B-A3B): with n_experts > 0 every layer's MLP is `SparseMoE`,
    # a softmax top-k router over n_experts SwiGLU experts of expert_ffn_dim plus one shared expert of
    # shared_expert_ffn_dim behind its own sigmoid gate (ffn_dim is then unused).
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    shared_expert_ffn_dim: int = 0
    # Where positions enter: "rope" (every layout's) or "learned", a table of absolute position embeddings added to
    # the token embeddings and no rotation: the sink lab's switch (quantgate demo --lab sinks), since on
    # Bigram-Backcopy a RoPE model's copy head goes dormant on BOS in some seeds only (benchmarks/sink_lab_recipe.py).
    # Such a model is saved in the quantgate_lab layout and runs in PyTorch only.
    positions: str = "rope"
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
        self._check_layer_types()
        self._check_experts()
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")

    def _check_experts(self) -> None:
        for name in ("n_experts", "n_experts_used", "expert_ffn_dim", "shared_expert_ffn_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if not self.n_experts:
            return
        if not 1 <= self.n_experts_used <= self.n_experts:
            raise ValueError(f"n_experts_used must be in [1, n_experts = {self.n_experts}], got {self.n_experts_used}")
        if self.expert_ffn_dim < 1 or self.shared_expert_ffn_dim < 1:
            raise ValueError(f"a mixture-of-experts model needs expert_ffn_dim and shared_expert_ffn_dim >= 1, got "
                             f"{self.expert_ffn_dim} and {self.shared_expert_ffn_dim}")

    def _check_layer_types(self) -> None:
        if self.layer_types is None:
            return
        types = tuple(self.layer_types)
        self.layer_types = types  # a JSON list reads back as the same tuple
        if len(types) != self.n_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types must name one of {LAYER_TYPES} for each of the {self.n_layers} layers, "
                             f"got {len(types)}: {list(types)[:6]}")
        if "linear_attention" not in types:
            return
        for name in ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim",
                     "linear_conv_kernel"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer for Gated DeltaNet layers, got {v!r}")
        if self.linear_value_heads % self.linear_key_heads:
            raise ValueError(f"linear_value_heads ({self.linear_value_heads}) must be a multiple of "
                             f"linear_key_heads ({self.linear_key_heads})")

    @property
    def rotary_dim(self) -> int:
        return int(round(self.head_dim * self.partial_rotary))

    @property
    def gate_dim(self) -> int:
        """Rows of W_g: one per head (headwise) or one per attention output channel (elementwise)."""
        return {"none": 0, "headwise": self.n_heads, "elementwise": self.n_heads * self.head_dim}[self.gate]

    def layer_type(self, i: int) -> str:
        return "full_attention" if self.layer_types is None else self.layer_types[i]

    @property
    def is_hybrid(self) -> bool:
        """Any Gated DeltaNet layer (Qwen3.5-style hybrid)."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    @property
    def is_lab(self) -> bool:
        """A sink-lab model (learned absolute positions): PyTorch only, saved in the quantgate_lab layout."""
        return self.positions != "rope"

    @property
    def is_moe(self) -> bool:
        """Every layer's MLP a routed mixture of experts with a gated shared expert (Qwen3.5-MoE)."""
        return self.n_experts > 0

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.layer_type(i) == "full_attention"]

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN's short causal conv: q, k and v (2 * Hk * dk + Hv * dv)."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

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
    # medium: every weight row a multiple of 256, so llama.cpp's k-quants apply to all of them (small's d=128 rows
    # fall back to 32-blocks); still trains on a laptop CPU in minutes
    "medium": ModelConfig(vocab_size=8192, dim=256, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=64,
                          ffn_dim=768, max_seq_len=1024),
    # large: the allocator benchmarks' CPU-trained pair of issue 50 (rows multiples of 256, d 512, 12 layers, 46M
    # parameters untied); hours to train on two cores
    "large": ModelConfig(vocab_size=8192, dim=512, n_layers=12, n_heads=8, n_kv_heads=4, head_dim=64,
                         ffn_dim=1536, max_seq_len=1024, tie_embeddings=False),
    "base": ModelConfig(vocab_size=32768, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64,
                        ffn_dim=2048, max_seq_len=2048),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def hybrid(cfg: ModelConfig, interval: int = 4, value_heads_per_key_head: int = 1) -> ModelConfig:
    """`cfg` as a Qwen3.5-style hybrid: every `interval`-th layer full attention (layers interval-1, 2*interval-1,
    ...; Qwen3.5's full_attention_interval), the others Gated DeltaNet with as many key heads as the attention has
    heads, head size head_dim, and `value_heads_per_key_head` value heads per key head; partial rotary 0.25 on the
    full-attention layers, as Qwen3.5 has. A model with fewer than `interval` layers gets its last one full."""
    types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(cfg.n_layers))
    if "full_attention" not in types:
        types = types[:-1] + ("full_attention",)
    return replace(cfg, layer_types=types, partial_rotary=0.25, linear_key_heads=cfg.n_heads,
                   linear_value_heads=cfg.n_heads * value_heads_per_key_head, linear_key_dim=cfg.head_dim,
                   linear_value_dim=cfg.head_dim, linear_conv_kernel=4)


def pytorch_only(cfg: ModelConfig, what: str) -> None:
    """Refuse a sink-lab model (learned positions) in what runs only rope models: exports, SmoothQuant, the
    layer-by-layer path (one line, before any work)."""
    if cfg.is_lab:
        raise QuantgateError(f"{what} does not take sink-lab models (learned absolute positions, the quantgate_lab "
                             f"layout); they run in PyTorch: train, eval, analyze, quantize --backend torch, report "
                             f"--backends torch")


def without_attention(cfg: ModelConfig) -> str | None:
    """Why a hybrid whose every layer is Gated DeltaNet cannot be exported (None when it has full attention): with no
    attention there is no attention gate to carry, and quantgate's GGUF and ONNX readers, as llama.cpp's qwen35 graph
    builder and the ONNX decoder signature, are built around at least one full-attention layer."""
    if cfg.is_hybrid and not cfg.full_attention_layers:
        return (f"this hybrid has no full-attention layer (all {cfg.n_layers} layers are Gated DeltaNet): it has no "
                f"attention gate, and quantgate's GGUF and ONNX formats need at least one full-attention layer")
    return None


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
    if cfg.positions == "learned":  # no rotation: cos 1, sin 0 (the positions are in the embeddings)
        shape = (*positions.shape, r)
        return (torch.ones(shape, dtype=torch.float32, device=positions.device),
                torch.zeros(shape, dtype=torch.float32, device=positions.device))
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32, device=positions.device) / r))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rope_sections(rotary_dim: int) -> list[int]:
    """M-RoPE sections (t, h, w, and a fourth llama.cpp has) under which Qwen3.5's interleaved multimodal rope is
    NEOX rope over `rotary_dim` channels for text, where the t, h and w positions are all the token's position:
    what a Qwen3.5 config.json (mrope_section) and a qwen35 GGUF (rope.dimension_sections) carry.

    llama.cpp's IMROPE sends frequency pair i to section s % 3 when s = i mod sum(sections) < 3 * sections[s % 3],
    else to the fourth section (position 0 for text, i.e. no rotation): every pair must land in the first three.
    """
    n = rotary_dim // 2
    s0, s1 = -(-n // 3), -(-(n - 1) // 3)
    sections = [s0, s1, n - s0 - s1, 0]
    for i in range(n):
        s = i % n
        if not s < 3 * sections[s % 3]:
            raise AssertionError(f"rope sections {sections} leave pair {i} unrotated")
    return sections


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


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: the FLA/HF form (eps inside the root), which llama.cpp matches."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_recurrent(q, k, v, g, beta, state):
    """The gated delta rule one token at a time (decode, and the reference the chunked form is tested against).

    q, k [B, T, H, dk] (L2-normed, q scaled), v [B, T, H, dv], g (log-decay <= 0) and beta [B, T, H], state
    [B, H, dk, dv]; all fp32. Per token: S <- S * exp(g); S <- S + k (beta (v - S^T k))^T; o = S^T q.
    Returns (o [B, T, H, dv], final state)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t, :, None, None].exp()
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1), state


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same rule as gated_delta_recurrent, a chunk of tokens at a time (prefill and training).

    Within a chunk, with c = cumsum(g) and D[t, s] = exp(c_t - c_s) for s <= t, the values the rule writes solve
    the unit lower-triangular system (I + tril(beta k k^T * D, -1)) U = beta (v - exp(c) k S0^T); the outputs are
    exp(c) q S0 + (q k^T * D) U and the state leaves as exp(c_last) S0 + (k * exp(c_last - c))^T U (the WY form of
    Yang et al. 2024, "Gated Delta Networks"). Written out here because no library quantgate uses ships it."""
    B, T, H, dk = q.shape
    outs = []
    for i in range(0, T, chunk):
        qc, kc, vc = (x[:, i:i + chunk].transpose(1, 2) for x in (q, k, v))     # [B, H, C, d]
        gc, bc = g[:, i:i + chunk].transpose(1, 2), beta[:, i:i + chunk].transpose(1, 2)  # [B, H, C]
        C = qc.shape[2]
        c = gc.cumsum(-1)
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()   # [B, H, C, C]
        kk = (kc @ kc.transpose(-1, -2)) * decay * bc[..., :, None]
        system = torch.eye(C, device=q.device) + kk.tril(-1)
        rhs = bc[..., None] * (vc - c.exp()[..., None] * (kc @ state))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outs.append((c.exp()[..., None] * (qc @ state) + ((qc @ kc.transpose(-1, -2)) * decay) @ u).transpose(1, 2))
        last = c[..., -1:]
        state = state * last.exp()[..., None] + (kc * (last - c).exp()[..., None]).transpose(-1, -2) @ u
    return torch.cat(outs, dim=1), state


def gated_delta_scan(q, k, v, g, beta, state):
    """The token loop of gated_delta_recurrent as one `scan` over time (the export form: torch.onnx's dynamo
    exporter turns it into an ONNX `Scan` with a dynamic length, which ONNX Runtime CPU runs; a Python loop would
    be unrolled at the example's length). torch's scan is a private higher-order op (torch 2.5+); only the
    exporter's copy of the model uses it."""
    from torch._higher_order_ops.scan import scan

    def step(S, x):
        qt, kt, vt, gt, bt = x  # one token: [B, H, dk], [B, H, dk], [B, H, dv], [B, H], [B, H]
        S = S * gt.exp()[..., None, None]
        delta = bt[..., None] * (vt - (S * kt[..., None]).sum(-2))
        S = S + kt[..., None] * delta[..., None, :]
        return S, (S * qt[..., None]).sum(-2)

    state, o = scan(step, state, tuple(x.transpose(0, 1) for x in (q, k, v, g, beta)))
    return o.transpose(0, 1), state


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer (HF `Qwen3_5GatedDeltaNet`, llama.cpp `qwen35` recurrent layers).

    x -> in_proj_qkv -> short causal depthwise conv (kernel K, its state the last K-1 inputs) -> SiLU -> q, k, v;
    beta = sigmoid(in_proj_b x), g = -exp(A_log) softplus(in_proj_a x + dt_bias); q, k L2-normed per head (q times
    dk^-0.5), each key head shared by Hv/Hk consecutive value heads; the gated delta rule over a [Hv, dk, dv]
    state; the output gate of this layer kind: w * rmsnorm(o) * silu(in_proj_z x) per value head, then out_proj.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        Hv, dv = cfg.linear_value_heads, cfg.linear_value_dim
        C = cfg.linear_conv_dim
        self.in_proj_qkv = nn.Linear(cfg.dim, C, bias=False)
        self.in_proj_z = nn.Linear(cfg.dim, Hv * dv, bias=False)
        self.in_proj_b = nn.Linear(cfg.dim, Hv, bias=False)
        self.in_proj_a = nn.Linear(cfg.dim, Hv, bias=False)
        self.conv1d = nn.Conv1d(C, C, cfg.linear_conv_kernel, groups=C, bias=False)  # weight [C, 1, K]
        self.A_log = nn.Parameter(torch.zeros(Hv))
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.norm = RMSNorm(dv, cfg.norm_eps)
        self.out_proj = nn.Linear(Hv * dv, cfg.dim, bias=False)
        self.export_form = False  # the exporter's copy sets it: the rule as one scan (gated_delta_scan)

    def empty_state(self, batch: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return (torch.zeros(batch, cfg.linear_conv_dim, cfg.linear_conv_kernel - 1, device=device, dtype=dtype),
                torch.zeros(batch, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim, device=device))

    def forward(self, x, state=None, recurrent: bool | None = None):
        """x: normed layer input [B, T, D]. state: (conv [B, C, K-1] pre-conv inputs, recurrent [B, Hv, dk, dv]
        fp32) or None (a fresh sequence). recurrent: the token loop instead of chunks (default: when T == 1).
        Returns (out, new state)."""
        cfg = self.cfg
        B, T, _ = x.shape
        Hk, Hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
        conv_state, rec_state = state if state is not None else self.empty_state(B, x.device, x.dtype)
        mixed = torch.cat([conv_state.to(x.dtype), self.in_proj_qkv(x).transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
        new_conv = mixed[..., mixed.shape[-1] - (cfg.linear_conv_kernel - 1):]
        mixed = F.silu(F.conv1d(mixed, self.conv1d.weight, groups=cfg.linear_conv_dim)).transpose(1, 2)  # [B, T, C]
        q, k, v = mixed.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
        r = Hv // Hk
        q = (l2norm(q.float().view(B, T, Hk, dk)) * dk ** -0.5).repeat_interleave(r, dim=2)
        k = l2norm(k.float().view(B, T, Hk, dk)).repeat_interleave(r, dim=2)
        v = v.float().view(B, T, Hv, dv)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        rule = gated_delta_recurrent if (T == 1 if recurrent is None else recurrent) else gated_delta_chunked
        rule = gated_delta_scan if self.export_form else rule
        o, rec_state = rule(q, k, v, g, beta, rec_state.float())
        z = self.in_proj_z(x).view(B, T, Hv, dv)
        o = (self.norm(o.to(x.dtype)).float() * F.silu(z.float())).to(x.dtype)
        return self.out_proj(o.reshape(B, T, Hv * dv)), (new_conv, rec_state)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn_dim: int | None = None):
        super().__init__()
        ffn = ffn_dim or cfg.ffn_dim
        self.gate_proj = nn.Linear(cfg.dim, ffn, bias=False)
        self.up_proj = nn.Linear(cfg.dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5-MoE's routing: softmax over every expert in fp32, the top k kept and renormalised to sum 1.
    Returns (weights [N, k] fp32, expert indices [N, k])."""
    w, idx = router_logits.float().softmax(dim=-1).topk(k, dim=-1)
    return w / w.sum(dim=-1, keepdim=True), idx


class SparseMoE(nn.Module):
    """Qwen3.5-MoE's feed-forward (HF `Qwen3_5MoeSparseMoeBlock`, llama.cpp qwen35moe's build_moe_ffn plus its shared
    expert): sum_k w_k expert_k(x) + sigmoid(shared_expert_gate x) shared_expert(x), the weights from `route`.

    The experts are a ModuleList of ordinary SwiGLU MLPs (HF fuses them into 3-D tensors; the loader slices those),
    so every tool that works on nn.Linear (fake quantization, GPTQ, SmoothQuant, importance matrices, activation
    capture) sees each expert's projections with the tokens routed to it. The shared expert's sigmoid gate is the
    model's third gate, beside the attention gate and the Gated DeltaNet's z. `last_route` keeps the last call's
    expert indices [N, k] when `keep_route` is set (analysis; off by default)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_used = cfg.n_experts_used
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)  # the router (HF's name)
        self.experts = nn.ModuleList(MLP(cfg, cfg.expert_ffn_dim) for _ in range(cfg.n_experts))
        self.shared_expert = MLP(cfg, cfg.shared_expert_ffn_dim)
        self.shared_expert_gate = nn.Linear(cfg.dim, 1, bias=False)
        self.keep_route = False
        self.last_route: torch.Tensor | None = None

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, idx = route(self.gate(flat), self.n_used)
        if self.keep_route:
            self.last_route = idx.detach()
        out = torch.zeros_like(flat)
        for e in idx.unique().tolist():  # only the experts some token was routed to run, on those tokens
            rows, slot = (idx == e).nonzero(as_tuple=True)
            y = self.experts[e](flat[rows]) * weights[rows, slot, None].to(flat.dtype)
            out.index_add_(0, rows, y)
        out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(shape)


class Block(nn.Module):
    """Pre-norm block; its mixer is the (gated) attention `self_attn` or, in a hybrid's linear_attention layers,
    the Gated DeltaNet `linear_attn` (HF's module names for both)."""

    def __init__(self, cfg: ModelConfig, layer_type: str = "full_attention"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.is_moe else MLP(cfg)

    @property
    def is_linear(self) -> bool:
        return hasattr(self, "linear_attn")

    def forward(self, h, cos, sin, past=None, probe=False, key_mask=None, kv_bits=None):
        x = self.input_layernorm(h)
        if self.is_linear:  # its cache is the conv and recurrent state; no attention probabilities, no KV cache
            (a, present), probs = self.linear_attn(x, past), None
        else:
            a, present, probs = self.self_attn(x, cos, sin, past, probe, key_mask, kv_bits)
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, present, probs


class ModelOutput(NamedTuple):
    """What every `Model.forward` call returns (one type, HF's `CausalLMOutputWithPast` shape, as a NamedTuple so
    torch.compile, DDP and the ONNX exporter's tracer see plain tensors in a tuple).

    logits: [B, T, V] fp32. past: the cache to pass to the next call, per layer: (k, v) [B, KV, P+T, hd] for
    attention, (conv [B, C, K-1], recurrent [B, Hv, dk, dv]) for Gated DeltaNet layers.
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
        self.embed_positions = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.positions == "learned" else None
        self.layers = nn.ModuleList(Block(cfg, cfg.layer_type(i)) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_weights(self, seed: int) -> None:
        """nanoGPT-style init, seeded: N(0, 0.02), residual projections scaled by 1/sqrt(2L). Gated DeltaNet
        layers as HF initialises them: conv U(+-1/sqrt(K)), A = exp(A_log) ~ U(1, 16), dt_bias 1."""
        g = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("A_log"):
                    p.copy_((1 + 15 * torch.rand(p.shape, generator=g)).log())
                elif name.endswith("conv1d.weight"):
                    p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) / math.sqrt(p.shape[-1]))
                elif p.dim() == 1:
                    p.fill_(1.0)
                else:
                    std = resid_std if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, idx: torch.Tensor, past=None, start_pos: int = 0, probe: bool = False,
                return_hidden: bool = False, on_layer=None, position_ids: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None, kv_bits: int | None = None, head: bool = True) -> ModelOutput:
        """idx: [B, T] token ids. Returns a ModelOutput (logits, the new cache, and what probe/return_hidden ask for).

        past: the per-layer cache of an earlier call (ModelOutput.past; None: an empty cache); start_pos: its length.
        on_layer(i, h, probs): called after each block with its output (and attention probabilities when
        probe=True) instead of collecting them, so analysis holds one layer's tensors at a time.
        position_ids [B, T] and key_mask [B, P+T] (exported graphs) replace start_pos and the implicit mask.
        kv_bits: a quantized KV cache, k and v rounded per token and head to that many bits (mlx-lm's quantized
        cache: an option of the run, which the runners pass, not state of the model).
        head=False: `logits` holds the final normed hidden state [B, T, D] instead, what the output head reads
        (quantgate.reference stores it in place of the reference's logits).
        """
        B, T = idx.shape
        positions = position_ids if position_ids is not None else \
            torch.arange(start_pos, start_pos + T, device=idx.device)
        cos, sin = rope_cache(self.cfg, positions)
        h = self.embed_tokens(idx)
        if self.embed_positions is not None:
            h = h + self.embed_positions(positions)
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
        x = self.norm(h)
        logits = self.lm_head(x).float() if head else x
        return ModelOutput(logits, presents, probs, hidden)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once by parameters()


def attention_only(cfg: ModelConfig, what: str) -> None:
    """Refuse a hybrid or a MoE in the verbs that do not handle Gated DeltaNet layers or routed experts yet (one
    line, before any work)."""
    if cfg.is_moe:
        raise QuantgateError(f"{what} does not handle mixture-of-experts models yet; info, eval, generate, analyze, "
                             f"torch quantization (router and shared-expert gate kept float) and GGUF export with "
                             f"llama.cpp quantization do")
    if cfg.is_hybrid:
        raise QuantgateError(f"{what} does not handle hybrid (Gated DeltaNet) models yet; train, info, eval, generate, "
                             f"analyze (with the gate-survival check), torch quantization, and GGUF and ONNX export (with "
                             f"quantize, eval and generate on both) do")


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
