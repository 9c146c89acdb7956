"""On-disk checkpoint layouts: explicit name tables and the q/gate row orders (DESIGN section 2).

| layout      | config                                   | q_proj rows                                   | norms        |
|-------------|------------------------------------------|-----------------------------------------------|--------------|
| qwen3       | model_type qwen3                         | H*hd                                          | w            |
| official    | qwen3 + headwise/elementwise_attn_output_gate | per KV group: [q of its g heads, gate of its g heads] | w  |
| qwen3_next  | model_type qwen3_next (dense, all full attention) | per head: [q_h (hd), gate_h (hd)]      | stored w-1   |
| qwen3_5     | model_type qwen3_5_text / qwen3_5 (hybrid: Gated DeltaNet + gated attention) | per head: [q_h, gate_h] | stored w-1, except the GDN's own norm |
| qwen3_5_moe | model_type qwen3_5_moe_text / qwen3_5_moe (qwen3_5 with a routed MoE + gated shared expert) | as qwen3_5 | as qwen3_5 |

A Qwen3.5 checkpoint of a gate-free model (a hybrid baseline has no stock layout) is written with zero gate rows
and o_proj doubled (sigmoid(0) = 1/2: exactly the same function) and `quantgate.gate = "none"`, which the reader
turns back into a gate-free model (halving o_proj, refusing non-zero gate rows).

Names that every layout shares are in one table; only the q/gate fusion and the norm convention differ.
"""
from __future__ import annotations

import torch

import json

from .errors import QuantgateError
from .model import ModelConfig, rope_sections

# ours -> theirs. `{i}` is the layer index. q_proj/g_proj are handled by the layout's fuse/split.
GLOBAL_NAMES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "embed_positions.weight": "model.embed_positions.weight",  # the sink lab's learned positions (quantgate_lab)
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
BLOCK_NAMES = {  # every layer, whatever its mixer
    "layers.{i}.input_layernorm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.post_attention_layernorm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
}
ATTENTION_NAMES = {  # full-attention layers
    "layers.{i}.self_attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.self_attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.self_attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.self_attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
GDN_NAMES = {  # Gated DeltaNet layers, Qwen3.5's split projections (the same names as ours)
    f"layers.{{i}}.linear_attn.{n}": f"model.layers.{{i}}.linear_attn.{n}"
    for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
              "A_log", "dt_bias", "norm.weight", "out_proj.weight")
}
# A mixture-of-experts layer's MLP (Qwen3.5-MoE): the router, the shared expert and its gate under their own
# names; the routed experts either one tensor each (EXPERT_NAMES, the released files' form and transformers'
# per-expert input) or fused 3-D (FUSED_EXPERT_NAMES: gate_up_proj [E, 2F, D] gate rows first, down_proj [E, D, F]),
# which is what transformers 5 holds in memory and may save.
MOE_NAMES = {
    f"layers.{{i}}.mlp.{n}": f"model.layers.{{i}}.mlp.{n}"
    for n in ("gate.weight", "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
              "shared_expert.down_proj.weight", "shared_expert_gate.weight")
}
EXPERT_NAMES = {f"layers.{{i}}.mlp.experts.{{j}}.{n}": f"model.layers.{{i}}.mlp.experts.{{j}}.{n}"
                for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")}
FUSED_EXPERT_NAMES = {"gate_up_proj": "model.layers.{i}.mlp.experts.gate_up_proj",
                      "down_proj": "model.layers.{i}.mlp.experts.down_proj"}
LAYER_NAMES = {**BLOCK_NAMES, **ATTENTION_NAMES}  # an all-attention layer (the names before hybrids)
Q_NAME = "model.layers.{i}.self_attn.q_proj.weight"  # theirs: q rows, gate rows fused in where gated
NORM_SUFFIXES = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "norm.weight")
PLAIN_NORMS = (".linear_attn.norm.weight",)  # the GDN's gated norm is a plain multiplier in every layout


def layer_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """ours -> theirs for layer i: its block, and its mixer's tensors (QK-norm only where the model has it)."""
    mixer = GDN_NAMES if cfg.layer_type(i) == "linear_attention" else ATTENTION_NAMES
    block = BLOCK_NAMES
    if cfg.is_moe:  # the router, shared expert and its gate; the routed experts are expert_names'
        block = {o: t for o, t in BLOCK_NAMES.items() if ".mlp." not in o} | MOE_NAMES
    names = {o.format(i=i): t.format(i=i) for o, t in {**block, **mixer}.items()}
    if not cfg.qk_norm:
        names = {o: t for o, t in names.items() if not o.endswith(("q_norm.weight", "k_norm.weight"))}
    return names


def expert_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """ours -> theirs for layer i's routed experts stored one tensor per expert and projection."""
    return {o.format(i=i, j=j): t.format(i=i, j=j) for j in range(cfg.n_experts) for o, t in EXPERT_NAMES.items()}


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
    default_rope_theta: float = 10000.0   # transformers' defaults for the model_type, where config.json says nothing
    default_partial_rotary: float = 1.0
    needs_qk_norm: bool = True        # its architecture always applies QK-norm
    hybrid_ok: bool = False           # holds Gated DeltaNet layers
    zero_gate_baseline: bool = False  # holds a gate-free model as zero gate rows and o_proj doubled
    moe: bool = False                 # holds mixture-of-experts models (and only those)
    lab: bool = False                 # holds sink-lab models (learned positions; and only those)
    multimodal_type: str = ""         # the model_type of its multimodal checkpoints (text model nested)
    omitted_keys: tuple[str, ...] = ()  # shared config.json keys its config class does not have
    description: str = ""

    def text_config(self, hf: dict) -> dict:
        """The config.json fields that describe the language model (a multimodal config nests them)."""
        return hf

    def disk_name(self, name: str, hf: dict) -> str:
        """The name a tensor has in this checkpoint ("model.layers.0..." in the layout's text-model naming)."""
        return name

    def skipped(self, name: str, hf: dict) -> str | None:
        """Which part of a checkpoint a tensor quantgate does not read belongs to (None: it must be read)."""
        return None

    def rope(self, hf: dict, where: str) -> tuple[float, float]:
        """(rope_theta, partial_rotary_factor) from wherever config.json keeps them (read_rope), else the
        model_type's defaults; partial rotary refused where the architecture has none."""
        theta, partial = read_rope(hf, where)
        partial = self.default_partial_rotary if partial is None else partial
        if partial != 1.0 and not self.partial_rotary_ok:
            raise QuantgateError(f"{where}: partial_rotary_factor {partial:g} is not part of a {self.name} model "
                                 f"(its attention rotates every channel); only qwen3_next and qwen3_5 rotate a part")
        return (self.default_rope_theta if theta is None else theta), partial

    def layer_types(self, hf: dict, f, n_layers: int, where: str) -> tuple | None:
        return None

    def matches(self, hf: dict) -> bool:
        return hf.get("model_type") == self.model_type

    def gate_of(self, f) -> str:
        """Our gate mode from config.json (`f`: the checked field reader)."""
        return "none"

    def check_config(self, hf: dict, f, n_layers: int, where: str) -> None:
        """Refuse a config.json of this model_type that uses features quantgate does not run."""

    def lab_fields(self, f) -> dict:
        """ModelConfig fields only the sink-lab layout sets (where positions enter)."""
        return {}

    def ffn_fields(self, f) -> dict:
        """Our MLP's ModelConfig fields from config.json: the dense FFN width (a MoE layout adds its experts)."""
        return {"ffn_dim": f.int("intermediate_size", hi=1 << 20)}

    def cannot_hold(self, cfg: ModelConfig) -> str | None:
        """Why a model with `cfg` cannot be written in this layout (None: it can), from the row's flags."""
        if cfg.is_lab != self.lab:
            return ("a sink-lab model (learned absolute positions) can only be written in the quantgate_lab layout"
                    if cfg.is_lab else f"the {self.name} layout holds sink-lab models only")
        if cfg.is_moe != self.moe:
            return (f"a mixture-of-experts model can only be written in the qwen3_5_moe layout, not {self.name}"
                    if cfg.is_moe else f"the {self.name} layout holds mixture-of-experts models only")
        if cfg.is_hybrid and not self.hybrid_ok:
            return f"a hybrid (Gated DeltaNet) model can only be written in the qwen3_5 layout, not {self.name}"
        if (cfg.gate != "none") != self.gated and not (cfg.gate == "none" and self.zero_gate_baseline):
            return f"a model with gate '{cfg.gate}' cannot be written in the {self.name} layout"
        if cfg.partial_rotary != 1.0 and not self.partial_rotary_ok:
            return f"partial rotary ({cfg.partial_rotary}) can only be written in the qwen3_next or qwen3_5 layout"
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


class QuantgateLab(Official):
    """quantgate's sink-lab models (`quantgate demo --lab sinks`): the official layout's names and per-KV-group q|gate
    rows (or plain q rows for a baseline), QK-norm optional, plus `model.embed_positions.weight`, a learned absolute
    position table that replaces rope. Its own model_type, so no stock loader runs it as a rope model; quantgate
    runs it in PyTorch only."""
    name, model_type, architecture = "quantgate_lab", "quantgate_lab", "QuantgateLabForCausalLM"
    lab = True
    description = "quantgate's sink lab (learned absolute positions, no rope; PyTorch only)"

    def matches(self, hf: dict) -> bool:
        return hf.get("model_type") == self.model_type

    def cannot_hold(self, cfg: ModelConfig) -> str | None:
        if not cfg.is_lab:
            return f"the {self.name} layout holds sink-lab models only"
        if cfg.is_hybrid or cfg.is_moe:
            return "a sink-lab model is all full attention, with a dense MLP"
        if cfg.partial_rotary != 1.0:
            return "a sink-lab model has no rope, so no partial rotary"
        return None

    def gate_of(self, f) -> str:
        gate = f.hf.get("attn_output_gate", "none")
        if gate not in ("none", "headwise", "elementwise"):
            raise QuantgateError(f"{f.where}: attn_output_gate must be none, headwise or elementwise, got "
                                 f"{json.dumps(gate)[:40]}")
        return gate

    def lab_fields(self, f) -> dict:
        pos = f.hf.get("position_embedding", "learned")
        if pos != "learned":
            raise QuantgateError(f"{f.where}: position_embedding must be 'learned' in a quantgate_lab config, got "
                                 f"{json.dumps(pos)[:40]}")
        return {"positions": "learned"}

    def config_fields(self, cfg: ModelConfig) -> dict:
        return {"attn_output_gate": cfg.gate, "position_embedding": cfg.positions, "use_qk_norm": cfg.qk_norm}

    def split_q(self, w: torch.Tensor, cfg: ModelConfig):
        return (w, None) if cfg.gate == "none" else super().split_q(w, cfg)

    def fuse_q(self, q: torch.Tensor, g, cfg: ModelConfig):
        return q if g is None else super().fuse_q(q, g, cfg)


class Qwen3Next(Layout):
    name, model_type, architecture = "qwen3_next", "qwen3_next", "Qwen3NextForCausalLM"
    zero_centred_norms, default_head_dim, gated, partial_rotary_ok = True, 256, True, True
    default_partial_rotary = 0.25
    description = "Qwen3-Next (per-head interleaved [q | gate], zero-centred norms)"

    def gate_of(self, f) -> str:
        return "elementwise"  # per head [q_h | gate_h]: a headwise gate is written as hd equal rows

    def check_config(self, hf: dict, f, n_layers: int, where: str) -> None:
        _check_dense_full_attention(hf, f, n_layers, where)

    def config_fields(self, cfg: ModelConfig) -> dict:
        return {"partial_rotary_factor": cfg.partial_rotary, "layer_types": ["full_attention"] * cfg.n_layers,
                "mlp_only_layers": list(range(cfg.n_layers)), "num_experts": 0, "decoder_sparse_step": 1}

    def q_rows(self, cfg: ModelConfig) -> int:
        return 2 * cfg.n_heads * cfg.head_dim

    def split_q(self, w: torch.Tensor, cfg: ModelConfig):
        return _split_interleaved(w, cfg)

    def fuse_q(self, q: torch.Tensor, g: torch.Tensor, cfg: ModelConfig):
        return _fuse_interleaved(q, g, cfg)


class Qwen35(Qwen3Next):
    """Qwen3.5 / Qwen3.6 dense text models: Gated DeltaNet layers and gated full attention (the Qwen3-Next
    attention rows and norms), `rope_parameters`, and, for the multimodal `Qwen3_5ForConditionalGeneration`
    checkpoints, a nested text_config and text weights under model.language_model.* beside model.visual.* and mtp.*
    (read past: quantgate runs the text model). Written as the text-only `Qwen3_5ForCausalLM`."""
    name, model_type, architecture = "qwen3_5", "qwen3_5_text", "Qwen3_5ForCausalLM"
    hybrid_ok, zero_gate_baseline = True, True
    description = "Qwen3.5 (Gated DeltaNet + gated attention, per-head [q | gate], zero-centred norms)"

    multimodal_type = "qwen3_5"
    default_rope_theta = 1e7

    def matches(self, hf: dict) -> bool:
        return hf.get("model_type") in (self.multimodal_type, self.model_type)

    def text_config(self, hf: dict) -> dict:
        if hf.get("model_type") != self.multimodal_type:
            return hf
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise QuantgateError(f"config.json: a {self.multimodal_type} config must hold its language model in "
                                 f"text_config")
        tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        return {**text, "tie_word_embeddings": tie, "quantgate": hf.get("quantgate", text.get("quantgate", {}))}

    def disk_name(self, name: str, hf: dict) -> str:
        if hf.get("model_type") == self.multimodal_type and name.startswith("model."):
            return "model.language_model." + name[len("model."):]
        return name

    def skipped(self, name: str, hf: dict) -> str | None:
        for prefix, part in (("model.visual.", "vision tower"), ("mtp.", "multi-token-prediction head")):
            if name.startswith(prefix):
                return part
        return None

    def gate_of(self, f) -> str:
        q = f.hf.get("quantgate") if isinstance(f.hf.get("quantgate"), dict) else {}
        return "none" if q.get("gate") == "none" else "elementwise"

    def check_config(self, hf: dict, f, n_layers: int, where: str) -> None:
        if f.bool("attn_output_gate", True) is not True:
            raise QuantgateError(f"{where}: attn_output_gate false is not supported (Qwen3.5 gates its attention)")
        if hf.get("num_experts") or hf.get("num_experts_per_tok"):
            raise QuantgateError(f"{where}: a qwen3_5 config with num_experts is neither dense Qwen3.5 nor Qwen3.5-MoE "
                                 f"(whose config says model_type qwen3_5_moe)")

    def layer_types(self, hf: dict, f, n_layers: int, where: str) -> tuple | None:
        types = hf.get("layer_types")
        if types is None:  # transformers' rule: every full_attention_interval-th layer is full attention
            k = f.int("full_attention_interval", 4)
            return tuple("full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n_layers))
        if not isinstance(types, list) or len(types) != n_layers or \
                any(t not in ("full_attention", "linear_attention") for t in types):
            raise QuantgateError(f"{where}: layer_types must list 'full_attention' or 'linear_attention' for each of "
                                 f"the {n_layers} layers (got {json.dumps(types)[:80]})")
        return tuple(types)

    def config_fields(self, cfg: ModelConfig) -> dict:
        rotary = cfg.rotary_dim
        types = list(cfg.layer_types or ["full_attention"] * cfg.n_layers)
        return {"partial_rotary_factor": cfg.partial_rotary, "layer_types": types, "attn_output_gate": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                    "partial_rotary_factor": cfg.partial_rotary,
                                    "mrope_section": rope_sections(rotary)[:3], "mrope_interleaved": True},
                "linear_num_key_heads": cfg.linear_key_heads or 1, "linear_num_value_heads": cfg.linear_value_heads or 1,
                "linear_key_head_dim": cfg.linear_key_dim or 1, "linear_value_head_dim": cfg.linear_value_dim or 1,
                "linear_conv_kernel_dim": cfg.linear_conv_kernel}


class Qwen35Moe(Qwen35):
    """Qwen3.5-MoE / Qwen3.6-35B-A3B: the Qwen3.5 hybrid with every MLP a routed mixture of experts (softmax top-k,
    renormalised) plus a shared expert behind a sigmoid gate (HF `Qwen3_5MoeSparseMoeBlock`). Its config class has
    no dense intermediate_size; every layer is sparse (no mlp_only_layers)."""
    name, model_type, architecture = "qwen3_5_moe", "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"
    multimodal_type, moe, omitted_keys = "qwen3_5_moe", True, ("intermediate_size",)
    description = "Qwen3.5-MoE (Gated DeltaNet + gated attention, routed experts + gated shared expert)"

    def check_config(self, hf: dict, f, n_layers: int, where: str) -> None:
        if f.bool("attn_output_gate", True) is not True:
            raise QuantgateError(f"{where}: attn_output_gate false is not supported (Qwen3.5 gates its attention)")
        if hf.get("mlp_only_layers"):
            raise QuantgateError(f"{where}: mlp_only_layers (dense layers in a MoE model) is not supported")

    def lab_fields(self, f) -> dict:
        """ModelConfig fields only the sink-lab layout sets (where positions enter)."""
        return {}

    def ffn_fields(self, f) -> dict:
        E = f.int("num_experts", 256, hi=1 << 16)
        shared = f.int("shared_expert_intermediate_size", 512, hi=1 << 20)
        return {"n_experts": E, "n_experts_used": f.int("num_experts_per_tok", 8, hi=E),
                "expert_ffn_dim": f.int("moe_intermediate_size", 512, hi=1 << 20), "shared_expert_ffn_dim": shared,
                "ffn_dim": shared}  # unused by a MoE layer; the one dense width our config requires

    def config_fields(self, cfg: ModelConfig) -> dict:
        return {**super().config_fields(cfg), "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_used,
                "moe_intermediate_size": cfg.expert_ffn_dim,
                "shared_expert_intermediate_size": cfg.shared_expert_ffn_dim}


# Where config.json keeps rope settings: transformers 4 at the top level (rope_theta, partial_rotary_factor) with
# a `rope_scaling` object for the non-default kinds; transformers 5 in one `rope_parameters` object (rope_type,
# rope_theta, partial_rotary_factor, and the scaling fields), writing no top-level rope_theta at all.
ROPE_BLOCKS = ("rope_parameters", "rope_scaling")
ROPE_FIELDS = ("rope_theta", "partial_rotary_factor")
# rope_type values that leave text positions' rotation as the plain one: "default", and the multimodal M-RoPE kinds
# (Qwen3.5's interleaved mrope_section; text tokens carry the same t/h/w position, which is plain rope).
PLAIN_ROPE_TYPES = ("default", "mrope")
# What transformers does for the other kinds (rescaled positions or frequencies, attention scaling) quantgate's
# model, GGUF and ONNX writers do not carry; such a config is refused rather than run as plain rope.
SCALED_ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")


def read_rope(hf: dict, where: str) -> tuple[float | None, float | None]:
    """(rope_theta, partial_rotary_factor) as config.json states them, None where it states nothing, by transformers
    5's precedence (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict): the block (`rope_scaling` when set,
    else `rope_parameters`) over the top level. Files transformers 5 writes can disagree between the two: a
    Qwen3_5TextConfig saves its class default partial_rotary_factor 0.25 at the top level beside the 0.5 its
    rope_parameters hold and its model runs. A scaled rope (yarn, linear, ...) or a malformed block is refused in one
    line: running it as plain rope gives wrong logits with exit 0."""
    top = {k: _positive(hf[k], k, where) for k in ROPE_FIELDS if hf.get(k) is not None}
    blocks = {}
    for name in ROPE_BLOCKS:
        rp = hf.get(name)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            raise QuantgateError(f"{where}: {name} must be a JSON object, got {json.dumps(rp)[:60]}")
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind not in PLAIN_ROPE_TYPES:
            what = ("a scaled rope transformers implements and quantgate does not"
                    if kind in SCALED_ROPE_TYPES else "not a rope type quantgate knows")
            raise QuantgateError(f"{where}: {name}.rope_type {json.dumps(kind)[:40]} is {what} (quantgate runs "
                                 f"rope_type 'default' only)")
        nested = [k for k, v in rp.items() if isinstance(v, dict)]
        if nested:  # transformers 5's per-layer-type form ({"full_attention": {...}, ...})
            raise QuantgateError(f"{where}: {name} holds per-layer-type rope settings ({', '.join(nested)[:60]}), "
                                 f"which quantgate does not read")
        blocks[name] = {k: _positive(rp[k], f"{name}.{k}", where) for k in ROPE_FIELDS if rp.get(k) is not None}
    block = blocks.get("rope_scaling") if hf.get("rope_scaling") else blocks.get("rope_parameters", {})
    theta, partial = ({**top, **(block or {})}.get(k) for k in ROPE_FIELDS)
    if partial is not None and partial > 1:
        raise QuantgateError(f"{where}: partial_rotary_factor must be at most 1, got {partial:g}")
    return theta, partial


def _positive(v, name: str, where: str = "config.json") -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e30:
        raise QuantgateError(f"{where}: {name} must be a positive number, got {json.dumps(v)[:40]}")
    return float(v)


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


LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (Qwen3(), Official(), Qwen3Next(), Qwen35(), Qwen35Moe(),
                                                         QuantgateLab())}

DEFAULT_LAYOUT_FOR_GATE = {"none": "qwen3", "headwise": "official", "elementwise": "qwen3_next"}


def detect_layout(hf: dict) -> str:
    """The name of the layout whose row recognises this config.json ("" when none does)."""
    return next((lay.name for lay in LAYOUTS.values() if lay.matches(hf)), "")


def is_norm(our_name: str) -> bool:
    """A norm stored as w - 1 by zero-centred layouts (the GDN's gated norm is not one)."""
    return our_name.endswith(NORM_SUFFIXES) and not our_name.endswith(PLAIN_NORMS)
