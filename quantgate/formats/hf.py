"""Read and write model directories (config.json + safetensors + tokenizer.json) in every layout.

Reading validates everything a broken or foreign checkpoint can get wrong (unknown architecture,
missing or mis-shaped tensors, NaN weights, tokenizer larger than the embedding) and raises one
QuantgateError naming the file or tensor. Writing is atomic. Only safetensors are read: a pickle
from a user is never loaded.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .. import __version__
from ..errors import QuantgateError
from ..fsio import atomic_dir, check_output, read_json, write_json
from ..layouts import (DEFAULT_LAYOUT_FOR_GATE, FUSED_EXPERT_NAMES, GLOBAL_NAMES, LAYOUTS, Q_NAME, Layout, detect_layout,
                       expert_names, is_norm, layer_names)
from ..model import Model, ModelConfig
from ..quant.simulate import apply_saved_quantization
from ..tokenizer import Tokenizer, load_tokenizer
from .hub import resolve


@dataclass
class Loaded:
    model: Model
    tokenizer: Tokenizer | None
    layout: str
    path: Path


# --- config.json <-> ModelConfig --------------------------------------------------------------------

class HFFields:
    """Typed reads of config.json values: a wrong type or an out-of-range value is one error naming the field.

    JSON from a user can hold anything; every value the loader uses passes through here first."""

    def __init__(self, hf: dict, where: str):
        self.hf, self.where = hf, where

    def _bad(self, name: str, v, want: str) -> QuantgateError:
        return QuantgateError(f"{self.where}: {name} must be {want}, got {json.dumps(v)[:60]}")

    def int(self, name: str, default=None, lo: int = 1, hi: int = 1 << 40) -> int:
        v = self.hf.get(name, default)
        if v is None:
            if default is None:
                raise QuantgateError(f"{self.where}: {name} is missing")
            v = default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self._bad(name, v, f"an integer in [{lo}, {hi}]")
        return v

    def float(self, name: str, default: float, hi: float = 1e30) -> float:
        v = self.hf.get(name, default)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= hi:
            raise self._bad(name, v, f"a positive number up to {hi:g}")
        return float(v)

    def bool(self, name: str, default: bool) -> bool:
        v = self.hf.get(name, default)
        v = default if v is None else v
        if not isinstance(v, bool):
            raise self._bad(name, v, "true or false")
        return v

    def token(self, name: str, default: int | None) -> int | None:
        v = self.hf.get(name, default)
        if isinstance(v, list) and v:  # eos_token_id may be a list: the first is the one that ends a text
            v = v[0]
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise self._bad(name, v, "a token id")
        return v


# Upper bounds far above any real model: past them a value is a typo or corruption, not a model.
MAX_DIM, MAX_LAYERS, MAX_VOCAB, MAX_CONTEXT = 1 << 17, 1 << 12, 1 << 22, 1 << 24


def config_from_hf(hf: dict, path: Path) -> tuple[ModelConfig, Layout]:
    where = f"{path}/config.json"
    if not isinstance(hf, dict):
        raise QuantgateError(f"{where}: must hold a JSON object, got {type(hf).__name__}")
    layout_name = detect_layout(hf)
    if not layout_name:
        mt = json.dumps(hf.get("model_type"))[:40]
        if "moe" in mt.lower():
            raise QuantgateError(f"{where}: model_type {mt} is a mixture-of-experts model quantgate does not read "
                                 f"(the MoE it reads is qwen3_5_moe, Qwen3.5-MoE / Qwen3.6-35B-A3B)")
        raise QuantgateError(f"{where}: model_type {mt} is not supported (supported: qwen3, qwen3 with "
                             f"attn_output_gate, qwen3_next, qwen3_5 / qwen3_5_text, qwen3_5_moe / qwen3_5_moe_text)")
    layout = LAYOUTS[layout_name]
    hf = layout.text_config(hf)
    f = HFFields(hf, where)
    L = f.int("num_hidden_layers", hi=MAX_LAYERS)
    H = f.int("num_attention_heads", hi=MAX_DIM)
    # absent fields take transformers' own defaults for that model_type
    hd = f.int("head_dim", layout.default_head_dim, hi=MAX_DIM)
    rope_theta, partial_rotary = layout.rope(hf, where)
    if hf.get("attention_bias") or hf.get("qkv_bias"):
        raise QuantgateError(f"{where}: attention biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise QuantgateError(f"{where}: hidden_act {json.dumps(hf['hidden_act'])[:40]} is not supported")
    layout.check_config(hf, f, L, where)
    gate = layout.gate_of(f)
    types = layout.layer_types(hf, f, L, where)
    gdn = {}
    if types is not None and "linear_attention" in types:
        gdn = dict(linear_key_heads=f.int("linear_num_key_heads", 16, hi=MAX_DIM),
                   linear_value_heads=f.int("linear_num_value_heads", 32, hi=MAX_DIM),
                   linear_key_dim=f.int("linear_key_head_dim", 128, hi=MAX_DIM),
                   linear_value_dim=f.int("linear_value_head_dim", 128, hi=MAX_DIM),
                   linear_conv_kernel=f.int("linear_conv_kernel_dim", 4, hi=64))
    eos = f.token("eos_token_id", 1)
    extra = hf.get("quantgate", {})
    if not isinstance(extra, dict):
        raise QuantgateError(f"{where}: the quantgate block must be a JSON object")
    try:
        cfg = ModelConfig(
            vocab_size=f.int("vocab_size", hi=MAX_VOCAB), dim=f.int("hidden_size", hi=MAX_DIM), n_layers=L, n_heads=H,
            n_kv_heads=f.int("num_key_value_heads", H, hi=MAX_DIM), head_dim=hd,
            **layout.ffn_fields(f), gate=gate,
            rope_theta=rope_theta, partial_rotary=partial_rotary, **layout.lab_fields(f),
            qk_norm=f.bool("use_qk_norm", True), tie_embeddings=f.bool("tie_word_embeddings", False),
            norm_eps=f.float("rms_norm_eps", 1e-6, hi=1.0),
            max_seq_len=f.int("max_position_embeddings", 2048, hi=MAX_CONTEXT),
            bos_id=f.token("bos_token_id", eos), eos_id=eos, pad_id=f.token("pad_token_id", eos),
            layer_types=types, **gdn, extra={"source_layout": layout_name, **extra},
        )
    except ValueError as e:
        raise QuantgateError(f"{where}: {e}") from None
    return cfg, layout


def fp32_load(cfg: ModelConfig) -> tuple[int, int, int | None]:
    """(parameters, bytes the in-memory loader needs: fp32 weights read once and held once, bytes available)."""
    with torch.device("meta"):
        n = Model(cfg).num_params()
    return n, 2 * 4 * n, available_memory()


def check_fits_in_memory(cfg: ModelConfig, where: str) -> None:
    """Refuse, before allocating anything, a model whose fp32 weights (read once and held once while
    loading) would not fit in the memory this machine has free."""
    n, need, avail = fp32_load(cfg)
    if avail is not None and need > avail:
        raise QuantgateError(f"{where}: describes {n / 1e9:.2f}B parameters ({need / 2**30:.1f} GiB to load in "
                             f"fp32), more than the {avail / 2**30:.1f} GiB of memory available")


def check_fits_block_by_block(cfg: ModelConfig, where: str) -> None:
    """Refuse, before anything but config.json is read, a model that would not fit even run one decoder block at a
    time (quantgate.layerwise): its largest block in fp32 plus its embedding table (counted in fp32, whatever it is
    stored as) beyond the memory available."""
    with torch.device("meta"):
        model = Model(cfg)
        block = max(sum(p.numel() for p in blk.parameters()) for blk in model.layers)
    need = 4 * (block + cfg.vocab_size * cfg.dim)
    avail = available_memory()
    if avail is not None and need > avail:
        raise QuantgateError(f"{where}: even one decoder block at a time it needs {need / 2**30:.1f} GiB (its largest "
                             f"block and its embedding table in fp32), more than the {avail / 2**30:.1f} GiB of "
                             f"memory available")


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


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
    hf.update(layout.config_fields(cfg))
    for k in layout.omitted_keys:
        hf.pop(k, None)
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
            weight_map = read_json(index)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) and Path(v).name == v for k, v in weight_map.items()):
                raise QuantgateError(f"{index}: weight_map must map tensor names to shard file names in the folder")
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
                    if name in self.files:  # which copy wins would be the glob's order: refused, as transformers does
                        raise QuantgateError(f"{path}: tensor {name} is in both {self.files[name].name} and {f.name}, "
                                             f"and no model.safetensors.index.json says which to read")
                    self.files[name] = f

    def _open(self, f: Path):
        if f not in self._handles:
            if not f.is_file():
                raise QuantgateError(f"{f}: shard named in the index is missing")
            try:
                self._handles[f] = safe_open(str(f), framework="pt")
            except RuntimeError as e:  # safetensors maps the whole file: an address-space limit refuses the map
                if "mmap" not in str(e):
                    raise QuantgateError(f"{f}: cannot open ({str(e)[:100]})") from None
                raise QuantgateError(f"{f}: cannot map its {f.stat().st_size / 1e9:.1f} GB into this process's address "
                                     f"space ({str(e).rsplit(':', 1)[-1].strip()[:60]}; is `ulimit -v` set?); "
                                     f"raise the limit or shard the file") from None
            except (SafetensorError, OSError, ValueError) as e:
                raise QuantgateError(f"{f}: corrupt or truncated safetensors ({str(e)[:100]})") from None
        return self._handles[f]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> set[str]:
        return set(self.files)

    FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")

    def header(self, name: str) -> tuple[tuple, str]:
        """(shape, dtype) of a tensor from its file's header, without reading its data."""
        if name not in self.files:
            raise QuantgateError(f"tensor {name} is missing from the checkpoint")
        f = self.files[name]
        try:
            sl = self._open(f).get_slice(name)
            return tuple(sl.get_shape()), str(sl.get_dtype())
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise QuantgateError(f"{f}: cannot read tensor {name} ({str(e)[:100]})") from None

    def get(self, name: str) -> torch.Tensor:
        """The tensor as fp32 (the in-memory loader's form)."""
        return self.get_stored(name).float()

    def get_stored(self, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor in its stored dtype, refused if it holds NaN or Inf; `part` = (j, r0, r1) reads rows r0:r1 of
        its j-th matrix only (one expert's projection of a fused 3-D expert tensor: safetensors slices the map).

        It is read through a handle opened for this tensor alone: safetensors maps the file and hands out tensors
        backed by that map, so a handle kept open would keep every page it ever touched resident (a 9B model's 18 GB
        in RSS by the end of an export); this way only the tensors still referenced stay mapped."""
        if name not in self.files:
            raise QuantgateError(f"tensor {name} is missing from the checkpoint")
        f = self.files[name]
        try:
            with safe_open(str(f), framework="pt") as h:
                t = h.get_tensor(name) if part is None else h.get_slice(name)[part[0], part[1]:part[2]]
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise QuantgateError(f"{f}: cannot read tensor {name} ({str(e)[:100]})") from None
        if not all_finite(t):
            raise QuantgateError(f"tensor {name} in {f.name} holds NaN or Inf values")
        return t


def all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """torch.isfinite(t).all(), a chunk of elements at a time, so checking a 1-billion-element embedding costs 16 MB
    of temporary memory, not a 1 GB bool tensor."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def _names(cfg: ModelConfig) -> dict[str, str]:
    """ours -> theirs for every tensor stored under its own name (q_proj/g_proj are the layout's to fuse)."""
    names = dict(GLOBAL_NAMES)
    if cfg.tie_embeddings:
        names.pop("lm_head.weight")
    if cfg.positions != "learned":
        names.pop("embed_positions.weight")
    for i in range(cfg.n_layers):
        names.update(layer_names(cfg, i))
    return names


def tensor_plan(cfg: ModelConfig, layout: Layout, shapes: dict, hf: dict | None = None, fused_experts: bool = False
                ) -> dict[str, tuple[str | None, tuple]]:
    """theirs (the name in this checkpoint) -> (ours, expected shape) for every tensor the layout stores; `shapes`
    are our model's parameter shapes (from a meta-device model: nothing allocated); `hf` the checkpoint's
    config.json, for layouts whose naming depends on it (a multimodal Qwen3.5 nests the text model).
    `fused_experts`: a MoE checkpoint stores each layer's routed experts as two 3-D tensors, planned under the
    pseudo-names `layers.{i}.mlp.experts.gate_up_proj` / `.down_proj` that CheckpointWeights slices per expert."""
    on_disk = (lambda n: layout.disk_name(n, hf)) if hf is not None else (lambda n: n)
    plan = {on_disk(theirs): (ours, shapes[ours]) for ours, theirs in _names(cfg).items()}
    for i in cfg.full_attention_layers:
        plan[on_disk(Q_NAME.format(i=i))] = (f"layers.{i}.self_attn.q_proj.weight", (layout.q_rows(cfg), cfg.dim))
    for i in range(cfg.n_layers) if cfg.is_moe else ():
        if not fused_experts:
            plan.update({on_disk(theirs): (ours, shapes[ours]) for ours, theirs in expert_names(cfg, i).items()})
            continue
        E, F, D = cfg.n_experts, cfg.expert_ffn_dim, cfg.dim
        for part, shape in (("gate_up_proj", (E, 2 * F, D)), ("down_proj", (E, D, F))):
            plan[on_disk(FUSED_EXPERT_NAMES[part].format(i=i))] = (f"layers.{i}.mlp.experts.{part}", shape)
    return plan


def has_fused_experts(names: set[str]) -> bool:
    """Whether a checkpoint stores its routed experts fused 3-D (transformers 5's in-memory form)."""
    return any(n.endswith(".mlp.experts.gate_up_proj") and not n.startswith(("mtp.", "model.mtp.")) for n in names)


def check_tensor_headers(src: TensorSource, cfg: ModelConfig, layout: Layout, plan: dict,
                         hf: dict | None = None) -> None:
    """Every tensor present with the shape and a float dtype config.json implies, nothing extra: checked
    from the safetensors headers before a single weight is allocated."""
    for theirs, (_ours, shape) in plan.items():
        got, dtype = src.header(theirs)
        if got != tuple(shape):
            raise QuantgateError(f"tensor {theirs} has shape {got}, expected {tuple(shape)} (from config.json)")
        if dtype not in TensorSource.FLOAT_DTYPES:
            raise QuantgateError(f"tensor {theirs} has dtype {dtype}; quantgate reads float weights only")
    extra = sorted(n for n in src.names() - set(plan) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
                   if not layout.skipped(n, hf or {}))
    if extra:
        raise QuantgateError(f"unexpected tensor {extra[0]} (+{len(extra) - 1} more): the checkpoint does not "
                             f"match its config.json ({layout.description})")


def skipped_parts(src: TensorSource, layout: Layout, hf: dict) -> dict[str, int]:
    """Tensors of the checkpoint quantgate does not read, counted by the part they belong to (`quantgate info`)."""
    parts: dict[str, int] = {}
    for n in src.names():
        part = layout.skipped(n, hf)
        if part:
            parts[part] = parts.get(part, 0) + 1
    return parts


class CheckpointWeights(Mapping):
    """Our state-dict names -> the checkpoint's tensors, each read when asked for, in its stored dtype (bf16 stays
    bf16), with the layout's transforms applied: zero-centred norms + 1 and a zero-gate baseline's o_proj halved
    (both in fp32), q and gate rows split out of the fused q_proj.

    This is what lets a 9B checkpoint be exported on a 24 GB machine: a writer asks for one tensor, writes it and
    lets it go. With `meta=True` every tensor is a meta tensor of the same shape and dtype, read from the headers
    alone, so a two-pass writer (a GGUF's tensor table comes before its data) lays the file out first."""

    def __init__(self, ckpt: "HFCheckpoint", meta: bool = False):
        self.ckpt, self.meta = ckpt, meta
        self._theirs = {ours: theirs for theirs, (ours, _shape) in ckpt.plan.items()}
        self._keys = [k for k in ckpt.shapes if k in self._theirs or k.endswith(".self_attn.g_proj.weight")
                      or self._fused_part(k) is not None]
        self._key_set = set(self._keys)

    def _fused_part(self, ours: str) -> tuple[str, int, str] | None:
        """(their fused tensor, expert j, projection) when `ours` is a routed expert's projection stored fused."""
        parts = ours.split(".")  # layers.{i}.mlp.experts.{j}.{proj}.weight
        if len(parts) != 7 or parts[2:4] != ["mlp", "experts"] or not parts[4].isdecimal():
            return None
        fused = f"layers.{parts[1]}.mlp.experts.{'down_proj' if parts[5] == 'down_proj' else 'gate_up_proj'}"
        theirs = self._theirs.get(fused)
        return None if theirs is None else (theirs, int(parts[4]), parts[5])

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._key_set

    def _read(self, theirs: str) -> torch.Tensor:
        shape, dtype = self.ckpt.src.header(theirs)
        if self.meta:
            return torch.empty(shape, dtype=STORED_DTYPES[dtype], device="meta")
        return self.ckpt.src.get_stored(theirs)

    def __getitem__(self, ours: str) -> torch.Tensor:
        if ours not in self._key_set:
            raise KeyError(ours)
        ck = self.ckpt
        cfg, layout = ck.cfg, ck.layout
        fused = self._fused_part(ours)
        if fused is not None:  # expert j's rows of the layer's [E, 2F, D] gate_up or [E, D, F] down tensor
            theirs, j, proj = fused
            F = cfg.expert_ffn_dim
            rows = {"gate_proj": (0, F), "up_proj": (F, 2 * F), "down_proj": (0, cfg.dim)}[proj]
            if self.meta:
                _shape, dtype = ck.src.header(theirs)
                shape = (rows[1] - rows[0], F if proj == "down_proj" else cfg.dim)
                return torch.empty(shape, dtype=STORED_DTYPES[dtype], device="meta")
            return ck.src.get_stored(theirs, (j, *rows))
        if ours.endswith((".self_attn.q_proj.weight", ".self_attn.g_proj.weight")):
            theirs = self._theirs[ours.replace(".g_proj.", ".q_proj.")]
            q, g = layout.split_q(self._read(theirs), cfg)
            if ours.endswith(".g_proj.weight"):
                return g.contiguous()
            if g is not None and cfg.gate == "none" and not self.meta and bool(g.abs().max() > 0):
                raise QuantgateError(f"tensor {theirs}: config.json says the model has no attention gate (written "
                                     f"with zero gate rows), but its gate rows are not zero")
            return q.contiguous()
        t = self._read(self._theirs[ours])
        if layout.zero_centred_norms and is_norm(ours):
            return t.float() + 1.0
        if cfg.gate == "none" and layout.zero_gate_baseline and ours.endswith(".self_attn.o_proj.weight"):
            return t.float() * 0.5  # o_proj was doubled to cancel sigmoid(0) = 1/2
        return t


STORED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def read_state_dict(src: TensorSource, cfg: ModelConfig, layout: Layout, plan: dict) -> dict:
    """Every tensor of the plan, as our model names them (fp32 where stored so, else the stored dtype)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Model(cfg).state_dict().items()}
    ckpt = HFCheckpoint(path=Path("."), hf={}, cfg=cfg, layout=layout, src=src, plan=plan, shapes=shapes)
    weights = ckpt.weights()
    return {k: weights[k] for k in weights}


def write_state_dict(model: Model, layout: Layout) -> dict[str, torch.Tensor]:
    return hf_tensors(model.cfg, layout, model.state_dict())


def hf_tensors(cfg: ModelConfig, layout: Layout, ours: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (their names, fp32) for the tensors of `ours` given: a whole model's state dict, or
    one block's (a layer-by-layer writer), or meta tensors (the file's shapes, nothing allocated). A layer's fused
    q_proj is written when its q_proj is given (its o_proj with it, which a zero-gate baseline layout doubles)."""
    out = {}
    names = _names(cfg)
    for i in range(cfg.n_layers) if cfg.is_moe else ():
        names.update(expert_names(cfg, i))
    for o, t in names.items():
        if o not in ours:
            continue
        w = ours[o].detach().float()
        out[t] = (w - 1.0 if layout.zero_centred_norms and is_norm(o) else w).contiguous().clone()
    for i in cfg.full_attention_layers:
        if f"layers.{i}.self_attn.q_proj.weight" not in ours:
            continue
        q = ours[f"layers.{i}.self_attn.q_proj.weight"].float()
        g = ours.get(f"layers.{i}.self_attn.g_proj.weight")
        if g is None and layout.zero_gate_baseline:  # sigmoid(0) = 1/2 on every channel, undone by 2 * o_proj
            g = torch.zeros(cfg.n_heads * cfg.head_dim, cfg.dim, device=q.device)
            out[f"model.layers.{i}.self_attn.o_proj.weight"] = out[f"model.layers.{i}.self_attn.o_proj.weight"] * 2.0
        out[Q_NAME.format(i=i)] = layout.fuse_q(q, None if g is None else g.float(), cfg).contiguous().clone()
    return out


# --- reading and writing a directory -------------------------------------------------------------

@dataclass
class HFCheckpoint:
    """A model directory opened and checked from its headers alone: config, layout, the tensor plan (every tensor
    present with the shape and a float dtype config.json implies) and the tokenizer, without a weight read.
    `quantgate info` stops here; exporters stream `weights()`; `load_hf` reads them all into a Model."""
    path: Path
    hf: dict
    cfg: ModelConfig
    layout: Layout
    src: TensorSource
    plan: dict
    shapes: dict  # our parameter name -> shape (from a meta-device model)
    tokenizer: Tokenizer | None = None

    def weights(self, meta: bool = False) -> CheckpointWeights:
        return CheckpointWeights(self, meta)

    def num_params(self) -> int:
        """Parameters of our model (a tied embedding counted once), from the shapes alone."""
        n = sum(int(torch.Size(s).numel()) for k, s in self.shapes.items())
        return n - (int(torch.Size(self.shapes["lm_head.weight"]).numel()) if self.cfg.tie_embeddings else 0)

    def stored_bytes(self) -> int:
        """Bytes of the tensors quantgate reads, as stored (bf16: 2 per weight)."""
        return sum(int(torch.Size(self.src.header(t)[0]).numel()) * STORED_DTYPES[self.src.header(t)[1]].itemsize
                   for t in self.plan)

    def largest_tensor_bytes(self) -> int:
        return max(int(torch.Size(self.src.header(t)[0]).numel()) * STORED_DTYPES[self.src.header(t)[1]].itemsize
                   for t in self.plan)


def open_hf(path: str | Path, with_tokenizer: bool = True, must_fit_in_memory: bool = False,
            must_fit_block_by_block: bool = False) -> HFCheckpoint:
    """Open a model directory (any layout of LAYOUTS; a Hugging Face repo id is resolved to its cached, else
    downloaded, snapshot first) and check it from config.json and the safetensors headers: nothing is allocated
    but the shapes, so this works for a model of any size. `must_fit_in_memory`: refuse, right after config.json
    and before anything else is read, a model whose fp32 weights this machine cannot hold (`load_hf`);
    `must_fit_block_by_block`: one that could not run even one block at a time."""
    path = resolve(path)
    if not path.exists():
        raise QuantgateError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise QuantgateError(f"{path} is not a model directory (expected config.json + *.safetensors)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise QuantgateError(f"{path}: no config.json")
    hf = read_json(cfg_file)
    cfg, layout = config_from_hf(hf, path)
    if must_fit_in_memory:
        check_fits_in_memory(cfg, str(cfg_file))
    if must_fit_block_by_block:  # the PyTorch verbs, which run a model too large for memory layer by layer
        check_fits_block_by_block(cfg, str(cfg_file))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Model(cfg).state_dict().items()}
    src = TensorSource(path)
    plan = tensor_plan(cfg, layout, shapes, hf, fused_experts=cfg.is_moe and has_fused_experts(src.names()))
    check_tensor_headers(src, cfg, layout, plan, hf)
    skipped = skipped_parts(src, layout, hf)
    if skipped:
        cfg.extra = {**cfg.extra, "skipped_tensors": skipped}
    tok = None
    if with_tokenizer and (path / "tokenizer.json").is_file():
        tok = load_tokenizer(path, cfg.bos_id, cfg.eos_id, cfg.pad_id)
        check_tokenizer_fits(tok, cfg, path)
    return HFCheckpoint(path, hf, cfg, layout, src, plan, shapes, tok)


def load_hf(path: str | Path, with_tokenizer: bool = True) -> Loaded:
    """A model directory (any layout of LAYOUTS) into our Model (fp32, eval mode); a quantgate-quantized
    checkpoint gets its saved scheme back (`apply_saved_quantization`). A Hugging Face repo id is resolved to its
    cached (else downloaded) snapshot first (quantgate.formats.hub)."""
    ckpt = open_hf(path, with_tokenizer, must_fit_in_memory=True)
    cfg = ckpt.cfg
    weights = ckpt.weights()
    model = model_holding(cfg, {k: weights[k].float() for k in weights})  # fp32 as read: one stored tensor at a time
    if "quant_scheme" in cfg.extra:
        apply_saved_quantization(model, cfg.extra, str(ckpt.path / "config.json"))
    model.eval()
    return Loaded(model, ckpt.tokenizer, ckpt.layout.name, ckpt.path)


def model_holding(cfg: ModelConfig, sd: dict) -> Model:
    """Our Model holding the tensors of `sd` themselves (built on the meta device, then assigned, fp32), so loading
    holds the weights once, not twice: a Qwen3.5-0.8B is 3 GB in fp32, and a Model built first would be 3 GB more."""
    with torch.device("meta"):
        model = Model(cfg)
    for k in sd:
        sd[k] = sd[k].float()  # a stored bf16/fp16 tensor becomes fp32 here (one tensor at a time)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:  # a mapping-table bug, not user error
        raise RuntimeError(f"internal mapping error: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:  # assign replaced embed_tokens.weight; the head reads the same tensor again
        model.lm_head.weight = model.embed_tokens.weight
    return model


def check_tokenizer_fits(tok: Tokenizer, cfg: ModelConfig, path: Path) -> None:
    if tok.vocab_size > cfg.vocab_size:
        raise QuantgateError(f"{path}/tokenizer.json has {tok.vocab_size} tokens but the embedding has only "
                             f"{cfg.vocab_size} rows (tokenizer/vocab mismatch)")
    for name, i in (("bos", tok.bos_id), ("eos", tok.eos_id)):
        if not 0 <= i < cfg.vocab_size:
            raise QuantgateError(f"{path}: {name} id {i} is outside the vocabulary of {cfg.vocab_size}")


def save_checkpoint(model: Model, out: str | Path, tokenizer: Tokenizer | None = None,
                    layout: str | None = None, inputs: tuple = (), side_json: dict[str, dict] | None = None) -> Path:
    """Write `model` as a stock-loadable directory: baseline -> qwen3, headwise -> official layout,
    elementwise -> dense all-full-attention qwen3_next, a hybrid (Gated DeltaNet layers) -> qwen3_5 whatever its
    gate (override with `layout`). `side_json`: JSON files written beside it in the same folder (an allocation's
    record), committed with it or not at all."""
    cfg = model.cfg
    lay = layout_for(cfg, layout)
    check_output(out, "checkpoint", inputs)
    tensors = write_state_dict(model, lay)
    with atomic_dir(out, "checkpoint") as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_side_files(tmp, cfg, lay, tokenizer)
        for name, d in (side_json or {}).items():
            write_json(tmp / name, d)
        check_written(tmp, out)
    return Path(out)


def check_written(tmp: Path, out: str | Path) -> None:
    """quantgate's own reader must open the checkpoint it just wrote (config, layout, every tensor's header); one it
    refuses is never committed: the caller's atomic_dir removes it."""
    try:
        open_hf(tmp, with_tokenizer=(tmp / "tokenizer.json").is_file())
    except QuantgateError as e:
        raise QuantgateError(f"{str(e).replace(str(tmp), str(out))} (the written checkpoint failed quantgate's own "
                             f"check; nothing was kept)") from None


def layout_for(cfg: ModelConfig, layout: str | None = None) -> Layout:
    """The layout a model is saved in (save_checkpoint's rule, or `layout` by name), refused if it cannot hold it."""
    name = layout or ("quantgate_lab" if cfg.is_lab else "qwen3_5_moe" if cfg.is_moe else "qwen3_5" if cfg.is_hybrid
                      else DEFAULT_LAYOUT_FOR_GATE[cfg.gate])
    if name not in LAYOUTS:
        raise QuantgateError(f"unknown layout {name!r}; choose from {sorted(LAYOUTS)}")
    lay = LAYOUTS[name]
    why = lay.cannot_hold(cfg)
    if why:
        raise QuantgateError(why)
    return lay


def write_side_files(tmp: Path, cfg: ModelConfig, lay: Layout, tokenizer: Tokenizer | None) -> None:
    """config.json, generation_config.json and the tokenizer beside a checkpoint's weights."""
    (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg, lay), indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(tmp)
