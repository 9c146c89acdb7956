"""`quantgate generate`: stream text from a GGUF (llama.cpp), an ONNX export (ONNX Runtime) or a model
directory (PyTorch), each with its KV cache.

The prompt is encoded without special tokens and BOS goes first, the convention of training and eval.
Text is decoded incrementally as UTF-8, so a character split over two byte-level tokens prints whole.
Prefill and decode speeds are reported separately: prefill is one batched pass over the prompt,
decode one token per step; decode also as a fraction of the machine's memory-bandwidth bound (the bytes one
step reads over a read bandwidth measured on the spot, quantgate.bandwidth), which tells a laptop user whether a
smaller file would decode faster.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .bandwidth import gguf_decode_bytes, onnx_decode_bytes, read_bandwidth, torch_decode_bytes
from .errors import QuantgateError
from .formats import artifact_kind, load_checkpoint
from .formats.gguf import check_finite_weights, inspect_gguf, open_reader, tokenizer_from_gguf
from .formats.onnx import check_finite_initializers, onnx_context
from .formats.onnx_io import read_meta, resolve_onnx
from .runners import LlamaRunner, OrtRunner, TorchRunner
from .runners.kv import kv_bits_for
from .sampling import Done, Sampler
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
    bytes_per_token: float = 0.0     # what one decode step reads at the mean decode position
    bandwidth_gbs: float = 0.0       # read bandwidth measured after generating (GB/s, every core)
    fraction_of_bound: float = 0.0   # decode tok/s over bandwidth / bytes_per_token
    threads: str = ""                # the CPU threads the runner used, and whether that was the default

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def token_budget(n_prompt: int, max_tokens: int, context: int, model_path) -> int:
    """The one rule on every backend: a prompt (BOS included) must leave room for one new token in the model's
    context, else it is refused; new tokens stop when the context is full."""
    if n_prompt >= context:
        raise QuantgateError(f"the prompt is {n_prompt} tokens (BOS included) and {model_path}'s context is "
                             f"{context}: shorten the prompt")
    return min(max_tokens, context - n_prompt)


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


def _open(model_path: str, kv_type: str, threads: int | None, n_ctx_for):
    """(runner, tokenizer, context, backend name) for a GGUF, an ONNX export or a model directory. `n_ctx_for(
    tokenizer, context)` sizes llama.cpp's context to the prompt and its budget (the others need no size)."""
    kind = artifact_kind(model_path)
    if kind == "gguf":
        context = inspect_gguf(model_path).context_length
        check_finite_weights(model_path)
        tok = tokenizer_from_gguf(open_reader(model_path))
        runner = LlamaRunner(model_path, n_ctx=n_ctx_for(tok, context), kv_type=kv_type, threads=threads,
                             logits_all=False)
        return runner, tok, context, f"llama.cpp:{runner.info.file_type} (KV {kv_type})"
    if kind == "onnx":
        onnx_path, model_dir = resolve_onnx(model_path)
        meta = read_meta(model_dir)
        context = onnx_context(model_dir)
        tok = load_tokenizer(model_dir, meta.get("bos_id"), meta.get("eos_id"))
        n_ctx_for(tok, context)  # the prompt must fit before anything is loaded
        kv_bits = kv_bits_for(kv_type, "ONNX Runtime")
        runner = OrtRunner(model_path, threads=threads, kv_bits=kv_bits)  # checks the graph first
        try:
            check_finite_initializers(onnx_path)
        except BaseException:
            runner.close()
            raise
        scheme = (meta.get("quantization") or {}).get("scheme") or meta.get("dtype", "fp32")
        return runner, tok, context, f"onnxruntime:{scheme}" + (f" (KV int{kv_bits})" if kv_bits else "")
    kv_bits = kv_bits_for(kv_type, "PyTorch")
    loaded = load_checkpoint(model_path)
    tok = loaded.tokenizer
    if tok is None:
        raise QuantgateError(f"{model_path}: no tokenizer.json, cannot encode the prompt")
    context = loaded.model.cfg.max_seq_len
    n_ctx_for(tok, context)
    if threads:
        torch.set_num_threads(threads)
    runner = TorchRunner(loaded.model, kv_bits=kv_bits)
    return runner, tok, context, "torch" + (f" (KV int{runner.kv_bits})" if runner.kv_bits else "")


def generate(model_path: str, prompt: str, max_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
             kv_type: str = "f16", threads: int | None = None,
             on_text: Callable[[str], None] | None = None) -> GenerateResult:
    """Generate from `prompt`, calling on_text(piece) as text arrives; returns the text and speeds. Every
    backend runs the same loop and sampler (quantgate.sampling) on its own KV cache."""
    if max_tokens < 1:
        raise QuantgateError("--max-tokens must be at least 1")
    plan: dict = {}

    def n_ctx_for(tok, context: int) -> int:
        plan["ids"] = [tok.bos_id] + tok.encode(prompt)
        plan["budget"] = token_budget(len(plan["ids"]), max_tokens, context, model_path)
        return len(plan["ids"]) + plan["budget"]

    runner, tok, context, backend = _open(model_path, kv_type, threads, n_ctx_for)
    ids, budget = plan["ids"], plan["budget"]
    pieces: list[str] = []
    new: list[int] = []
    prev, done = "", None
    with runner:  # an error or Ctrl-C stops a llama.cpp worker at once
        for rec in runner.stream(ids, budget, Sampler(temperature, seed=seed), stop_ids=(tok.eos_id,)):
            if isinstance(rec, Done):
                done = rec
            else:
                new.append(rec.id)
                prev = _emit_tail(tok, new, prev, pieces, on_text)
    res = GenerateResult("".join(pieces), len(ids), done.new_tokens, done.prefill_tps, done.decode_tps, backend,
                         context, budget < max_tokens and done.new_tokens == budget, threads=_threads_used(runner))
    if done.new_tokens > 1:  # decode speed is measured from the second new token on
        reads = _decode_bytes(model_path, runner)
        res.bytes_per_token = reads.at(len(ids) + done.new_tokens / 2)
        res.bandwidth_gbs = read_bandwidth(256 << 20, repeats=3) / 1e9
        res.fraction_of_bound = done.decode_tps * res.bytes_per_token / (res.bandwidth_gbs * 1e9)
    return res


def _threads_used(runner) -> str:
    """The CPU threads a runner ran on, in words (speeds on a loaded machine swing with them)."""
    if isinstance(runner, LlamaRunner):
        return f"{runner.threads}" + (" (the default, min(cores, 8); --threads sets it)" if runner.threads_default else "")
    if isinstance(runner, OrtRunner):
        return str(runner.threads) if runner.threads else "onnxruntime's default (one per physical core)"
    return f"{torch.get_num_threads()}"


def _decode_bytes(model_path: str, runner):
    if isinstance(runner, LlamaRunner):
        return gguf_decode_bytes(model_path, kv_bytes_per_value={"f32": 4, "f16": 2, "q8_0": 34 / 32,
                                                                 "q4_0": 18 / 32}[runner.kv_type])
    if isinstance(runner, OrtRunner):
        return onnx_decode_bytes(model_path)
    return torch_decode_bytes(runner.model)
