"""Read a Linear's weight back out of an exported (and possibly quantized) ONNX graph, dequantized.

The exporter names every Linear's MatMul `<module>.MatMul` and its weight `<module>.weight_T` ([in, out]).
onnxruntime.quantization then leaves one of: the float initializer; `<weight>_quantized` int8 with
`_scale`/`_zero_point` (quantize_dynamic, or quantize_static's QDQ per channel); or a MatMulNBits node
named `<module>.MatMul_Q4`/`_Q8` holding packed blocks, scales and optional zero points. Written by
hand: ORT has no public function that turns these back into a float matrix.
"""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ..errors import QuantgateError
from ..fsio import read_json
from ..model import Model
from ..tokenizer import load_tokenizer
from .hf import MAX_CONTEXT, HFFields, Loaded, check_fits_in_memory, config_from_hf
from .onnx_io import check_graph, read_meta, resolve_onnx


LINEAR_WEIGHT = re.compile(r"(_proj|\.in_proj_(qkv|z|a|b))\.weight$")  # Linear weights (the GDN's in_proj_* too)


def _init(model, name: str):
    for i in model.graph.initializer:
        if i.name == name:
            return numpy_helper.to_array(i)
    return None


def _matmul_nbits(model, node) -> np.ndarray:
    attrs = {a.name: a.i for a in node.attribute}
    K, N, bits = attrs["K"], attrs["N"], attrs["bits"]
    packed = _init(model, node.input[1])
    scales = _init(model, node.input[2]).astype(np.float32).reshape(N, -1)
    n_blocks = scales.shape[1]
    packed = packed.reshape(N, n_blocks, -1)
    if bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(N, n_blocks, -1)
    elif bits == 8:
        q = packed
    else:
        raise QuantgateError(f"MatMulNBits with {bits} bits is not supported by the weight reader")
    zp_name = node.input[3] if len(node.input) > 3 and node.input[3] else None
    if zp_name:
        zp = _init(model, zp_name).reshape(N, -1)
        if bits == 4:
            zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(N, -1)
        zp = zp[:, :n_blocks].astype(np.float32)[..., None]
    else:
        zp = float(1 << (bits - 1))
    w = (q.astype(np.float32) - zp) * scales[..., None]  # [N, n_blocks, block]
    return w.reshape(N, -1)[:, :K]  # [out, in]


def read_linear(model, module: str) -> np.ndarray:
    """Weight of `module` (e.g. model.layers.0.self_attn.qg_proj) as float32 [out, in]."""
    base = f"{module}.weight_T"
    w = _init(model, base)
    if w is not None:
        return w.astype(np.float32).T
    q = _init(model, f"{base}_quantized")
    if q is not None:
        scale = _init(model, f"{base}_scale").astype(np.float32)
        zp = _init(model, f"{base}_zero_point")
        zp = np.zeros_like(scale) if zp is None else zp.astype(np.float32)
        w = (q.astype(np.float32) - zp) * scale  # per tensor (scalars) or per output column (axis 1)
        return w.T
    for n in model.graph.node:
        if n.op_type == "MatMulNBits" and n.name.startswith(f"{module}.MatMul"):
            return _matmul_nbits(model, n)
    raise QuantgateError(f"the ONNX graph has no weight for {module} (not a quantgate export?)")


def read_embedding(model) -> np.ndarray | None:
    """The embedding table [V, D] as float32: the initializer itself (a tied traced graph names it
    model.lm_head.weight), or dequantized from the GatherBlockQuantized that onnx_weight_only.quantize_embedding
    writes (uint8 blocks along D, implicit zero point 2^(bits-1) unless given). None where the graph has neither."""
    w = _first_init(model, "model.embed_tokens.weight", "model.lm_head.weight")
    if w is not None:
        return w.astype(np.float32)
    for n in model.graph.node:
        if n.op_type != "GatherBlockQuantized":
            continue
        attrs = {a.name: a.i for a in n.attribute}
        bits, block = attrs.get("bits", 4), attrs["block_size"]
        packed, scales = _init(model, n.input[0]), _init(model, n.input[2]).astype(np.float32)
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(len(packed), -1) if bits == 4 else packed
        zp = float(1 << (bits - 1))
        if len(n.input) > 3 and n.input[3]:
            zp = _init(model, n.input[3])
            zp = (np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(len(zp), -1) if bits == 4 else zp)
            zp = np.repeat(zp[:, :scales.shape[1]].astype(np.float32), block, axis=1)[:, :q.shape[1]]
        return (q.astype(np.float32) - zp) * np.repeat(scales, block, axis=1)[:, :q.shape[1]]
    return None


def gate_rows(model, layer: int, n_q_rows: int) -> np.ndarray:
    """Gate rows of one layer: the fused q|gate projection's rows after the first n_q_rows."""
    return read_linear(model, f"model.layers.{layer}.self_attn.qg_proj")[n_q_rows:]


def _first_init(model, *names: str):
    for n in names:
        a = _init(model, n)
        if a is not None:
            return a
    return None


def read_export_header(path):
    """(model.onnx path, export folder, the source's ModelConfig, quantgate.json) of an ONNX export, its graph
    checked (quantgate's decoder I/O, external data) and nothing loaded."""
    onnx_path, model_dir = resolve_onnx(path)
    check_graph(onnx_path)
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        raise QuantgateError(f"{model_dir}: no config.json beside model.onnx")
    cfg, _layout = config_from_hf(read_json(cfg_file), model_dir)
    return onnx_path, model_dir, cfg, read_meta(model_dir)


def load_onnx_model(path):
    """Our PyTorch Model from an exported ONNX directory, every weight dequantized (the inverse of the
    exporter plus onnxruntime's quantizers). For the gate-survival check and `analyze`/`info` on ONNX."""
    onnx_path, model_dir, cfg, meta = read_export_header(path)
    check_fits_in_memory(cfg, str(model_dir / "config.json"))
    try:
        graph = onnx.load(str(onnx_path))
    except Exception as e:  # external data unreadable after check_graph passed: a torn file
        raise QuantgateError(f"{onnx_path}: cannot read its weights ({type(e).__name__})") from None
    if cfg.tie_embeddings and any(t.name.startswith("model.lm_head.weight_T") for t in graph.graph.initializer):
        # quantize_onnx gave a tied model's logits matrix its own (quantized) copy: read that one back
        cfg = replace(cfg, tie_embeddings=False)
    model = Model(cfg)
    sd = {}
    for name, t in model.state_dict().items():
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue
        module = f"model.{name[: -len('.weight')]}"
        if name.endswith(("q_proj.weight", "g_proj.weight")) and cfg.gate != "none":
            qg = read_linear(graph, module.rsplit(".", 1)[0] + ".qg_proj")
            q_rows = cfg.n_heads * cfg.head_dim
            w = qg[:q_rows] if name.endswith("q_proj.weight") else qg[q_rows:]
        elif LINEAR_WEIGHT.search(name):
            w = read_linear(graph, module)
        elif name.endswith("linear_attn.A_log") and _init(graph, f"model.{name}") is not None:
            w = _init(graph, f"model.{name}")  # the gqa form's GatedDeltaNet reads A_log itself
        elif name.endswith("linear_attn.A_log"):  # the exporter folds A_log into A = -exp(A_log) (export.onnx)
            a = _first_init(graph, f"model.{name[: -len('_log')]}")
            if a is None:
                raise QuantgateError(f"{onnx_path}: no initializer for {name[: -len('_log')]} (-exp(A_log))")
            w = np.log(-np.asarray(a, dtype=np.float64))
        elif name == "lm_head.weight":
            w = _first_init(graph, "model.lm_head.weight")
            w = read_linear(graph, "model.lm_head") if w is None else w
        elif name == "embed_tokens.weight":
            w = read_embedding(graph)
            if w is None:
                raise QuantgateError(f"{onnx_path}: no initializer for {name}")
        else:
            w = _first_init(graph, f"model.{name}")
            if w is None:
                raise QuantgateError(f"{onnx_path}: no initializer for {name}")
        w = torch.from_numpy(np.array(w, dtype=np.float32))
        if tuple(w.shape) != tuple(t.shape):
            raise QuantgateError(f"{onnx_path}: {name} has shape {tuple(w.shape)}, config.json implies {tuple(t.shape)}")
        sd[name] = w
    model.load_state_dict(sd, strict=False)
    model.eval()
    tok = None
    if (model_dir / "tokenizer.json").is_file():
        tok = load_tokenizer(model_dir, meta.get("bos_id", cfg.bos_id), meta.get("eos_id", cfg.eos_id))
    return Loaded(model, tok, f"onnx:{(meta.get('quantization') or {}).get('scheme', meta.get('dtype', 'fp32'))}",
                  Path(path))


def onnx_context(model_dir) -> int:
    """The export's context: max_position_embeddings of the config.json beside model.onnx."""
    f = Path(model_dir) / "config.json"
    if not f.is_file():
        raise QuantgateError(f"{model_dir}: no config.json beside model.onnx (the export's context is unknown)")
    hf = read_json(f)
    if not isinstance(hf, dict):
        raise QuantgateError(f"{f}: must hold a JSON object")
    return HFFields(hf, str(f)).int("max_position_embeddings", 2048, hi=MAX_CONTEXT)


def check_finite_initializers(onnx_path) -> None:
    """Refuse an export whose float initializers (weights, norms, quantization scales) hold NaN or Inf."""
    try:
        model = onnx.load(str(onnx_path))
    except Exception as e:  # external data unreadable after check_graph passed: a torn file
        raise QuantgateError(f"{onnx_path}: cannot read its weights ({type(e).__name__})") from None
    for t in model.graph.initializer:
        if t.data_type in (1, 10, 11, 16):  # float, float16, double, bfloat16
            a = numpy_helper.to_array(t)
            if not np.isfinite(a.astype(np.float32)).all():
                raise QuantgateError(f"{onnx_path}: initializer {t.name} holds NaN or Inf values")
