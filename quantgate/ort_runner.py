"""Run an exported ONNX decoder in ONNX Runtime: logits for eval, KV-cache generation, speed.

The CPU execution provider by default; the CUDA one when asked for and present (onnxruntime-gpu),
with IOBinding so the cache stays on the device between steps. Every file is opened with onnx first,
and its inputs and outputs are checked against the names the exporter writes, so a corrupt file or a
foreign graph ends in one clear error.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import QuantgateError


def resolve_onnx(path: str | Path) -> tuple[Path, Path]:
    """(model.onnx, its directory) for a directory or a .onnx path."""
    p = Path(path)
    if p.is_dir():
        p = p / "model.onnx"
    if not p.exists():
        raise QuantgateError(f"ONNX model {p} does not exist")
    return p, p.parent


def read_meta(model_dir: Path) -> dict:
    f = model_dir / "quantgate.json"
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QuantgateError(f"{f}: not valid JSON ({e})") from None


def check_graph(path: Path):
    """Load the graph (without weights kept) and check its I/O against the exporter's names."""
    import onnx

    from quantgate.export.onnx import io_names
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends: any failure means a malformed file
        raise QuantgateError(f"{path}: corrupt or truncated ONNX file ({type(e).__name__})") from None
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    n_layers = sum(1 for n in inputs if n.startswith("past_key_values.")) // 2
    want_in, want_out = io_names(n_layers)
    if n_layers == 0 or inputs != want_in or outputs != want_out:
        raise QuantgateError(f"{path}: the graph's inputs/outputs ({', '.join(inputs[:4])}...) do not match a "
                             f"quantgate decoder (input_ids, attention_mask, position_ids, past_key_values.N.key/value)")
    return model, n_layers


class OrtRunner:
    """An ONNX decoder in an InferenceSession. Runner protocol: logits(windows)."""

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None, name: str | None = None):
        import onnxruntime as ort

        self.path, self.dir = resolve_onnx(path)
        graph, self.n_layers = check_graph(self.path)
        past = next(i for i in graph.graph.input if i.name == "past_key_values.0.key")
        dims = past.type.tensor_type.shape.dim
        self.n_kv_heads, self.head_dim = int(dims[1].dim_value), int(dims[3].dim_value)
        self.kv_dtype = np.float16 if past.type.tensor_type.elem_type == 10 else np.float32
        logits = graph.graph.output[0].type.tensor_type.shape.dim
        self.vocab_size = int(logits[2].dim_value) if logits[2].dim_value else read_meta(self.dir).get("vocab_size")
        del graph
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.log_severity_level = 4  # failures surface as one QuantgateError, not as ORT log lines
        providers = ["CPUExecutionProvider"]
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise QuantgateError("--device cuda needs onnxruntime-gpu and a CUDA device")
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(self.path), opts, providers=providers)
        except Exception as e:
            raise QuantgateError(f"{self.path}: ONNX Runtime cannot load it ({str(e).splitlines()[0][:150]})") from None
        self.device = device
        self.name = name or f"onnxruntime:{self.dir.name}"
        self.out_names = [o.name for o in self.session.get_outputs()]

    def _empty_past(self, batch: int) -> dict:
        z = np.zeros((batch, self.n_kv_heads, 0, self.head_dim), dtype=self.kv_dtype)
        if self.device == "cuda":
            import onnxruntime as ort
            z = ort.OrtValue.ortvalue_from_numpy(z, "cuda", 0)
        return {f"past_key_values.{i}.{kv}": z for i in range(self.n_layers) for kv in ("key", "value")}

    def step(self, ids: np.ndarray, past: dict, start: int) -> tuple[np.ndarray, dict]:
        """Run ids [B, T] after `start` cached positions; returns (logits [B, T, V] fp32, next past)."""
        B, T = ids.shape
        feed = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((B, start + T), dtype=np.int64),
                "position_ids": np.broadcast_to(np.arange(start, start + T, dtype=np.int64), (B, T)).copy(), **past}
        if self.device == "cuda":
            return self._step_bound(feed)
        try:
            outs = self.session.run(None, feed)
        except Exception as e:  # e.g. GroupQueryAttention's limits (several new tokens on a cache need batch 1)
            msg = str(e).split("Status Message:")[-1].strip().splitlines()[0][:200]
            raise QuantgateError(f"{self.path}: ONNX Runtime failed: {msg}") from None
        present = {n.replace("present.", "past_key_values."): v for n, v in zip(self.out_names[1:], outs[1:])}
        return outs[0].astype(np.float32), present

    def _step_bound(self, feed: dict) -> tuple[np.ndarray, dict]:
        """CUDA: IOBinding keeps present k/v on the device and feeds them back as the next past."""
        import onnxruntime as ort
        io = self.session.io_binding()
        for k, v in feed.items():
            if isinstance(v, ort.OrtValue):
                io.bind_ortvalue_input(k, v)
            else:
                io.bind_cpu_input(k, np.ascontiguousarray(v))
        io.bind_output("logits", "cpu")
        for n in self.out_names[1:]:
            io.bind_output(n, "cuda")
        self.session.run_with_iobinding(io)
        outs = io.get_outputs()
        present = {n.replace("present.", "past_key_values."): v for n, v in zip(self.out_names[1:], outs[1:])}
        return outs[0].numpy().astype(np.float32), present

    def logits(self, windows: np.ndarray) -> np.ndarray:
        lg, _ = self.step(np.asarray(windows), self._empty_past(len(windows)), 0)
        return lg

    def generate(self, ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
                 stop_ids: tuple[int, ...] = ()) -> Iterator[int]:
        """Yield new token ids; `self.last_stats` = (prefill seconds, decode seconds, new tokens)."""
        rng = np.random.default_rng(seed)
        t0 = time.perf_counter()
        logits, past = self.step(np.asarray([ids]), self._empty_past(1), 0)
        t1 = time.perf_counter()
        pos, n = len(ids), 0
        while True:
            last = logits[0, -1].astype(np.float64)
            if temperature > 0:
                p = np.exp((last - last.max()) / temperature)
                tok = int(rng.choice(len(p), p=p / p.sum()))
            else:
                tok = int(last.argmax())
            if tok in stop_ids:
                break
            n += 1
            yield tok
            if n >= max_tokens:
                break
            logits, past = self.step(np.asarray([[tok]]), past, pos)
            pos += 1
        self.last_stats = (t1 - t0, time.perf_counter() - t1, n)

    def bench(self, prefill_ids: list[int], decode_ids: list[int], repeats: int = 5) -> dict:
        """Median seconds to prefill `prefill_ids` in one batch, then decode `decode_ids` one at a time."""
        pre, dec = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            _, past = self.step(np.asarray([prefill_ids]), self._empty_past(1), 0)
            t1 = time.perf_counter()
            pos = len(prefill_ids)
            for t in decode_ids:
                _, past = self.step(np.asarray([[t]]), past, pos)
                pos += 1
            dec.append(time.perf_counter() - t1)
            pre.append(t1 - t0)
        return {"prefill_s": float(np.median(pre)), "decode_s": float(np.median(dec)),
                "prefill_tps": len(prefill_ids) / float(np.median(pre)),
                "decode_tps": len(decode_ids) / float(np.median(dec))}

    def close(self) -> None:
        self.session = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
