"""An ONNX export as quantgate writes it (optimum's decoder I/O spec) and the checks a file must pass before ONNX
Runtime opens it: shared by the exporter (`quantgate.export.onnx`), the runner (`quantgate.runners.ort`) and the
reader that loads an export back into PyTorch (`quantgate.formats.onnx`).

I/O names are optimum's: input_ids, attention_mask, position_ids, past_key_values.{i}.key/value in; logits and
present.{i}.key/value out. Beside model.onnx lie config.json and quantgate.json (what was exported, how).
"""
from __future__ import annotations

import json
from pathlib import Path

import onnx

from ..errors import QuantgateError
from ..fsio import read_json


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of a decoder with `n_layers` KV caches, in graph order."""
    past = [f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


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
