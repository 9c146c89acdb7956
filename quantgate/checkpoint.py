"""Read and write model directories (config.json + safetensors + tokenizer.json) in every layout.

Reading validates everything a broken or foreign checkpoint can get wrong (unknown architecture,
missing or mis-shaped tensors, NaN weights, tokenizer larger than the embedding) and raises one
QuantgateError naming the file or tensor. Writing is atomic. Only safetensors are read: a pickle
from a user is never loaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import __version__
from .errors import QuantgateError
from .fsio import atomic_dir, check_not_input
from .layouts import (DEFAULT_LAYOUT_FOR_GATE, GLOBAL_NAMES, LAYER_NAMES, LAYOUTS, Q_NAME, Layout,
                      detect_layout, is_norm)
from .model import Model, ModelConfig
from .tokenizer import Tokenizer, load_tokenizer


@dataclass
class Loaded:
    model: Model
    tokenizer: Tokenizer | None
    layout: str
    path: Path


# --- config.json <-> ModelConfig --------------------------------------------------------------------

def config_from_hf(hf: dict, path: Path) -> tuple[ModelConfig, Layout]:
    layout_name = detect_layout(hf)
    if not layout_name:
        raise QuantgateError(f"{path}/config.json: model_type {hf.get('model_type')!r} is not supported "
                             f"(supported: qwen3, qwen3 with attn_output_gate, qwen3_next)")
    layout = LAYOUTS[layout_name]
    try:
        L = int(hf["num_hidden_layers"])
        H = int(hf["num_attention_heads"])
        # absent fields take transformers' own defaults for that model_type
        hd = int(hf.get("head_dim") or (256 if layout_name == "qwen3_next" else 128))
        if hf.get("rope_scaling"):
            raise QuantgateError(f"{path}/config.json: rope_scaling {hf['rope_scaling']} is not supported")
        if hf.get("attention_bias") or hf.get("qkv_bias"):
            raise QuantgateError(f"{path}/config.json: attention biases are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise QuantgateError(f"{path}/config.json: hidden_act {hf['hidden_act']!r} is not supported")
        if layout_name == "qwen3_next":
            _check_dense_full_attention(hf, L, path)
            gate = "elementwise"
        elif layout_name == "official":
            gate = "headwise" if hf.get("headwise_attn_output_gate") else "elementwise"
        else:
            gate = "none"
        eos = hf.get("eos_token_id", 1)
        eos = eos[0] if isinstance(eos, list) else eos
        cfg = ModelConfig(
            vocab_size=int(hf["vocab_size"]), dim=int(hf["hidden_size"]), n_layers=L, n_heads=H,
            n_kv_heads=int(hf.get("num_key_value_heads") or H), head_dim=hd,
            ffn_dim=int(hf["intermediate_size"]), gate=gate, rope_theta=float(hf.get("rope_theta", 10000.0)),
            partial_rotary=float(hf.get("partial_rotary_factor", 0.25)) if layout_name == "qwen3_next" else 1.0,
            qk_norm=bool(hf.get("use_qk_norm", True)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            bos_id=int(hf["bos_token_id"]) if hf.get("bos_token_id") is not None else int(eos),
            eos_id=int(eos), pad_id=int(hf["pad_token_id"]) if hf.get("pad_token_id") is not None else int(eos),
            extra={"source_layout": layout_name, **hf.get("quantgate", {})},
        )
    except QuantgateError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise QuantgateError(f"{path}/config.json: missing or invalid field ({e})") from None
    return cfg, layout


def _check_dense_full_attention(hf: dict, L: int, path: Path) -> None:
    types = hf.get("layer_types") or []
    if len(types) != L or any(t != "full_attention" for t in types):
        raise QuantgateError(f"{path}/config.json: only all-full-attention Qwen3-Next is supported "
                             f"(layer_types has linear-attention layers)")
    mlp_only = set(hf.get("mlp_only_layers") or [])
    n_exp, step = int(hf.get("num_experts", 0) or 0), int(hf.get("decoder_sparse_step", 1) or 1)
    moe = [i for i in range(L) if i not in mlp_only and n_exp > 0 and (i + 1) % step == 0]
    if moe:
        raise QuantgateError(f"{path}/config.json: mixture-of-experts layers {moe} are not supported "
                             f"(dense models only: mlp_only_layers must cover every layer)")


def config_to_hf(cfg: ModelConfig, layout: Layout) -> dict:
    hf = {
        "architectures": [layout.architecture], "model_type": layout.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        "pad_token_id": cfg.pad_id, "torch_dtype": "float32", "use_cache": True,
    }
    if layout.name == "qwen3":
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    elif layout.name == "official":
        hf.update(headwise_attn_output_gate=cfg.gate == "headwise",
                  elementwise_attn_output_gate=cfg.gate == "elementwise",
                  use_qk_norm=cfg.qk_norm, qkv_bias=False, use_sliding_window=False, sliding_window=None)
    else:
        hf.update(partial_rotary_factor=cfg.partial_rotary, layer_types=["full_attention"] * cfg.n_layers,
                  mlp_only_layers=list(range(cfg.n_layers)), num_experts=0, decoder_sparse_step=1)
    hf["quantgate"] = {"version": __version__, "gate": cfg.gate,
                       **{k: v for k, v in cfg.extra.items() if k != "source_layout"},
                       "source_layout": cfg.extra.get("source_layout", "quantgate")}
    return hf


# --- tensors ---------------------------------------------------------------------------------------

class TensorSource:
    """Name -> file map over one or several (sharded) safetensors files, read lazily."""

    def __init__(self, path: Path):
        self._handles: dict[Path, object] = {}
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise QuantgateError(f"{index}: not a valid safetensors index ({e})") from None
            self.files = {name: path / f for name, f in weight_map.items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt*")]
                hint = f" (found {pickles[0]}: pickled weights are never loaded)" if pickles else ""
                raise QuantgateError(f"{path}: no .safetensors weights{hint}")
            self.files = {}
            for f in files:
                for name in self._open(f).keys():
                    self.files[name] = f

    def _open(self, f: Path):
        if f not in self._handles:
            if not f.is_file():
                raise QuantgateError(f"{f}: shard named in the index is missing")
            try:
                self._handles[f] = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise QuantgateError(f"{f}: corrupt or truncated safetensors ({str(e)[:100]})") from None
        return self._handles[f]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise QuantgateError(f"tensor {name} is missing from the checkpoint")
        f = self.files[name]
        try:
            t = self._open(f).get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise QuantgateError(f"{f}: cannot read tensor {name} ({str(e)[:100]})") from None
        t = t.float()
        if not torch.isfinite(t).all():
            raise QuantgateError(f"tensor {name} in {f.name} holds NaN or Inf values")
        return t


def _expect(name: str, t: torch.Tensor, shape: tuple) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise QuantgateError(f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def read_state_dict(src: TensorSource, cfg: ModelConfig, layout: Layout, model: Model) -> dict:
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    sd, used = {}, set()
    names = dict(GLOBAL_NAMES)
    if cfg.tie_embeddings:
        names.pop("lm_head.weight")
        used.add("lm_head.weight")  # some tied checkpoints still carry a copy; it is ignored
    for i in range(cfg.n_layers):
        for ours, theirs in LAYER_NAMES.items():
            if not cfg.qk_norm and ("q_norm" in ours or "k_norm" in ours):
                continue
            names[ours.format(i=i)] = theirs.format(i=i)
    for ours, theirs in names.items():
        t = _expect(theirs, src.get(theirs), shapes[ours])
        sd[ours] = t + 1.0 if layout.zero_centred_norms and is_norm(ours) else t
        used.add(theirs)
    for i in range(cfg.n_layers):
        qname = Q_NAME.format(i=i)
        w = _expect(qname, src.get(qname), (layout.q_rows(cfg), cfg.dim))
        q, g = layout.split_q(w, cfg)
        sd[f"layers.{i}.self_attn.q_proj.weight"] = q.contiguous()
        if g is not None:
            sd[f"layers.{i}.self_attn.g_proj.weight"] = g.contiguous()
        used.add(qname)
    extra = sorted(src.names() - used)
    if extra:
        raise QuantgateError(f"unexpected tensor {extra[0]} (+{len(extra) - 1} more): the checkpoint does not "
                             f"match its config.json ({layout.description})")
    return sd


def write_state_dict(model: Model, layout: Layout) -> dict[str, torch.Tensor]:
    cfg, ours = model.cfg, model.state_dict()
    out = {}
    names = dict(GLOBAL_NAMES)
    if cfg.tie_embeddings:
        names.pop("lm_head.weight")
    for i in range(cfg.n_layers):
        for o, t in LAYER_NAMES.items():
            if cfg.qk_norm or not ("q_norm" in o or "k_norm" in o):
                names[o.format(i=i)] = t.format(i=i)
    for o, t in names.items():
        w = ours[o].detach().float()
        out[t] = (w - 1.0 if layout.zero_centred_norms and is_norm(o) else w).contiguous().clone()
    for i in range(cfg.n_layers):
        q = ours[f"layers.{i}.self_attn.q_proj.weight"].float()
        g = ours.get(f"layers.{i}.self_attn.g_proj.weight")
        out[Q_NAME.format(i=i)] = layout.fuse_q(q, None if g is None else g.float(), cfg).contiguous().clone()
    return out


# --- public API ------------------------------------------------------------------------------------

def load_checkpoint(path: str | Path, with_tokenizer: bool = True) -> Loaded:
    """Load any supported layout into our Model (fp32, eval mode); a .gguf file or an ONNX export is
    dequantized."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":  # a GGUF file: dequantized into our model (quantgate.gguf_file)
        from .gguf_file import load_gguf_model
        return load_gguf_model(path)
    from .onnx_weights import is_onnx
    if is_onnx(path):  # an exported ONNX directory: dequantized likewise (quantgate.onnx_weights)
        from .onnx_weights import load_onnx_model
        return load_onnx_model(path)
    if not path.exists():
        raise QuantgateError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise QuantgateError(f"{path} is not a model directory (expected config.json + *.safetensors)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise QuantgateError(f"{path}: no config.json")
    try:
        hf = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QuantgateError(f"{cfg_file}: not valid JSON ({e})") from None
    cfg, layout = config_from_hf(hf, path)
    model = Model(cfg)
    sd = read_state_dict(TensorSource(path), cfg, layout, model)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:  # a mapping-table bug, not user error
        raise RuntimeError(f"internal mapping error: missing {missing}, unexpected {unexpected}")
    if "quant_scheme" in cfg.extra:
        from .quantize import apply_saved_quantization
        apply_saved_quantization(model, cfg.extra)
    model.eval()
    tok = None
    if with_tokenizer and (path / "tokenizer.json").is_file():
        tok = load_tokenizer(path, cfg.bos_id, cfg.eos_id, cfg.pad_id)
        check_tokenizer_fits(tok, cfg, path)
    return Loaded(model, tok, layout.name, path)


def check_tokenizer_fits(tok: Tokenizer, cfg: ModelConfig, path: Path) -> None:
    if tok.vocab_size > cfg.vocab_size:
        raise QuantgateError(f"{path}/tokenizer.json has {tok.vocab_size} tokens but the embedding has only "
                             f"{cfg.vocab_size} rows (tokenizer/vocab mismatch)")
    for name, i in (("bos", tok.bos_id), ("eos", tok.eos_id)):
        if not 0 <= i < cfg.vocab_size:
            raise QuantgateError(f"{path}: {name} id {i} is outside the vocabulary of {cfg.vocab_size}")


def save_checkpoint(model: Model, out: str | Path, tokenizer: Tokenizer | None = None,
                    layout: str | None = None, inputs: tuple = ()) -> Path:
    """Write `model` as a stock-loadable directory: baseline -> qwen3, headwise -> official layout,
    elementwise -> dense all-full-attention qwen3_next (override with `layout`)."""
    cfg = model.cfg
    name = layout or DEFAULT_LAYOUT_FOR_GATE[cfg.gate]
    if name not in LAYOUTS:
        raise QuantgateError(f"unknown layout {name!r}; choose from {sorted(LAYOUTS)}")
    lay = LAYOUTS[name]
    if (cfg.gate == "none") != (name == "qwen3"):
        raise QuantgateError(f"a model with gate '{cfg.gate}' cannot be written in the {name} layout")
    if name != "qwen3_next" and cfg.partial_rotary != 1.0:
        raise QuantgateError(f"partial rotary ({cfg.partial_rotary}) can only be written in the qwen3_next layout")
    if name != "official" and not cfg.qk_norm:
        raise QuantgateError("a model without QK-norm can only be written in the official layout")
    check_not_input(Path(out), *inputs)
    tensors = write_state_dict(model, lay)
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg, lay), indent=2) + "\n")
        gen = {"bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp)
    return Path(out)
