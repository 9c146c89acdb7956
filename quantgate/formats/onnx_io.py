"""An ONNX export as quantgate writes it (optimum's decoder I/O spec) and the checks a file must pass before ONNX
Runtime opens it: shared by the exporter (`quantgate.export.onnx`), the runner (`quantgate.runners.ort`) and the
reader that loads an export back into PyTorch (`quantgate.formats.onnx`).

I/O names are optimum's: input_ids, attention_mask, position_ids, past_key_values.{i}.key/value in; logits and
present.{i}.key/value out. A hybrid's Gated DeltaNet layers have no KV cache; each carries its two states instead,
named as onnxruntime-genai's Qwen3.5 builder names them: past.conv.{i} [B, conv_dim, K-1] (the last K-1 inputs of
the short conv) and past.recurrent.{i} [B, Hv, dk, dv] fp32, with present.conv.{i} / present.recurrent.{i} out.
Beside model.onnx lie config.json and quantgate.json (what was exported, how).
"""
from __future__ import annotations

import json
from pathlib import Path

import onnx

from ..errors import QuantgateError
from ..fsio import read_json


LINEAR, FULL = "linear_attention", "full_attention"


def cache_names(i: int, layer_type: str = FULL) -> tuple[list[str], list[str]]:
    """(past inputs, present outputs) of layer i: k and v for attention, conv and recurrent state for GDN."""
    if layer_type == LINEAR:
        return [f"past.conv.{i}", f"past.recurrent.{i}"], [f"present.conv.{i}", f"present.recurrent.{i}"]
    return [f"past_key_values.{i}.{kv}" for kv in ("key", "value")], [f"present.{i}.{kv}" for kv in ("key", "value")]


def io_names(layers: int | tuple | list) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of a decoder, in graph order: `layers` is a layer count (all attention) or the
    per-layer types (ModelConfig.layer_types)."""
    types = [FULL] * layers if isinstance(layers, int) else list(layers)
    past, present = [], []
    for i, t in enumerate(types):
        p, q = cache_names(i, t)
        past += p
        present += q
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def past_name(present: str) -> str:
    """The input a present output is fed back to on the next step."""
    return present.replace("present.", "past." if present.startswith(("present.conv.", "present.recurrent."))
                           else "past_key_values.", 1)


def layer_types_of(inputs: list[str]) -> list[str]:
    """Per-layer types read off a graph's cache input names (empty where they follow no quantgate pattern)."""
    types: dict[int, str] = {}
    for n in inputs[3:]:
        parts = n.split(".")
        if n.startswith("past_key_values.") and len(parts) == 3 and parts[1].isdigit():
            types.setdefault(int(parts[1]), FULL)
        elif n.startswith(("past.conv.", "past.recurrent.")) and len(parts) == 3 and parts[2].isdigit():
            types.setdefault(int(parts[2]), LINEAR)
        else:
            return []
    return [types[i] for i in range(len(types))] if sorted(types) == list(range(len(types))) else []


EXTERNAL_DATA = "model.onnx.data"
ALIGN = 4096  # ORT memory-maps external data whose offset is page-aligned
CHUNK = 64 << 20  # bytes copied at a time from one data file to another
INLINE_BYTES = 1024  # tensors this small stay in model.onnx (onnx.save's size_threshold in save_onnx)
INLINE_LIMIT = 1 << 30  # protobuf cannot serialize a message over 2 GiB: larger weights go to EXTERNAL_DATA


def weight_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def save_onnx(model: onnx.ModelProto, path: Path) -> None:
    """Save a graph as model.onnx, with its weights in one `model.onnx.data` beside it when they are over 1 GiB (a
    Qwen3.5-0.8B export holds 3 GB; protobuf stops at 2 GiB). onnx appends to an existing data file, so the caller
    writes into a fresh folder."""
    if weight_bytes(model) > INLINE_LIMIT:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=EXTERNAL_DATA,
                  size_threshold=1024)
    else:
        onnx.save(model, str(path))


def onnx_bytes(folder: Path) -> int:
    """Size of an export's graph and weights: model.onnx plus its external data, if any."""
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.name in ("model.onnx", EXTERNAL_DATA))


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


LOGITS_TO_KEEP = "logits_to_keep"  # the --graph gqa form's last input: how many positions get logits


def decoder_inputs(model) -> list:
    """The graph's decoder inputs (ids, mask, positions, caches), without the gqa form's logits_to_keep."""
    return [i for i in model.graph.input if i.name != LOGITS_TO_KEEP]


def check_model(path: Path) -> None:
    """onnx's checker on a written file (it reads external data's headers, not the bytes); its failure as one line."""
    try:
        onnx.checker.check_model(str(path))
    except Exception as e:  # ValidationError, or a protobuf error on a malformed file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise QuantgateError(f"{path}: the written graph fails onnx's checker: {first}") from None


def check_written(folder: Path, out: Path | str, checker: bool = True) -> None:
    """quantgate's own checks on the export or quantized graph it just wrote in `folder` (onnx's checker unless
    `checker` is off, then what the runner relies on); one it refuses is never committed: the caller's atomic_dir
    removes it. (onnx's float16 converter leaves a node order the checker rejects and ONNX Runtime runs.)"""
    try:
        if checker:
            check_model(folder / "model.onnx")
        check_graph(folder / "model.onnx")
    except QuantgateError as e:
        raise QuantgateError(f"{str(e).replace(str(folder), str(out))} (the written export failed quantgate's own "
                             f"check; nothing was kept)") from None


def check_graph(path: Path):
    """Load the graph (without its weights) and check what ONNX Runtime and our runner rely on: the
    exporter's input/output names, dtypes and cache shapes, and every external-data file the weights name
    (present in the export's folder and long enough)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends: any failure means a malformed file
        raise QuantgateError(f"{path}: corrupt or truncated ONNX file ({type(e).__name__})") from None
    inputs = [i.name for i in decoder_inputs(model)]
    outputs = [o.name for o in model.graph.output]
    types = layer_types_of(inputs)
    want_in, want_out = io_names(types)
    if not types or FULL not in types or inputs != want_in or outputs != want_out:
        raise QuantgateError(f"{path}: the graph's inputs/outputs ({', '.join(inputs[:4])}...) do not match a "
                             f"quantgate decoder (input_ids, attention_mask, position_ids, past_key_values.N.key/value"
                             f" and, for Gated DeltaNet layers, past.conv.N/past.recurrent.N)")
    _check_io_types(path, model)
    _check_external_data(path, model)
    return model, types


INT64, FLOATS = 7, (1, 10)  # onnx.TensorProto element types: int64; float32, float16


def _check_io_types(path: Path, model) -> None:
    for v in model.graph.input:
        t = v.type.tensor_type
        if v.name == LOGITS_TO_KEEP and (t.elem_type != INT64 or len(t.shape.dim) != 0):
            raise QuantgateError(f"{path}: {LOGITS_TO_KEEP} must be an int64 scalar")
    for v in list(decoder_inputs(model)) + list(model.graph.output):
        t = v.type.tensor_type
        want = (INT64,) if v.name in ("input_ids", "attention_mask", "position_ids") else FLOATS
        conv, rec = ".conv." in v.name, ".recurrent." in v.name
        rank = 3 if v.name == "logits" or conv else 4 if "key" in v.name or "value" in v.name or rec else 2
        if t.elem_type not in want or len(t.shape.dim) != rank:
            raise QuantgateError(f"{path}: {v.name} has element type {t.elem_type} and rank {len(t.shape.dim)}; a "
                                 f"quantgate decoder has {'int64' if want == (INT64,) else 'float'} of rank {rank}")
        fixed = (1, 2) if conv else (1, 2, 3) if rec else (1, 3) if rank == 4 else ()
        if not all(t.shape.dim[d].dim_value > 0 for d in fixed):
            what = "its channels and conv width" if conv else "its heads and state size" if rec else \
                "its KV heads and head size"
            raise QuantgateError(f"{path}: {v.name} does not state {what} (dims {', '.join(map(str, fixed))})")


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
        need = tensor_bytes(t.data_type, t.dims)
        have = int(info["length"]) if info.get("length") else target.stat().st_size - int(info.get("offset", 0) or 0)
        if need is not None and have < need:
            raise QuantgateError(f"{path}: weight {t.name} of shape {tuple(t.dims)} needs {need} bytes, and its "
                                 f"external data in {loc} holds {have}")


PACKED_4BIT = {21, 22, 23}  # onnx.TensorProto UINT4, INT4, FLOAT4E2M1: two values per byte


def tensor_bytes(data_type: int, dims) -> int | None:
    """Bytes a tensor of this element type and shape takes in raw data (None for strings and unknown types)."""
    n = 1
    for d in dims:
        n *= int(d)
    if data_type in PACKED_4BIT:
        return (n + 1) // 2
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return None
    return None if data_type == onnx.TensorProto.STRING else n * itemsize


class DataWriter:
    """Appends tensors to one external-data file and returns protos that point into it."""

    def __init__(self, path: Path):
        self.f, self.offset = open(path, "wb"), 0

    def put(self, t, base: Path | None = None):
        """A proto of `t` (read from `base`'s external data when it lives there): inline if tiny, else appended,
        copied CHUNK bytes at a time from the source file."""
        import onnx
        out = header(t)
        where = external(t)
        if where is None or where[2] <= INLINE_BYTES:
            raw = raw_bytes(t, base)
            if len(raw) <= INLINE_BYTES:
                out.raw_data = raw
                return out
            pieces, n = [raw], len(raw)
        else:
            pieces, n = chunks(base / where[0], where[1], where[2]), where[2]
        pad = -self.offset % ALIGN
        self.f.write(b"\0" * pad)
        self.offset += pad
        for piece in pieces:
            self.f.write(piece)
        out.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", EXTERNAL_DATA), ("offset", str(self.offset)), ("length", str(n))):
            e = out.external_data.add()
            e.key, e.value = k, v
        self.offset += n
        return out

    def close(self) -> None:
        self.f.close()


def header(t):
    """A copy of tensor proto `t` without its data."""
    import onnx
    h = onnx.TensorProto()
    h.name, h.data_type = t.name, t.data_type
    h.dims.extend(t.dims)
    return h


def external(t) -> tuple[str, int, int] | None:
    """(file, offset, length) of a tensor stored in external data, else None."""
    import onnx
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in t.external_data}
    if "length" not in info:
        return None
    return info["location"], int(info.get("offset", 0)), int(info["length"])


def chunks(path: Path, offset: int, length: int):
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0:
            piece = f.read(min(CHUNK, length))
            if not piece:
                raise OSError(f"{path}: external data ends before {length} more bytes")
            length -= len(piece)
            yield piece


def raw_bytes(t, base: Path | None) -> bytes:
    """The bytes of tensor proto `t`, read from its external data file when it has one."""
    from onnx import numpy_helper
    where = external(t)
    if where is not None:
        return b"".join(chunks(base / where[0], where[1], where[2]))
    return t.raw_data or numpy_helper.to_array(t, str(base or "")).tobytes()
