"""A quantized KV cache for ONNX Runtime, as an option of the run: the graph ONNX Runtime loads is the export with
k and v rounded per token and head where they enter the cache, the same rounding `Model.forward(kv_bits=)` does in
PyTorch (mlx-lm's quantized cache: what the cache holds, and what attention reads back from it).

The exported file is not changed. The exporter writes each layer's cache as `present.i.key = Concat(past, new)`;
the rewrite puts round(new / s) * s, s = max|new| / qmax over head_dim (clipped to [-qmax-1, qmax]), on `new`.
ONNX Runtime's `GroupQueryAttention` (the `--graph gqa` form) applies RoPE inside the op, after any rewrite could
round k, so that form is refused rather than rounded at a different place than the other backends.
Written by hand: ONNX Runtime has no quantized-cache option for a CPU decoder graph.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import QuantgateError

KV_BITS = (8, 4)


def check_kv_bits(kv_bits: int | None) -> None:
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise QuantgateError(f"KV-cache bits must be one of {', '.join(map(str, KV_BITS))} (got {kv_bits})")


def with_quantized_cache(model: onnx.ModelProto, path: Path, layers: list[int], kv_bits: int,
                         dtype: np.dtype) -> onnx.ModelProto:
    """`model` (the graph of `path`, weights not loaded) with every new k and v rounded to `kv_bits` before the
    Concat that writes them into the cache. layers: the attention layers' indices; a hybrid's Gated DeltaNet
    states are not a KV cache and stay as they are."""
    check_kv_bits(kv_bits)
    g = model.graph
    if any(n.op_type == "GroupQueryAttention" for n in g.node):
        raise QuantgateError(f"{path}: a quantized KV cache needs the standard graph (--graph standard); "
                             f"GroupQueryAttention applies RoPE inside the op, after k could be rounded")
    producer = {o: n for n in g.node for o in n.output}
    qmax = float(2 ** (kv_bits - 1) - 1)
    consts = {"qmax": qmax, "lo": -qmax - 1, "hi": qmax, "eps": 1e-12}
    for k, v in consts.items():
        g.initializer.append(numpy_helper.from_array(np.array(v, dtype=dtype), f"kvq/{k}"))
    g.initializer.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), "kvq/last_axis"))
    before: dict[str, list] = {}  # Concat's output name -> the rounding nodes that must run just before it
    for i in layers:
        for kv in ("key", "value"):
            cat = producer.get(f"present.{i}.{kv}")
            if cat is None or cat.op_type != "Concat" or list(cat.input[:1]) != [f"past_key_values.{i}.{kv}"]:
                raise QuantgateError(f"{path}: present.{i}.{kv} is not written as Concat(past, new), so the place "
                                     f"to round the cache is unknown (not a graph quantgate exported?)")
            x, p = cat.input[1], f"kvq/{i}.{kv}/"
            before[cat.output[0]] = [
                helper.make_node("Abs", [x], [p + "abs"]),
                helper.make_node("ReduceMax", [p + "abs", "kvq/last_axis"], [p + "amax"], keepdims=1),
                helper.make_node("Max", [p + "amax", "kvq/eps"], [p + "amax_eps"]),
                helper.make_node("Div", [p + "amax_eps", "kvq/qmax"], [p + "scale"]),
                helper.make_node("Div", [x, p + "scale"], [p + "scaled"]),
                helper.make_node("Round", [p + "scaled"], [p + "rounded"]),
                helper.make_node("Clip", [p + "rounded", "kvq/lo", "kvq/hi"], [p + "clipped"]),
                helper.make_node("Mul", [p + "clipped", p + "scale"], [p + "out"]),
            ]
            cat.input[1] = p + "out"
    nodes = [m for n in g.node for m in (*before.get(n.output[0], ()), n)]  # the graph stays in topological order
    del g.node[:]
    g.node.extend(nodes)
    return model


def staged(model: onnx.ModelProto, path: Path) -> tuple[Path, Path]:
    """Write the rewritten graph into a fresh temporary folder beside links to the export's external-data files
    (never into the export's own folder); returns (graph file, folder to remove once the session is built)."""
    tmp = Path(tempfile.mkdtemp(prefix="quantgate-kv-"))
    try:
        for loc in {e.value for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
                    for e in t.external_data if e.key == "location"}:
            (tmp / loc).parent.mkdir(parents=True, exist_ok=True)
            (tmp / loc).symlink_to((path.parent / loc).resolve())
        onnx.save(model, str(tmp / path.name))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp / path.name, tmp
