"""On-disk checkpoint layouts: explicit name tables and the q/gate row orders (DESIGN section 2).

| layout      | config                                   | q_proj rows                                   | norms        |
|-------------|------------------------------------------|-----------------------------------------------|--------------|
| qwen3       | model_type qwen3                         | H*hd                                          | w            |
| official    | qwen3 + headwise/elementwise_attn_output_gate | per KV group: [q of its g heads, gate of its g heads] | w  |
| qwen3_next  | model_type qwen3_next (dense, all full attention) | per head: [q_h (hd), gate_h (hd)]      | stored w-1   |

Names that every layout shares are in one table; only the q/gate fusion and the norm convention differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .model import ModelConfig

# ours -> theirs. `{i}` is the layer index. q_proj/g_proj are handled by the layout's fuse/split.
GLOBAL_NAMES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "layers.{i}.input_layernorm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.self_attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.self_attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.self_attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.self_attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.post_attention_layernorm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
}
Q_NAME = "model.layers.{i}.self_attn.q_proj.weight"  # theirs: q rows, gate rows fused in where gated
NORM_SUFFIXES = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "norm.weight")


def _split_none(w: torch.Tensor, cfg: ModelConfig):
    return w, None


def _fuse_none(q: torch.Tensor, g, cfg: ModelConfig):
    return q


def _split_official(w: torch.Tensor, cfg: ModelConfig):
    """Per KV group j: [q rows of its g heads (g*hd), gate rows of its g heads (g or g*hd)]."""
    grp = cfg.n_heads // cfg.n_kv_heads
    per_group = w.view(cfg.n_kv_heads, -1, w.shape[-1])
    q = per_group[:, : grp * cfg.head_dim].reshape(-1, w.shape[-1])
    g = per_group[:, grp * cfg.head_dim:].reshape(-1, w.shape[-1])
    return q, g


def _fuse_official(q: torch.Tensor, g: torch.Tensor, cfg: ModelConfig):
    D = q.shape[-1]
    return torch.cat([q.view(cfg.n_kv_heads, -1, D), g.view(cfg.n_kv_heads, -1, D)], dim=1).reshape(-1, D)


def _split_interleaved(w: torch.Tensor, cfg: ModelConfig):
    """Per head h: [q_h (hd rows), gate_h (hd rows)]: Qwen3-Next / Qwen3.5 and llama.cpp's qwen35."""
    per_head = w.view(cfg.n_heads, 2 * cfg.head_dim, w.shape[-1])
    D = w.shape[-1]
    return per_head[:, : cfg.head_dim].reshape(-1, D), per_head[:, cfg.head_dim:].reshape(-1, D)


def _fuse_interleaved(q: torch.Tensor, g: torch.Tensor, cfg: ModelConfig):
    D = q.shape[-1]
    if cfg.gate == "headwise":  # a headwise gate is an elementwise gate with hd equal rows per head
        g = g.repeat_interleave(cfg.head_dim, dim=0)
    return torch.cat([q.view(cfg.n_heads, cfg.head_dim, D), g.view(cfg.n_heads, cfg.head_dim, D)],
                     dim=1).reshape(-1, D)


@dataclass(frozen=True)
class Layout:
    name: str
    model_type: str
    architecture: str
    zero_centred_norms: bool
    split_q: Callable
    fuse_q: Callable
    description: str

    def q_rows(self, cfg: ModelConfig) -> int:
        hd_rows = cfg.n_heads * cfg.head_dim
        if self.name == "qwen3_next":
            return 2 * hd_rows
        return hd_rows + cfg.gate_dim


LAYOUTS = {
    "qwen3": Layout("qwen3", "qwen3", "Qwen3ForCausalLM", False, _split_none, _fuse_none,
                    "Qwen3 (no gate)"),
    "official": Layout("official", "qwen3", "Qwen3ForCausalLM", False, _split_official, _fuse_official,
                       "official gated-attention (qwen3 + attn_output_gate, per-KV-group gate rows)"),
    "qwen3_next": Layout("qwen3_next", "qwen3_next", "Qwen3NextForCausalLM", True, _split_interleaved,
                         _fuse_interleaved, "Qwen3-Next (per-head interleaved [q | gate], zero-centred norms)"),
}

DEFAULT_LAYOUT_FOR_GATE = {"none": "qwen3", "headwise": "official", "elementwise": "qwen3_next"}


def detect_layout(hf: dict) -> str:
    mt = hf.get("model_type")
    if mt == "qwen3":
        gated = hf.get("headwise_attn_output_gate") or hf.get("elementwise_attn_output_gate")
        return "official" if gated else "qwen3"
    if mt == "qwen3_next":
        return "qwen3_next"
    return ""


def is_norm(our_name: str) -> bool:
    return our_name.endswith(NORM_SUFFIXES)
