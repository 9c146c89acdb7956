"""Run GGUF files in stock llama.cpp (through llama-cpp-python), in a worker process.

llama.cpp stops the whole process with GGML_ASSERT/abort on some malformed or unsupported files, so
the model lives in a child process (`python -m quantgate.llama_worker run`, a module that imports only
llama-cpp-python and numpy, so nothing of the caller's __main__ is re-imported and a spawn stays quick) and the parent talks to it over a socket pair: if the child dies, the parent
raises one QuantgateError quoting llama.cpp's last stderr line and carries on. Every file is checked with gguf-py first
(`formats.gguf.inspect_gguf`).

Logits follow the Runner protocol (one window per llama.cpp context reset, all positions scored).
KV-cache types f32 (parity), f16 (llama.cpp's default), q8_0 and q4_0 (needs flash attention in
llama.cpp, switched on for those).
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import QuantgateError
from ..memory import note_child_peak
from ..formats.gguf import GGUFInfo, inspect_gguf
from ..quant.schemes import GGUF_KV_TYPES, ggml_type
from ..sampling import Done, Sampler, Token
from .bench import bench
from .device import cuda_index
from .kv import check_llama_kv_type

KV_TYPES = {k: ggml_type(k) for k in GGUF_KV_TYPES}  # KV-cache type -> ggml_type id (gguf-py's enum)
QUANTIZED_KV = ("q8_0", "q4_0")  # llama.cpp needs flash attention for a quantized V cache


GenerationStats = Done  # the name before quantgate.sampling, kept for one release


def attn_rotation(head_dim: int, kv_type: str, env=os.environ) -> dict:
    """Whether llama.cpp rotates Q/K (and V/the output) by a Walsh-Hadamard matrix for this KV cache: its own rule
    (llama-kv-cache.cpp, llama.cpp PR #21038, in the llama.cpp llama-cpp-python 0.3.36 bundles): on for a quantized
    K (V) cache whose head dimension is a multiple of 64, unless LLAMA_ATTN_ROT_DISABLE is set to a non-zero number.
    A rotated cache quantizes outliers spread over the head, so a KV-quantization arm must say which way it ran
    (tests/test_gguf.py checks this rule against llama.cpp's logits)."""
    try:
        disabled = bool(int(env.get("LLAMA_ATTN_ROT_DISABLE", "0") or 0))
    except ValueError:  # llama.cpp reads it with atoi: text that is not a number means 0
        disabled = False
    on = kv_type in QUANTIZED_KV and head_dim % 64 == 0 and not disabled
    why = ("on" if on else "off: LLAMA_ATTN_ROT_DISABLE is set" if disabled and kv_type in QUANTIZED_KV
           else f"off: head dimension {head_dim} is not a multiple of 64" if kv_type in QUANTIZED_KV
           else "off: the KV cache is not quantized")
    return {"k": on, "v": on, "reading": f"llama.cpp's Q/K/V Hadamard rotation {why}"}


# --- parent ----------------------------------------------------------------------------------------

class LlamaRunner:
    """A GGUF model in a llama.cpp worker process. Use as a context manager (or call close())."""

    def __init__(self, path: str | Path, n_ctx: int = 512, kv_type: str = "f32", threads: int | None = None,
                 logits_all: bool = True, name: str | None = None, device: str = "cpu"):
        gpu = cuda_index(device)
        check_llama_kv_type(kv_type)
        self.info: GGUFInfo = inspect_gguf(path)
        if kv_type in QUANTIZED_KV and self.info.head_dim % 32:
            raise QuantgateError(f"KV-cache type {kv_type} needs a head dimension that is a multiple of 32 "
                                 f"(llama.cpp's block size); {path} has {self.info.head_dim}")
        if n_ctx > self.info.context_length:
            raise QuantgateError(f"a context of {n_ctx} tokens is longer than {path}'s own context of "
                                 f"{self.info.context_length} tokens")
        self.path, self.kv_type, self.device = Path(path), kv_type, device
        self.kv_rotation = attn_rotation(self.info.head_dim, kv_type)
        self.name = name or f"llama.cpp:{self.path.name}"
        self.vocab_size = self.info.vocab_size
        self.threads_default = not threads
        threads = self.threads = threads or min(os.cpu_count() or 1, 8)
        parent, child = socket.socketpair()
        self._stderr = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "quantgate.llama_worker", "run", str(child.fileno()), str(path), str(n_ctx),
               str(KV_TYPES[kv_type]), str(int(kv_type in QUANTIZED_KV)), str(threads), str(int(logits_all)),
               str(-1 if gpu is None else gpu)]
        self._proc = subprocess.Popen(cmd, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=self._stderr,
                                      start_new_session=True)  # a terminal's Ctrl-C reaches only us; we stop it
        child.close()
        self._sock = parent
        self._conn = Connection(parent.detach())
        self.n_ctx = n_ctx
        try:
            self._recv("loading")
        except BaseException:
            self.close(at_once=True)
            raise

    def _died(self, doing: str) -> QuantgateError:
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        self._stderr.seek(0)
        lines = [ln.strip() for ln in self._stderr.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "GGML_ASSERT" in ln or "error" in ln.lower()),
                   lines[-1] if lines else "")
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return QuantgateError(f"llama.cpp stopped ({how}) while {doing} {self.path}"
                              + (f": {why[:160]}" if why else ": the file is malformed or unsupported"))

    def _recv(self, doing: str):
        try:
            status, payload = self._conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            raise self._died(doing) from None
        if status == "error":
            raise QuantgateError(f"{self.path}: {payload}")
        return payload

    def logits(self, windows: np.ndarray) -> np.ndarray:
        if windows.shape[1] > self.n_ctx:
            raise QuantgateError(f"window of {windows.shape[1]} tokens exceeds the llama.cpp context {self.n_ctx}")
        self._conn.send(("logits", np.asarray(windows, dtype=np.int64)))
        shape = self._recv("evaluating")
        # each window's bytes land straight in the result: a pickled batch would be held twice (the message and
        # the array), 2 x 254 MB per window at Qwen3.5's vocabulary
        out = np.empty(shape, dtype=np.float32)
        for w in out:
            try:
                self._conn.recv_bytes_into(memoryview(w.reshape(-1).view(np.uint8)))
            except (EOFError, ConnectionResetError, OSError):
                raise self._died("evaluating") from None
        return out

    def tokenize(self, text: str) -> list[int]:
        self._conn.send(("tokenize", text))
        return self._recv("tokenizing with")

    def stream(self, ids: list[int], max_tokens: int, sampler: Sampler,
               stop_ids: tuple[int, ...] = ()) -> Iterator[Token | Done]:
        """quantgate.sampling's records, from its loop and sampler running in the worker next to the model."""
        if len(ids) + max_tokens > self.n_ctx:
            raise QuantgateError(f"prompt ({len(ids)} tokens) + {max_tokens} new tokens exceed the context {self.n_ctx}")
        self._conn.send(("generate", list(ids), max_tokens, sampler.temperature, sampler.top_k, sampler.top_p,
                         sampler.seed, list(stop_ids)))
        while True:
            msg = self._recv_stream()
            if msg[0] == "error":
                raise QuantgateError(f"{self.path}: {msg[1]}")
            if msg[0] == "done":
                yield Done(**msg[1])
                return
            yield Token(msg[1])

    def generate(self, ids: list[int], max_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
                 stop_ids: tuple[int, ...] = ()) -> Iterator[int]:
        """New token ids (the same on every runner for the same logits, seed and settings)."""
        for rec in self.stream(ids, max_tokens, Sampler(temperature, seed=seed), stop_ids):
            if isinstance(rec, Token):
                yield rec.id

    def _recv_stream(self):
        try:
            return self._conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            raise self._died("generating with") from None

    def time_round(self, prefill_ids: list[int], decode_ids: list[int]) -> tuple[float, float]:
        """One round of the bench protocol (quantgate.runners.bench), timed inside the worker: prefill, then
        decode one token at a time."""
        self._conn.send(("round", list(prefill_ids), list(decode_ids)))
        pre, dec = self._recv("benchmarking")
        return pre, dec

    def bench(self, prefill_ids: list[int], decode_ids: list[int], repeats: int = 5, warmup: int = 0) -> dict:
        """Medians over `repeats` rounds of `time_round` (quantgate.runners.bench)."""
        return bench([self], prefill_ids, decode_ids, rounds=repeats, warmup=warmup)[0]

    def peak_rss_bytes(self) -> int | None:
        """The worker process's peak resident memory so far (Linux VmHWM), or None where /proc cannot tell."""
        try:
            for line in Path(f"/proc/{self._proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None

    def close(self, at_once: bool = False) -> None:
        """Ask the worker to finish; `at_once` (an error or Ctrl-C in the parent, the worker possibly busy in a long
        llama.cpp call) kills it instead of waiting."""
        if self._proc.poll() is None:
            try:
                if at_once:
                    raise subprocess.TimeoutExpired(self._proc.args, 0)
                self._conn.send(("close",))
                if self._conn.poll(10):
                    with contextlib.suppress(EOFError, OSError):
                        msg = self._conn.recv()
                        if msg[0] == "peak" and msg[1]:
                            note_child_peak(msg[1])
                self._proc.wait(timeout=10)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._conn.close()
        self._stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(at_once=exc_type is not None)
