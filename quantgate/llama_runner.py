"""Run GGUF files in stock llama.cpp (through llama-cpp-python), in a worker process.

llama.cpp stops the whole process with GGML_ASSERT/abort on some malformed or unsupported files, so
the model lives in a child process (`python -m quantgate.llama_runner`, so nothing of the caller's
__main__ is re-imported) and the parent talks to it over a socket pair: if the child dies, the parent
raises one QuantgateError quoting llama.cpp's last stderr line and carries on. Every file is checked with gguf-py first
(`gguf_file.inspect_gguf`).

Logits follow the Runner protocol (one window per llama.cpp context reset, all positions scored).
KV-cache types f32 (parity), f16 (llama.cpp's default), q8_0 and q4_0 (needs flash attention in
llama.cpp, switched on for those).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import QuantgateError
from .gguf_file import GGUFInfo, inspect_gguf
from .quant.schemes import GGUF_KV_TYPES, ggml_type

KV_TYPES = {k: ggml_type(k) for k in GGUF_KV_TYPES}  # KV-cache type -> ggml_type id (gguf-py's enum)


@dataclass
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tps(self) -> float:
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 and self.generated_tokens > 1 \
            else float("nan")


# --- child process ---------------------------------------------------------------------------------

def _worker(conn, path: str, n_ctx: int, kv: str, threads: int, logits_all: bool, gpu: int) -> None:
    """Runs in the child: load the model, then answer requests until 'close' or EOF. gpu: -1 for the CPU, else
    the CUDA device every layer is offloaded to."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    try:
        import llama_cpp
        if gpu >= 0 and not llama_cpp.llama_supports_gpu_offload():
            conn.send(("error", f"--device cuda:{gpu}: this llama-cpp-python has no GPU backend (reinstall it with "
                                f"CMAKE_ARGS=-DGGML_CUDA=on), so GGUF files run on the CPU only; drop --device"))
            return
        flash = kv in ("q8_0", "q4_0")  # llama.cpp needs flash attention for a quantized V cache
        llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=logits_all,
                              n_threads=threads, n_threads_batch=threads, type_k=KV_TYPES[kv],
                              type_v=KV_TYPES[kv], flash_attn=flash, verbose=False,
                              n_gpu_layers=-1 if gpu >= 0 else 0, main_gpu=max(gpu, 0))
    except Exception as e:
        conn.send(("error", f"llama.cpp could not load it ({str(e)[:120]})"))
        return
    conn.send(("ok", {"n_vocab": llm.n_vocab(), "n_ctx": llm.n_ctx()}))
    try:
        while True:
            try:
                req = conn.recv()
            except EOFError:
                return
            op = req[0]
            if op == "close":
                return
            if op == "logits":
                out = []
                for row in req[1]:
                    llm.reset()
                    llm.eval(row.tolist())
                    out.append(np.array(llm.scores[: len(row)], dtype=np.float32))
                conn.send(("ok", np.stack(out)))
            elif op == "tokenize":
                conn.send(("ok", llm.tokenize(req[1].encode("utf-8"), add_bos=False, special=False)))
            elif op == "generate":
                _generate(llm, conn, *req[1:])
            elif op == "bench":
                conn.send(("ok", _bench(llm, *req[1:])))
    finally:
        llm.close()


def _generate(llm, conn, ids: list[int], max_tokens: int, temperature: float, seed: int, stop_ids: list[int]):
    """Stream ('token', id, text) messages, then ('done', GenerationStats)."""
    llm.set_seed(seed)
    t0 = time.perf_counter()
    t_first, n = None, 0
    for tok in llm.generate(ids, temp=temperature, top_k=40 if temperature > 0 else 1, top_p=0.95, reset=True):
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        n += 1
        if tok in stop_ids:
            break
        piece = llm.detokenize([tok], prev_tokens=None)
        conn.send(("token", int(tok), piece))
        if n >= max_tokens:
            break
    end = time.perf_counter()
    conn.send(("done", {"prompt_tokens": len(ids), "generated_tokens": n, "prefill_s": (t_first or end) - t0,
                        "decode_s": end - (t_first or end)}))


def _bench(llm, prefill_ids: list[int], decode_ids: list[int], repeats: int) -> dict:
    """Median seconds to prefill `prefill_ids` in one batch and to decode `decode_ids` one at a time."""
    pre, dec = [], []
    for _ in range(repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prefill_ids)
        t1 = time.perf_counter()
        for t in decode_ids:
            llm.eval([t])
        t2 = time.perf_counter()
        pre.append(t1 - t0)
        dec.append(t2 - t1)
    return {"prefill_s": float(np.median(pre)), "decode_s": float(np.median(dec)),
            "prefill_tps": len(prefill_ids) / float(np.median(pre)), "decode_tps": len(decode_ids) / float(np.median(dec))}


# --- parent ----------------------------------------------------------------------------------------

class LlamaRunner:
    """A GGUF model in a llama.cpp worker process. Use as a context manager (or call close())."""

    def __init__(self, path: str | Path, n_ctx: int = 512, kv_type: str = "f32", threads: int | None = None,
                 logits_all: bool = True, name: str | None = None, device: str = "cpu"):
        from .runners import cuda_index
        gpu = cuda_index(device)
        if kv_type not in KV_TYPES:
            raise QuantgateError(f"unknown KV-cache type {kv_type!r}; choose from {', '.join(KV_TYPES)}")
        self.info: GGUFInfo = inspect_gguf(path)
        if kv_type in ("q8_0", "q4_0") and self.info.head_dim % 32:
            raise QuantgateError(f"KV-cache type {kv_type} needs a head dimension that is a multiple of 32 "
                                 f"(llama.cpp's block size); {path} has {self.info.head_dim}")
        if n_ctx > self.info.context_length:
            raise QuantgateError(f"a context of {n_ctx} tokens is longer than {path}'s own context of "
                                 f"{self.info.context_length} tokens")
        self.path, self.kv_type, self.device = Path(path), kv_type, device
        self.name = name or f"llama.cpp:{self.path.name}"
        self.vocab_size = self.info.vocab_size
        threads = threads or min(os.cpu_count() or 1, 8)
        parent, child = socket.socketpair()
        self._stderr = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "quantgate.llama_runner", str(child.fileno()), str(path), str(n_ctx), kv_type,
               str(threads), str(int(logits_all)), str(-1 if gpu is None else gpu)]
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
        return self._recv("evaluating")

    def tokenize(self, text: str) -> list[int]:
        self._conn.send(("tokenize", text))
        return self._recv("tokenizing with")

    def generate(self, ids: list[int], max_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
                 stop_ids: tuple[int, ...] = ()) -> Iterator[tuple[int, bytes]]:
        """Yield (token id, bytes) as llama.cpp produces them; `self.last_stats` holds the timings after."""
        if len(ids) + max_tokens > self.n_ctx:
            raise QuantgateError(f"prompt ({len(ids)} tokens) + {max_tokens} new tokens exceed the context {self.n_ctx}")
        self._conn.send(("generate", list(ids), max_tokens, temperature, seed, list(stop_ids)))
        while True:
            msg = self._recv_stream()
            if msg[0] == "done":
                self.last_stats = GenerationStats(**msg[1])
                return
            yield msg[1], msg[2]

    def _recv_stream(self):
        try:
            return self._conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            raise self._died("generating with") from None

    def bench(self, prefill_ids: list[int], decode_ids: list[int], repeats: int = 5) -> dict:
        self._conn.send(("bench", list(prefill_ids), list(decode_ids), repeats))
        return self._recv("benchmarking")

    def close(self, at_once: bool = False) -> None:
        """Ask the worker to finish; `at_once` (an error or Ctrl-C in the parent, the worker possibly busy in a long
        llama.cpp call) kills it instead of waiting."""
        if self._proc.poll() is None:
            try:
                if at_once:
                    raise subprocess.TimeoutExpired(self._proc.args, 0)
                self._conn.send(("close",))
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


def _child_main(argv: list[str]) -> None:
    fd, path, n_ctx, kv, threads, logits_all, gpu = argv
    _worker(Connection(int(fd)), path, int(n_ctx), kv, int(threads), bool(int(logits_all)), int(gpu))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
