"""ONNX Runtime's weight-only quantization (MatMulNBits, int4 and int8 blocks) of an export, one MatMul at a time.

onnxruntime.quantization's MatMulNBitsQuantizer loads the whole fp32 graph (7.5 GB at the Qwen3.5-2B shape) and
keeps the quantized copy beside it before saving. Here the graph is loaded without its weights; for each MatMul
to quantize, its one weight is memory-mapped from the export's external data and handed to ORT's own block
quantizer (DefaultWeightOnlyQuantizer.qbits_block_quant, the C++ kernels MatMulNBitsQuantizer runs for every node),
its packed blocks and scales are appended to the new model.onnx.data at once, and the node becomes the MatMulNBits
node ORT's quantize_matmul writes (same names, attributes and inputs: tests/test_onnx_weight_only.py checks the
bytes against MatMulNBitsQuantizer's). Every other weight is copied across in chunks. Peak memory: the mapped pages
of one weight and its packed form (an eighth of it at int4).

Written by hand because ORT offers no streaming form of its quantizer (its per-node quantize_matmul wants the
weight as an in-memory TensorProto, one more full copy); the quantization itself is ORT's.
A tied model's logits MatMul reads Transpose(embedding), which no ORT quantizer touches: it is given its own
transposed weight, `model.lm_head.weight_T` (written transposed, in chunks, to a scratch file in the output folder
and mapped from there), as onnx_quantize.untie_lm_head does in memory.
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
        self.f, self.offset = open(path, "wb"), 0

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
    from onnx import numpy_helper
    where = _external(t)
    if where is not None:
        return b"".join(_chunks(base / where[0], where[1], where[2]))
    return t.raw_data or numpy_helper.to_array(t, str(base or "")).tobytes()


def _array(t, base: Path) -> np.ndarray:
    """Weight `t` as a read-only array: mapped from its external data file, or over its inline bytes."""
    from onnx import helper
    dtype, shape = helper.tensor_dtype_to_np_dtype(t.data_type), tuple(t.dims)
    where = _external(t)
    if where is None:
        return np.frombuffer(_raw(t, base), dtype=dtype).reshape(shape)
    return np.memmap(base / where[0], dtype=dtype, mode="r", offset=where[1], shape=shape)


def _transposed(t, base: Path, scratch: Path) -> np.ndarray:
    """`t`.T written to `scratch` a block of columns at a time, mapped back: the tied head's [D, V] weight."""
    a = _array(t, base)
    step = max(1, CHUNK // (a.itemsize * a.shape[0]))
    with open(scratch, "wb") as f:
        for c in range(0, a.shape[1], step):
            f.write(np.ascontiguousarray(a[:, c:c + step].T).tobytes())
    del a
    return np.memmap(scratch, dtype=np.float32, mode="r", shape=(t.dims[1], t.dims[0]))


def _matmul_nbits(node, b_name: str, w: np.ndarray, quantizer, writer: "_DataWriter", bits: int, block_size: int):
    """(MatMulNBits node, its weight protos) for MatMul `node` with weight `w` [K, N], as ORT's quantize_matmul
    builds them for a 2-D weight in QOperator form, symmetric (so no zero points)."""
    from onnx import helper, numpy_helper
    packed, scales, _zero_points = quantizer.qbits_block_quant(w)
    protos = [writer.put(numpy_helper.from_array(packed, f"{b_name}_Q{bits}")),
              writer.put(numpy_helper.from_array(scales, f"{b_name}_scales"))]
    k, n = w.shape
    qnode = helper.make_node("MatMulNBits", inputs=[node.input[0], protos[0].name, protos[1].name],
                             outputs=[node.output[0]], name=node.name + f"_Q{bits}" if node.name else "",
                             domain="com.microsoft", K=k, N=n, bits=bits, block_size=block_size,
                             accuracy_level=quantizer.config.accuracy_level)
    return qnode, protos


def quantize_weight_only(src: Path, dst: Path, bits_of: Callable[[str], int | None], block_size: int) -> dict:
    """Write dst (model.onnx and model.onnx.data, in a fresh folder) from the export at src: every MatMul with a
    weight for which bits_of(node name) gives 4 or 8 becomes ORT's MatMulNBits (symmetric, accuracy_level 4, as
    onnx_quantize's recipes); None leaves it float. Returns counts of the MatMuls by bits."""
    import onnx
    from onnx import numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    base = src.parent
    model = onnx.load(str(src), load_external_data=False)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    quantizers = {b: DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=True, accuracy_level=4, bits=b)) for b in (4, 8)}
    untie = tied_head(graph, inits)
    writer = _DataWriter(dst.parent / EXTERNAL_DATA)
    counts = {4: 0, 8: 0, None: 0}
    new_nodes, new_inits = [], []
    scratch = dst.parent / ".untied-lm-head.bin"  # in the fresh output folder; removed below
    try:
        for node in track(list(graph.node), f"quantizing {src.parent.name}", total=len(graph.node), memory=True):
            if untie and node.op_type == "Transpose" and node.output[0] == untie[1]:
                continue  # its MatMul reads the untied weight instead
            b_name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
            tied = untie is not None and b_name == untie[1]
            b = inits.get(b_name) if b_name is not None else None
            if not tied and (b is None or len(b.dims) != 2 or b.data_type != onnx.TensorProto.FLOAT):
                new_nodes.append(node)  # no constant 2-D fp32 weight: nothing ORT's quantizer would take either
                continue
            bits = bits_of(node.name)
            counts[bits] += 1
            if tied:
                node.input[1] = b_name = UNTIED
            w = _transposed(inits[untie[0]], base, scratch) if tied else _array(b, base)
            if bits is None:
                new_nodes.append(node)
                if tied:
                    new_inits.append(writer.put(numpy_helper.from_array(np.asarray(w), UNTIED)))
            else:
                qnode, protos = _matmul_nbits(node, b_name, w, quantizers[bits], writer, bits, block_size)
                new_nodes.append(qnode)
                new_inits.extend(protos)
            del w
            release_freed()
        used = _inputs(new_nodes) | {o.name for o in graph.output}
        done = {t.name for t in new_inits}
        for t in graph.initializer:  # the weights left as they are (norms, the embedding table, float MatMuls)
            if t.name in used and t.name not in done:
                new_inits.append(writer.put(t, base))
    finally:
        writer.close()
        scratch.unlink(missing_ok=True)
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


def tied_head(graph, inits) -> tuple[str, str] | None:
    """(embedding initializer, Transpose output) when the logits MatMul reads a transposed initializer: a tied
    model's head, which no onnxruntime quantizer touches (its B is not an initializer)."""
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
