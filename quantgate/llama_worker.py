"""llama.cpp's child processes: a malformed file can abort the process llama.cpp runs in, so it never runs in ours.

- `python -m quantgate.llama_worker run FD PATH ...`: the worker behind `quantgate.runners.llama.LlamaRunner`,
  answering requests (logits, tokenize, generate, one bench round) over a socket.
- `python -m quantgate.llama_worker quantize REQUEST.json`: llama.cpp's quantizer for `quantgate.quant.llama_cpp`.
- `python -m quantgate.llama_worker proxy REQUEST.json OUT.json`: ggml's own row quantizers on sampled rows of every
  tensor, for the allocator's weight-error proxy (`quantgate.quant.proxy`); this one also reads the file with gguf-py.

It imports only llama-cpp-python, numpy, the standard library and quantgate.sampling (numpy only): the parents
check every file with gguf-py and pass plain numbers (ggml_type ids, llama_ftype), so a spawn does not pay for
torch or the rest of quantgate.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from quantgate.memory import own_peak_bytes
from quantgate.sampling import NonFiniteLogits, Sampler, Token, stream


def _without_amx_buffers(llama_cpp) -> bool:
    """Keep llama.cpp's CPU weights out of its AMX buffer type on a CPU that has AMX (Xeon Sapphire Rapids and
    later), where llama-cpp-python 0.3.36 built here (from PyPI, natively) segfaults in ggml_backend_amx_mul_mat on
    the first matrix product of every quantized file (Q8_0, Q4_0, Q4_K_M, Q6_K; F32/F16 run). llama.cpp's switch
    is the model parameter `use_extra_bufts`, which llama-cpp-python's Llama() does not expose, so its default
    parameters are patched here, in the worker process only. Extra buffer types also hold the repacked Q4_0/Q4_K
    layouts, so laptops (no AMX) keep them; QUANTGATE_LLAMA_EXTRA_BUFTS=1 keeps them on AMX too. Returns whether
    the buffers were turned off."""
    import os
    if os.environ.get("QUANTGATE_LLAMA_EXTRA_BUFTS") == "1":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    if " amx_int8" not in flags or b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info():
        return False
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    return True


def _worker(conn, path: str, n_ctx: int, kv: int, flash: bool, threads: int, logits_all: bool, gpu: int) -> None:
    """Runs in the child: load the model, then answer requests until 'close' or EOF. gpu: -1 for the CPU, else
    the CUDA device every layer is offloaded to; kv: the KV cache's ggml_type id; flash: flash attention (llama.cpp
    needs it for a quantized V cache)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    try:
        import llama_cpp
        if gpu >= 0 and not llama_cpp.llama_supports_gpu_offload():
            conn.send(("error", f"--device cuda:{gpu}: this llama-cpp-python has no GPU backend (reinstall it with "
                                f"CMAKE_ARGS=-DGGML_CUDA=on), so GGUF files run on the CPU only; drop --device"))
            return
        _without_amx_buffers(llama_cpp)
        llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=logits_all,
                              n_threads=threads, n_threads_batch=threads, type_k=kv,
                              type_v=kv, flash_attn=flash, verbose=False,
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
                conn.send(("peak", _peak_bytes()))  # ru_maxrss would carry the parent's peak (memory.py)
                return
            if op == "logits":  # the shape, then each window's [T, V] fp32 logits as raw bytes (see LlamaRunner)
                rows = req[1]
                conn.send(("ok", (len(rows), rows.shape[1], llm.n_vocab())))
                for row in rows:
                    llm.reset()
                    llm.eval(row.tolist())
                    conn.send_bytes(np.ascontiguousarray(llm.scores[: len(row)], dtype=np.float32))
            elif op == "tokenize":
                conn.send(("ok", llm.tokenize(req[1].encode("utf-8"), add_bos=False, special=False)))
            elif op == "generate":
                _generate(llm, llama_cpp, conn, *req[1:])
            elif op == "round":
                conn.send(("ok", _time_round(llm, *req[1:])))
    finally:
        llm.close()


class _Steps:
    """prefill/decode on llama.cpp's context for quantgate.sampling.stream (the loop every backend shares)."""

    def __init__(self, llm, llama_cpp):
        self.llm, self.lib, self.n_vocab = llm, llama_cpp, llm.n_vocab()

    def _last(self) -> np.ndarray:
        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)  # the last evaluated position's logits
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32)

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return self._last()

    def decode(self, token: int) -> np.ndarray:
        self.llm.eval([token])
        return self._last()


def _generate(llm, llama_cpp, conn, ids: list[int], max_tokens: int, temperature: float, top_k: int, top_p: float,
              seed: int, stop_ids: list[int]) -> None:
    """Stream ('token', id) messages, then ('done', the Done record's fields): quantgate.sampling's loop and
    sampler, run here next to the model."""
    try:
        for rec in stream(_Steps(llm, llama_cpp), ids, max_tokens, Sampler(temperature, top_k, top_p, seed),
                          tuple(stop_ids)):
            conn.send(("token", rec.id) if isinstance(rec, Token) else ("done", asdict(rec)))
    except NonFiniteLogits as e:
        conn.send(("error", str(e)))


def _time_round(llm, prefill_ids: list[int], decode_ids: list[int]) -> tuple[float, float]:
    """Seconds to prefill `prefill_ids` in one batch from an empty cache, then decode `decode_ids` one at a time."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prefill_ids)
    t1 = time.perf_counter()
    for t in decode_ids:
        llm.eval([t])
    return t1 - t0, time.perf_counter() - t1


def quantize_main(request_file: str) -> int:
    """Build llama_model_quantize_params from the request and run llama.cpp's quantizer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us

    import llama_cpp  # here, as in _worker: a failing import is reported like any other llama.cpp failure

    req = json.loads(Path(request_file).read_text())
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = req["ftype"]
    params.nthread = req["threads"]
    keep = []  # ctypes buffers must outlive the call
    if req["overrides"]:
        arr = (llama_cpp.llama_model_tensor_override * (len(req["overrides"]) + 1))()
        for i, (pattern, gtype) in enumerate(req["overrides"]):
            arr[i].pattern = pattern.encode()
            arr[i].type = gtype
        arr[len(req["overrides"])].pattern = None
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
        keep.append(arr)
    if req.get("imatrix"):
        data = dict(np.load(req["imatrix"]))
        arr = (llama_cpp.llama_model_imatrix_data * (len(data) + 1))()
        for i, (name, values) in enumerate(data.items()):
            buf = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(buf)
            arr[i].name = name.encode()
            arr[i].data = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = buf.size
        arr[len(data)].name = None
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(arr)
    rc = llama_cpp.llama_model_quantize(req["src"].encode(), req["dst"].encode(), ctypes.byref(params))
    if rc != 0:
        print(f"error: llama_model_quantize returned {rc}", file=sys.stderr)
    print(f"{PEAK_PREFIX} {_peak_bytes()}")  # the parent's peak line reads it (quantgate.memory)
    return 0 if rc == 0 else 1


PEAK_PREFIX = "quantgate-peak-bytes"


def proxy_main(request_file: str, out_file: str) -> int:
    """Each unit's importance-weighted squared weight error at each type, from sampled rows quantized and dequantized
    by ggml's own row functions (ggml_quantize_chunk, dequantize_row_*: the code llama.cpp's quantizer runs, so
    the error is the file's), scaled to the whole tensor; the sampled rows' squared norm, likewise scaled; and the CPU
    seconds each type's quantizer took on the sampled rows (what the allocator's quantize-time limit predicts from).
    With the gradient sensitivity's weights (quant.gradient), each element's squared error is weighted by its Fisher
    diagonal on the rows that sensitivity chose, instead of by imp on rows drawn here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from gguf import GGUFReader
    from llama_cpp._ggml import libggml as lib

    req = json.loads(Path(request_file).read_text())
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    im = dict(np.load(req["imatrix"])) if req.get("imatrix") else {}
    # the gradient sensitivity's rows: per unit j, the rows to quantize (r{j}), each element's weight (w{j}: the
    # Fisher diagonal) and each row's factor to the whole tensor (s{j}), in place of sampled rows weighted by imp
    fisher = np.load(req["weights"]) if req.get("weights") else None
    tensors = {t.name: t for t in GGUFReader(req["src"]).tensors}
    rng = np.random.default_rng(req["seed"])
    picks = []  # drawn in order first, so the rows sampled do not depend on the threads
    for name, _types in req["units"]:
        n = int(np.prod([int(d) for d in tensors[name].shape])) // int(tensors[name].shape[0])
        picks.append(np.sort(rng.choice(n, size=min(req["rows"], n), replace=False)))

    def one(j: int, name: str, types: dict, pick: np.ndarray) -> dict:
        t = tensors[name]
        row = int(t.shape[0])
        w = float_rows(t, row)
        imp = np.ones(row, dtype=np.float32)
        if name in im and im[name].size % row == 0:
            imp = im[name].reshape(-1, row).mean(0).astype(np.float32)  # a MoE's experts: their mean
        if fisher is not None:
            pick = fisher[f"r{j}"]
            weight = fisher[f"w{j}"].astype(np.float32)
            scale = fisher[f"s{j}"].astype(np.float64)[:, None]
        else:
            weight, scale = imp[None, :], np.full((len(pick), 1), len(w) / max(len(pick), 1))
        x = np.ascontiguousarray(w[pick], dtype=np.float32).reshape(len(pick), row)
        errs, secs = {}, {}
        for tname, (gtype, block, size) in types.items():
            if not len(x):  # no row carries weight (a tensor the output does not depend on): no error to weigh
                errs[tname], secs[tname] = 0.0, 0.0
                continue
            dst = np.zeros(x.size // block * size, dtype=np.uint8)
            t0 = time.thread_time()  # this thread's CPU seconds: the quantizer's cost, whatever else runs beside it
            lib.ggml_quantize_chunk(gtype, x.ctypes.data, dst.ctypes.data, 0, len(x), row,
                                    imp.ctypes.data if name in im else None)
            secs[tname] = time.thread_time() - t0
            deq = getattr(lib, "dequantize_row_" + tname.lower().replace("_k", "_K"))
            deq.restype, deq.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            y = np.zeros_like(x)
            deq(dst.ctypes.data, y.ctypes.data, x.size)
            errs[tname] = float((((x - y) ** 2) * weight * scale).sum())
        return {"err": errs, "sq": float(((x ** 2) * weight * scale).sum()), "rows": int(len(w)),
                "sampled": int(len(x)), "row": row, "quantize_s": secs}

    # ctypes lets go of the GIL inside ggml's quantizers, so tensors run in parallel on the cores llama.cpp's own
    # quantizer would use (a third of a 9B allocation's time was this loop on one core)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=max(1, int(req.get("threads") or os.cpu_count() or 1))) as pool:
        done = list(pool.map(lambda a: one(*a), [(j, n, ty, pk) for j, ((n, ty), pk) in
                                                   enumerate(zip(req["units"], picks))]))
    out = {name: d for (name, _t), d in zip(req["units"], done)}
    Path(out_file).write_text(json.dumps(out))
    print(f"{PEAK_PREFIX} {_peak_bytes()}")
    return 0


def float_rows(t, row: int) -> np.ndarray:
    """A float tensor's rows (ggml's ne[0] each) as a float32-convertible view: F32, F16, or BF16 widened."""
    data = np.asarray(t.data)
    kind = t.tensor_type.name
    if kind == "BF16":
        raw = data.view(np.uint16).reshape(-1, row)
        return _Bf16Rows(raw)
    if kind == "F16":
        return data.view(np.float16).reshape(-1, row)
    return data.view(np.float32).reshape(-1, row)


class _Bf16Rows:
    """BF16 rows widened to float32 only where indexed (a 9B file's tensors stay memory-mapped)."""
    def __init__(self, raw: np.ndarray):
        self.raw = raw

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, idx) -> np.ndarray:
        return (self.raw[idx].astype(np.uint32) << 16).view(np.float32)


def _peak_bytes() -> int:
    """This process's own peak RSS (VmHWM), 0 where /proc is not there."""
    return own_peak_bytes() or 0


def run_main(argv: list[str]) -> None:
    fd, path, n_ctx, kv, flash, threads, logits_all, gpu = argv
    _worker(Connection(int(fd)), path, int(n_ctx), int(kv), bool(int(flash)), int(threads), bool(int(logits_all)),
            int(gpu))


if __name__ == "__main__":
    if sys.argv[1] == "quantize":
        sys.exit(quantize_main(sys.argv[2]))
    if sys.argv[1] == "proxy":
        sys.exit(proxy_main(sys.argv[2], sys.argv[3]))
    run_main(sys.argv[2:])
