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

from ..formats.onnx_io import EXTERNAL_DATA, INLINE_LIMIT, DataWriter, save_onnx
from ..formats.onnx_io import external as _external, raw_bytes as _raw
from ..memory import release_freed
from ..progress import track

CHUNK = 64 << 20  # bytes written at a time when a tied head is transposed
UNTIED = "model.lm_head.weight_T"


def weight_array(t, base: Path) -> np.ndarray:
    """Weight `t` as a read-only array: mapped from its external data file, or over its inline bytes."""
    from onnx import helper
    dtype, shape = helper.tensor_dtype_to_np_dtype(t.data_type), tuple(t.dims)
    where = _external(t)
    if where is None:
        return np.frombuffer(_raw(t, base), dtype=dtype).reshape(shape)
    return np.memmap(base / where[0], dtype=dtype, mode="r", offset=where[1], shape=shape)


def _transposed(t, base: Path, scratch: Path) -> np.ndarray:
    """`t`.T written to `scratch` a block of columns at a time, mapped back: the tied head's [D, V] weight."""
    a = weight_array(t, base)
    step = max(1, CHUNK // (a.itemsize * a.shape[0]))
    with open(scratch, "wb") as f:
        for c in range(0, a.shape[1], step):
            f.write(np.ascontiguousarray(a[:, c:c + step].T).tobytes())
    del a
    return np.memmap(scratch, dtype=np.float32, mode="r", shape=(t.dims[1], t.dims[0]))


def _matmul_nbits(node, b_name: str, w: np.ndarray, quantizer, writer: "DataWriter", bits: int, block_size: int):
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


Spec = tuple[int, int]  # (bits, block_size) of one MatMulNBits node: 4 or 8 bits, blocks of 16 to 256 along K


def quantize_weight_only(src: Path, dst: Path, spec_of: Callable[[str], Spec | None],
                         embed: Spec | None = None) -> dict:
    """Write dst (model.onnx and model.onnx.data, in a fresh folder) from the export at src: every MatMul with a
    weight for which spec_of(node name) gives (bits, block size) becomes ORT's MatMulNBits at those (symmetric,
    accuracy_level 4, as the ort recipes); None leaves it float. A recipe gives every node one spec; the allocator
    (quant.allocate_onnx) gives each its own. embed: the embedding table's Gather becomes GatherBlockQuantized at
    that spec (quantize_embedding), and a tied head given the same spec reads that one table. Returns counts of
    the MatMuls by bits."""
    import onnx
    from onnx import numpy_helper

    base = src.parent
    model = onnx.load(str(src), load_external_data=False)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    quantizers: dict[Spec, object] = {}
    untie = tied_head(graph, inits)
    writer = DataWriter(dst.parent / EXTERNAL_DATA)
    counts = {4: 0, 8: 0, None: 0}
    new_nodes, new_inits = [], []
    scratch = dst.parent / ".untied-lm-head.bin"  # in the fresh output folder; removed below
    table = None  # (packed name, scales name, [V, D]) of the quantized embedding, once written
    try:
        for node in track(list(graph.node), f"quantizing {src.parent.name}", total=len(graph.node), memory=True):
            if untie and node.op_type == "Transpose" and node.output[0] == untie[1]:
                continue  # its MatMul reads the untied weight instead
            if embed and node.op_type == "Gather" and inits.get(node.input[0]) is not None \
                    and len(inits[node.input[0]].dims) == 2:
                qnode, protos, table = quantize_embedding(node, inits[node.input[0]], base, writer, *embed)
                new_nodes.append(qnode)
                new_inits.extend(protos)
                continue
            b_name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
            tied = untie is not None and b_name == untie[1]
            if tied and table is not None and spec_of(node.name) == embed:  # the head reads the same table
                counts[embed[0]] += 1
                new_nodes.extend(shared_head(node, table, *embed, new_inits))
                continue
            b = inits.get(b_name) if b_name is not None else None
            if not tied and (b is None or len(b.dims) != 2 or b.data_type != onnx.TensorProto.FLOAT):
                new_nodes.append(node)  # no constant 2-D fp32 weight: nothing ORT's quantizer would take either
                continue
            spec = spec_of(node.name)
            counts[spec[0] if spec else None] += 1
            if tied:
                node.input[1] = b_name = UNTIED
            w = _transposed(inits[untie[0]], base, scratch) if tied else weight_array(b, base)
            if spec is None:
                new_nodes.append(node)
                if tied:
                    new_inits.append(writer.put(numpy_helper.from_array(np.asarray(w), UNTIED)))
            else:
                if spec not in quantizers:
                    quantizers[spec] = block_quantizer(*spec)
                qnode, protos = _matmul_nbits(node, b_name, w, quantizers[spec], writer, *spec)
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


def block_quantizer(bits: int, block_size: int):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer
    return DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True,
                                                                   accuracy_level=4, bits=bits))


def quantize_embedding(node, table, base: Path, writer: DataWriter, bits: int, block_size: int):
    """(GatherBlockQuantized node, its weight protos, (packed, scales, [V, D])) for the embedding Gather `node`:
    the [V, D] table in blocks of `block_size` along D, symmetric, by ORT's own block quantizer (each row of the
    table is a column of the [D, V] matrix a tied head multiplies by, so MatMulNBits can read the same bytes:
    shared_head). The packed rows are [V, D * bits / 8] and the zero point is implicit (2^(bits-1)), as
    GatherBlockQuantized reads uint8 data. Quantized a block of rows at a time from the mapped table."""
    from onnx import helper, numpy_helper
    quantizer = block_quantizer(bits, block_size)
    a = weight_array(table, base)
    V, D = a.shape
    step = max(1, CHUNK // (4 * D))
    packed, scales = [], []
    for r in range(0, V, step):
        p, s, _ = quantizer.qbits_block_quant(np.ascontiguousarray(a[r:r + step].T))
        packed.append(p.reshape(p.shape[0], -1))
        scales.append(s.reshape(p.shape[0], -1))
    del a
    name = table.name
    protos = [writer.put(numpy_helper.from_array(np.concatenate(packed), f"{name}_Q{bits}")),
              writer.put(numpy_helper.from_array(np.concatenate(scales), f"{name}_scales"))]
    qnode = helper.make_node("GatherBlockQuantized", [protos[0].name, node.input[1], protos[1].name],
                             list(node.output), name=(node.name or "embed") + f"_Q{bits}", domain="com.microsoft",
                             gather_axis=0, quantize_axis=1, block_size=block_size, bits=bits)
    return qnode, protos, (protos[0].name, protos[1].name, (V, D))


def shared_head(node, table, bits: int, block_size: int, new_inits: list) -> list:
    """A tied head's MatMul as MatMulNBits over the quantized embedding table itself: the packed [V, D*bits/8]
    rows reshaped to MatMulNBits' [N, blocks, block bytes] (ORT folds the Reshape of a constant at load), so the
    file holds the largest matrix of a small model once."""
    from onnx import helper, numpy_helper
    packed, scales, (V, D) = table
    n_blocks = -(-D // block_size)
    shape = numpy_helper.from_array(np.array([V, n_blocks, block_size * bits // 8], dtype=np.int64),
                                    f"{packed}_as_matmul_shape")
    new_inits.append(shape)
    reshape = helper.make_node("Reshape", [packed, shape.name], [f"{packed}_as_matmul"], name=f"{packed}/Reshape")
    qnode = helper.make_node("MatMulNBits", [node.input[0], reshape.output[0], scales], [node.output[0]],
                             name=node.name + f"_Q{bits}", domain="com.microsoft", K=D, N=V, bits=bits,
                             block_size=block_size, accuracy_level=4)
    return [reshape, qnode]


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
