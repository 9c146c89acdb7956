"""Run an exported ONNX decoder in ONNX Runtime: logits for eval, KV-cache generation, speed.

The CPU execution provider by default; the CUDA one when asked for and present (onnxruntime-gpu).
Generation keeps the cache in ONNX Runtime's own buffers between steps with IOBinding (on the device, or
on the CPU in its allocator). Every file is opened with onnx first, and its inputs and outputs are checked
against the names the exporter writes, so a corrupt file or a foreign graph ends in one clear error.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import QuantgateError
from ..formats.onnx_io import FULL, LOGITS_TO_KEEP, check_graph, decoder_inputs, past_name, read_meta, resolve_onnx
from ..sampling import Done, NonFiniteLogits, Sampler, Token, stream
from .bench import bench
from .device import cuda_index
from .ort_kv import check_kv_bits, staged, with_quantized_cache


class OrtRunner:
    """An ONNX decoder in an InferenceSession. Runner protocol: logits(windows).

    kv_bits (8 or 4): a quantized KV cache, k and v rounded per token and head where they enter the cache, as
    PyTorch's runner does (`runners.ort_kv`; the file on disk is not changed). None: the cache as exported."""

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None, name: str | None = None,
                 kv_bits: int | None = None):
        import onnxruntime as ort
        check_kv_bits(kv_bits)

        self.path, self.dir = resolve_onnx(path)
        graph, self.layer_types = check_graph(self.path)
        self.n_layers = len(self.layer_types)
        self.attention_layers = [i for i, t in enumerate(self.layer_types) if t == FULL]
        past = next(i for i in graph.graph.input if i.name == f"past_key_values.{self.attention_layers[0]}.key")
        dims = past.type.tensor_type.shape.dim
        self.n_kv_heads, self.head_dim = int(dims[1].dim_value), int(dims[3].dim_value)
        self.kv_dtype = np.float16 if past.type.tensor_type.elem_type == 10 else np.float32
        # every cache input's shape without its batch: dynamic dims (the cached length) start at 0; GDN states
        # (conv [C, K-1], recurrent [Hv, dk, dv]) are fixed-size and start at zeros
        self._cache_specs = {i.name: ([d.dim_value for d in i.type.tensor_type.shape.dim][1:],
                                      np.float16 if i.type.tensor_type.elem_type == 10 else np.float32)
                             for i in decoder_inputs(graph)[3:]}
        # the gqa form computes the last position's logits unless told how many to keep (export/onnx_gqa.py)
        self.keeps_last = any(i.name == LOGITS_TO_KEEP for i in graph.graph.input)
        logits = graph.graph.output[0].type.tensor_type.shape.dim
        self.vocab_size = int(logits[2].dim_value) if logits[2].dim_value else read_meta(self.dir).get("vocab_size")
        load_from, tmp = str(self.path), None
        if kv_bits is not None:
            model = with_quantized_cache(graph, self.path, self.attention_layers, kv_bits, self.kv_dtype)
            graph_file, tmp = staged(model, self.path)
            load_from = str(graph_file)
        del graph
        self.kv_bits = kv_bits
        opts = ort.SessionOptions()
        self.threads = threads
        if threads:
            opts.intra_op_num_threads = threads
        opts.log_severity_level = 4  # failures surface as one QuantgateError, not as ORT log lines
        self.cuda = cuda_index(device)
        providers: list = ["CPUExecutionProvider"]
        if self.cuda is not None:
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise QuantgateError(f"--device {device} needs onnxruntime-gpu (pip uninstall onnxruntime; pip install "
                                     f"onnxruntime-gpu) and a CUDA device")
            # TF32 off: ORT's CUDA EP rounds fp32 GEMM inputs to TF32 by default, which is not fp32 parity
            providers = [("CUDAExecutionProvider", {"device_id": self.cuda, "use_tf32": 0}), "CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(load_from, opts, providers=providers)
        except Exception as e:
            raise QuantgateError(f"{self.path}: ONNX Runtime cannot load it ({str(e).splitlines()[0][:150]})") from None
        finally:
            if tmp is not None:  # the session holds the graph and its weights now
                shutil.rmtree(tmp, ignore_errors=True)
        self.device = device
        self.name = name or f"onnxruntime:{self.dir.name}" + (f" (KV int{kv_bits})" if kv_bits else "")
        self.out_names = [o.name for o in self.session.get_outputs()]
        # the gqa form on the CPU with the cache as exported generates through one SharedCache (no allocation per step)
        self.shares_cache = self.keeps_last and self.cuda is None and kv_bits is None
        self._present_of = {past_name(n): n for n in self.out_names[1:]}
        self._logits_dtype = np.float16 if self.session.get_outputs()[0].type == "tensor(float16)" else np.float32

    def _empty_past(self, batch: int) -> dict:
        past = {name: np.zeros((batch, *shape), dtype=dtype) for name, (shape, dtype) in self._cache_specs.items()}
        if self.cuda is not None:
            import onnxruntime as ort
            past = {k: ort.OrtValue.ortvalue_from_numpy(z, "cuda", self.cuda) for k, z in past.items()}
        return past

    def step(self, ids: np.ndarray, past: dict, start: int, bound: bool = False,
             last_only: bool = False) -> tuple[np.ndarray, dict]:
        """Run ids [B, T] after `start` cached positions; returns (logits [B, T, V] fp32, next past).

        last_only: the logits of the last position only ([B, 1, V]), where the graph can skip the others (the gqa
        form's logits_to_keep); a graph that cannot returns all of them.

        bound: the next past stays in ONNX Runtime's own buffers (OrtValues bound with IOBinding) instead of coming
        back as numpy arrays, so a decode loop does not copy the whole cache through Python every step; the
        generation and timing loops use it, calibration (which needs arrays) does not. CUDA always binds."""
        B, T = ids.shape
        shared = isinstance(past, SharedCache)
        feed = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((B, start + T), dtype=np.int64),
                "position_ids": np.broadcast_to(np.arange(start, start + T, dtype=np.int64), (B, T)).copy(),
                **({} if shared else past)}
        if self.keeps_last:  # a SharedCache holds one row of logits: the last position's
            feed[LOGITS_TO_KEEP] = np.array(1 if last_only or shared else T, dtype=np.int64)
        try:
            if shared:
                return past.run(self.session, feed, start + T), past
            if self.cuda is not None or bound:
                return self._step_bound(feed)
            outs = self.session.run(None, feed)
        except Exception as e:  # e.g. GroupQueryAttention's limits (several new tokens on a cache need batch 1)
            msg = (str(e).split("Status Message:")[-1].strip().splitlines() or [type(e).__name__])[0][:200]
            raise QuantgateError(f"{self.path}: ONNX Runtime failed: {msg}") from None
        present = {past_name(n): v for n, v in zip(self.out_names[1:], outs[1:])}
        return outs[0].astype(np.float32), present

    def _step_bound(self, feed: dict) -> tuple[np.ndarray, dict]:
        """IOBinding: present k/v (and GDN states) stay where ONNX Runtime put them (the CUDA device, or its CPU
        allocator) and are bound as the next step's past; only the logits come back as an array."""
        import onnxruntime as ort
        io = self.session.io_binding()
        for k, v in feed.items():
            if isinstance(v, ort.OrtValue):
                io.bind_ortvalue_input(k, v)
            else:
                io.bind_cpu_input(k, np.asarray(v, order="C"))  # ascontiguousarray would make a scalar 1-D
        io.bind_output("logits", "cpu")
        for n in self.out_names[1:]:
            if self.cuda is not None:
                io.bind_output(n, "cuda", self.cuda)
            else:
                io.bind_output(n, "cpu")
        self.session.run_with_iobinding(io)
        outs = io.get_outputs()
        present = {past_name(n): v for n, v in zip(self.out_names[1:], outs[1:])}
        return outs[0].numpy().astype(np.float32, copy=False), present

    def _generation_past(self, length: int):
        """An empty batch-1 cache for a generation of about `length` tokens: a SharedCache where the graph allows
        it (it grows past `length` when asked), else the plain one."""
        if self.shares_cache:
            return SharedCache(self._cache_specs, self._present_of, (self.vocab_size, self._logits_dtype), length)
        return self._empty_past(1)

    def logits(self, windows: np.ndarray) -> np.ndarray:
        lg, _ = self.step(np.asarray(windows), self._empty_past(len(windows)), 0)
        return lg

    def prefill(self, ids: list[int]) -> np.ndarray:
        """An empty cache, then the prompt in one batch: the last position's logits (quantgate.sampling)."""
        logits, self._past = self.step(np.asarray([ids]), self._generation_past(len(ids)), 0, bound=True,
                                       last_only=True)
        self._pos = len(ids)
        return logits[0, -1]

    def decode(self, token: int) -> np.ndarray:
        logits, self._past = self.step(np.asarray([[token]]), self._past, self._pos, bound=True, last_only=True)
        self._pos += 1
        return logits[0, -1]

    def stream(self, ids: list[int], max_tokens: int, sampler: Sampler,
               stop_ids: tuple[int, ...] = ()) -> Iterator[Token | Done]:
        try:
            yield from stream(self, ids, max_tokens, sampler, stop_ids)
        except NonFiniteLogits:
            raise QuantgateError(f"{self.path} produced NaN or Inf logits") from None

    def generate(self, ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
                 stop_ids: tuple[int, ...] = ()) -> Iterator[int]:
        """New token ids (the same on every runner for the same logits, seed and settings)."""
        for rec in self.stream(ids, max_tokens, Sampler(temperature, seed=seed), stop_ids):
            if isinstance(rec, Token):
                yield rec.id

    def time_round(self, prefill_ids: list[int], decode_ids: list[int]) -> tuple[float, float]:
        """Seconds to prefill `prefill_ids` in one batch from an empty cache, then decode `decode_ids` one at a
        time (the runners' bench protocol, quantgate.runners.bench)."""
        t0 = time.perf_counter()
        _, past = self.step(np.asarray([prefill_ids]), self._generation_past(len(prefill_ids) + len(decode_ids)), 0,
                            bound=True, last_only=True)
        t1 = time.perf_counter()
        pos = len(prefill_ids)
        for t in decode_ids:
            _, past = self.step(np.asarray([[t]]), past, pos, bound=True, last_only=True)
            pos += 1
        return t1 - t0, time.perf_counter() - t1

    def bench(self, prefill_ids: list[int], decode_ids: list[int], repeats: int = 5, warmup: int = 0) -> dict:
        """Medians over `repeats` rounds of `time_round` (quantgate.runners.bench)."""
        return bench([self], prefill_ids, decode_ids, rounds=repeats, warmup=warmup)[0]

    def close(self) -> None:
        self.session = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SharedCache:
    """The batch-1 generation cache of a gqa-form graph (export/onnx_gqa.py), bound with IOBinding so that a
    decode step allocates nothing, as onnxruntime-genai's runtime does:

    - each KV cache is one buffer [1, KV, capacity, head_dim], bound as GroupQueryAttention's past *and* present
      (its shared-buffer mode: the op writes the new keys after seqlens_k and reads only that many), doubled
      and copied when a step would pass its capacity;
    - each Gated DeltaNet state (conv, recurrent; fixed size) is one buffer, bound as past and present too
      (CausalConvWithState, LinearAttention and GatedDeltaNet update it in place; tests/test_onnx_fused.py
      checks the logits equal those of fresh outputs bit for bit, which a kernel reading what it already wrote
      would break); at 0.8B's shape this took 1.3 ms a decode step off two buffers used in turn;
    - the logits row is one more buffer ([1, 1, V]: the graph keeps the last position only).

    One IOBinding serves every step. The OrtValues view numpy arrays held here (ONNX Runtime does not copy a CPU
    array it is given)."""

    ROUND = 256  # capacities are multiples of this

    def __init__(self, specs: dict, present_of: dict, logits: tuple[int, type], length: int):
        self.present_of = present_of
        cap = self._round(length)
        self.kv = {n: self._buffer((1, shape[0], cap, shape[2]), dt) for n, (shape, dt) in specs.items()
                   if n.startswith("past_key_values.")}
        self.states = {n: self._buffer((1, *shape), dt) for n, (shape, dt) in specs.items()
                       if not n.startswith("past_key_values.")}
        self.logits = self._buffer((1, 1, logits[0]), logits[1])
        self.capacity, self.io = cap, None

    @classmethod
    def _round(cls, n: int) -> int:
        return max(cls.ROUND, -(-n // cls.ROUND) * cls.ROUND)

    @staticmethod
    def _buffer(shape, dtype):
        import onnxruntime as ort
        a = np.zeros(shape, dtype=dtype)
        return a, ort.OrtValue.ortvalue_from_numpy(a)

    def _grow(self, total: int, cached: int) -> None:
        cap = self._round(max(total, 2 * self.capacity))
        for n, (a, _) in self.kv.items():
            new = self._buffer((*a.shape[:2], cap, a.shape[3]), a.dtype)
            new[0][:, :, :cached] = a[:, :, :cached]
            self.kv[n] = new
        self.capacity = cap

    def run(self, session, feed: dict, total: int) -> np.ndarray:
        """One step: bind (the caches in place), run; returns a copy of the logits row [1, 1, V] in fp32."""
        if total > self.capacity:
            self._grow(total, total - feed["input_ids"].shape[1])
        if self.io is None:
            self.io = session.io_binding()
        io = self.io
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        for k, v in feed.items():
            io.bind_cpu_input(k, np.asarray(v, order="C"))
        for n, (_, v) in (*self.kv.items(), *self.states.items()):
            io.bind_ortvalue_input(n, v)
            io.bind_ortvalue_output(self.present_of[n], v)
        io.bind_ortvalue_output("logits", self.logits[1])
        session.run_with_iobinding(io)
        return self.logits[0].astype(np.float32)  # a copy: the buffer is the next step's
