"""Read and check a GGUF file with gguf-py before llama.cpp ever sees it.

llama.cpp aborts the whole process on some malformed files, so every GGUF a user hands us is first
parsed here (header, metadata, tensor table, data extent) and refused with one clear line when it is
truncated, not a GGUF, of an architecture quantgate does not run, or inconsistent. The tokenizer is
rebuilt from the file's own metadata, so `quantgate eval FILE.gguf` needs nothing else.
"""
from __future__ import annotations

import gc
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from tokenizers import Tokenizer as HFTokenizer

from ..errors import QuantgateError
from ..model import Model, ModelConfig
from ..quant.schemes import llama_file_type_name
from ..tokenizer import Tokenizer
from .gguf_layout import (ARCH_NAMES, BLOCK_TENSORS, GGUF_ARCHS, GLOBAL_TENSORS, LAYER_TENSORS, MTP_OPTIONAL, Q_TENSOR,
                          SPLIT_PRE_TOKENIZERS, SUPPORTED_ARCHS, expected_tensor_names, expected_tensor_shapes,
                          gdn_from_gguf, moe_from_gguf)
from .hf import Loaded, check_fits_in_memory

# enum llama_ftype values (general.file_type) -> llama.cpp's names, from gguf-py's LlamaFileType
FILE_TYPE_NAMES = {int(t): llama_file_type_name(int(t)) for t in LlamaFileType if t is not LlamaFileType.GUESSED}
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
    ffn_dim: int = 0
    rotary_dim: int = 0
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    context_length: int = 2048
    tensor_types: dict[str, str] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    recurrent_layers: tuple[int, ...] = ()  # real layers that are Gated DeltaNet (a hybrid)
    nextn_layers: int = 0  # multi-token-prediction blocks after the trunk (llama.cpp's speculative-decoding head)
    ssm: dict = field(default_factory=dict)  # their shapes: state, inner, heads, groups, conv (the ssm.* keys)
    moe: dict = field(default_factory=dict)  # a MoE's experts, used, expert_ffn, shared_ffn (the expert_* keys)

    @property
    def bits_per_weight(self) -> float:
        return self.metadata.get("_bits_per_weight", float("nan"))


def _field(reader, key: str, default=None):
    f = reader.get_field(key)
    if f is None:
        return default
    try:
        return f.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as e:  # e.g. a string that is not UTF-8
        raise QuantgateError(f"{reader.data.filename}: metadata {key} cannot be read ({type(e).__name__})") from None


class _Meta:
    """Typed reads of GGUF metadata: a value of the wrong type or range is one error naming the key."""

    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path

    def int(self, key: str, default=None, lo: int = 1, hi: int = 1 << 40) -> int:
        v = _field(self.reader, key, default)
        if v is None:
            raise QuantgateError(f"{self.path}: metadata {key} is missing")
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise QuantgateError(f"{self.path}: metadata {key} = {str(v)[:40]} is not an integer in [{lo}, {hi}]")
        return v

    def float(self, key: str, default: float, hi: float = 1e30) -> float:
        v = _field(self.reader, key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= hi:
            raise QuantgateError(f"{self.path}: metadata {key} = {str(v)[:40]} is not a positive number")
        return float(v)

    def str(self, key: str, default: str | None = None) -> str | None:
        v = _field(self.reader, key, default)
        if v is not None and not isinstance(v, str):
            raise QuantgateError(f"{self.path}: metadata {key} must be a string")
        return v

    def list(self, key: str, item: type) -> list | None:
        v = _field(self.reader, key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(x, item) and (item is bool or not isinstance(x, bool))
                                              for x in v):
            raise QuantgateError(f"{self.path}: metadata {key} must be an array of {item.__name__}")
        return v


def open_reader(path: str | Path):
    """gguf-py reader over `path`, or a QuantgateError saying what is wrong with the file.

    gguf-py parses metadata arrays one element at a time: Qwen3.5's 248,320-token vocabulary takes it ~6 s, and
    `info`, `generate` and `eval` each opened a file three times. So the last readers are kept, keyed by the
    file's identity (device, inode, size, modification time), not its name: a file rewritten or replaced is parsed
    again, and a file quantgate checked under its temporary name and then renamed into place is not."""
    path = Path(path)
    if not path.exists():
        raise QuantgateError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise QuantgateError(f"{path} is not a file")
    st = path.stat()
    return _checked_reader(path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


class _ReaderCache:
    """The last `size` checked readers, keyed by file identity (functools.lru_cache keys on every argument, and
    the path must not be part of the key: a rename keeps the file). Written by hand for that one difference."""

    def __init__(self, parse, size: int = 2):
        self.parse, self.size, self.items = parse, size, OrderedDict()

    def __call__(self, path: Path, identity: tuple):
        if identity in self.items:
            self.items.move_to_end(identity)
            return self.items[identity]
        reader = self.parse(path, identity[2])
        self.items[identity] = reader
        while len(self.items) > self.size:
            self.items.popitem(last=False)
        return reader

    def forget(self, path: Path) -> None:
        """Drop a file's reader (a temporary file about to be removed: its mapping would keep the bytes alive)."""
        try:
            st = path.stat()
        except OSError:
            return
        self.items.pop((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), None)

    def cache_clear(self) -> None:
        self.items.clear()


def _parse_checked(path: Path, size: int):
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise QuantgateError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(str(path), "r")
    except Exception as e:  # a parser of untrusted bytes: any failure means a malformed file
        raise QuantgateError(f"{path}: corrupt or truncated GGUF ({type(e).__name__}: {str(e)[:100]})") from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
            raise QuantgateError(f"{path}: truncated GGUF (tensor {t.name} ends at byte {end}, file has {size})")
        if int(t.data_offset) % reader.alignment:
            raise QuantgateError(f"{path}: tensor {t.name} is not aligned to {reader.alignment} bytes")
        block = GGML_QUANT_SIZES[t.tensor_type][0]
        if len(t.shape) == 0 or any(int(d) == 0 for d in t.shape) or int(t.shape[0]) % block:
            raise QuantgateError(f"{path}: tensor {t.name} has shape {[int(d) for d in t.shape]}, not whole "
                                 f"{t.tensor_type.name} blocks of {block}")
    return reader


_checked_reader = _ReaderCache(_parse_checked)


def forget_readers() -> None:
    """Drop the kept readers: gguf-py holds a numpy view per metadata element (half a GB of Python objects for
    Qwen3.5's vocabulary and merges), which a long run that needs no more metadata should not carry."""
    _checked_reader.cache_clear()
    gc.collect()


def forget_reader(path: str | Path) -> None:
    """Drop the kept reader of `path` (a temporary file about to be removed)."""
    _checked_reader.forget(Path(path))


def inspect_gguf(path: str | Path) -> GGUFInfo:
    """Parse and validate a GGUF that quantgate can run; one clear error for anything else: metadata of the
    wrong type or range, and tensors whose set or shapes disagree with the header's hyperparameters."""
    path = Path(path)
    reader = open_reader(path)
    m = _Meta(reader, path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise QuantgateError(f"{path}: architecture {str(arch)[:40]!r} is not supported "
                             f"(quantgate runs {', '.join(SUPPORTED_ARCHS)})")
    n_blocks = m.int(f"{arch}.block_count", hi=1 << 12)
    n_embd = m.int(f"{arch}.embedding_length", hi=1 << 17)
    nextn = m.int(f"{arch}.nextn_predict_layers", 0, lo=0, hi=n_blocks - 1)
    identity = m.int("quantgate.identity_layers", 0, lo=0, hi=n_blocks - 1 - nextn)
    n_heads = m.int(f"{arch}.attention.head_count", hi=1 << 12)
    n_kv = m.int(f"{arch}.attention.head_count_kv", n_heads, hi=n_heads)
    if n_heads % n_kv:
        raise QuantgateError(f"{path}: head_count {n_heads} is not a multiple of head_count_kv {n_kv}")
    head_dim = m.int(f"{arch}.attention.key_length", n_embd // n_heads or None, hi=1 << 12)
    m.int(f"{arch}.attention.value_length", head_dim, lo=head_dim, hi=head_dim)
    moe = {}
    if arch == ARCH_NAMES["moe"]:  # expert widths instead of one dense feed_forward_length
        E = m.int(f"{arch}.expert_count", hi=1 << 16)
        moe = {"experts": E, "used": m.int(f"{arch}.expert_used_count", hi=E),
               "expert_ffn": m.int(f"{arch}.expert_feed_forward_length", hi=1 << 20),
               "shared_ffn": m.int(f"{arch}.expert_shared_feed_forward_length", hi=1 << 20)}
    ffn = _field(reader, f"{arch}.feed_forward_length", moe.get("shared_ffn"))
    ffn = ffn[0] if isinstance(ffn, list) and ffn else ffn
    if isinstance(ffn, bool) or not isinstance(ffn, int) or not 0 < ffn <= 1 << 20:
        raise QuantgateError(f"{path}: metadata {arch}.feed_forward_length = {str(ffn)[:40]} is not a positive integer")
    rot = m.int(f"{arch}.rope.dimension_count", head_dim, hi=head_dim)
    if rot % 2:
        raise QuantgateError(f"{path}: rope.dimension_count {rot} is odd")
    _check_plain_rope(m, arch, path)
    n_layers = n_blocks - identity - nextn
    flags = m.list(f"{arch}.attention.recurrent_layers", bool) or []
    recurrent = tuple(i for i, f in enumerate(flags[:n_layers]) if f)
    if n_layers and len(recurrent) == n_layers:
        raise QuantgateError(f"{path}: every layer is recurrent (no full-attention layer): quantgate runs hybrids with "
                             f"at least one gated full-attention layer")
    if any(flags[n_layers + identity:]):
        raise QuantgateError(f"{path}: {arch}.attention.recurrent_layers marks an MTP block recurrent")
    tensors = {t.name: t for t in reader.tensors}
    _check_tensor_set(path, arch, n_layers, identity, set(tensors), n_blocks, recurrent, nextn)
    if flags and len(flags) != n_blocks:  # after the tensor set, which names a wrong block count more plainly
        raise QuantgateError(f"{path}: {arch}.attention.recurrent_layers lists {len(flags)} layers, block_count is "
                             f"{n_blocks}")
    emb_rows = int(tensors["token_embd.weight"].shape[1]) if len(tensors["token_embd.weight"].shape) == 2 else 0
    if emb_rows < 1:
        raise QuantgateError(f"{path}: token_embd.weight is not a matrix")
    hp = {"vocab": emb_rows, "dim": n_embd, "heads": n_heads, "kv_heads": n_kv, "head_dim": head_dim, "ffn": ffn,
          **moe}
    if identity or recurrent:
        hp.update(ssm_state=m.int(f"{arch}.ssm.state_size", hi=1 << 16),
                  ssm_inner=m.int(f"{arch}.ssm.inner_size", hi=1 << 20),
                  ssm_heads=m.int(f"{arch}.ssm.time_step_rank", hi=1 << 12),
                  ssm_groups=m.int(f"{arch}.ssm.group_count", hi=1 << 12),
                  ssm_conv=m.int(f"{arch}.ssm.conv_kernel", hi=64))
    _check_tensor_shapes(path, arch, n_layers, identity, tensors, hp, recurrent, nextn)
    tokens = m.list("tokenizer.ggml.tokens", str)
    if tokens is None:
        raise QuantgateError(f"{path}: no embedded tokenizer (tokenizer.ggml.tokens)")
    if len(tokens) != emb_rows:
        raise QuantgateError(f"{path}: the tokenizer has {len(tokens)} tokens but token_embd has {emb_rows} rows "
                             f"(tokenizer/vocab mismatch)")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    ftype = m.int("general.file_type", 0, lo=0, hi=1 << 16)
    n_weights = sum(int(np.prod(t.shape, dtype=np.float64)) for t in reader.tensors)
    n_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    meta = {"name": m.str("general.name"), "quantgate_version": m.str("quantgate.version"),
            "_bits_per_weight": 8 * n_bytes / max(n_weights, 1)}
    row = GGUF_ARCHS[arch]
    gate = m.str("quantgate.gate", row.read_gate)
    if gate not in row.exported_gates or (gate == "none" and arch != "qwen3" and not recurrent):
        raise QuantgateError(f"{path}: metadata quantgate.gate {gate!r} does not fit arch {arch}")
    return GGUFInfo(
        path=path, arch=arch, n_layers=n_layers, n_blocks=n_blocks, vocab_size=emb_rows, n_embd=n_embd,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, gate=gate,
        source_layout=m.str("quantgate.source_layout", "unknown"),
        file_type=FILE_TYPE_NAMES.get(ftype, f"ftype {ftype}"),
        n_bytes=path.stat().st_size, ffn_dim=ffn, rotary_dim=rot,
        rope_base=m.float(f"{arch}.rope.freq_base", 10000.0),
        norm_eps=m.float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, hi=1.0),
        context_length=m.int(f"{arch}.context_length", 2048, hi=1 << 24), tensor_types=types, metadata=meta,
        recurrent_layers=recurrent, nextn_layers=nextn, ssm={k[4:]: v for k, v in hp.items() if k.startswith("ssm_")} if recurrent else {},
        moe=moe)


def _check_plain_rope(m: _Meta, arch: str, path: Path) -> None:
    """llama.cpp reads rope scaling from these keys (llama_model_loader: LLM_KV_ROPE_SCALING_*, ROPE_SCALE_LINEAR);
    quantgate's runners compute plain rope, so a file that scales it is refused, not run with other logits."""
    kind = m.str(f"{arch}.rope.scaling.type", "none")
    factor = _field(m.reader, f"{arch}.rope.scaling.factor", None)
    linear = _field(m.reader, f"{arch}.rope.scale_linear", None)
    scaled = [f"{k} = {v}" for k, v in ((f"{arch}.rope.scaling.factor", factor), (f"{arch}.rope.scale_linear", linear))
              if v not in (None, 0, 0.0, 1, 1.0)]
    if kind not in ("none", "linear") or scaled:
        what = f"{arch}.rope.scaling.type = {kind!r}" if kind not in ("none", "linear") else ", ".join(scaled)
        raise QuantgateError(f"{path}: {what}: a scaled rope, which quantgate does not run (it runs plain rope only)")


def _check_tensor_set(path: Path, arch: str, n_layers: int, identity: int, names: set[str], n_blocks: int,
                      recurrent: tuple = (), nextn: int = 0) -> None:
    """The tensor table must hold exactly what the header's architecture and block count call for; a wrong
    tensor count in the header shows up here as a missing or nameless tensor."""
    optional = {f"blk.{i}.attn_{qk}_norm.weight" for i in range(n_layers) for qk in "qk"} | {"output.weight"}
    expected = expected_tensor_names(arch, n_layers, tied=False, identity=identity, recurrent=recurrent, nextn=nextn)
    mtp_extra = {f"blk.{n_layers + identity}.{n}" for n in MTP_OPTIONAL} if nextn else set()
    expected, optional = expected | mtp_extra, optional | mtp_extra
    missing = sorted(expected - optional - names)
    extra = sorted(names - expected)
    if missing:
        raise QuantgateError(f"{path}: tensor {missing[0]} is missing (+{len(missing) - 1} more; "
                             f"{arch}.block_count = {n_blocks}, {len(names)} tensors in the file)")
    if extra:
        raise QuantgateError(f"{path}: unexpected tensor {extra[0]!r} (+{len(extra) - 1} more; the header's tensor "
                             f"count or block count does not match the tensors)")


def _check_tensor_shapes(path: Path, arch: str, n_layers: int, identity: int, tensors: dict, hp: dict,
                         recurrent: tuple = (), nextn: int = 0) -> None:
    """Every tensor's shape must be what the header's hyperparameters imply (llama.cpp checks the same on load,
    but a failed check there can take the process down)."""
    def ggml_dims(dims) -> tuple:  # GGUF lists dims innermost first; ggml drops trailing dims of size 1
        dims = [int(d) for d in dims]
        while len(dims) > 1 and dims[-1] == 1:
            dims.pop()
        return tuple(dims)

    for name, shape in expected_tensor_shapes(arch, n_layers, identity, hp, recurrent, nextn).items():
        t = tensors.get(name)
        if t is not None and ggml_dims(t.shape) != ggml_dims(reversed(shape)):
            got = tuple(int(d) for d in reversed(t.shape))
            raise QuantgateError(f"{path}: tensor {name} has shape {got}, the header implies {shape}")


# Byte offsets of the fp16 scales inside one block of each quantized type (ggml-common.h's block structs): a
# quantized block is non-finite exactly when one of its scales is, its quants being integers.
F16_SCALE_OFFSETS = {
    "Q8_0": (34, (0,)), "Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)), "Q5_1": (24, (0, 2)),
    "Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
    "Q6_K": (210, (208,)), "IQ4_NL": (18, (0,)), "IQ4_XS": (136, (0,)), "IQ3_S": (110, (0,)), "IQ3_XXS": (98, (0,)),
}


FINITE_CHUNK_BYTES = 64 << 20  # check_finite_weights reads a tensor this much at a time


def check_finite_weights(path: str | Path) -> None:
    """Refuse a GGUF holding NaN or Inf weights before llama.cpp scores it: float tensors value by value,
    quantized ones by their block scales (nothing dequantized). The bytes are read with plain reads, a chunk at a
    time, not through the reader's memory map: a map's touched pages stay resident as long as it lives, so a 0.8B
    model's check would hold the whole file in this process's memory while llama.cpp (another process) runs it."""
    reader = open_reader(path)
    with open(path, "rb") as f:
        for t in reader.tensors:
            kind = t.tensor_type.name
            if kind in ("F32", "F16", "F64", "BF16"):
                item = {"F32": 4, "F16": 2, "F64": 8, "BF16": 2}[kind]
            elif kind in F16_SCALE_OFFSETS:
                item = F16_SCALE_OFFSETS[kind][0]  # whole blocks per chunk
            else:
                continue  # other types: the runner's finite-logits check still stands guard
            step = max(1, FINITE_CHUNK_BYTES // item) * item
            f.seek(int(t.data_offset))
            left = int(t.n_bytes)
            while left > 0:
                raw = np.frombuffer(f.read(min(step, left)), dtype=np.uint8)
                if not raw.size:
                    raise QuantgateError(f"{path}: truncated GGUF (tensor {t.name} ends past the file's end)")
                left -= len(raw)
                if _nonfinite(raw, kind):
                    raise QuantgateError(f"{path}: tensor {t.name} ({kind}) holds NaN or Inf values")


def _nonfinite(raw: np.ndarray, kind: str) -> bool:
    """Whether a chunk of whole values (float types) or whole blocks (quantized types) holds a NaN or Inf."""
    if kind in ("F32", "F16", "F64"):
        return not np.isfinite(raw.view({"F32": np.float32, "F16": np.float16, "F64": np.float64}[kind])).all()
    if kind == "BF16":
        return bool(((raw.view(np.uint16) & 0x7F80) == 0x7F80).any())
    size, offsets = F16_SCALE_OFFSETS[kind]
    blocks = raw.reshape(-1, size)
    return any(not np.isfinite(blocks[:, o:o + 2].copy().view(np.float16)).all() for o in offsets)


def read_tensor(reader, name: str) -> np.ndarray:
    """Dequantized float32 tensor in PyTorch orientation ([out, in] for matrices), via gguf-py."""
    for t in reader.tensors:
        if t.name == name:
            try:
                with np.errstate(all="ignore"):  # non-finite values are refused by the caller, not warned about
                    a = dequantize(t.data, t.tensor_type)
                return np.array(a, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])  # a writable copy
            except (NotImplementedError, ValueError, TypeError) as e:  # a type gguf-py cannot dequantize, a bad shape
                raise QuantgateError(f"tensor {name} ({t.tensor_type.name}) cannot be read: {str(e)[:80]}") from None
    raise QuantgateError(f"tensor {name} is not in the GGUF")


def tokenizer_from_gguf(reader) -> Tokenizer:
    """Rebuild the HF byte-level BPE tokenizer from `tokenizer.ggml.*` (the inverse of the exporter).

    Written by hand because no library turns GGUF vocab metadata back into a `tokenizers` object.
    """
    path = Path(reader.data.filename)
    m = _Meta(reader, path)
    model, pre = m.str("tokenizer.ggml.model"), m.str("tokenizer.ggml.pre")
    if model != "gpt2" or pre not in ("gpt-2", *SPLIT_PRE_TOKENIZERS):
        raise QuantgateError(f"{path}: tokenizer {str(model)[:20]!r}/{str(pre)[:20]!r} is not supported "
                             f"(byte-level BPE gpt-2, qwen2 or qwen35 only)")
    tokens = m.list("tokenizer.ggml.tokens", str) or []
    types = m.list("tokenizer.ggml.token_type", int) or [1] * len(tokens)
    if len(types) != len(tokens) or len(set(tokens)) != len(tokens):
        raise QuantgateError(f"{path}: tokenizer.ggml.token_type must give one type per token, and tokens must be "
                             f"unique ({len(tokens)} tokens, {len(set(tokens))} distinct, {len(types)} types)")
    known = {t for i, t in enumerate(tokens) if types[i] == 1}
    merges = [x.split(" ", 1) for x in (m.list("tokenizer.ggml.merges", str) or [])]
    merges = [x for x in merges if len(x) == 2 and x[0] in known and x[1] in known]  # drops the placeholder merge
    try:
        tok = _hf_tokenizer(tokens, types, merges, pre)
    except Exception as e:  # tokenizers raises plain Exceptions for a spec it cannot build
        raise QuantgateError(f"{path}: the embedded tokenizer cannot be rebuilt ({str(e).splitlines()[0][:80]})") \
            from None
    n = len(tokens)
    bos = m.int("tokenizer.ggml.bos_token_id", 0, lo=0, hi=n - 1)
    eos = m.int("tokenizer.ggml.eos_token_id", bos, lo=0, hi=n - 1)
    pad = m.int("tokenizer.ggml.padding_token_id", eos, lo=0, hi=n - 1)
    return Tokenizer(tok, bos, eos, pad)


def _hf_tokenizer(tokens: list[str], types: list[int], merges: list, pre: str):
    """Built through a tokenizer.json spec, where every token (special or not) keeps its GGUF id."""
    vocab = {t: i for i, t in enumerate(tokens)}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(tokens) if types[i] != 1]
    if pre == "gpt-2":
        pre_tok = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    else:
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT_PRE_TOKENIZERS[pre]}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    normalizer = {"type": "NFC"} if pre == "qwen35" else None  # Qwen3.5's tokenizer.json normalizes; llama.cpp not
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
            "pre_tokenizer": pre_tok, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": [list(m) for m in merges]}}
    return HFTokenizer.from_str(json.dumps(spec))


def gguf_config(info: GGUFInfo, names: set[str], tok: Tokenizer) -> ModelConfig:
    """Our ModelConfig for a GGUF, from its header and tensor names alone (`info` and the reader use it before a
    weight is read)."""
    first_attention = next(i for i in range(info.n_layers) if i not in info.recurrent_layers)
    hybrid = {}
    if info.recurrent_layers:
        ssm = info.ssm
        hybrid = dict(layer_types=tuple("linear_attention" if i in info.recurrent_layers else "full_attention"
                                        for i in range(info.n_layers)),
                      linear_key_heads=ssm["groups"], linear_value_heads=ssm["heads"], linear_key_dim=ssm["state"],
                      linear_value_dim=ssm["inner"] // ssm["heads"], linear_conv_kernel=ssm["conv"])
    if info.moe:
        hybrid.update(n_experts=info.moe["experts"], n_experts_used=info.moe["used"],
                      expert_ffn_dim=info.moe["expert_ffn"], shared_expert_ffn_dim=info.moe["shared_ffn"])
    try:
        return ModelConfig(vocab_size=info.vocab_size, dim=info.n_embd, n_layers=info.n_layers, n_heads=info.n_heads,
                           n_kv_heads=info.n_kv_heads, head_dim=info.head_dim, **hybrid,
                           ffn_dim=info.ffn_dim, gate="none" if info.gate == "none" else GGUF_ARCHS[info.arch].read_gate,
                           rope_theta=info.rope_base, partial_rotary=info.rotary_dim / info.head_dim,
                           qk_norm=f"blk.{first_attention}.attn_q_norm.weight" in names,
                           tie_embeddings="output.weight" not in names,
                           norm_eps=info.norm_eps, max_seq_len=info.context_length,
                           bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id,
                           extra={"source_layout": f"gguf:{info.arch}", "gguf_file_type": info.file_type,
                                  "exported_gate": info.gate})
    except ValueError as e:
        raise QuantgateError(f"{info.path}: {e}") from None


def global_state(cfg: ModelConfig, names: set[str], read) -> dict[str, torch.Tensor]:
    """Our embedding, final norm and head from `read(GGUF name) -> fp32 torch tensor`."""
    return {ours: read(theirs) for ours, theirs in GLOBAL_TENSORS.items() if theirs in names}


def layer_state(cfg: ModelConfig, arch: str, names: set[str], read, i: int) -> dict[str, torch.Tensor]:
    """Our parameters of layer i from `read(GGUF name) -> fp32 torch tensor`: the inverse of the exporter, in torch
    operations only (indexing, views, a division), so a gradient flows back to the tensors `read` returned:
    quant.gradient differentiates the GGUF's own tensors through it."""
    row = GGUF_ARCHS[arch]
    linear = cfg.layer_type(i) == "linear_attention"
    table = dict(BLOCK_TENSORS if linear else LAYER_TENSORS, **{"post_attention_layernorm.weight": row.post_attention_norm})
    sd = {f"layers.{i}.{ours}": read(f"blk.{i}.{theirs}") for ours, theirs in table.items()
          if f"blk.{i}.{theirs}" in names}
    if cfg.is_moe:
        sd.update(moe_from_gguf(cfg, read, i))
    if linear:
        sd.update(gdn_from_gguf(cfg, read, i))
        return sd
    q, g = row.split_q(read(f"blk.{i}.{Q_TENSOR}"), cfg)
    if g is not None and cfg.gate != "none":
        sd[f"layers.{i}.self_attn.g_proj.weight"] = g.contiguous()
    elif g is not None:  # a hybrid baseline: zero gate rows, attn_output doubled
        sd[f"layers.{i}.self_attn.o_proj.weight"] = sd[f"layers.{i}.self_attn.o_proj.weight"] / 2
    sd[f"layers.{i}.self_attn.q_proj.weight"] = q.contiguous()
    return sd


def load_gguf_model(path: str | Path):
    """Our PyTorch Model from a GGUF, every tensor dequantized to fp32 (the inverse of the exporter).

    A qwen35 file gives an elementwise-gated model (llama.cpp's graph is elementwise; a headwise gate
    is exported as equal rows per head). Used for gate-survival checks, importance matrices computed
    from a GGUF, and `quantgate analyze`/`info` on GGUF files.
    """
    info = inspect_gguf(path)
    reader = open_reader(path)
    arch = info.arch
    names = {t.name for t in reader.tensors}
    tok = tokenizer_from_gguf(reader)
    cfg = gguf_config(info, names, tok)
    check_fits_in_memory(cfg, str(path))
    with torch.device("meta"):  # the tensors read below are assigned to it: the weights are held once
        model = Model(cfg)
    read = lambda n: torch.from_numpy(read_tensor(reader, n))  # noqa: E731
    sd = global_state(cfg, names, read)
    for i in range(cfg.n_layers):
        sd.update(layer_state(cfg, arch, names, read, i))
    expected = model.state_dict()
    for k, v in sd.items():
        t = torch.as_tensor(v)
        if k not in expected or tuple(t.shape) != tuple(expected[k].shape):
            raise QuantgateError(f"{path}: tensor for {k} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(expected[k].shape) if k in expected else 'none'}")
        if not torch.isfinite(t).all():
            raise QuantgateError(f"{path}: tensor for {k} holds NaN or Inf values")
        sd[k] = t.to(torch.float32, copy=True)  # its own memory: a view of the file must not become a parameter
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing:
        raise QuantgateError(f"{path}: tensors missing for {missing[0]} (+{len(missing) - 1} more)")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval()
    return Loaded(model, tok, f"gguf:{arch}", Path(path))
