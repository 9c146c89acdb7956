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
from .runners import LlamaRunner, OrtRunner
from .runners.open import open_runner
from .sampling import Done, Sampler


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

    opened = open_runner(model_path, n_ctx_for, kv_type=kv_type, threads=threads, logits_all=False,
                         layerwise=False)  # generation streams from a whole model
    runner, tok, context = opened.runner, opened.tokenizer, opened.context
    backend = opened.backend + (f" ({opened.kv})" if opened.kv else "")
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
