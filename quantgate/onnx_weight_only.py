"""ONNX Runtime's weight-only quantization (MatMulNBits, int4 and int8 blocks) of an export, one MatMul at a time.

onnxruntime.quantization's MatMulNBitsQuantizer loads the whole fp32 graph (7.5 GB at the Qwen3.5-2B shape) and
keeps the quantized copy beside it before saving. Here the graph is loaded without its weights; for each MatMul
to quantize, its one weight is read from the export's external data, handed to ORT's own per-node quantizer
(DefaultWeightOnlyQuantizer.quantize, the code MatMulNBitsQuantizer runs for every node: same kernels, same
MatMulNBits node, same packed bytes and scales), and its outputs are appended to the new model.onnx.data at once;
every other weight is copied across. Peak memory: one weight in fp32 and its quantized form.

Written by hand because ORT offers no streaming form of its quantizer; the quantization itself is ORT's.
A tied model's logits MatMul reads Transpose(embedding), which no ORT quantizer touches: it is given its own
transposed weight, `model.lm_head.weight_T`, as onnx_quantize.untie_lm_head does in memory.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from .formats.onnx_io import EXTERNAL_DATA, INLINE_LIMIT, save_onnx
from .memory import release_freed
from .progress import track

ALIGN = 4096
CHUNK = 64 << 20  # bytes copied at a time from the export's data file
INLINE_BYTES = 1024  # tensors this small stay in model.onnx (onnx.save's size_threshold in save_onnx)
UNTIED = "model.lm_head.weight_T"


class _DataWriter:
    """Appends tensors to one external-data file and returns protos that point into it."""

    def __init__(self, path: Path):
        self.path, self.f, self.offset = path, open(path, "wb"), 0

    def put(self, t, base: Path | None = None):
        """A proto of `t` (read from `base`'s external data when it lives there): inline if tiny, else appended,
        copied CHUNK bytes at a time from the source file."""
        import onnx
        out = _header(t)
        where = _external(t)
        if where is None or where[2] <= INLINE_BYTES:
            raw = _raw(t, base)
            if len(raw) <= INLINE_BYTES:
                out.raw_data = raw
                return out
            pieces, n = [raw], len(raw)
        else:
            pieces, n = _chunks(base / where[0], where[1], where[2]), where[2]
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


def _header(t):
    """A copy of tensor proto `t` without its data."""
    import onnx
    h = onnx.TensorProto()
    h.name, h.data_type = t.name, t.data_type
    h.dims.extend(t.dims)
    return h


def _external(t) -> tuple[str, int, int] | None:
    """(file, offset, length) of a tensor stored in external data, else None."""
    import onnx
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in t.external_data}
    if "length" not in info:
        return None
    return info["location"], int(info.get("offset", 0)), int(info["length"])


def _chunks(path: Path, offset: int, length: int):
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0:
            piece = f.read(min(CHUNK, length))
            if not piece:
                raise OSError(f"{path}: external data ends before {length} more bytes")
            length -= len(piece)
            yield piece


def _raw(t, base: Path | None) -> bytes:
    """The bytes of tensor proto `t`, read from its external data file when it has one."""
    import onnx
    if t.data_location != onnx.TensorProto.EXTERNAL:
        if t.raw_data:
            return t.raw_data
        from onnx import numpy_helper
        return numpy_helper.to_array(t).tobytes()
    info = {e.key: e.value for e in t.external_data}
    with open(base / info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        return f.read(int(info["length"])) if "length" in info else f.read()


def _loaded(t, base: Path, name: str | None = None, transpose: bool = False):
    """An in-memory tensor proto of `t` (optionally transposed, under another name), what ORT's quantizer reads. An
    external weight is mapped, not read, so only the proto's own copy is held (and, transposed, the one before it)."""
    from onnx import helper, numpy_helper
    dtype, shape = helper.tensor_dtype_to_np_dtype(t.data_type), tuple(t.dims)
    where = _external(t)
    if where is None:
        a = np.frombuffer(_raw(t, base), dtype=dtype).reshape(shape)
    else:
        a = np.memmap(base / where[0], dtype=dtype, mode="r", offset=where[1], shape=shape)
    if transpose:
        a = np.ascontiguousarray(a.T)
    return numpy_helper.from_array(np.asarray(a), name or t.name)


def quantize_weight_only(src: Path, dst: Path, bits_of: Callable[[str], int | None], block_size: int) -> dict:
    """Write dst (model.onnx and model.onnx.data, in a fresh folder) from the export at src: every MatMul with a
    weight for which bits_of(node name) gives 4 or 8 becomes ORT's MatMulNBits (symmetric, accuracy_level 4, as
    onnx_quantize's recipes); None leaves it float. Returns counts of the MatMuls by bits."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    base = src.parent
    model = onnx.load(str(src), load_external_data=False)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    quantizers = {b: DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=True, accuracy_level=4, bits=b)) for b in (4, 8)}
    untie = _tied_head(graph, inits)
    writer = _DataWriter(dst.parent / EXTERNAL_DATA)
    counts = {4: 0, 8: 0, None: 0}
    new_nodes, new_inits = [], []
    try:
        for node in track(list(graph.node), f"quantizing {src.parent.name}", total=len(graph.node), memory=True):
            if untie and node.op_type == "Transpose" and node.output[0] == untie[1]:
                continue  # its MatMul reads the untied weight instead
            b_name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
            tied = untie is not None and b_name == untie[1]
            if b_name is None or not (b_name in inits or tied):
                new_nodes.append(node)
                continue
            bits = bits_of(node.name)
            counts[bits] += 1
            if tied:
                node.input[1] = UNTIED
            weight = _loaded(inits[untie[0]], base, UNTIED, transpose=True) if tied else _loaded(inits[b_name], base)
            if bits is None:
                new_nodes.append(node)
                if tied:
                    new_inits.append(writer.put(weight))
                continue
            scratch = onnx.GraphProto()
            scratch.initializer.append(weight)
            new_nodes.extend(quantizers[bits].quantize(node, [scratch]))
            new_inits.extend(writer.put(t) for t in scratch.initializer[1:])
            del scratch, weight
            release_freed()
        used = _inputs(new_nodes) | {o.name for o in graph.output}
        done = {t.name for t in new_inits}
        for t in graph.initializer:  # the weights left as they are (norms, the embedding table, float MatMuls)
            if t.name in used and t.name not in done:
                new_inits.append(writer.put(t, base))
    finally:
        writer.close()
    graph.ClearField("node")
    graph.node.extend(new_nodes)
    graph.ClearField("initializer")
    graph.initializer.extend(new_inits)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(dst))
    if writer.offset <= INLINE_LIMIT:  # a small model stays one file, as every export of quantgate's
        whole = onnx.load(str(dst))
        (dst.parent / EXTERNAL_DATA).unlink()
        save_onnx(whole, dst)
    return {"int4": counts[4], "int8": counts[8], "float": counts[None]}


def _tied_head(graph, inits) -> tuple[str, str] | None:
    """(embedding initializer, Transpose output) when the logits MatMul reads a transposed initializer."""
    for n in graph.node:
        if n.op_type != "Transpose" or n.input[0] not in inits:
            continue
        users = [m for m in graph.node if n.output[0] in m.input]
        if users and all(m.op_type == "MatMul" and "lm_head" in m.name for m in users):
            return n.input[0], n.output[0]
    return None


def _inputs(nodes) -> set[str]:
    """Every value the nodes read, in Scan bodies too (a body reads outer initializers by name)."""
    import onnx
    out: set[str] = set()
    for n in nodes:
        out.update(n.input)
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                out |= _inputs(a.g.node)
    return out
