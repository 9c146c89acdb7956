"""`quantgate info`: what a model directory holds, without running it."""
from __future__ import annotations

import onnx
import torch

from .formats import artifact_kind, inspect_gguf, load_checkpoint
from .formats.gguf import gguf_config, open_reader, tokenizer_from_gguf
from .formats.onnx import read_export_header
from .formats.onnx_io import onnx_bytes
from .formats.hf import open_hf
from .model import Model
from .tokenizer import load_tokenizer
from .quant.simulate import block_bits_per_weight


def cache_bytes(cfg) -> dict:
    """What a sequence holds while generating: an fp16 KV cache on the full-attention layers (per token), and a
    hybrid's Gated DeltaNet layers' fixed fp32 state (recurrent [Hv, dk, dv] and conv [C, K-1]), whatever the
    length."""
    n_lin = (cfg.layer_types or ()).count("linear_attention")
    state = 4 * n_lin * (cfg.linear_value_heads * cfg.linear_key_dim * cfg.linear_value_dim
                         + cfg.linear_conv_dim * (cfg.linear_conv_kernel - 1)) if n_lin else 0
    return {"kv_cache_bytes_per_token": 2 * 2 * cfg.n_kv_heads * cfg.head_dim * (cfg.n_layers - n_lin),
            "recurrent_state_bytes": state}


def _header(path: str):
    """(config, layout name, parameter count, tokenizer, file facts) of any artifact, from headers alone where the
    format allows: a model directory's config.json and safetensors headers, a GGUF's metadata and tensor table
    (nothing is dequantized, so `info` answers at once for a model of any size). An ONNX export is read back (its
    config alone does not say how it was quantized); so is a quantgate-quantized directory, whose stored bits per
    weight live in its wrapped Linears."""
    kind = artifact_kind(path)
    if kind == "gguf":
        g = inspect_gguf(path)
        reader = open_reader(path)
        tok = tokenizer_from_gguf(reader)
        cfg = gguf_config(g, {t.name for t in reader.tensors}, tok)
        with torch.device("meta"):
            n = Model(cfg).num_params()
        facts = {"gguf": {"arch": g.arch, "file_type": g.file_type, "bytes": g.n_bytes,
                          "bits_per_weight": round(g.bits_per_weight, 3), "exported_gate": g.gate,
                          "source_layout": g.source_layout, "identity_layers": g.n_blocks - g.n_layers - g.nextn_layers,
                          "mtp_layers": g.nextn_layers}}
        alloc = _allocation(reader)
        if alloc:
            facts["allocation"] = alloc
        return cfg, f"gguf:{g.arch}", n, tok, facts
    if kind == "onnx":
        return _onnx_header(path)
    if kind == "hf":
        ckpt = open_hf(path)
        if "quant_scheme" not in ckpt.cfg.extra:
            facts = {"weights": {"stored_bytes": ckpt.stored_bytes(), "largest_tensor_bytes": ckpt.largest_tensor_bytes(),
                                 "dtypes": ", ".join(sorted({ckpt.src.header(t)[1] for t in ckpt.plan}))}}
            return ckpt.cfg, ckpt.layout.name, ckpt.num_params(), ckpt.tokenizer, facts
    loaded = load_checkpoint(path)
    facts = {}
    if "quant_scheme" in loaded.model.cfg.extra:  # a quantgate-quantized checkpoint: the bits its Linears stored
        facts = {"quantization": {"scheme": loaded.model.cfg.extra["quant_scheme"].get("name"),
                                  "block_bits_per_weight": block_bits_per_weight(loaded.model)}}
    return loaded.model.cfg, loaded.layout, loaded.model.num_params(), loaded.tokenizer, facts


def _allocation(reader) -> dict | None:
    """What quantgate's allocator recorded in a GGUF it wrote (quantgate.allocation.*): the target, the predicted
    KLD and how many tensors took each type."""
    prefix = "quantgate.allocation."
    fields = {k[len(prefix):]: f.contents() for k, f in reader.fields.items() if k.startswith(prefix)}
    if "tensor_types" not in fields:
        return None
    counts: dict[str, int] = {}
    for item in fields.pop("tensor_types"):
        t = str(item).rpartition("=")[2]
        counts[t] = counts.get(t, 0) + 1
    return {**fields, "tensor_type_counts": dict(sorted(counts.items()))}


def _onnx_header(path: str):
    """An ONNX export's facts from its graph (weights not loaded) and the files beside it: the source's config and
    parameter count (its tying included), the scheme, file bytes and bits per weight, and what the logits read."""
    onnx_path, model_dir, cfg, meta = read_export_header(path)
    graph = onnx.load(str(onnx_path), load_external_data=False)
    with torch.device("meta"):
        n = Model(cfg).num_params()
    scheme = (meta.get("quantization") or {}).get("scheme") or meta.get("dtype", "fp32")
    size = onnx_bytes(model_dir)
    facts = {"onnx": {"scheme": scheme, "graph": meta.get("graph", "standard"), "bytes": size,
                      "bits_per_weight": round(8 * size / n, 3), "logits": _onnx_logits(cfg, graph, scheme)}}
    tok = None
    if (model_dir / "tokenizer.json").is_file():
        tok = load_tokenizer(model_dir, meta.get("bos_id", cfg.bos_id), meta.get("eos_id", cfg.eos_id))
    return cfg, f"onnx:{scheme}", n, tok, facts


def _onnx_logits(cfg, graph, scheme: str) -> str:
    """What the export's logits MatMul reads, in words: the source's own head, the tied table, or the copy of the
    tied table quantize_onnx adds (counted once in the parameters, as the source has it)."""
    if not cfg.tie_embeddings:
        return "the source's own output head (untied)"
    if any(t.name.startswith("model.lm_head.weight_T") for t in graph.graph.initializer):
        return (f"a {scheme} copy of the tied embedding table, beside the table the lookup reads (the source is tied; "
                f"its parameters are counted once)")
    if any(nd.op_type == "GatherBlockQuantized" for nd in graph.graph.node):
        return f"the tied embedding table, one packed {scheme} table shared with the lookup"
    return "the tied embedding table (shared with the lookup)"


def header_config(path):
    """The ModelConfig of any artifact, from its headers (nothing loaded)."""
    return _header(str(path))[0]


def param_count(path) -> int:
    """Parameters of any artifact, from its headers where the format allows (as `info` counts them)."""
    return _header(str(path))[2]


def model_info(path: str) -> dict:
    cfg, layout, n_params, tok, facts = _header(path)
    hybrid = {}
    if cfg.is_hybrid:  # which layers are Gated DeltaNet, and their shapes
        n_lin = cfg.layer_types.count("linear_attention")
        hybrid = {"layer_types": f"{n_lin} linear_attention (Gated DeltaNet), {cfg.n_layers - n_lin} full_attention "
                                 f"(layers {', '.join(map(str, cfg.full_attention_layers))})",
                  "gated_deltanet": {"key_heads": cfg.linear_key_heads, "value_heads": cfg.linear_value_heads,
                                     "key_dim": cfg.linear_key_dim, "value_dim": cfg.linear_value_dim,
                                     "conv_kernel": cfg.linear_conv_kernel},
                  **cache_bytes(cfg)}
    if cfg.is_moe:  # routed experts: what each token runs is the active part
        D, E, k = cfg.dim, cfg.n_experts, cfg.n_experts_used
        per_expert = 3 * D * cfg.expert_ffn_dim
        hybrid["experts"] = {"routed": E, "per_token": k, "expert_ffn": cfg.expert_ffn_dim,
                             "shared_expert_ffn": cfg.shared_expert_ffn_dim,
                             "active_params": n_params - cfg.n_layers * (E - k) * per_expert}
    skipped = cfg.extra.get("skipped_tensors")
    if skipped:
        hybrid["not_read"] = ", ".join(f"{part} ({n} tensors)" for part, n in sorted(skipped.items()))
    return {**facts,
        "path": str(path), "layout": layout, "gate": cfg.gate,
        "params": n_params,
        "dims": {"vocab": cfg.vocab_size, "dim": cfg.dim, "layers": cfg.n_layers, "heads": cfg.n_heads,
                 "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "ffn": cfg.ffn_dim,
                 "rotary_dim": cfg.rotary_dim, "gate_rows": cfg.gate_dim},
        **hybrid, "rope_theta": cfg.rope_theta, "qk_norm": cfg.qk_norm, "tied_embeddings": cfg.tie_embeddings,
        "tokenizer": None if tok is None else {"vocab": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id},
        "provenance": cfg.extra,
    }
