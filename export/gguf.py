"""Write a GGUF that stock llama.cpp runs, with the attention gate inside llama.cpp's own graph.

Baseline models become arch `qwen3`. Gated models become arch `qwen35` (Qwen3.5's text decoder) with
every real layer full attention: `attn_q` holds [q_h | gate_h] per head, and llama.cpp's graph splits
it, runs attention and multiplies by sigmoid(gate) before `attn_output` (DESIGN section 3).

Name tables (quantgate.formats.gguf_layout) come from gguf-py's TENSOR_NAMES; weights are written as PyTorch stores them ([out, in]),
no permutations (both archs use NEOX-style rope). Written by hand because no converter maps our
model (or the official gated layout) to qwen35; gguf-py does the file format.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch

from quantgate import __version__
from quantgate.errors import DiskFull, QuantgateError
from quantgate.formats import artifact_kind, inspect_gguf, load_checkpoint
from quantgate.formats.gguf import forget_reader
from quantgate.formats.gguf_layout import (BLOCK_TENSORS, GGUF_ARCHS, GLOBAL_TENSORS, LAYER_TENSORS, LINEAR_TO_GGUF,
                                           POST_ATTENTION_NORM, Q_TENSOR, QWEN2_SPLIT,
                                           SPLIT_PRE_TOKENIZERS, IdentityLayerShape, arch_of,
                                           expected_tensor_names, expected_tensor_shapes, gguf_arch,
                                           gdn_to_gguf, identity_recurrent_layer, moe_to_gguf, mtp_expert_recipes,
                                           mtp_names, MTP_BLOCK_TENSORS, MTP_MOE_TENSORS, MTP_NEXTN_TENSORS,
                                           rope_sections)
from quantgate.formats.hf import STORED_DTYPES, available_memory, open_hf
from quantgate.fsio import atomic_path, check_output
from quantgate.model import Model, ModelConfig, pytorch_only, without_attention
from quantgate.progress import track
from quantgate.tokenizer import Tokenizer

# the name tables and the identity layer live in quantgate.formats.gguf_layout (shared with the reader);
# re-exported here for one release
__all__ = ["export_gguf", "export_checkpoint", "rope_sections", "tokenizer_pre", "tokenizer_fields", "gguf_tensors",
           "GLOBAL_TENSORS", "LAYER_TENSORS", "LINEAR_TO_GGUF", "POST_ATTENTION_NORM", "Q_TENSOR", "QWEN2_SPLIT",
           "IdentityLayerShape", "expected_tensor_names", "expected_tensor_shapes", "gguf_arch",
           "identity_recurrent_layer", "GGUF_ARCHS"]

OUTTYPES = ("f32", "f16", "bf16")


# --- tokenizer -------------------------------------------------------------------------------------

def tokenizer_pre(tok: Tokenizer) -> str:
    """The llama.cpp pre-tokenizer name for a byte-level BPE tokenizer.json, or a clear error."""
    spec = json.loads(tok.tok.to_str())
    model, pre = spec.get("model", {}), spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        raise QuantgateError(f"tokenizer model {model.get('type')!r} is not supported for GGUF (byte-level BPE only)")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        if (len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel"
                and not parts[1].get("use_regex", True)):
            regex = parts[0].get("pattern", {}).get("Regex")
            for name, split in SPLIT_PRE_TOKENIZERS.items():
                if regex == split:
                    return name
    raise QuantgateError("the tokenizer's pre-tokenizer matches no llama.cpp pre-tokenizer quantgate knows "
                         "(supported: ByteLevel as GPT-2, Qwen2's and Qwen3.5's Split+ByteLevel)")


def tokenizer_fields(tok: Tokenizer, n_rows: int) -> dict:
    """Token list (id order), token types and merges, padded with unused tokens to the embedding rows."""
    spec = json.loads(tok.tok.to_str())
    specials = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    n = tok.vocab_size
    tokens, types = [], []
    for i in range(n):
        t = tok.tok.id_to_token(i)
        if t is None:
            raise QuantgateError(f"the tokenizer has no token with id {i} (ids must be contiguous)")
        tokens.append(t)
        types.append(3 if i in specials else 1)  # llama.cpp: 1 normal, 3 control, 5 unused
    for i in range(n, n_rows):
        tokens.append(f"<|quantgate_unused_{i}|>")
        types.append(5)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    if not merges:
        # gguf-py drops empty arrays and llama.cpp then refuses the file. A merge of two control tokens is
        # harmless: BPE starts from single bytes, so that pair of symbols can never occur in text.
        ctrl = sorted(specials)
        if len(ctrl) < 2:
            raise QuantgateError("a tokenizer without merges needs two special tokens for a placeholder merge")
        merges = [f"{tokens[ctrl[0]]} {tokens[ctrl[1]]}"]
    return {"tokens": tokens, "types": types, "merges": merges}


# --- tensors ---------------------------------------------------------------------------------------

def gguf_tensors(cfg: ModelConfig, sd: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) for the real layers, in the order they are written (name tables of
    formats.gguf_layout), each computed from `sd` (our names) only when reached: `sd` is a model's state dict, a
    checkpoint read tensor by tensor (formats.hf.CheckpointWeights), or the meta twin of either, whose tensors
    give the shapes and dtypes a GGUF's tensor table needs before any data. Tensors keep the dtype `sd` gives."""
    arch = arch_of(cfg)
    for ours, theirs in GLOBAL_TENSORS.items():
        if ours == "lm_head.weight" and cfg.tie_embeddings:
            continue
        yield theirs, sd[ours]
    for i in range(cfg.n_layers):
        linear = cfg.layer_type(i) == "linear_attention"
        names = dict(BLOCK_TENSORS if linear else LAYER_TENSORS,
                     **{"post_attention_layernorm.weight": arch.post_attention_norm})
        for ours, theirs in names.items():
            key = f"layers.{i}.{ours}"
            if key in sd:  # no local holds the tensor while this generator waits (the writer frees each one)
                yield f"blk.{i}.{theirs}", _doubled(sd[key]) if _zero_gate_o_proj(cfg, ours) else sd[key]
        if cfg.is_moe:
            yield from moe_to_gguf(cfg, sd, i)
        if linear:
            yield from gdn_to_gguf(cfg, sd, i).items()
            continue
        yield f"blk.{i}.{Q_TENSOR}", _fused_q(cfg, arch, sd, i)


def _zero_gate_o_proj(cfg: ModelConfig, ours: str) -> bool:
    """A hybrid baseline goes to qwen35 with zero gate rows: sigmoid(0) = 1/2, undone by doubling attn_output."""
    return ours == "self_attn.o_proj.weight" and cfg.gate == "none" and cfg.is_hybrid


def _doubled(t: torch.Tensor) -> torch.Tensor:
    return 2 * t.float()


def _fused_q(cfg: ModelConfig, arch, sd: Mapping, i: int) -> torch.Tensor:
    q = sd[f"layers.{i}.self_attn.q_proj.weight"]
    g = sd.get(f"layers.{i}.self_attn.g_proj.weight")
    if g is None and cfg.is_hybrid:
        g = torch.zeros(cfg.n_heads * cfg.head_dim, cfg.dim, dtype=q.dtype, device=q.device)
    return arch.fuse_q(q, g, cfg)


def mtp_tensors(ckpt, n_layers: int) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """The checkpoint's multi-token-prediction head as llama.cpp's converter writes it (qwen35: `blk.{L+j}.*`, one
    full-attention block after the trunk, plus its `nextn.*` projection and norms; gguf_layout.mtp_names): (GGUF name, a
    reader of the stored tensor with zero-centred norms + 1). Empty when the checkpoint has none."""
    check_mtp_head(ckpt, n_layers)
    out = []
    moe = ckpt.cfg.is_moe
    for their, gguf_name in mtp_names(ckpt.src.names(), ckpt.hf, n_layers, moe).items():
        # the converter's rule, on the name it maps to (enorm, hnorm, shared_head_norm, attn_norm, ...): + 1
        plus_one = ckpt.layout.zero_centred_norms and gguf_name.endswith("norm.weight")
        out.append((gguf_name, lambda meta=False, t=their, p=plus_one: _stored(ckpt, t, p, meta)))
    for gguf_name, (how, theirs) in mtp_expert_recipes(ckpt.src.names(), n_layers, ckpt.cfg.n_experts).items():
        out.append((gguf_name, lambda meta=False, h=how, t=theirs: _mtp_experts(ckpt, h, t, meta)))
    return out


def check_mtp_head(ckpt, n_layers: int) -> None:
    """Refuse, before a byte is written, an MTP head llama.cpp could not load: a missing tensor (every block needs its
    full set, numbered from 0, plus the nextn projection and norms), a shape that is not the trunk's, or a dtype
    quantgate does not read. Each names the tensors and --no-mtp."""
    names = sorted(n for n in ckpt.src.names() if n.startswith(("mtp.", "model.mtp.")))
    if not names:
        return
    prefix = "model.mtp." if names[0].startswith("model.mtp.") else "mtp."
    no_mtp = "export with --no-mtp to leave the head out"
    bad = [f"{n} ({ckpt.src.header(n)[1]})" for n in names if ckpt.src.header(n)[1] not in STORED_DTYPES]
    if bad:
        raise QuantgateError(f"the multi-token-prediction head has tensors in a dtype quantgate does not read: "
                             f"{_some(bad)}; {no_mtp}")
    moe = ckpt.cfg.is_moe
    block = {k for k in MTP_BLOCK_TENSORS if not (moe and k.startswith("mlp."))} | (set(MTP_MOE_TENSORS) if moe else set())
    found = {int(n[len(prefix):].split(".")[1]) for n in names
             if n[len(prefix):].startswith("layers.") and n[len(prefix):].split(".")[1].isdecimal()}
    n_blocks = int(ckpt.hf.get("mtp_num_hidden_layers") or (max(found) + 1 if found else 1))
    want = [prefix + k for k in MTP_NEXTN_TENSORS] + [f"{prefix}layers.{j}.{k}" for j in range(n_blocks)
                                                       for k in sorted(block)]
    missing = [n for n in want if n not in set(names)]
    extra = sorted(j for j in found if j >= n_blocks)
    if missing or extra:
        what = f"missing {_some(missing)}" if missing else ""
        if extra:
            what += ("; " if what else "") + f"blocks {extra} beyond its {n_blocks} (blocks are numbered from 0)"
        raise QuantgateError(f"the checkpoint's multi-token-prediction head is incomplete: {what}; {no_mtp}")
    D = ckpt.cfg.dim
    expect = {prefix + "fc.weight": (D, 2 * D), **{prefix + k: (D,) for k in MTP_NEXTN_TENSORS if k != "fc.weight"}}
    trunk = _trunk_names(ckpt)
    for j in range(n_blocks):
        for k in block:
            if k in trunk:
                expect[f"{prefix}layers.{j}.{k}"] = tuple(ckpt.src.header(trunk[k])[0])
    wrong = [f"{n} {tuple(ckpt.src.header(n)[0])} (want {shape})" for n, shape in expect.items()
             if tuple(ckpt.src.header(n)[0]) != shape]
    if wrong:
        raise QuantgateError(f"the multi-token-prediction head's shapes are not the trunk's: {_some(wrong)}; {no_mtp}")


def _trunk_names(ckpt) -> dict[str, str]:
    """The stored name of each tensor of the trunk's first full-attention layer, by its name within the layer."""
    i = ckpt.cfg.full_attention_layers[0] if ckpt.cfg.is_hybrid else 0
    out = {}
    for n in ckpt.src.names():
        if n.startswith(("mtp.", "model.mtp.")) or f"layers.{i}." not in n:
            continue
        rest = n.split(f"layers.{i}.", 1)[1]
        if n.endswith(f"layers.{i}.{rest}"):
            out[rest] = n
    return out


def _some(items: list[str], k: int = 6) -> str:
    return ", ".join(items[:k]) + (f" (+{len(items) - k} more)" if len(items) > k else "")


def _mtp_experts(ckpt, how: str, theirs: list[str], meta: bool = False) -> torch.Tensor:
    """One stacked expert tensor of a MoE's MTP block (gguf_layout.mtp_expert_recipes)."""
    if how == "stack":
        return torch.stack([_stored(ckpt, t, False, meta) for t in theirs])
    t = _stored(ckpt, theirs[0], False, meta)
    if how == "whole":
        return t
    F = t.shape[1] // 2  # gate rows first, then up (transformers' gate_up_proj)
    return (t[:, :F] if how == "gate" else t[:, F:]).contiguous()


def _stored(ckpt, theirs: str, plus_one: bool, meta: bool = False) -> torch.Tensor:
    if meta:
        shape, dtype = ckpt.src.header(theirs)
        t = torch.empty(shape, dtype=STORED_DTYPES[dtype], device="meta")
    else:
        t = ckpt.src.get_stored(theirs)
    return t.float() + 1.0 if plus_one else t


# --- writer ----------------------------------------------------------------------------------------

F16_MAX = 65504.0


# tensors llama.cpp's converter always writes F32 (conversion/base.py, the list its quantizer mirrors): the conv,
# which llama.cpp's op takes in F32 only, and a MoE's router and shared-expert gate
ALWAYS_F32 = ("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def _out_kind(t: torch.Tensor, outtype: str, name: str) -> str:
    """Matrices take the out type; 1-D tensors (norms, biases) and ALWAYS_F32 stay F32 as llama.cpp expects."""
    if t.ndim == 1 or outtype == "f32" or name.endswith(ALWAYS_F32):
        return "f32"
    return outtype


def _spec(t: torch.Tensor, kind: str) -> tuple[tuple, np.dtype, int, gguf.GGMLQuantizationType | None]:
    """(shape, numpy dtype, bytes, raw GGML type) of the tensor `t` becomes: gguf-py's add_tensor_info arguments."""
    n = int(t.numel())
    if kind == "f32":
        return tuple(t.shape), np.dtype(np.float32), 4 * n, None
    if kind == "f16":
        return tuple(t.shape), np.dtype(np.float16), 2 * n, None
    return tuple(t.shape), np.dtype(np.uint16), 2 * n, gguf.GGMLQuantizationType.BF16


def _max_abs(t: torch.Tensor, chunk: int = 1 << 24) -> float:
    flat = t.reshape(-1)
    return max((float(flat[i:i + chunk].abs().max()) for i in range(0, flat.numel(), chunk)), default=0.0)


def _data(t: torch.Tensor, kind: str, name: str) -> np.ndarray:
    """The bytes written for `t`, converted straight from its dtype (a bf16 tensor never passes through fp32 on
    its way to f16 or bf16). torch rounds to nearest even, as gguf-py's BF16 quantizer does."""
    t = t.detach().contiguous()
    if kind == "f32":
        return t.float().numpy()
    if kind == "f16":
        if t.dtype != torch.float16 and _max_abs(t) > F16_MAX:
            raise QuantgateError(f"tensor {name} has values beyond the fp16 range; export with --outtype f32 or bf16")
        return t.to(torch.float16).numpy()
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def check_room(out: Path, file_bytes: int, working_bytes: int) -> None:
    """Refuse before the first byte of data: a disk without room for the whole file, or a machine without the
    memory for the largest tensor as read plus as written (the most a streamed export holds at once)."""
    free = shutil.disk_usage(out.parent if str(out.parent) else Path(".")).free
    if file_bytes > free:
        raise DiskFull(f"cannot write {out}: the GGUF needs {file_bytes / 1e9:.2f} GB and its disk has "
                       f"{free / 1e9:.2f} GB free; nothing was written")
    avail = available_memory()
    if avail is not None and working_bytes > avail:
        raise QuantgateError(f"{out}: its largest tensor needs {working_bytes / 1e9:.2f} GB of memory to convert and "
                             f"write, more than the {avail / 1e9:.2f} GB available")


def export_gguf(model: Model, tokenizer: Tokenizer | None, out: str | Path, outtype: str = "f32",
                source_layout: str = "quantgate", name: str | None = None, inputs: tuple = (),
                identity_shape: IdentityLayerShape | None = None, identity_layers: int = 1) -> Path:
    """Write `model` as a GGUF file (atomically). Returns the path.

    identity_layers: how many identity recurrent layers a gated (qwen35) file gets. 1 is the workaround;
    0 reproduces llama.cpp's abort (tests use it to show the runner survives it); 2 lets the benchmark
    measure what one of them costs."""
    if "quant_scheme" in model.cfg.extra:
        raise QuantgateError("this model carries a simulated PyTorch quantization scheme; export the float model "
                             "and quantize the GGUF with `quantgate quantize FILE.gguf --type ...`")
    sd = model.state_dict()
    meta = {k: torch.empty_like(v, device="meta") for k, v in sd.items()}
    return write_gguf(model.cfg, sd, meta, tokenizer, out, outtype, source_layout, name, inputs, identity_shape,
                      identity_layers)


def write_gguf(cfg: ModelConfig, sd: Mapping, meta_sd: Mapping, tokenizer: Tokenizer | None, out: str | Path,
               outtype: str = "f32", source_layout: str = "quantgate", name: str | None = None, inputs: tuple = (),
               identity_shape: IdentityLayerShape | None = None, identity_layers: int = 1,
               extra: list[tuple[str, Callable]] = (), n_extra_blocks: int = 0) -> Path:
    """The one GGUF writer, streaming: the tensor table is laid out from `meta_sd` (shapes and dtypes only), then
    each tensor is computed from `sd`, converted and written before the next is read, so the peak is set by the
    largest tensor, not the model. `extra`: (name, reader) of tensors after the trunk (a checkpoint's MTP head,
    `n_extra_blocks` blocks of it), each reader called as reader() for data and reader(meta=True) for its shape."""
    out = Path(out)
    if outtype not in OUTTYPES:
        raise QuantgateError(f"unknown --outtype {outtype!r}; choose from {', '.join(OUTTYPES)}")
    if tokenizer is None:
        raise QuantgateError("the model has no tokenizer.json: a GGUF must embed its tokenizer")
    if not cfg.qk_norm:
        raise QuantgateError("llama.cpp's qwen3/qwen35 graphs always apply QK-norm; models without it cannot be exported")
    pytorch_only(cfg, "GGUF export (llama.cpp runs rope models)")
    why = without_attention(cfg)
    if why:
        raise QuantgateError(why)
    arch = arch_of(cfg)
    why = arch.cannot_hold(cfg)
    if why:
        raise QuantgateError(why)
    check_output(out, "gguf", inputs)
    pre = tokenizer_pre(tokenizer)
    tok = tokenizer_fields(tokenizer, cfg.vocab_size)
    n_identity = identity_layers if arch.identity_layers and not cfg.is_hybrid else 0
    shape = identity_shape or IdentityLayerShape()
    identity = {}
    for k in range(n_identity):
        identity.update(identity_recurrent_layer(cfg, shape, cfg.n_layers + k))

    def tensors(which: Mapping, meta: bool) -> Iterator[tuple[str, torch.Tensor]]:
        yield from gguf_tensors(cfg, which)
        yield from identity.items()
        for tname, read in extra:
            yield tname, read(meta=meta) if meta else read()

    with atomic_path(out, "gguf") as tmp:
        w = gguf.GGUFWriter(path=str(tmp), arch=arch.name)
        w.add_name(name or out.stem)
        w.add_string("quantgate.version", __version__)
        w.add_string("quantgate.gate", cfg.gate)
        w.add_string("quantgate.source_layout", source_layout)
        w.add_uint32("quantgate.identity_layers", n_identity)
        w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                         "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype])
        n_blocks = cfg.n_layers + n_identity + n_extra_blocks
        w.add_context_length(cfg.max_seq_len)
        w.add_embedding_length(cfg.dim)
        w.add_block_count(n_blocks)
        if not cfg.is_moe:  # a MoE's widths are the expert keys (its config has no dense intermediate_size)
            w.add_feed_forward_length(cfg.ffn_dim)  # qwen35 ignores per-layer arrays: the identity MLP is full width
        w.add_head_count(cfg.n_heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_rope_dimension_count(cfg.rotary_dim)
        arch.write_header(w, cfg, shape, n_identity, n_extra_blocks)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        w.add_bos_token_id(cfg.bos_id)
        w.add_eos_token_id(cfg.eos_id)
        w.add_pad_token_id(cfg.pad_id)
        w.add_add_bos_token(False)  # callers put BOS in front themselves (one convention everywhere)
        kinds, total, working = [], 0, 0
        for tname, t in tensors(meta_sd, meta=True):
            kind = _out_kind(t, outtype, tname)
            kinds.append((tname, kind))
            tshape, dtype, nbytes, raw = _spec(t, kind)
            w.add_tensor_info(tname, tshape, dtype, nbytes, raw_dtype=raw)
            total, working = total + nbytes, max(working, nbytes + t.numel() * t.element_size())
        check_room(out, total, working)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        # the progress bar iterates over names only: an iterator that held the tensor it last yielded would keep it
        # alive while the next one is read (two 2 GB tables at once at 9B, measured)
        source = tensors(sd, meta=False)
        for want, kind in track(kinds, f"writing {out.name}", total=len(kinds), memory=True):
            tname, t = next(source)
            if tname != want:  # the two passes walk the same tables; a difference is a bug here
                raise RuntimeError(f"internal error: tensor {tname} written where {want} was laid out")
            w.write_tensor_data(_data(t, kind, tname))
            del t
        w.close()
        try:  # quantgate's own reader must take what it wrote; a file it refuses is never committed
            inspect_gguf(tmp)
        except QuantgateError as e:
            forget_reader(tmp)
            raise QuantgateError(f"{str(e).replace(str(tmp), str(out))} (the written file failed quantgate's own "
                                 f"check; nothing was kept)") from None
    return out


def export_checkpoint(model_path: str | Path, out: str | Path, outtype: str = "f32",
                      identity_shape: IdentityLayerShape | None = None, identity_layers: int = 1,
                      mtp: bool = True) -> dict:
    """`quantgate export gguf`: write the GGUF of any layout the loader reads. A model directory is streamed from
    its safetensors tensor by tensor (CheckpointWeights: bf16 stays bf16), so its size is bounded by the disk, not
    the memory; its multi-token-prediction head, when it has one, is kept as llama.cpp's converter keeps it
    (`mtp=False` drops it, the converter's --no-mtp). An ONNX export is read back into a model first. Returns a
    summary."""
    kind = artifact_kind(model_path)
    if kind == "gguf":
        raise QuantgateError(f"{model_path} is already a GGUF; quantize it with `quantgate quantize FILE.gguf --type ...`")
    check_output(out, "gguf", (model_path,))
    if kind == "onnx":
        loaded = load_checkpoint(model_path)
        cfg, layout = loaded.model.cfg, loaded.layout
        export_gguf(loaded.model, loaded.tokenizer, out, outtype, source_layout=layout, name=Path(model_path).name,
                    inputs=(model_path,), identity_shape=identity_shape, identity_layers=identity_layers)
        n_mtp = 0
    else:
        ckpt = open_hf(model_path)
        cfg, layout = ckpt.cfg, ckpt.layout.name
        if "quant_scheme" in cfg.extra:
            raise QuantgateError("this model carries a simulated PyTorch quantization scheme; export the float model "
                                 "and quantize the GGUF with `quantgate quantize FILE.gguf --type ...`")
        extra = mtp_tensors(ckpt, cfg.n_layers) if mtp else []
        n_mtp = mtp_blocks(extra, cfg.n_layers)
        write_gguf(cfg, ckpt.weights(), ckpt.weights(meta=True), ckpt.tokenizer, out, outtype, source_layout=layout,
                   name=Path(model_path).name, inputs=(model_path,), identity_shape=identity_shape,
                   identity_layers=identity_layers, extra=extra, n_extra_blocks=n_mtp)
    info = inspect_gguf(out)
    return {"model": str(model_path), "out": str(out), "arch": info.arch, "gate": cfg.gate,
            "source_layout": layout, "outtype": outtype, "layers": cfg.n_layers,
            "identity_layers": info.n_blocks - info.n_layers - info.nextn_layers, "mtp_layers": info.nextn_layers,
            "bytes": info.n_bytes}


def mtp_blocks(extra: list, n_layers: int) -> int:
    """How many blocks past the trunk the MTP tensors occupy (blk.{L+j}.*)."""
    blocks = {int(name.split(".")[1]) for name, _ in extra}
    return len(blocks)
