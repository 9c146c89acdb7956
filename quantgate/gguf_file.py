"""Read and check a GGUF file with gguf-py before llama.cpp ever sees it.

llama.cpp aborts the whole process on some malformed files, so every GGUF a user hands us is first
parsed here (header, metadata, tensor table, data extent) and refused with one clear line when it is
truncated, not a GGUF, of an architecture quantgate does not run, or inconsistent. The tokenizer is
rebuilt from the file's own metadata, so `quantgate eval FILE.gguf` needs nothing else.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import QuantgateError
from .tokenizer import Tokenizer

SUPPORTED_ARCHS = ("qwen3", "qwen35")
# enum llama_ftype values (general.file_type) -> llama.cpp's names
FILE_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
                   12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
                   19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
                   26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16"}
GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFInfo:
    path: Path
    arch: str
    n_layers: int  # real layers (without quantgate's identity recurrent layer)
    n_blocks: int
    vocab_size: int
    n_embd: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    gate: str  # none, headwise, elementwise ('elementwise' for a foreign qwen35: the file cannot tell)
    source_layout: str
    file_type: str  # llama.cpp's name for general.file_type, e.g. Q4_K_M
    n_bytes: int
    tensor_types: dict[str, str] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    @property
    def bits_per_weight(self) -> float:
        return self.metadata.get("_bits_per_weight", float("nan"))


def _field(reader, key: str, default=None):
    f = reader.get_field(key)
    if f is None:
        return default
    v = f.contents()
    return v


def open_reader(path: str | Path):
    """gguf-py reader over `path`, or a QuantgateError saying what is wrong with the file."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.exists():
        raise QuantgateError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise QuantgateError(f"{path} is not a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise QuantgateError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(str(path), "r")
    except Exception as e:  # a parser of untrusted bytes: any failure means a malformed file
        raise QuantgateError(f"{path}: corrupt or truncated GGUF ({type(e).__name__}: {str(e)[:100]})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
            raise QuantgateError(f"{path}: truncated GGUF (tensor {t.name} ends at byte {end}, file has {size})")
    return reader


def inspect_gguf(path: str | Path) -> GGUFInfo:
    """Parse and validate a GGUF that quantgate can run; one clear error for anything else."""
    path = Path(path)
    reader = open_reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise QuantgateError(f"{path}: architecture {arch!r} is not supported (quantgate runs {', '.join(SUPPORTED_ARCHS)})")
    n_blocks = _field(reader, f"{arch}.block_count")
    n_embd = _field(reader, f"{arch}.embedding_length")
    if n_blocks is None or n_embd is None:
        raise QuantgateError(f"{path}: missing {arch}.block_count or {arch}.embedding_length")
    identity = int(_field(reader, "quantgate.identity_layers", 0) or 0)
    tensors = {t.name: t for t in reader.tensors}
    n_layers = int(n_blocks) - identity
    _check_tensor_set(path, arch, n_layers, identity, set(tensors), int(n_blocks))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    emb_rows = int(tensors["token_embd.weight"].shape[1])  # GGUF shapes are innermost first
    if tokens is None:
        raise QuantgateError(f"{path}: no embedded tokenizer (tokenizer.ggml.tokens)")
    if len(tokens) != emb_rows:
        raise QuantgateError(f"{path}: the tokenizer has {len(tokens)} tokens but token_embd has {emb_rows} rows "
                             f"(tokenizer/vocab mismatch)")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    ftype = _field(reader, "general.file_type")
    file_type = FILE_TYPE_NAMES.get(int(ftype), f"ftype {ftype}") if ftype is not None else "unknown"
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", n_embd // n_heads))
    n_weights = sum(int(np.prod(t.shape)) for t in reader.tensors)
    n_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    meta = {"name": _field(reader, "general.name"), "quantgate_version": _field(reader, "quantgate.version"),
            "_bits_per_weight": 8 * n_bytes / max(n_weights, 1)}
    return GGUFInfo(
        path=path, arch=arch, n_layers=n_layers, n_blocks=int(n_blocks), vocab_size=emb_rows, n_embd=int(n_embd),
        n_heads=n_heads, n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        gate=_field(reader, "quantgate.gate", "none" if arch == "qwen3" else "elementwise"),
        source_layout=_field(reader, "quantgate.source_layout", "unknown"), file_type=file_type,
        n_bytes=path.stat().st_size, tensor_types=types, metadata=meta)


def _check_tensor_set(path: Path, arch: str, n_layers: int, identity: int, names: set[str], n_blocks: int) -> None:
    """The tensor table must hold exactly what the header's architecture and block count call for; a wrong
    tensor count in the header shows up here as a missing or nameless tensor."""
    from quantgate.export.gguf import expected_tensor_names

    optional = {f"blk.{i}.attn_{qk}_norm.weight" for i in range(n_layers) for qk in "qk"} | {"output.weight"}
    expected = expected_tensor_names(arch, n_layers, tied=False, identity=identity)
    missing = sorted(expected - optional - names)
    extra = sorted(names - expected)
    if missing:
        raise QuantgateError(f"{path}: tensor {missing[0]} is missing (+{len(missing) - 1} more; "
                             f"{arch}.block_count = {n_blocks}, {len(names)} tensors in the file)")
    if extra:
        raise QuantgateError(f"{path}: unexpected tensor {extra[0]!r} (+{len(extra) - 1} more; the header's tensor "
                             f"count or block count does not match the tensors)")


def read_tensor(reader, name: str) -> np.ndarray:
    """Dequantized float32 tensor in PyTorch orientation ([out, in] for matrices), via gguf-py."""
    from gguf.quants import dequantize
    for t in reader.tensors:
        if t.name == name:
            a = dequantize(t.data, t.tensor_type)
            return np.array(a, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])  # a writable copy
    raise QuantgateError(f"tensor {name} is not in the GGUF")


def tokenizer_from_gguf(reader) -> Tokenizer:
    """Rebuild the HF byte-level BPE tokenizer from `tokenizer.ggml.*` (the inverse of the exporter).

    Written by hand because no library turns GGUF vocab metadata back into a `tokenizers` object.
    """
    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre")
    if model != "gpt2" or pre not in ("gpt-2", "qwen2"):
        raise QuantgateError(f"tokenizer {model!r}/{pre!r} is not supported (byte-level BPE gpt-2 or qwen2 only)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    known = {t for i, t in enumerate(tokens) if types[i] == 1}
    merges = [m.split(" ", 1) for m in _field(reader, "tokenizer.ggml.merges", [])]
    merges = [m for m in merges if m[0] in known and m[1] in known]  # drops the exporter's placeholder merge
    tok = _hf_tokenizer(tokens, types, merges, pre)
    bos = int(_field(reader, "tokenizer.ggml.bos_token_id", 0))
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", bos))
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    return Tokenizer(tok, bos, eos, eos if pad is None else int(pad))


def _hf_tokenizer(tokens: list[str], types: list[int], merges: list, pre: str):
    """Built through a tokenizer.json spec, where every token (special or not) keeps its GGUF id."""
    from tokenizers import Tokenizer as HFTokenizer

    from quantgate.export.gguf import QWEN2_SPLIT

    vocab = {t: i for i, t in enumerate(tokens)}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(tokens) if types[i] != 1]
    if pre == "gpt-2":
        pre_tok = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    else:
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": pre_tok, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": [list(m) for m in merges]}}
    return HFTokenizer.from_str(json.dumps(spec))


def load_gguf_model(path: str | Path):
    """Our PyTorch Model from a GGUF, every tensor dequantized to fp32 (the inverse of the exporter).

    A qwen35 file gives an elementwise-gated model (llama.cpp's graph is elementwise; a headwise gate
    is exported as equal rows per head). Used for gate-survival checks, importance matrices computed
    from a GGUF, and `quantgate analyze`/`info` on GGUF files.
    """
    import torch

    from quantgate.export.gguf import GLOBAL_TENSORS, LAYER_TENSORS, POST_ATTENTION_NORM, Q_TENSOR

    from .checkpoint import Loaded
    from .layouts import _split_interleaved
    from .model import Model, ModelConfig

    info = inspect_gguf(path)
    reader = open_reader(path)
    arch = info.arch
    names = {t.name for t in reader.tensors}
    ffn = _field(reader, f"{arch}.feed_forward_length")
    ffn = int(ffn[0]) if isinstance(ffn, list) else int(ffn)
    rot = int(_field(reader, f"{arch}.rope.dimension_count", info.head_dim))
    tok = tokenizer_from_gguf(reader)
    cfg = ModelConfig(vocab_size=info.vocab_size, dim=info.n_embd, n_layers=info.n_layers, n_heads=info.n_heads,
                      n_kv_heads=info.n_kv_heads, head_dim=info.head_dim,
                      ffn_dim=ffn, gate="none" if arch == "qwen3" else "elementwise",
                      rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
                      partial_rotary=rot / info.head_dim, qk_norm="blk.0.attn_q_norm.weight" in names,
                      tie_embeddings="output.weight" not in names,
                      norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
                      max_seq_len=int(_field(reader, f"{arch}.context_length", 2048)),
                      bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id,
                      extra={"source_layout": f"gguf:{arch}", "gguf_file_type": info.file_type,
                             "exported_gate": info.gate})
    model = Model(cfg)
    sd = {}
    for ours, theirs in GLOBAL_TENSORS.items():
        if theirs in names:
            sd[ours] = read_tensor(reader, theirs)
    layer_names = dict(LAYER_TENSORS, **{"post_attention_layernorm.weight": POST_ATTENTION_NORM[arch]})
    for i in range(cfg.n_layers):
        for ours, theirs in layer_names.items():
            if f"blk.{i}.{theirs}" in names:
                sd[f"layers.{i}.{ours}"] = read_tensor(reader, f"blk.{i}.{theirs}")
        q = torch.from_numpy(read_tensor(reader, f"blk.{i}.{Q_TENSOR}"))
        if arch == "qwen35":
            q, g = _split_interleaved(q, cfg)
            sd[f"layers.{i}.self_attn.g_proj.weight"] = g.contiguous()
        sd[f"layers.{i}.self_attn.q_proj.weight"] = q.contiguous()
    expected = model.state_dict()
    for k, v in sd.items():
        t = torch.as_tensor(v)
        if k not in expected or tuple(t.shape) != tuple(expected[k].shape):
            raise QuantgateError(f"{path}: tensor for {k} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(expected[k].shape) if k in expected else 'none'}")
        if not torch.isfinite(t).all():
            raise QuantgateError(f"{path}: tensor for {k} holds NaN or Inf values")
        sd[k] = t
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing:
        raise QuantgateError(f"{path}: tensors missing for {missing[0]} (+{len(missing) - 1} more)")
    model.eval()
    return Loaded(model, tok, f"gguf:{arch}", Path(path))
