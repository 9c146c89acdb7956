"""One door from a model path to a runner: `open_runner(path)` for a .gguf (llama.cpp), an ONNX export (ONNX Runtime)
or a model directory (PyTorch, block by block when it does not fit), with its tokenizer and context.

`eval`, `generate`, the report's cells and the allocator's sensitivity runs all open models here, so every one of
them applies the same checks in the same order: the file's own header, the model's context against what the caller
asks for (`size`), finite weights, and a tokenizer that fits the logits. Not imported by `quantgate.runners`'
package: it sits above the formats, the layer-by-layer runner and torchao, which the runners themselves do not need.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..calib_data import check_ctx
from ..errors import QuantgateError
from ..formats import artifact_kind, load_checkpoint
from ..formats.gguf import check_finite_weights, forget_readers, inspect_gguf, open_reader, tokenizer_from_gguf
from ..formats.hf import open_hf
from ..formats.onnx import check_finite_initializers, onnx_context
from ..formats.onnx_io import onnx_bytes, read_meta, resolve_onnx
from ..layerwise import LayerwiseRunner, check_layerwise_applies, needs_layerwise
from ..quant.torchao_backend import quantize_torchao_
from ..tokenizer import Tokenizer, load_tokenizer
from .kv import ROUNDED_KV_TYPES, kv_bits_for
from .llama import LlamaRunner
from .ort import OrtRunner
from .pytorch import TorchRunner

# (tokenizer, the model's context) -> the context the runner needs (llama.cpp sizes its own to it), or an error
Size = Callable[[Tokenizer, int], int]


@dataclass
class Opened:
    """What `open_runner` gives: the runner (close it, or use it as a context manager), the tokenizer, the model's
    own context length, the backend in words (`llama.cpp:Q4_K_M`, `onnxruntime:int4`, `torch`), the KV cache it
    runs with in words when it rounds one, and what an evaluation records about the artifact."""
    runner: object
    tokenizer: Tokenizer
    context: int
    backend: str
    kv: str | None = None
    record: dict = field(default_factory=dict)
    loaded: object | None = None  # a model directory loaded whole (its quantization scheme, for layer SQNR)


def fixed_ctx(ctx: int, path) -> Size:
    """A Size for windows of `ctx` tokens: refused in one line when the model's context is shorter."""
    def size(_tok: Tokenizer, context: int) -> int:
        check_ctx(ctx, context, path)
        return ctx
    return size


def open_runner(path: str, size: Size, device: str = "cpu", kv_type: str = "f32", threads: int | None = None,
                logits_all: bool = True, torchao: str | None = None, layerwise: bool | None = None) -> Opened:
    """Open the model at `path` as a runner. `size(tokenizer, context)` checks the caller's need against the model's
    context and returns the context llama.cpp allocates; `logits_all=False`: llama.cpp keeps the last position's
    logits only (generation); `torchao` and `layerwise` apply to model directories."""
    kind = artifact_kind(path)
    check_layerwise_applies(layerwise, kind, path)
    if torchao and kind != "hf":
        raise QuantgateError(f"--torchao applies to PyTorch model directories, not {'GGUF files' if kind == 'gguf' else 'ONNX exports'}")
    if kind == "gguf":
        return _gguf(path, size, device, kv_type, threads, logits_all)
    if kind == "onnx":
        return _onnx(path, size, device, kv_type, threads)
    return _torch(path, size, device, kv_type, threads, torchao, layerwise)


def _gguf(path, size: Size, device, kv_type, threads, logits_all) -> Opened:
    context = inspect_gguf(path).context_length
    check_finite_weights(path)
    tok = tokenizer_from_gguf(open_reader(path))
    n_ctx = size(tok, context)
    runner = LlamaRunner(path, n_ctx=n_ctx, kv_type=kv_type, threads=threads, logits_all=logits_all, device=device)
    forget_readers()  # the metadata is read: the reader's objects would ride along the whole run
    return Opened(runner, tok, context, f"llama.cpp:{runner.info.file_type}", f"KV {kv_type}",
                  {"kv_type": kv_type, "file_bytes": runner.info.n_bytes, "kv_rotation": runner.kv_rotation["reading"]})


def _onnx(path, size: Size, device, kv_type, threads) -> Opened:
    onnx_path, model_dir = resolve_onnx(path)
    meta = read_meta(model_dir)
    context = onnx_context(model_dir)
    tok = load_tokenizer(model_dir, meta.get("bos_id"), meta.get("eos_id"))
    size(tok, context)  # before anything is loaded
    kv_bits = kv_bits_for(kv_type, "ONNX Runtime")
    runner = OrtRunner(path, device, threads, kv_bits=kv_bits)  # checks the graph first
    try:
        check_finite_initializers(onnx_path)
        if tok.vocab_size > (runner.vocab_size or tok.vocab_size):
            raise QuantgateError(f"{model_dir}/tokenizer.json has {tok.vocab_size} tokens but the graph's logits have "
                                 f"only {runner.vocab_size} (tokenizer/vocab mismatch)")
    except BaseException:
        runner.close()
        raise
    scheme = (meta.get("quantization") or {}).get("scheme") or meta.get("dtype", "fp32")
    return Opened(runner, tok, context, f"onnxruntime:{scheme}", f"KV int{kv_bits}" if kv_bits else None,
                  {"file_bytes": onnx_bytes(model_dir), **_kv_record(kv_type)})


def _torch(path, size: Size, device, kv_type, threads, torchao, layerwise) -> Opened:
    kv_bits = kv_bits_for(kv_type, "PyTorch")
    if layerwise and (torchao or kv_bits):
        raise QuantgateError("--layerwise runs the model block by block as its directory holds it; it does not combine "
                             "with --torchao or a rounded --kv-type")
    if threads:
        torch.set_num_threads(threads)
    if layerwise is not False and not torchao and not kv_bits:
        ckpt = open_hf(path, must_fit_block_by_block=True)
        if layerwise or needs_layerwise(ckpt.cfg):
            if ckpt.tokenizer is None:
                raise QuantgateError(f"{path}: no tokenizer.json, cannot tokenize text")
            if device != "cpu":
                raise QuantgateError(f"{path}: too large for memory, it is run layer by layer, on the CPU only")
            size(ckpt.tokenizer, ckpt.cfg.max_seq_len)
            runner = LayerwiseRunner(ckpt)
            kv = runner.lw.kv_bits
            return Opened(runner, ckpt.tokenizer, ckpt.cfg.max_seq_len, "torch (layer by layer)",
                          f"KV int{kv}" if kv else None, _kv_record(f"int{kv}") if kv else {})
    loaded = load_checkpoint(path)
    if loaded.tokenizer is None:
        raise QuantgateError(f"{path}: no tokenizer.json, cannot tokenize text")
    context = loaded.model.cfg.max_seq_len
    size(loaded.tokenizer, context)
    model, backend = loaded.model, "torch"
    if torchao:
        model, backend = quantize_torchao_(model, torchao, device), f"torchao:{torchao}"
    runner = TorchRunner(model, device, kv_bits=kv_bits)
    kv = f"int{runner.kv_bits}" if runner.kv_bits else kv_type
    return Opened(runner, loaded.tokenizer, context, backend, f"KV {kv}" if runner.kv_bits else None,
                  _kv_record(kv), loaded)


def _kv_record(kv_type: str) -> dict:
    """What a PyTorch or ONNX Runtime result says about its cache: only a rounded one is worth a field."""
    return {"kv_cache": kv_type} if kv_type in ROUNDED_KV_TYPES else {}
