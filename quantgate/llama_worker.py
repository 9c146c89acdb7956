"""The llama.cpp worker process behind `quantgate.runners.llama.LlamaRunner` (`python -m quantgate.llama_worker`).

It imports only llama-cpp-python, numpy and the standard library: the parent checks the file with gguf-py and
passes the KV-cache type as its ggml_type id, so a spawn does not pay for torch or the rest of quantgate.
"""
from __future__ import annotations

import signal
import sys
import time
from multiprocessing.connection import Connection

import numpy as np


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


def main(argv: list[str]) -> None:
    fd, path, n_ctx, kv, flash, threads, logits_all, gpu = argv
    _worker(Connection(int(fd)), path, int(n_ctx), int(kv), bool(int(flash)), int(threads), bool(int(logits_all)),
            int(gpu))


if __name__ == "__main__":
    main(sys.argv[1:])
