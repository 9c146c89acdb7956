"""`quantgate info`: what a model directory holds, without running it."""
from __future__ import annotations

from .formats import artifact_kind, inspect_gguf, load_checkpoint
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


def model_info(path: str) -> dict:
    loaded = load_checkpoint(path)
    cfg = loaded.model.cfg
    gguf = {}
    if artifact_kind(path) == "gguf":
        g = inspect_gguf(path)
        gguf = {"gguf": {"arch": g.arch, "file_type": g.file_type, "bytes": g.n_bytes,
                         "bits_per_weight": round(g.bits_per_weight, 3), "exported_gate": g.gate,
                         "source_layout": g.source_layout, "identity_layers": g.n_blocks - g.n_layers}}
    quant = {}
    if "quant_scheme" in cfg.extra:  # a quantgate-quantized checkpoint: the bits its Linears stored
        quant = {"quantization": {"scheme": cfg.extra["quant_scheme"].get("name"),
                                  "block_bits_per_weight": block_bits_per_weight(loaded.model)}}
    hybrid = {}
    if cfg.is_hybrid:  # which layers are Gated DeltaNet, and their shapes
        n_lin = cfg.layer_types.count("linear_attention")
        hybrid = {"layer_types": f"{n_lin} linear_attention (Gated DeltaNet), {cfg.n_layers - n_lin} full_attention "
                                 f"(layers {', '.join(map(str, cfg.full_attention_layers))})",
                  "gated_deltanet": {"key_heads": cfg.linear_key_heads, "value_heads": cfg.linear_value_heads,
                                     "key_dim": cfg.linear_key_dim, "value_dim": cfg.linear_value_dim,
                                     "conv_kernel": cfg.linear_conv_kernel},
                  **cache_bytes(cfg)}
    skipped = cfg.extra.get("skipped_tensors")
    if skipped:
        hybrid["not_read"] = ", ".join(f"{part} ({n} tensors)" for part, n in sorted(skipped.items()))
    return {**gguf, **quant,
        "path": str(path), "layout": loaded.layout, "gate": cfg.gate,
        "params": loaded.model.num_params(),
        "dims": {"vocab": cfg.vocab_size, "dim": cfg.dim, "layers": cfg.n_layers, "heads": cfg.n_heads,
                 "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "ffn": cfg.ffn_dim,
                 "rotary_dim": cfg.rotary_dim, "gate_rows": cfg.gate_dim},
        **hybrid, "rope_theta": cfg.rope_theta, "qk_norm": cfg.qk_norm, "tied_embeddings": cfg.tie_embeddings,
        "tokenizer": None if loaded.tokenizer is None else
        {"vocab": loaded.tokenizer.vocab_size, "bos_id": loaded.tokenizer.bos_id, "eos_id": loaded.tokenizer.eos_id},
        "provenance": cfg.extra,
    }
