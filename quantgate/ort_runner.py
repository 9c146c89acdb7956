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
    from .fsio import read_json
    meta = read_json(f)
    if not isinstance(meta, dict):
        raise QuantgateError(f"{f}: must hold a JSON object")
    return check_meta(meta, f)


META_TYPES = {  # quantgate.json field -> (accepted types, what it must be)
    "bos_id": ((int,), "a token id"), "eos_id": ((int,), "a token id"), "vocab_size": ((int,), "a positive integer"),
    "n_layers": ((int,), "a positive integer"), "n_kv_heads": ((int,), "a positive integer"),
    "head_dim": ((int,), "a positive integer"), "opset": ((int,), "an opset number"),
    "dtype": ((str,), "fp32 or fp16"), "graph": ((str,), "standard or gqa"), "gate": ((str,), "a gate mode"),
    "quantization": ((dict, type(None)), "an object or null"), "files": ((list,), "a list of file names"),
}


def check_meta(meta: dict, f: Path) -> dict:
    """The fields of an export's quantgate.json that quantgate reads, each of the right type and range."""
    for k, (types, want) in META_TYPES.items():
        v = meta.get(k)
        if v is None and k != "quantization":
            continue
        ok = isinstance(v, types) and not isinstance(v, bool)
        if ok and types == (int,):
            ok = v >= (0 if k in ("bos_id", "eos_id") else 1)
        if ok and k == "dtype":
            ok = v in ("fp32", "fp16")
        if ok and k == "quantization" and v is not None:
            ok = isinstance(v.get("scheme"), str)
        if not ok:
            raise QuantgateError(f"{f}: {k} must be {want}, got {json.dumps(v)[:60]}")
    return meta


def check_graph(path: Path):
    """Load the graph (without its weights) and check what ONNX Runtime and our runner rely on: the
    exporter's input/output names, dtypes and cache shapes, and every external-data file the weights name
    (present in the export's folder and long enough)."""
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
    _check_io_types(path, model)
    _check_external_data(path, model)
    return model, n_layers


INT64, FLOATS = 7, (1, 10)  # onnx.TensorProto element types: int64; float32, float16


def _check_io_types(path: Path, model) -> None:
    for v in list(model.graph.input) + list(model.graph.output):
        t = v.type.tensor_type
        want = (INT64,) if v.name in ("input_ids", "attention_mask", "position_ids") else FLOATS
        rank = 3 if v.name == "logits" else 4 if "key" in v.name or "value" in v.name else 2
        if t.elem_type not in want or len(t.shape.dim) != rank:
            raise QuantgateError(f"{path}: {v.name} has element type {t.elem_type} and rank {len(t.shape.dim)}; a "
                                 f"quantgate decoder has {'int64' if want == (INT64,) else 'float'} of rank {rank}")
        if rank == 4 and not (t.shape.dim[1].dim_value > 0 and t.shape.dim[3].dim_value > 0):
            raise QuantgateError(f"{path}: {v.name} does not state its KV heads and head size (dims 1 and 3)")


def _check_external_data(path: Path, model) -> None:
    """Weights stored beside the graph: each named file must lie in the export's folder and hold its bytes."""
    import onnx
    folder = path.parent.resolve()
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        target = (folder / loc).resolve()
        if not loc or folder not in target.parents:
            raise QuantgateError(f"{path}: weight {t.name} names external data {loc!r} outside the export's folder")
        if not target.is_file():
            raise QuantgateError(f"{path}: weight {t.name} is stored in {loc}, which is missing")
        try:
            end = int(info.get("offset", 0) or 0) + int(info.get("length", 0) or 0)
        except ValueError:
            raise QuantgateError(f"{path}: weight {t.name} has a malformed external-data offset or length") from None
        if end > target.stat().st_size:
            raise QuantgateError(f"{path}: {loc} is truncated (weight {t.name} ends at byte {end}, "
                                 f"the file has {target.stat().st_size})")


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
        from .runners import cuda_index
        self.cuda = cuda_index(device)
        providers: list = ["CPUExecutionProvider"]
        if self.cuda is not None:
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise QuantgateError(f"--device {device} needs onnxruntime-gpu (pip uninstall onnxruntime; pip install "
                                     f"onnxruntime-gpu) and a CUDA device")
            # TF32 off: ORT's CUDA EP rounds fp32 GEMM inputs to TF32 by default, which is not fp32 parity
            providers = [("CUDAExecutionProvider", {"device_id": self.cuda, "use_tf32": 0}), "CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(self.path), opts, providers=providers)
        except Exception as e:
            raise QuantgateError(f"{self.path}: ONNX Runtime cannot load it ({str(e).splitlines()[0][:150]})") from None
        self.device = device
        self.name = name or f"onnxruntime:{self.dir.name}"
        self.out_names = [o.name for o in self.session.get_outputs()]

    def _empty_past(self, batch: int) -> dict:
        z = np.zeros((batch, self.n_kv_heads, 0, self.head_dim), dtype=self.kv_dtype)
        if self.cuda is not None:
            import onnxruntime as ort
            z = ort.OrtValue.ortvalue_from_numpy(z, "cuda", self.cuda)
        return {f"past_key_values.{i}.{kv}": z for i in range(self.n_layers) for kv in ("key", "value")}

    def step(self, ids: np.ndarray, past: dict, start: int) -> tuple[np.ndarray, dict]:
        """Run ids [B, T] after `start` cached positions; returns (logits [B, T, V] fp32, next past)."""
        B, T = ids.shape
        feed = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((B, start + T), dtype=np.int64),
                "position_ids": np.broadcast_to(np.arange(start, start + T, dtype=np.int64), (B, T)).copy(), **past}
        try:
            if self.cuda is not None:
                return self._step_bound(feed)
            outs = self.session.run(None, feed)
        except Exception as e:  # e.g. GroupQueryAttention's limits (several new tokens on a cache need batch 1)
            msg = (str(e).split("Status Message:")[-1].strip().splitlines() or [type(e).__name__])[0][:200]
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
            io.bind_output(n, "cuda", self.cuda)
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
            if not np.isfinite(last).all():
                raise QuantgateError(f"{self.path} produced NaN or Inf logits")
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
