"""What a quantgate GGUF holds, shared by the writer (`quantgate.export.gguf`) and the reader
(`quantgate.formats.gguf`): architecture names, tensor names, the shapes the header implies, and the identity
recurrent layer a qwen35 file carries (DESIGN section 3).

Every GGUF name comes from gguf-py's own constants (MODEL_ARCH_NAMES, TENSOR_NAMES over MODEL_TENSOR, the
per-architecture MODEL_TENSORS lists), the tables convert_hf_to_gguf.py maps through; what is written by hand
is only which of our tensors goes to which of theirs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

from ..errors import QuantgateError
from ..layouts import _fuse_interleaved, _split_interleaved
from ..model import ModelConfig, rope_sections

# gated: every real layer full attention, or a hybrid; moe: a Qwen3.5-MoE hybrid
ARCHS = {"baseline": MODEL_ARCH.QWEN3, "gated": MODEL_ARCH.QWEN35, "moe": MODEL_ARCH.QWEN35MOE}
ARCH_NAMES = {role: MODEL_ARCH_NAMES[a] for role, a in ARCHS.items()}  # "qwen3", "qwen35", "qwen35moe"
SUPPORTED_ARCHS = tuple(ARCH_NAMES.values())


def tensor_name(t: MODEL_TENSOR, suffix: str = ".weight") -> str:
    """gguf-py's name of `t` without the `blk.{bid}.` prefix: MODEL_TENSOR.ATTN_Q -> "attn_q.weight"."""
    return TENSOR_NAMES[t].removeprefix("blk.{bid}.") + suffix


def gguf_arch(cfg: ModelConfig) -> str:
    """qwen3 for an all-attention baseline; qwen35 for a gated model and for any hybrid (qwen3 has no GDN layers:
    a hybrid baseline is written as qwen35 with zero gate rows and attn_output doubled); qwen35moe for a MoE."""
    if cfg.is_moe:
        return ARCH_NAMES["moe"]
    return ARCH_NAMES["baseline" if cfg.gate == "none" and not cfg.is_hybrid else "gated"]


GLOBAL_TENSORS = {  # ours -> GGUF
    "embed_tokens.weight": tensor_name(MODEL_TENSOR.TOKEN_EMBD),
    "norm.weight": tensor_name(MODEL_TENSOR.OUTPUT_NORM),
    "lm_head.weight": tensor_name(MODEL_TENSOR.OUTPUT),  # omitted when tied: llama.cpp then reuses token_embd
}
LAYER_TENSORS = {  # ours (under layers.{i}.) -> GGUF (under blk.{i}.), both archs
    "input_layernorm.weight": tensor_name(MODEL_TENSOR.ATTN_NORM),
    "self_attn.k_proj.weight": tensor_name(MODEL_TENSOR.ATTN_K),
    "self_attn.v_proj.weight": tensor_name(MODEL_TENSOR.ATTN_V),
    "self_attn.o_proj.weight": tensor_name(MODEL_TENSOR.ATTN_OUT),
    "self_attn.q_norm.weight": tensor_name(MODEL_TENSOR.ATTN_Q_NORM),
    "self_attn.k_norm.weight": tensor_name(MODEL_TENSOR.ATTN_K_NORM),
    "mlp.gate_proj.weight": tensor_name(MODEL_TENSOR.FFN_GATE),
    "mlp.up_proj.weight": tensor_name(MODEL_TENSOR.FFN_UP),
    "mlp.down_proj.weight": tensor_name(MODEL_TENSOR.FFN_DOWN),
}
Q_TENSOR = tensor_name(MODEL_TENSOR.ATTN_Q)  # qwen3: q rows; qwen35: per head [q_h | gate_h]

# ours -> the GGUF tensor whose input is that Linear's input (for importance matrices and gate checks)
LINEAR_TO_GGUF = {
    "self_attn.q_proj": Q_TENSOR, "self_attn.g_proj": Q_TENSOR,
    **{ours.removesuffix(".weight"): theirs for ours, theirs in LAYER_TENSORS.items() if "proj" in ours},
}

# A Gated DeltaNet layer's own tensors: ours (under layers.{i}.linear_attn.) -> GGUF (under blk.{i}.), the names
# convert_hf_to_gguf.py maps Qwen3.5's to (tensor_mapping.py); its norms and MLP are the block's, as above.
GDN_TENSORS = {
    "in_proj_qkv.weight": tensor_name(MODEL_TENSOR.ATTN_QKV), "in_proj_z.weight": tensor_name(MODEL_TENSOR.ATTN_GATE),
    "in_proj_b.weight": tensor_name(MODEL_TENSOR.SSM_BETA), "in_proj_a.weight": tensor_name(MODEL_TENSOR.SSM_ALPHA),
    "conv1d.weight": tensor_name(MODEL_TENSOR.SSM_CONV1D), "dt_bias": tensor_name(MODEL_TENSOR.SSM_DT, ".bias"),
    "A_log": tensor_name(MODEL_TENSOR.SSM_A, ""), "norm.weight": tensor_name(MODEL_TENSOR.SSM_NORM),
    "out_proj.weight": tensor_name(MODEL_TENSOR.SSM_OUT),
}
BLOCK_TENSORS = {k: v for k, v in LAYER_TENSORS.items() if not k.startswith("self_attn.")}

# A mixture-of-experts MLP (qwen35moe): ours (under layers.{i}.mlp.) -> GGUF (under blk.{i}.); the routed experts'
# projections are stacked into one 3-D tensor each ([E, F, D] / [E, D, F] in PyTorch order), as the converter
# stacks HF's per-expert tensors (conversion/qwen.py, Qwen2MoeModel.modify_tensors).
MOE_TENSORS = {
    "gate.weight": tensor_name(MODEL_TENSOR.FFN_GATE_INP),
    "shared_expert.gate_proj.weight": tensor_name(MODEL_TENSOR.FFN_GATE_SHEXP),
    "shared_expert.up_proj.weight": tensor_name(MODEL_TENSOR.FFN_UP_SHEXP),
    "shared_expert.down_proj.weight": tensor_name(MODEL_TENSOR.FFN_DOWN_SHEXP),
    "shared_expert_gate.weight": tensor_name(MODEL_TENSOR.FFN_GATE_INP_SHEXP),
}
EXPERT_TENSORS = {"gate_proj.weight": tensor_name(MODEL_TENSOR.FFN_GATE_EXP),
                  "up_proj.weight": tensor_name(MODEL_TENSOR.FFN_UP_EXP),
                  "down_proj.weight": tensor_name(MODEL_TENSOR.FFN_DOWN_EXP)}
DENSE_MLP_TENSORS = {k: v for k, v in BLOCK_TENSORS.items() if k.startswith("mlp.")}
LINEAR_TO_GGUF.update({f"linear_attn.{ours.removesuffix('.weight')}": theirs for ours, theirs in GDN_TENSORS.items()
                       if ours.startswith(("in_proj", "out_proj"))})
LINEAR_TO_GGUF.update({f"mlp.{ours.removesuffix('.weight')}": theirs for ours, theirs in MOE_TENSORS.items()})


def moe_to_gguf(cfg: ModelConfig, sd, i: int):
    """(GGUF name, tensor) of MoE layer i: router, shared expert and its gate as they are, each routed projection
    stacked over the experts (one projection's experts held at a time)."""
    for ours, theirs in MOE_TENSORS.items():
        yield f"blk.{i}.{theirs}", sd[f"layers.{i}.mlp.{ours}"]
    for ours, theirs in EXPERT_TENSORS.items():
        yield f"blk.{i}.{theirs}", torch.stack([sd[f"layers.{i}.mlp.experts.{j}.{ours}"]
                                                for j in range(cfg.n_experts)])


def moe_from_gguf(cfg: ModelConfig, read, i: int) -> dict[str, torch.Tensor]:
    """The inverse of moe_to_gguf: our MoE parameters of layer i from `read(gguf name) -> fp32 tensor`."""
    out = {f"layers.{i}.mlp.{ours}": read(f"blk.{i}.{theirs}").reshape(-1, cfg.dim) for ours, theirs in
           MOE_TENSORS.items() if not ours.endswith("down_proj.weight")}
    out[f"layers.{i}.mlp.shared_expert.down_proj.weight"] = read(f"blk.{i}.{MOE_TENSORS['shared_expert.down_proj.weight']}")
    for ours, theirs in EXPERT_TENSORS.items():
        stacked = read(f"blk.{i}.{theirs}")
        out.update({f"layers.{i}.mlp.experts.{j}.{ours}": stacked[j].contiguous() for j in range(cfg.n_experts)})
    return out


# A checkpoint's multi-token-prediction head (Qwen3.5: `mtp.*`, beside the text model) as llama.cpp's converter
# writes it (conversion/qwen.py, _QwenMtpMixin): `mtp.layers.{j}.*` is a full-attention decoder block, written as
# block L + j with the trunk's tensor names (q_proj keeps its per-head [q | gate] rows); the projection and norms
# that feed it become `blk.{L}.nextn.*`. Zero-centred norms take + 1 like the trunk's. llama.cpp loads it only for
# speculative decoding (a draft context) and skips it otherwise.
MTP_BLOCK_TENSORS = {"post_attention_layernorm.weight": tensor_name(MODEL_TENSOR.ATTN_POST_NORM),
                     "self_attn.q_proj.weight": Q_TENSOR, **LAYER_TENSORS}
MTP_NEXTN_TENSORS = {"fc.weight": tensor_name(MODEL_TENSOR.NEXTN_EH_PROJ),
                     "pre_fc_norm_embedding.weight": tensor_name(MODEL_TENSOR.NEXTN_ENORM),
                     "pre_fc_norm_hidden.weight": tensor_name(MODEL_TENSOR.NEXTN_HNORM),
                     "norm.weight": tensor_name(MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM)}
# in a file, optional beside those (llama.cpp: TENSOR_NOT_REQUIRED); quantgate does not write them
MTP_OPTIONAL = (tensor_name(MODEL_TENSOR.NEXTN_EMBED_TOKENS), tensor_name(MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD))


# a MoE's MTP block has the routed MLP (qwen35moe's load_block_mtp): router and shared expert 1:1, the experts
# stacked (per-expert storage) or split (fused gate_up_proj; a fused down_proj is already the stacked tensor)
MTP_MOE_TENSORS = {f"mlp.{k}": v for k, v in MOE_TENSORS.items()}


def _mtp_rest(name: str) -> str | None:
    """`name` under the checkpoint's MTP head, without its `mtp.` (or `model.mtp.`) prefix; None elsewhere."""
    rest = name[len("model."):] if name.startswith("model.mtp.") else name
    return rest[len("mtp."):] if rest.startswith("mtp.") else None


def mtp_names(names: set[str], hf: dict, n_layers: int, moe: bool = False) -> dict[str, str]:
    """The checkpoint's MTP tensor -> its GGUF name (block n_layers + j); {} when the checkpoint has no MTP head.
    A name under mtp.* that the tables do not know is refused: it would be dropped silently otherwise. With `moe`,
    the block's MLP is the routed one; its experts are mtp_expert_recipes', not listed here."""
    block = dict(MTP_BLOCK_TENSORS)
    if moe:
        block = {k: v for k, v in block.items() if not k.startswith("mlp.")} | MTP_MOE_TENSORS
    out = {}
    for name in sorted(names):
        rest = _mtp_rest(name)
        if rest is None:
            continue
        parts = rest.split(".", 2)
        if moe and len(parts) == 3 and parts[2].startswith("mlp.experts."):
            continue
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdecimal() and parts[2] in block:
            out[name] = f"blk.{n_layers + int(parts[1])}.{block[parts[2]]}"
        elif rest in MTP_NEXTN_TENSORS:
            out[name] = f"blk.{n_layers}.{MTP_NEXTN_TENSORS[rest]}"
        else:
            raise QuantgateError(f"tensor {name}: a multi-token-prediction tensor quantgate does not know how to "
                                 f"write to GGUF (export with --no-mtp to leave the head out)")
    return out


def mtp_expert_recipes(names: set[str], n_layers: int, n_experts: int) -> dict[str, tuple[str, list[str]]]:
    """A MoE's MTP experts: GGUF name -> (how, the checkpoint tensors it is made of): "stack" the per-expert
    tensors in expert order, "gate"/"up" the first/second half of a fused gate_up_proj's rows, "whole" a fused
    down_proj. An expert tensor that fits neither form is refused."""
    per: dict[tuple[int, str], dict[int, str]] = {}
    out: dict[str, tuple[str, list[str]]] = {}
    for name in sorted(names):
        rest = _mtp_rest(name)
        if rest is None or ".mlp.experts." not in f".{rest}":
            continue
        parts = rest.split(".")  # layers.{j}.mlp.experts.{k}.{proj}.weight, or layers.{j}.mlp.experts.{fused}
        j = n_layers + int(parts[1]) if parts[1].isdecimal() else None
        if j is not None and len(parts) == 5 and parts[4] in ("gate_up_proj", "down_proj"):
            if parts[4] == "down_proj":
                out[f"blk.{j}.{EXPERT_TENSORS['down_proj.weight']}"] = ("whole", [name])
            else:
                for half, proj in (("gate", "gate_proj.weight"), ("up", "up_proj.weight")):
                    out[f"blk.{j}.{EXPERT_TENSORS[proj]}"] = (half, [name])
        elif j is not None and len(parts) == 7 and parts[4].isdecimal() and f"{parts[5]}.weight" in EXPERT_TENSORS:
            per.setdefault((j, f"{parts[5]}.weight"), {})[int(parts[4])] = name
        else:
            raise QuantgateError(f"tensor {name}: a multi-token-prediction expert tensor quantgate does not know how to "
                                 f"write to GGUF (export with --no-mtp to leave the head out)")
    for (j, proj), by_expert in per.items():
        if sorted(by_expert) != list(range(n_experts)):
            raise QuantgateError(f"the MTP head's experts of {proj} are incomplete ({len(by_expert)} of {n_experts})")
        out[f"blk.{j}.{EXPERT_TENSORS[proj]}"] = ("stack", [by_expert[k] for k in range(n_experts)])
    return out


def tiled_heads(cfg: ModelConfig) -> torch.Tensor:
    """The value-head order llama.cpp's qwen35 graph wants, as indices into ours (HF's): we keep value heads grouped
    by key head (head j reads key head j // r), ggml broadcasts key heads tiled (head p reads key head p % Hk), so
    position p holds our head (p % Hk) * r + p // Hk (the converter's V-head reorder; identity when r = 1)."""
    Hk, r = cfg.linear_key_heads, cfg.linear_value_heads // cfg.linear_key_heads
    p = torch.arange(cfg.linear_value_heads)
    return (p % Hk) * r + p // Hk


def gdn_to_gguf(cfg: ModelConfig, sd: dict, i: int) -> dict[str, torch.Tensor]:
    """GGUF tensors of GDN layer i: value heads reordered (tiled_heads) in every value-indexed axis, the conv
    squeezed to [C, K], A stored as -exp(A_log) (what llama.cpp multiplies by), norms as they are."""
    Hk, dk, dv = cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_dim
    order = tiled_heads(cfg)
    rows = (order[:, None] * dv + torch.arange(dv)).reshape(-1)  # value-channel order
    qkv_rows = torch.cat([torch.arange(2 * Hk * dk), 2 * Hk * dk + rows])
    w = {k: sd[f"layers.{i}.linear_attn.{k}"].detach().float() for k in GDN_TENSORS}
    ours = {"in_proj_qkv.weight": w["in_proj_qkv.weight"][qkv_rows], "in_proj_z.weight": w["in_proj_z.weight"][rows],
            "in_proj_b.weight": w["in_proj_b.weight"][order], "in_proj_a.weight": w["in_proj_a.weight"][order],
            "conv1d.weight": w["conv1d.weight"][:, 0][qkv_rows], "dt_bias": w["dt_bias"][order],
            "A_log": -w["A_log"][order].exp(), "norm.weight": w["norm.weight"],
            "out_proj.weight": w["out_proj.weight"][:, rows]}
    return {f"blk.{i}.{GDN_TENSORS[k]}": t for k, t in ours.items()}


def gdn_from_gguf(cfg: ModelConfig, read, i: int) -> dict[str, torch.Tensor]:
    """The inverse of gdn_to_gguf: our GDN parameters of layer i from `read(gguf name) -> fp32 tensor`."""
    dk, dv, Hk = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_key_heads
    back = torch.argsort(tiled_heads(cfg))
    rows = (back[:, None] * dv + torch.arange(dv)).reshape(-1)
    qkv_rows = torch.cat([torch.arange(2 * Hk * dk), 2 * Hk * dk + rows])
    t = {k: read(f"blk.{i}.{n}") for k, n in GDN_TENSORS.items()}
    ours = {"in_proj_qkv.weight": t["in_proj_qkv.weight"][qkv_rows], "in_proj_z.weight": t["in_proj_z.weight"][rows],
            "in_proj_b.weight": t["in_proj_b.weight"][back], "in_proj_a.weight": t["in_proj_a.weight"][back],
            "conv1d.weight": t["conv1d.weight"][qkv_rows][:, None], "dt_bias": t["dt_bias"][back],
            "A_log": (-t["A_log"][back]).log(), "norm.weight": t["norm.weight"],
            "out_proj.weight": t["out_proj.weight"][:, rows]}
    return {f"layers.{i}.linear_attn.{k}": v.contiguous() for k, v in ours.items()}


# the identity recurrent layer's tensors (under blk.{L}.), in the order they are written
IDENTITY_TENSORS = tuple(tensor_name(t, s) for t, s in (
    (MODEL_TENSOR.ATTN_NORM, ".weight"), (MODEL_TENSOR.ATTN_POST_NORM, ".weight"), (MODEL_TENSOR.ATTN_QKV, ".weight"),
    (MODEL_TENSOR.ATTN_GATE, ".weight"), (MODEL_TENSOR.SSM_CONV1D, ".weight"), (MODEL_TENSOR.SSM_BETA, ".weight"),
    (MODEL_TENSOR.SSM_ALPHA, ".weight"), (MODEL_TENSOR.SSM_DT, ".bias"), (MODEL_TENSOR.SSM_A, ""),
    (MODEL_TENSOR.SSM_NORM, ".weight"), (MODEL_TENSOR.SSM_OUT, ".weight"), (MODEL_TENSOR.FFN_GATE, ".weight"),
    (MODEL_TENSOR.FFN_UP, ".weight"), (MODEL_TENSOR.FFN_DOWN, ".weight")))

# The HF pre-tokenizer that llama.cpp's `tokenizer.ggml.pre` "qwen2" reproduces (llama.cpp's own table).
QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
# Qwen3.5's (transformers' PRETOKENIZE_REGEX): Qwen2's with combining marks \p{M} in letter runs; llama.cpp "qwen35".
# Its tokenizer.json also NFC-normalizes, which llama.cpp does not: text that is not NFC may tokenize differently.
QWEN35_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+"
                "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
SPLIT_PRE_TOKENIZERS = {"qwen2": QWEN2_SPLIT, "qwen35": QWEN35_SPLIT}  # llama.cpp pre name -> the HF Split regex


def arch_tensors(arch: str) -> set[str]:
    """Every per-layer and global tensor name gguf-py lists for `arch` (without blk prefixes or suffixes)."""
    a = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    return {TENSOR_NAMES[t].removeprefix("blk.{bid}.") for t in MODEL_TENSORS[a]}


@dataclass
class IdentityLayerShape:
    """The one recurrent (gated delta net) layer llama.cpp's qwen35 needs (see `identity_recurrent_layer`).

    state = head_k_dim, inner = value width, heads = value heads (dt_rank), groups = key heads. Its MLP
    has the model's width: llama.cpp's qwen35 reads one feed_forward_length for all layers (a per-layer
    array fails its shape check). Measured on the small twins, 1 thread (benchmarks/results/gguf_twins.md):
    256x256 (DESIGN's first choice) costs +20..40% prefill and decode time; 32x32 and 1x1 cost 0..27%
    depending on the run (within this machine's noise of each other), so the default is 1x1, the smallest
    file; its few 1-wide rows stay unquantized.
    """
    state: int = 1
    inner: int = 1
    heads: int = 1
    groups: int = 1
    conv_kernel: int = 4


def identity_recurrent_layer(cfg: ModelConfig, shape: IdentityLayerShape, i: int) -> dict[str, torch.Tensor]:
    """Workaround for a llama.cpp defect, kept in this one place.

    qwen35 with zero recurrent layers loads but aborts the process on the first decode (an unused
    recurrent-state input is never allocated; GGML_ASSERT, not catchable). So the file gets one extra
    gated-delta-net layer after the real ones whose output projections (`ssm_out`, `ffn_down`) are zero:
    it adds exactly 0 to the residual stream. Its other weights are zero too, so no NaN can arise in it.
    Its cost (compute and bytes) is measured in benchmarks/gguf_twins.py.
    """
    D = cfg.dim
    key_dim, ffn = shape.state * shape.groups, cfg.ffn_dim
    z = torch.zeros
    tensors = (torch.ones(D), torch.ones(D), z(2 * key_dim + shape.inner, D), z(shape.inner, D),
               z(2 * key_dim + shape.inner, shape.conv_kernel), z(shape.heads, D), z(shape.heads, D), z(shape.heads),
               z(shape.heads), torch.ones(shape.inner // shape.heads), z(D, shape.inner), z(ffn, D), z(ffn, D),
               z(D, ffn))
    return {f"blk.{i}.{n}": t for n, t in zip(IDENTITY_TENSORS, tensors)}


# --- the architectures, one row each ---------------------------------------------------------------------------

class GgufArch:
    """One llama.cpp architecture quantgate writes and reads, a row carrying its behaviour (convert_hf_to_gguf.py's
    per-architecture classes): which of our models it holds, how q and gate rows sit in `attn_q`, its norm names,
    the header keys of its own, and what a file of it reads back as. Writer and reader ask the row."""
    name: str
    post_attention_norm: str
    exported_gates: tuple[str, ...]   # quantgate.gate values a file of this arch may carry
    read_gate: str                    # our gate mode for a model read back from it
    identity_layers: bool = False     # whether the file carries the identity recurrent layer(s)

    def cannot_hold(self, cfg: ModelConfig) -> str | None:
        return None

    def q_rows(self, n_heads: int, head_dim: int) -> int:
        return n_heads * head_dim

    def fuse_q(self, q: torch.Tensor, g: torch.Tensor | None, cfg: ModelConfig) -> torch.Tensor:
        return q

    def split_q(self, q: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
        return q, None

    def write_header(self, w, cfg: ModelConfig, shape: IdentityLayerShape, n_identity: int, n_mtp: int = 0) -> None:
        """The header keys only this architecture has (`w`: gguf-py's GGUFWriter); `n_mtp` MTP blocks follow."""
        if n_mtp:
            raise QuantgateError(f"llama.cpp's {self.name} has no multi-token-prediction block")


class Qwen3Arch(GgufArch):
    name, post_attention_norm = ARCH_NAMES["baseline"], tensor_name(MODEL_TENSOR.FFN_NORM)
    exported_gates, read_gate = ("none",), "none"

    def cannot_hold(self, cfg: ModelConfig) -> str | None:
        if cfg.partial_rotary != 1.0:
            return "llama.cpp's qwen3 rotates the whole head: a baseline with partial rotary cannot be exported"
        return None


class Qwen35Arch(GgufArch):
    """Qwen3.5's text decoder with every real layer full attention: llama.cpp's graph splits `attn_q` per head
    into [q_h | gate_h] and multiplies attention by sigmoid(gate) before `attn_output` (DESIGN section 3)."""
    name, post_attention_norm = ARCH_NAMES["gated"], tensor_name(MODEL_TENSOR.ATTN_POST_NORM)
    # llama.cpp's gate is elementwise; "none": a hybrid baseline, written with zero gate rows and attn_output doubled
    exported_gates, read_gate = ("headwise", "elementwise", "none"), "elementwise"
    identity_layers = True  # for all-attention models (a hybrid's own GDN layers make them unnecessary)

    def cannot_hold(self, cfg: ModelConfig) -> str | None:
        if cfg.is_hybrid and cfg.linear_key_dim != cfg.linear_value_dim:
            return (f"llama.cpp's qwen35 reads one ssm.state_size for both GDN head sizes; this model has key heads "
                    f"of {cfg.linear_key_dim} and value heads of {cfg.linear_value_dim}")
        return None

    def q_rows(self, n_heads: int, head_dim: int) -> int:
        return 2 * n_heads * head_dim

    def fuse_q(self, q: torch.Tensor, g: torch.Tensor | None, cfg: ModelConfig) -> torch.Tensor:
        return _fuse_interleaved(q, g, cfg)  # a headwise gate becomes hd equal rows per head

    def split_q(self, q: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _split_interleaved(q, cfg)

    def write_header(self, w, cfg: ModelConfig, shape: IdentityLayerShape, n_identity: int, n_mtp: int = 0) -> None:
        w.add_rope_dimension_sections(rope_sections(cfg.rotary_dim))
        if cfg.is_hybrid:  # the real GDN layers' shapes (convert_hf_to_gguf.py's keys), no identity layer
            w.add_ssm_conv_kernel(cfg.linear_conv_kernel)
            w.add_ssm_inner_size(cfg.linear_value_heads * cfg.linear_value_dim)
            w.add_ssm_state_size(cfg.linear_key_dim)
            w.add_ssm_time_step_rank(cfg.linear_value_heads)
            w.add_ssm_group_count(cfg.linear_key_heads)
            w.add_array(f"{self.name}.attention.recurrent_layers",
                        [t == "linear_attention" for t in cfg.layer_types] + [False] * n_mtp)  # MTP: attention
            if n_mtp:
                w.add_nextn_predict_layers(n_mtp)
            return
        if n_mtp:
            raise QuantgateError("an MTP head is written only for hybrid (Qwen3.5) checkpoints")
        w.add_ssm_conv_kernel(shape.conv_kernel)
        w.add_ssm_inner_size(shape.inner)
        w.add_ssm_state_size(shape.state)
        w.add_ssm_time_step_rank(shape.heads)
        w.add_ssm_group_count(shape.groups)
        w.add_full_attention_interval(1)
        if n_identity:  # gguf 0.19 has no helper for this key; llama.cpp reads it as a bool array
            w.add_array(f"{self.name}.attention.recurrent_layers", [False] * cfg.n_layers + [True] * n_identity)


class Qwen35MoeArch(Qwen35Arch):
    """Qwen3.5-MoE's text decoder (llama.cpp qwen35moe): the qwen35 hybrid with every MLP a routed mixture of
    experts (ffn_gate_inp, ffn_{gate,up,down}_exps) plus a shared expert behind its sigmoid gate
    (ffn_gate_inp_shexp). llama.cpp routes with softmax, top expert_used_count, renormalised (build_moe_ffn with
    norm_w), as transformers does."""
    name = ARCH_NAMES["moe"]
    identity_layers = False

    def cannot_hold(self, cfg: ModelConfig) -> str | None:
        if not cfg.is_hybrid:
            return ("a mixture-of-experts model without Gated DeltaNet layers has no llama.cpp architecture quantgate "
                    "writes (qwen35moe is a hybrid)")
        return super().cannot_hold(cfg)

    def write_header(self, w, cfg: ModelConfig, shape: IdentityLayerShape, n_identity: int, n_mtp: int = 0) -> None:
        super().write_header(w, cfg, shape, n_identity, n_mtp)
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.n_experts_used)
        w.add_expert_feed_forward_length(cfg.expert_ffn_dim)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_ffn_dim)


GGUF_ARCHS: dict[str, GgufArch] = {a.name: a for a in (Qwen3Arch(), Qwen35Arch(), Qwen35MoeArch())}
POST_ATTENTION_NORM = {name: a.post_attention_norm for name, a in GGUF_ARCHS.items()}


def arch_of(cfg: ModelConfig) -> GgufArch:
    """The row our model is written as: a baseline as qwen3, a gated model as qwen35."""
    return GGUF_ARCHS[gguf_arch(cfg)]


def expected_tensor_names(arch: str, n_layers: int, tied: bool, identity: int, recurrent: tuple = (),
                          nextn: int = 0) -> set[str]:
    """Every tensor a file of this shape holds (what the exporter writes and llama.cpp's loader wants); `recurrent`:
    the real layers that are Gated DeltaNet (a hybrid); `nextn`: MTP blocks after them (MTP_OPTIONAL aside)."""
    names = {GLOBAL_TENSORS["embed_tokens.weight"], GLOBAL_TENSORS["norm.weight"]}
    names |= set() if tied else {GLOBAL_TENSORS["lm_head.weight"]}
    per_layer = set(LAYER_TENSORS.values()) | {POST_ATTENTION_NORM[arch], Q_TENSOR}
    per_gdn = set(BLOCK_TENSORS.values()) | {POST_ATTENTION_NORM[arch]} | set(GDN_TENSORS.values())
    if arch == ARCH_NAMES["moe"]:  # every MLP (the MTP block's too) is the routed one
        moe = set(MOE_TENSORS.values()) | set(EXPERT_TENSORS.values())
        per_layer = per_layer - set(DENSE_MLP_TENSORS.values()) | moe
        per_gdn = per_gdn - set(DENSE_MLP_TENSORS.values()) | moe
    names |= {f"blk.{i}.{n}" for i in range(n_layers) for n in (per_gdn if i in recurrent else per_layer)}
    names |= {f"blk.{n_layers + k}.{n}" for k in range(identity) for n in IDENTITY_TENSORS}
    first = n_layers + identity
    mtp_block = set(MTP_BLOCK_TENSORS.values())
    if arch == ARCH_NAMES["moe"]:
        mtp_block = mtp_block - set(DENSE_MLP_TENSORS.values()) | set(MOE_TENSORS.values()) | set(EXPERT_TENSORS.values())
    names |= {f"blk.{first + j}.{n}" for j in range(nextn) for n in mtp_block}
    names |= {f"blk.{first}.{n}" for n in MTP_NEXTN_TENSORS.values()} if nextn else set()
    return names


def expected_tensor_shapes(arch: str, n_layers: int, identity: int, hp: dict, recurrent: tuple = (),
                           nextn: int = 0) -> dict[str, tuple]:
    """Tensor name -> PyTorch-order shape ([out, in]) that the header's hyperparameters imply (`hp`: vocab, dim,
    heads, kv_heads, head_dim, ffn, and ssm_* for the identity layers): what the exporter writes, so a reader can
    refuse a file whose tensors disagree with its header before llama.cpp sees it."""
    V, D, H, KV, hd, F = (hp[k] for k in ("vocab", "dim", "heads", "kv_heads", "head_dim", "ffn"))
    g = GLOBAL_TENSORS
    shapes = {g["embed_tokens.weight"]: (V, D), g["norm.weight"]: (D,), g["lm_head.weight"]: (V, D)}
    q_rows = GGUF_ARCHS[arch].q_rows(H, hd)
    ours = {"input_layernorm.weight": (D,), "self_attn.k_proj.weight": (KV * hd, D),
            "self_attn.v_proj.weight": (KV * hd, D), "self_attn.o_proj.weight": (D, H * hd),
            "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,), "mlp.gate_proj.weight": (F, D),
            "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)}
    per_layer = {LAYER_TENSORS[k]: sh for k, sh in ours.items()} | {POST_ATTENTION_NORM[arch]: (D,), Q_TENSOR: (q_rows, D)}
    shapes |= {f"blk.{i}.{n}": sh for i in range(n_layers) if i not in recurrent for n, sh in per_layer.items()}
    first = n_layers + identity  # MTP blocks: attention blocks, and the projection of [embedding | hidden] into one
    shapes |= {f"blk.{first + j}.{n}": sh for j in range(nextn) for n, sh in per_layer.items()}
    if nextn:
        shapes |= {f"blk.{first}.{n}": (D, 2 * D) if n == MTP_NEXTN_TENSORS["fc.weight"] else (D,)
                   for n in MTP_NEXTN_TENSORS.values()}
    if identity or recurrent:  # a real GDN layer has the identity layer's shapes, which the ssm keys give
        shape = IdentityLayerShape(hp["ssm_state"], hp["ssm_inner"], hp["ssm_heads"], hp["ssm_groups"], hp["ssm_conv"])
        cfg = ModelConfig(vocab_size=V, dim=D, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2, ffn_dim=F,
                          bos_id=0, eos_id=0, pad_id=0)
        with torch.device("meta"):
            for i in (*recurrent, *range(n_layers, n_layers + identity)):
                shapes |= {n: tuple(t.shape) for n, t in identity_recurrent_layer(cfg, shape, i).items()}
    if arch == ARCH_NAMES["moe"]:  # the routed MLP in place of the dense one, in every block
        E, Fe, Fs = hp["experts"], hp["expert_ffn"], hp["shared_ffn"]
        moe = {MOE_TENSORS["gate.weight"]: (E, D), MOE_TENSORS["shared_expert.gate_proj.weight"]: (Fs, D),
               MOE_TENSORS["shared_expert.up_proj.weight"]: (Fs, D), MOE_TENSORS["shared_expert.down_proj.weight"]: (D, Fs),
               MOE_TENSORS["shared_expert_gate.weight"]: (1, D), EXPERT_TENSORS["gate_proj.weight"]: (E, Fe, D),
               EXPERT_TENSORS["up_proj.weight"]: (E, Fe, D), EXPERT_TENSORS["down_proj.weight"]: (E, D, Fe)}
        dense = set(DENSE_MLP_TENSORS.values())
        shapes = {n: sh for n, sh in shapes.items() if n.split(".", 2)[-1] not in dense}
        shapes |= {f"blk.{i}.{n}": sh for i in range(n_layers + nextn) for n, sh in moe.items()}
    return shapes
