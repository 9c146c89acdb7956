"""The memory-bandwidth bound on decode: how fast a token could come if reading the weights were all it cost.

Decoding one token reads every weight matrix once (the token embedding only for one row, unless it is also the
output matrix), the KV cache of every attention layer up to the current position, and a hybrid's recurrent states.
At a measured read bandwidth B (bytes/s), the bound is B / (bytes read per token); a runner's decode speed as a
fraction of it says how much of the machine a format uses. On laptops with a few cores decode is often
compute-bound instead, and the fraction shows that too.

The read bandwidth is measured as torch's multi-threaded sum over a buffer far larger than any cache (decode reads
weights and writes almost nothing, and uses every core: a single-threaded copy undercounts it, and a GGUF decoded
faster than a numpy copy's rate here); numpy's copy (STREAM's convention, bytes read plus written) is kept beside it
for comparison. No library we depend on measures either, hence these few lines. The per-token bytes come from the
file itself (GGUF tensor sizes, ONNX initializer sizes without loading their data, a checkpoint's parameters).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper

from .formats import artifact_kind, load_checkpoint
from .formats.gguf import inspect_gguf, open_reader
from .formats.onnx_io import decoder_inputs
from .formats.onnx_io import resolve_onnx

def copy_bandwidth(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Median copy bandwidth in bytes/s over `repeats` copies of an `n_bytes` buffer (read + write counted), far
    larger than any CPU cache so the memory bus, not the cache, is measured."""
    src = np.ones(n_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # page both buffers in before timing
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return 2 * src.nbytes / float(np.median(times))


def read_bandwidth(n_bytes: int = 512 << 20, repeats: int = 5, threads: int | None = None) -> float:
    """Median read bandwidth in bytes/s: torch.sum over an `n_bytes` float32 buffer on `threads` threads (default:
    torch's own count), the access pattern of a decode step's weight reads."""
    x = torch.ones(n_bytes // 4, dtype=torch.float32)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        x.sum()  # page in
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(old)
    return x.numel() * 4 / float(np.median(times))


@dataclass
class DecodeBytes:
    """What one decode step reads: weights (bytes), KV cache per cached position (bytes), fixed state (bytes)."""
    weights: int
    kv_per_position: int = 0
    state: int = 0

    def at(self, position: float) -> float:
        """Bytes read by a decode step with `position` tokens already cached."""
        return self.weights + self.kv_per_position * position + self.state

    def bound_tps(self, bandwidth: float, position: float) -> float:
        return bandwidth / self.at(position)


def gguf_decode_bytes(path: str | Path, kv_bytes_per_value: float = 2.0) -> DecodeBytes:
    """Per-token reads of a GGUF: every tensor but the token embedding (read whole when it is also the output,
    i.e. no output.weight), of a MoE's stacked experts only the expert_used_count of expert_count that one token
    runs, an F16 (default) KV cache over the attention layers, and the recurrent states (F32)."""
    reader = open_reader(path)
    info = inspect_gguf(path)
    mtp = tuple(f"blk.{i}." for i in range(info.n_blocks - info.nextn_layers, info.n_blocks))  # a draft's, not read
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors if not t.name.startswith(mtp or ("\0",))}
    tied = "output.weight" not in sizes
    active = info.moe["used"] / info.moe["experts"] if info.moe else 1.0
    weights = int(sum(b * (active if n.endswith("_exps.weight") else 1) for n, b in sizes.items()
                      if tied or n != "token_embd.weight"))
    n_attn = info.n_layers - len(info.recurrent_layers)
    kv = int(2 * n_attn * info.n_kv_heads * info.head_dim * kv_bytes_per_value)
    state = 0
    if info.recurrent_layers:
        s = info.ssm  # recurrent state [Hv, dk, dv] per layer in F32: Hv * dv = inner, dk = state
        state = len(info.recurrent_layers) * 4 * s.get("inner", 0) * s.get("state", 0)
    return DecodeBytes(weights, kv, state)


def onnx_decode_bytes(path: str | Path) -> DecodeBytes:
    """Per-token reads of an ONNX decoder: initializer bytes (from their shapes and types; external data is not
    loaded) except an embedding only a Gather reads, the fp32/fp16 KV cache of the attention layers, the GDN
    states."""
    model_path, _ = resolve_onnx(path)
    m = onnx.load(str(model_path), load_external_data=False)
    readers: dict[str, set[str]] = {}
    for n in m.graph.node:
        for x in n.input:
            readers.setdefault(x, set()).add(n.op_type)
    weights = 0
    for t in m.graph.initializer:
        size = int(np.prod(t.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        if readers.get(t.name) in ({"Gather"}, {"GatherBlockQuantized"}):
            continue  # a lookup table: one row per token
        weights += size
    kv, state = 0, 0
    for i in decoder_inputs(m)[3:]:
        dims = [d.dim_value for d in i.type.tensor_type.shape.dim][1:]
        item = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).itemsize
        if i.name.endswith((".key", ".value")):
            kv += int(np.prod([d for d in dims if d], dtype=np.int64)) * item  # the dynamic length left out
        else:
            state += int(np.prod(dims, dtype=np.int64)) * item
    return DecodeBytes(weights, kv, state)


def torch_decode_bytes(model) -> DecodeBytes:
    """Per-token reads of our PyTorch model in its own dtype: parameters but an untied embedding, fp32 KV, states."""
    cfg = model.cfg
    item = next(model.parameters()).element_size()
    active = cfg.n_experts_used / cfg.n_experts if cfg.is_moe else 1.0  # one token runs k of the routed experts
    weights = int(sum(p.numel() * (active if ".mlp.experts." in n else 1) for n, p in model.named_parameters()
                      if cfg.tie_embeddings or not n.startswith("embed_tokens")) * item)
    n_attn = sum(1 for i in range(cfg.n_layers) if cfg.layer_type(i) != "linear_attention")
    kv = 2 * n_attn * cfg.n_kv_heads * cfg.head_dim * 4
    state = (cfg.n_layers - n_attn) * 4 * cfg.linear_value_heads * cfg.linear_key_dim * cfg.linear_value_dim \
        if cfg.is_hybrid else 0
    return DecodeBytes(weights, kv, state)


def decode_bytes_for(path: str | Path) -> DecodeBytes:
    """The right reader for a GGUF file, an ONNX export or a model directory."""
    kind = artifact_kind(path)
    if kind == "gguf":
        return gguf_decode_bytes(path)
    if kind == "onnx":
        return onnx_decode_bytes(path)
    return torch_decode_bytes(load_checkpoint(path).model)
