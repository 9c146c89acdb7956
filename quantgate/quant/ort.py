"""Quantize an exported ONNX decoder with onnxruntime.quantization, in the settings DESIGN section 4 found.

| scheme       | ORT tool                                   | weights              | activations          |
|--------------|--------------------------------------------|----------------------|----------------------|
| int8-dynamic | quantize_dynamic (MatMulConstBOnly)        | int8 per tensor      | uint8, per call      |
| int8-static  | quantize_static, QDQ, MinMax calibration   | int8 per channel     | uint8, calibrated    |
| int8-weight  | MatMulNBits bits=8, one MatMul at a time   | int8 blocks          | float                |
| int4         | MatMulNBits bits=4, one MatMul at a time   | int4 blocks          | float                |

The MatMulNBits schemes also quantize the embedding table in the same blocks and bits (GatherBlockQuantized), and
a tied model's head reads that one table (onnx_weight_only.shared_head): at Qwen3.5-0.8B's shape the fp32 table
was half the int4 file. The int8 activation schemes leave the table float and give a tied head its own copy.

The MatMulNBits schemes run ORT's own per-node quantizer on one weight at a time, read from the export's external
data and written out at once (quantgate.quant.ort_weight_only: the bytes MatMulNBitsQuantizer writes, at the memory of
one weight); the int8 activation schemes use ORT's whole-graph tools.

MatMulNBits always gets accuracy_level=4 (int8 activations inside the kernel on CPU: without it, int4
prefill is slower than fp32). `gate_bits=8` with int4 keeps the fused q|gate MatMul of every layer at 8
bits, and in a hybrid every Gated DeltaNet's output gate (in_proj_z) too; a GDN's in_proj_a/in_proj_b stay float
in every scheme. Static calibration feeds prefill windows and single-token decode steps on a cache, both drawn
from `calib_data` (QUInt8 activations: QInt8 gives an invalid model at opset 23).
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..calib_data import calibration_windows, check_ctx, data_paths
from ..errors import QuantgateError
from ..formats.hf import available_memory
from ..formats.onnx import onnx_context
from ..formats.onnx_io import INLINE_LIMIT, LOGITS_TO_KEEP, check_graph, check_written, onnx_bytes, read_meta, resolve_onnx, save_onnx
from ..fsio import atomic_dir, check_output
from ..runners import OrtRunner
from ..tokenizer import load_tokenizer
from .ort_weight_only import UNTIED, quantize_weight_only, tied_head
from .schemes import OnnxScheme, with_gate_bits

SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


GATE_MATMULS = (".qg_proj.", ".linear_attn.in_proj_z.")  # the attention output gate (fused with q); the GDN's gate
KEPT_FLOAT = (".linear_attn.in_proj_a.", ".linear_attn.in_proj_b.")  # per-head decay and beta inputs: [D, Hv]


def gate_matmuls(model) -> list[str]:
    """Names of the MatMul nodes that compute a gate: the fused q|gate projection of every gated attention layer
    (`...qg_proj.MatMul`) and, in a hybrid, every Gated DeltaNet's output gate (`...linear_attn.in_proj_z.MatMul`)."""
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and any(g in n.name for g in GATE_MATMULS)]


def kept_float_matmuls(model) -> list[str]:
    """MatMuls every scheme leaves in float: a Gated DeltaNet's in_proj_a and in_proj_b (Hv outputs each, about
    0.1% of the weights, and they set each head's decay and write strength; onnxruntime-genai's Qwen3.5 builder
    keeps them dense, as llama.cpp's recipes keep ssm_alpha/ssm_beta at 8 bits or more)."""
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and any(k in n.name for k in KEPT_FLOAT)]


class _Calibration:
    """onnxruntime CalibrationDataReader: prefill windows (empty cache), then one decode step per window."""

    def __init__(self, runner: OrtRunner, windows: np.ndarray):
        feeds = []
        for w in windows:
            ids = w[None, :-1]
            past = runner._empty_past(1)
            keep = {LOGITS_TO_KEEP: np.array(ids.shape[1], dtype=np.int64)} if runner.keeps_last else {}
            feeds.append({"input_ids": ids, "attention_mask": np.ones_like(ids),
                          "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None], **past, **keep})
            _, present = runner.step(ids, past, 0)
            P = ids.shape[1]
            keep = {LOGITS_TO_KEEP: np.array(1, dtype=np.int64)} if runner.keeps_last else {}
            feeds.append({"input_ids": w[None, -1:], "attention_mask": np.ones((1, P + 1), dtype=np.int64),
                          "position_ids": np.array([[P]], dtype=np.int64), **present, **keep})
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)


def untie_lm_head(model) -> bool:
    """A tied model's logits MatMul reads `Transpose(model.embed_tokens.weight)`, which no onnxruntime quantizer
    touches (its B is not an initializer), so the largest matrix of a small model (151,936 x 1,024 at Qwen3-0.6B's
    shape: 0.62 GB fp32, more than its int4 body) stayed fp32 and bounded decode. Give it its own initializer,
    `model.lm_head.weight_T`, so every scheme quantizes it as it does an untied lm_head; the Gather keeps the float
    table (one row per token). Returns whether the graph changed."""
    from onnx import numpy_helper
    inits = {t.name: t for t in model.graph.initializer}
    tied = tied_head(model.graph, inits)
    if tied is None:
        return False
    w = numpy_helper.to_array(inits[tied[0]]).T
    model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w), UNTIED))
    for n in list(model.graph.node):
        if n.op_type == "Transpose" and n.output[0] == tied[1]:
            model.graph.node.remove(n)
        else:
            n.input[:] = [UNTIED if x == tied[1] else x for x in n.input]
    return True


WHOLE_GRAPH = ("dynamic", "static")  # the tools that load the whole graph


def check_whole_graph_fits(model_dir: Path, s: OnnxScheme) -> None:
    """ORT's quantize_dynamic / quantize_static load the whole fp32 graph and build the quantized copy beside it: refuse
    one whose export is over half the memory available (a lower bound on what they hold), before anything is read."""
    if s.tool not in WHOLE_GRAPH:
        return
    scheme = s.base
    size, avail = onnx_bytes(model_dir), available_memory()
    if avail is not None and 2 * size > avail:
        raise QuantgateError(f"{model_dir}: {scheme} runs onnxruntime.quantization on the whole graph, which holds the "
                             f"{size / 1e9:.1f} GB export and its quantized copy in memory (at least "
                             f"{2 * size / 1e9:.1f} GB; {avail / 1e9:.1f} GB available); int4 and int8-weight quantize "
                             f"one MatMul at a time")


def _whole_graph(path: Path, dst: Path, work: Path, s: OnnxScheme, kept: list[str], windows) -> None:
    """int8-dynamic and int8-static: onnxruntime.quantization's own tools, which read and write the whole graph."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    src = path
    graph = onnx.load(str(path))
    if untie_lm_head(graph):  # quantize the tied logits matrix too (a copy; the export is not changed)
        src = work / "untied" / "model.onnx"
        src.parent.mkdir()
        save_onnx(graph, src)
    del graph
    big = onnx_bytes(src.parent) > INLINE_LIMIT
    if s.tool == "dynamic":
        quantize_dynamic(str(src), str(dst), op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8,
                         nodes_to_exclude=kept, use_external_data_format=big,
                         extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})
    else:
        with OrtRunner(path) as runner:
            reader = _Calibration(runner, windows)
        quantize_static(str(src), str(dst), reader, quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True,
                        op_types_to_quantize=["MatMul"], calibrate_method=CalibrationMethod.MinMax,
                        nodes_to_exclude=kept, use_external_data_format=big, extra_options={"MatMulConstBOnly": True})


def quantize_onnx(src: str | Path, out_dir: str | Path, scheme: OnnxScheme | str, gate_bits: int | None = None,
                  block_size: int | None = None, calib_data: str = "embedded", calib_windows: int = 16, ctx: int = 128,
                  seed: int = 0) -> dict:
    """Quantize the ONNX decoder at `src` (a directory or model.onnx) into `out_dir`. Returns a summary.

    `scheme`: the registry's config (`quantgate.quant.get("onnx", "int4+gate8")`), whose tool, bits, block size and
    keep override are what runs; or a base name, with `gate_bits` for its +gate8 variant and `block_size`."""
    s = onnx_scheme(scheme, gate_bits, block_size)
    path, model_dir = resolve_onnx(src)
    graph, _ = check_graph(path)
    meta = read_meta(model_dir)
    if meta.get("quantization"):
        raise QuantgateError(f"{path} is already quantized ({meta['quantization']['scheme']}); start from the fp32 export")
    if meta.get("dtype") == "fp16":
        raise QuantgateError(f"{path} is an fp16 export; quantize the fp32 export")
    gates, kept = gate_matmuls(graph), kept_float_matmuls(graph)
    if s.keep and not gates:
        raise QuantgateError(f"{path} has no gate projection (fused q|gate or a Gated DeltaNet's in_proj_z): "
                             f"--gate-bits applies to gated models")
    out_dir = Path(out_dir)
    check_output(out_dir, "onnx", (model_dir, *data_paths(calib_data if s.needs_calibration else None)))

    check_whole_graph_fits(model_dir, s)
    windows = None
    if s.needs_calibration:
        check_ctx(ctx, onnx_context(model_dir), src)
        tok = load_tokenizer(model_dir, meta.get("bos_id"), meta.get("eos_id"))
        windows = calibration_windows(tok, calib_data, calib_windows, ctx, seed)

    # ORT's quantizers log advice and per-node INFO lines (root logger and their own); keep stderr for errors
    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
                                       if n.startswith("onnxruntime")]
    loggers.append(logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer"))
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        _run(path, out_dir, s, gates, kept, windows, model_dir, meta)
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)
    size = onnx_bytes(out_dir)
    return {"src": str(path), "out": str(out_dir), "scheme": s.base, "gate_bits": s.keep.bits if s.keep else None,
            "block_size": s.block_size, "bytes": size, "src_bytes": onnx_bytes(model_dir), "gate_matmuls": len(gates),
            "kept_float": kept}


def onnx_scheme(scheme: OnnxScheme | str, gate_bits: int | None = None, block_size: int | None = None) -> OnnxScheme:
    """The config a quantization runs: a registry config as given, or a base name's (with its +gate8 variant for
    `gate_bits`); `block_size` replaces the config's. Checked here, in one line each: the ONNX export is the fp32
    scheme itself, block sizes are ORT's, and a keep override is 8-bit over the fused q|gate projection (the one
    scope an export that fuses q and gate rows can hold)."""
    if isinstance(scheme, str):
        s = with_gate_bits("onnx", scheme, gate_bits)
    elif isinstance(scheme, OnnxScheme):
        if gate_bits is not None:
            raise QuantgateError("gate_bits comes with a scheme's name; a registry config says its own keep override")
        s = scheme
    else:
        raise QuantgateError(f"not an ONNX scheme: {scheme!r}")
    if s.tool == "export":
        raise QuantgateError("onnx:fp32 is the export itself: write it with quantgate export onnx")
    if block_size is not None:
        s = replace(s, block_size=block_size)
    if s.block_size is None:
        s = replace(s, block_size=32)  # the int8 tools have no blocks; the summary keeps the field's old value
    if s.block_size not in (16, 32, 64, 128, 256):
        raise QuantgateError(f"--block-size must be 16, 32, 64, 128 or 256, got {s.block_size}")
    if s.keep and (s.keep.bits != 8 or s.keep.scope != "q_and_gate" or s.tool != "nbits"):
        raise QuantgateError(f"onnx:{s.name} keeps {s.keep.scope} at {s.keep.bits} bits: an ONNX export keeps the "
                             f"fused q|gate projection (q_and_gate) at 8 bits, in the int4 scheme only")
    return s


def _run(path: Path, out_dir: Path, s: OnnxScheme, gates: list[str], kept: list[str], windows, model_dir: Path,
         meta: dict) -> None:
    with atomic_dir(out_dir, "onnx") as tmp, tempfile.TemporaryDirectory() as work:
        dst = tmp / "model.onnx"
        try:
            if s.tool == "nbits":  # one MatMul at a time (ort_weight_only), ORT's kernels
                skip, kept_at = set(kept), {n: s.keep.bits for n in gates} if s.keep else {}
                quantize_weight_only(path, dst, lambda n: None if n in skip else (kept_at.get(n, s.weight_bits),
                                                                                   s.block_size),
                                     embed=(s.weight_bits, s.block_size))
            else:
                _whole_graph(path, dst, Path(work), s, kept, windows)
        except (QuantgateError, OSError):
            raise
        except Exception as e:  # onnxruntime.quantization on a graph it cannot handle: one line, not its traceback
            msg = (str(e).strip().splitlines() or [""])[0][:160]
            raise QuantgateError(f"onnxruntime.quantization could not quantize {path} ({s.base}): "
                                 f"{type(e).__name__}: {msg}") from None
        side_files(model_dir, tmp, {**meta, "quantization": {
            "scheme": s.base, "gate_bits": s.keep.bits if s.keep else None, "block_size": s.block_size,
            "calibration_windows": 0 if windows is None else len(windows), "source": str(path)}})
        check_written(tmp, out_dir)


def side_files(model_dir: Path, folder: Path, meta: dict) -> None:
    """Beside a quantized graph: the export's config and tokenizer files, and its quantgate.json with `meta`."""
    for f in SIDE_FILES:
        if (model_dir / f).is_file():
            shutil.copy2(model_dir / f, folder / f)
    (folder / "quantgate.json").write_text(json.dumps(meta, indent=2) + "\n")
