"""On-disk checkpoint layouts: explicit name tables and the q/gate row orders (DESIGN section 2).

| layout      | config                                   | q_proj rows                                   | norms        |
|-------------|------------------------------------------|-----------------------------------------------|--------------|
| qwen3       | model_type qwen3                         | H*hd                                          | w            |
| official    | qwen3 + headwise/elementwise_attn_output_gate | per KV group: [q of its g heads, gate of its g heads] | w  |
| qwen3_next  | model_type qwen3_next (dense, all full attention) | per head: [q_h (hd), gate_h (hd)]      | stored w-1   |

Names that every layout shares are in one table; only the q/gate fusion and the norm convention differ.
"""
from __future__ import annotations

import torch

from .errors import QuantgateError
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


class Layout:
    """One on-disk layout, a row carrying its own behaviour (llama.cpp's per-architecture converter classes):
    how config.json says it is this layout, what it implies for our ModelConfig, which of our models it can
    hold, the config keys it writes, and how q and gate rows are stored. Reading and writing checkpoints
    (quantgate.formats.hf) asks the row; a new layout (a Qwen3.5 hybrid, say) is one more class below."""
    name: str
    model_type: str
    architecture: str
    zero_centred_norms: bool = False  # norms stored as w - 1 (Qwen3-Next)
    default_head_dim: int = 128       # transformers' default when config.json has no head_dim
    gated: bool = False               # holds gated models (True) or only gate-free ones (False)
    partial_rotary_ok: bool = False   # config.json can say partial_rotary_factor
    needs_qk_norm: bool = True        # its architecture always applies QK-norm
    description: str = ""

    def matches(self, hf: dict) -> bool:
        return hf.get("model_type") == self.model_type

    def gate_of(self, f) -> str:
        """Our gate mode from config.json (`f`: the checked field reader)."""
        return "none"

    def check_config(self, hf: dict, f, n_layers: int, where: str) -> None:
        """Refuse a config.json of this model_type that uses features quantgate does not run."""

    def partial_rotary(self, f) -> float:
        return 1.0

    def cannot_hold(self, cfg: ModelConfig) -> str | None:
        """Why a model with `cfg` cannot be written in this layout (None: it can), from the row's three flags."""
        if (cfg.gate != "none") != self.gated:
            return f"a model with gate '{cfg.gate}' cannot be written in the {self.name} layout"
        if cfg.partial_rotary != 1.0 and not self.partial_rotary_ok:
            return f"partial rotary ({cfg.partial_rotary}) can only be written in the qwen3_next layout"
        if not cfg.qk_norm and self.needs_qk_norm:
            return "a model without QK-norm can only be written in the official layout"
        return None

    def config_fields(self, cfg: ModelConfig) -> dict:
        """The config.json keys this layout adds to the shared ones."""
        return {}

    def q_rows(self, cfg: ModelConfig) -> int:
        return cfg.n_heads * cfg.head_dim + cfg.gate_dim

    def split_q(self, w: torch.Tensor, cfg: ModelConfig):
        return w, None

    def fuse_q(self, q: torch.Tensor, g, cfg: ModelConfig):
        return q


class Qwen3(Layout):
    name, model_type, architecture, description = "qwen3", "qwen3", "Qwen3ForCausalLM", "Qwen3 (no gate)"

    def matches(self, hf: dict) -> bool:
        return super().matches(hf) and not _official_gate(hf)

    def config_fields(self, cfg: ModelConfig) -> dict:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}


class Official(Layout):
    name, model_type, architecture = "official", "qwen3", "Qwen3ForCausalLM"
    gated, needs_qk_norm = True, False
    description = "official gated-attention (qwen3 + attn_output_gate, per-KV-group gate rows)"

    def matches(self, hf: dict) -> bool:
        return super().matches(hf) and _official_gate(hf)

    def gate_of(self, f) -> str:
        gate = "headwise" if f.bool("headwise_attn_output_gate", False) else "elementwise"
        f.bool("elementwise_attn_output_gate", False)  # checked for its type too
        return gate

    def config_fields(self, cfg: ModelConfig) -> dict:
        return {"headwise_attn_output_gate": cfg.gate == "headwise", "elementwise_attn_output_gate": cfg.gate ==
                "elementwise", "use_qk_norm": cfg.qk_norm, "qkv_bias": False, "use_sliding_window": False,
                "sliding_window": None}

    def split_q(self, w: torch.Tensor, cfg: ModelConfig):
        """Per KV group j: [q rows of its g heads (g*hd), gate rows of its g heads (g or g*hd)]."""
        grp = cfg.n_heads // cfg.n_kv_heads
        per_group = w.view(cfg.n_kv_heads, -1, w.shape[-1])
        q = per_group[:, : grp * cfg.head_dim].reshape(-1, w.shape[-1])
        g = per_group[:, grp * cfg.head_dim:].reshape(-1, w.shape[-1])
        return q, g

    def fuse_q(self, q: torch.Tensor, g: torch.Tensor, cfg: ModelConfig):
        D = q.shape[-1]
        return torch.cat([q.view(cfg.n_kv_heads, -1, D), g.view(cfg.n_kv_heads, -1, D)], dim=1).reshape(-1, D)


class Qwen3Next(Layout):
    name, model_type, architecture = "qwen3_next", "qwen3_next", "Qwen3NextForCausalLM"
    zero_centred_norms, default_head_dim, gated, partial_rotary_ok = True, 256, True, True
    description = "Qwen3-Next (per-head interleaved [q | gate], zero-centred norms)"

    def gate_of(self, f) -> str:
        return "elementwise"  # per head [q_h | gate_h]: a headwise gate is written as hd equal rows

    def check_config(self, hf: dict, f, n_layers: int, where: str) -> None:
        _check_dense_full_attention(hf, f, n_layers, where)

    def partial_rotary(self, f) -> float:
        return f.float("partial_rotary_factor", 0.25, hi=1.0)

    def config_fields(self, cfg: ModelConfig) -> dict:
        return {"partial_rotary_factor": cfg.partial_rotary, "layer_types": ["full_attention"] * cfg.n_layers,
                "mlp_only_layers": list(range(cfg.n_layers)), "num_experts": 0, "decoder_sparse_step": 1}

    def q_rows(self, cfg: ModelConfig) -> int:
        return 2 * cfg.n_heads * cfg.head_dim

    def split_q(self, w: torch.Tensor, cfg: ModelConfig):
        return _split_interleaved(w, cfg)

    def fuse_q(self, q: torch.Tensor, g: torch.Tensor, cfg: ModelConfig):
        return _fuse_interleaved(q, g, cfg)


def _official_gate(hf: dict) -> bool:
    return bool(hf.get("headwise_attn_output_gate") or hf.get("elementwise_attn_output_gate"))


def _check_dense_full_attention(hf: dict, f, n_layers: int, where: str) -> None:
    """Qwen3-Next's config describes hybrids and MoE too; quantgate reads the dense all-full-attention ones."""
    types = hf.get("layer_types") or []
    if not isinstance(types, list) or len(types) != n_layers or any(t != "full_attention" for t in types):
        raise QuantgateError(f"{where}: only all-full-attention Qwen3-Next is supported "
                             f"(layer_types must list {n_layers} 'full_attention' layers; linear-attention hybrids "
                             f"are not supported yet)")
    mlp_only = hf.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise QuantgateError(f"{where}: mlp_only_layers must be a list of layer indices")
    n_exp, step = f.int("num_experts", 0, lo=0), f.int("decoder_sparse_step", 1)
    moe = [i for i in range(n_layers) if i not in set(mlp_only) and n_exp > 0 and (i + 1) % step == 0]
    if moe:
        raise QuantgateError(f"{where}: mixture-of-experts layers {moe[:8]} are not supported "
                             f"(dense models only: mlp_only_layers must cover every layer)")


LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (Qwen3(), Official(), Qwen3Next())}

DEFAULT_LAYOUT_FOR_GATE = {"none": "qwen3", "headwise": "official", "elementwise": "qwen3_next"}


def detect_layout(hf: dict) -> str:
    """The name of the layout whose row recognises this config.json ("" when none does)."""
    return next((lay.name for lay in LAYOUTS.values() if lay.matches(hf)), "")


def is_norm(our_name: str) -> bool:
    return our_name.endswith(NORM_SUFFIXES)
