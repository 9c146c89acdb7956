"""`quantgate generate`: stream text from a GGUF (llama.cpp), an ONNX export (ONNX Runtime) or a model
directory (PyTorch), each with its KV cache.

The prompt is encoded without special tokens and BOS goes first, the convention of training and eval.
Text is decoded incrementally as UTF-8, so a character split over two byte-level tokens prints whole.
Prefill and decode speeds are reported separately: prefill is one batched pass over the prompt,
decode one token per step.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .errors import QuantgateError
from .formats import artifact_kind, load_checkpoint
from .formats.gguf import check_finite_weights, inspect_gguf, open_reader, tokenizer_from_gguf
from .formats.onnx import check_finite_initializers, onnx_context
from .formats.onnx_io import read_meta, resolve_onnx
from .quant.simulate import saved_kv_bits
from .runners import LlamaRunner, OrtRunner
from .tokenizer import load_tokenizer


@dataclass
class GenerateResult:
    text: str
    prompt_tokens: int
    new_tokens: int
    prefill_tps: float
    decode_tps: float
    backend: str
    context: int = 0                 # the model's context in tokens (prompt and new tokens share it)
    stopped_at_context: bool = False  # fewer than --max-tokens because the context was full

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def token_budget(n_prompt: int, max_tokens: int, context: int, model_path) -> int:
    """The one rule on every backend: a prompt (BOS included) must leave room for one new token in the model's
    context, else it is refused; new tokens stop when the context is full."""
    if n_prompt >= context:
        raise QuantgateError(f"the prompt is {n_prompt} tokens (BOS included) and {model_path}'s context is "
                             f"{context}: shorten the prompt")
    return min(max_tokens, context - n_prompt)


def _torch_tokens(model, ids: list[int], max_tokens: int, temperature: float, seed: int, eos: int,
                  timing: dict) -> Iterator[int]:
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        t0 = time.perf_counter()
        kv = saved_kv_bits(model)  # a kv-int8/kv-int4 checkpoint decodes on the cache it was scored with
        out = model(torch.tensor([ids]), past=[None] * model.cfg.n_layers, start_pos=0, kv_bits=kv)  # empty cache
        past, pos = out["past"], len(ids)
        logits = out["logits"][0, -1]
        timing["prefill_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        for n in range(max_tokens):
            if not torch.isfinite(logits).all():
                raise QuantgateError("the model produced NaN or Inf logits: its activations overflowed")
            if temperature > 0:
                tok = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))
            else:
                tok = int(logits.argmax())
            if tok == eos:
                break
            yield tok
            if n + 1 == max_tokens:
                break
            out = model(torch.tensor([[tok]]), past=past, start_pos=pos, kv_bits=kv)
            past, pos, logits = out["past"], pos + 1, out["logits"][0, -1]
        timing["decode_s"] = time.perf_counter() - t1


def _emit_tail(tok, new: list[int], prev: str, pieces: list[str], on_text) -> str:
    """Byte-level BPE: decode all new tokens, emit what was not emitted yet, hold back a split character."""
    text = tok.decode(new)
    if text.endswith("\ufffd") or not text.startswith(prev):
        return prev
    if len(text) > len(prev):
        pieces.append(text[len(prev):])
        if on_text:
            on_text(text[len(prev):])
    return text


def generate(model_path: str, prompt: str, max_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
             kv_type: str = "f16", threads: int | None = None,
             on_text: Callable[[str], None] | None = None) -> GenerateResult:
    """Generate from `prompt`, calling on_text(piece) as text arrives; returns the text and speeds."""
    if max_tokens < 1:
        raise QuantgateError("--max-tokens must be at least 1")
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces: list[str] = []

    def emit(b: bytes) -> None:
        s = decoder.decode(b)
        if s:
            pieces.append(s)
            if on_text:
                on_text(s)

    kind = artifact_kind(model_path)
    if kind == "gguf":
        context = inspect_gguf(model_path).context_length
        check_finite_weights(model_path)
        tok = tokenizer_from_gguf(open_reader(model_path))
        ids = [tok.bos_id] + tok.encode(prompt)
        budget = token_budget(len(ids), max_tokens, context, model_path)
        with LlamaRunner(model_path, n_ctx=len(ids) + budget, kv_type=kv_type, threads=threads,
                         logits_all=False) as r:
            for _tid, b in r.generate(ids, budget, temperature, seed, stop_ids=(tok.eos_id,)):
                emit(b)
            st = r.last_stats
            backend = f"llama.cpp:{r.info.file_type} (KV {kv_type})"
        emit(b"")
        return GenerateResult("".join(pieces), len(ids), st.generated_tokens, st.prefill_tps, st.decode_tps, backend,
                              context, budget < max_tokens and st.generated_tokens == budget)

    if kind == "onnx":
        onnx_path, model_dir = resolve_onnx(model_path)
        meta = read_meta(model_dir)
        context = onnx_context(model_dir)
        tok = load_tokenizer(model_dir, meta.get("bos_id"), meta.get("eos_id"))
        ids = [tok.bos_id] + tok.encode(prompt)
        budget = token_budget(len(ids), max_tokens, context, model_path)
        with OrtRunner(model_path, threads=threads) as r:
            check_finite_initializers(onnx_path)
            new: list[int] = []
            prev = ""
            for t in r.generate(ids, budget, temperature, seed, stop_ids=(tok.eos_id,)):
                new.append(t)
                prev = _emit_tail(tok, new, prev, pieces, on_text)
            pre_s, dec_s, n = r.last_stats
        scheme = (meta.get("quantization") or {}).get("scheme") or meta.get("dtype", "fp32")
        return GenerateResult("".join(pieces), len(ids), n, len(ids) / pre_s,
                              (n - 1) / dec_s if n > 1 and dec_s > 0 else float("nan"), f"onnxruntime:{scheme}",
                              context, budget < max_tokens and n == budget)

    loaded = load_checkpoint(model_path)
    tok = loaded.tokenizer
    if tok is None:
        raise QuantgateError(f"{model_path}: no tokenizer.json, cannot encode the prompt")
    if threads:
        torch.set_num_threads(threads)
    ids = [tok.bos_id] + tok.encode(prompt)
    context = loaded.model.cfg.max_seq_len
    budget = token_budget(len(ids), max_tokens, context, model_path)
    timing: dict = {}
    new: list[int] = []
    prev = ""
    for t in _torch_tokens(loaded.model, ids, budget, temperature, seed, tok.eos_id, timing):
        new.append(t)
        prev = _emit_tail(tok, new, prev, pieces, on_text)
    n = len(new)
    return GenerateResult("".join(pieces), len(ids), n, len(ids) / timing["prefill_s"],
                          (n - 1) / timing["decode_s"] if n > 1 and timing.get("decode_s") else float("nan"), "torch",
                          context, budget < max_tokens and n == budget)
