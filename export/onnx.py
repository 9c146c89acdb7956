"""Export to ONNX: a decoder with an explicit KV cache that ONNX Runtime runs, and optimum loads.

torch.onnx.export (dynamo) traces our own model, built on the meta device, through a thin wrapper (both in
export/onnx_stream.py, which then writes the weights one tensor at a time) whose positional inputs are
optimum's names: input_ids, attention_mask, position_ids, past_key_values.{i}.key/value; outputs logits
and present.{i}.key/value. The gated twin's q and gate rows go through one fused MatMul (`qg_proj`, as
Qwen3-Next computes them); at opset 23 SDPA becomes the ONNX `Attention` op (GQA native) and the gate a
Sigmoid and Mul on its output before o_proj, since no ONNX or ORT attention op takes an output gate
(DESIGN section 4). Opset 18 is the fallback for older runtimes (attention decomposed).

Beside model.onnx: config.json (the HF config of the layout the twin is saved in), tokenizer files,
generation_config.json and quantgate.json (what was exported, how), so optimum's ORTModelForCausalLM
opens the baseline and our runner opens every export.
"""
from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

from quantgate import __version__
from quantgate.errors import QuantgateError
from quantgate.formats import load_checkpoint
from quantgate.formats.hf import available_memory, config_to_hf, open_hf
from quantgate.formats.kind import artifact_kind
from quantgate.formats.onnx_io import (EXTERNAL_DATA, INLINE_LIMIT, check_model, check_written, io_names, onnx_bytes,
                                      save_onnx, weight_bytes)
from quantgate.fsio import atomic_dir, check_output
from quantgate.info import header_config, param_count
from quantgate.layouts import DEFAULT_LAYOUT_FOR_GATE, LAYOUTS
from quantgate.model import Model, pytorch_only, without_attention

from .onnx_gqa import build_gqa_graph, check_gdn_op, default_gdn_op
from .onnx_stream import (DecoderWithPast, example_inputs, export_copy, plan_bytes, trace_graph,  # noqa: F401
                          write_weights)

# io_names (the I/O spec) lives in quantgate.formats.onnx_io; importable from here for one release

OPSETS = (23, 18)
DTYPES = ("fp32", "fp16")
GRAPHS = ("standard", "gqa")


def trace_to_onnx(model: Model, path: Path, opset: int = 23, dtype: str = "fp32", graph_form: str = "standard",
                  gdn_op: str | None = None) -> None:
    """`model` as an ONNX decoder at `path`: the traced graph with its weights streamed from the model's state dict
    (write_onnx), or, for graph_form 'gqa', the hand-built graph on ORT's fused ops of export/onnx_gqa.py."""
    if graph_form != "gqa":
        write_onnx(model.cfg, model.state_dict(), path, opset, dtype)
        return
    build_gqa_graph(model.cfg, model.state_dict(), path, gdn_op)
    if dtype == "fp16":
        import onnx
        graph = onnx.load(str(path))
        (path.parent / EXTERNAL_DATA).unlink(missing_ok=True)
        _save(graph, path, dtype)


def write_onnx(cfg, weights, path: Path, opset: int = 23, dtype: str = "fp32") -> None:
    """The decoder of `cfg` traced on the meta device, its weights written from `weights` (our parameter names ->
    tensors of any float dtype: a state dict, or a checkpoint's CheckpointWeights) one at a time into
    model.onnx.data beside `path`, in a folder this call owns (export_onnx's fresh temporary one: the data file it
    writes there is replaced, and removed again when folded in) (export/onnx_stream.py). Weights of 1 GiB or less are then folded into
    model.onnx itself, and fp16 is converted from the fp32 file (both in memory, which their size allows)."""
    import onnx
    import onnx_ir as ir

    traced, plan = trace_graph(cfg, opset)
    write_weights(traced.graph, plan, weights, cfg, path.parent, label=f"writing {path.name}")
    proto = ir.serde.serialize_model(traced)
    del traced
    name_linear_weights(proto)
    onnx.save(proto, str(path))
    del proto
    check_model(path)  # from the file: the checker reads external data's headers, not the bytes
    if dtype == "fp16" or plan_bytes(plan) <= INLINE_LIMIT:
        graph = onnx.load(str(path))
        (path.parent / EXTERNAL_DATA).unlink()
        _save(graph, path, dtype)


def _save(graph, path: Path, dtype: str) -> None:
    if dtype == "fp16":
        # ORT's converter (weights and compute in fp16; inputs, outputs and the KV cache stay fp32, as
        # optimum's fp16 exports do). Tracing a half-precision module instead leaves fp32 rope constants
        # that ORT refuses to multiply with fp16 tensors.
        from onnxruntime.transformers.float16 import convert_float_to_float16
        graph = convert_float_to_float16(graph, keep_io_types=True)  # its node order upsets the checker, not ORT
    save_onnx(graph, path)


def name_linear_weights(model) -> None:
    """Give every Linear's MatMul the module's name, e.g. `model.layers.0.self_attn.qg_proj.MatMul` (its weight is
    already `...qg_proj.weight_T`, export/onnx_stream.py), so quantizers, the gate-survival check and people reading
    the graph can find them (the exporter names the node `node_MatMul_30`). Drops the exporter's per-node stack
    traces, in Scan bodies too (they hold local paths and the tracer's counters)."""
    for n in _all_nodes(model.graph):
        for p in [p for p in n.metadata_props if p.key == "pkg.torch.onnx.stack_trace"]:
            n.metadata_props.remove(p)
    for n in model.graph.node:
        props = {p.key: p.value for p in n.metadata_props}
        if n.op_type != "MatMul" or "pkg.torch.onnx.name_scopes" not in props:
            continue
        module = next((x for x in reversed(_scopes(n)) if LINEAR_MODULE.search(x)), None)
        if module is not None:
            n.name = f"{module}.MatMul"


def _all_nodes(graph):
    import onnx
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(a.g)


LINEAR_MODULE = re.compile(r"(_proj|\.in_proj_(qkv|z|a|b)|lm_head)$")  # a Linear's module name (GDN's in_proj_*)


def _scopes(node) -> list[str]:
    props = {p.key: p.value for p in node.metadata_props}
    return [x.strip(" '") for x in props.get("pkg.torch.onnx.name_scopes", "").strip("[]").split(",")]


def export_onnx(model: Model, tokenizer, out_dir: str | Path, opset: int = 23, graph: str = "standard",
                dtype: str = "fp32", layout: str | None = None, source: str = "", inputs: tuple = (),
                gdn_op: str | None = None) -> Path:
    """Write `out_dir` (atomically): model.onnx, config.json, tokenizer, generation_config.json, quantgate.json."""
    return _export(model.cfg, tokenizer, out_dir, lambda path: trace_to_onnx(model, path, opset, dtype, graph, gdn_op),
                   opset, graph, dtype, layout, source, inputs, gdn_op)


def _export(cfg, tokenizer, out_dir: str | Path, write, opset: int, graph: str, dtype: str, layout: str | None,
            source: str, inputs: tuple, gdn_op: str | None = None) -> Path:
    """The export directory around `write(path of model.onnx)`: options and model checked first, then everything
    written into a temporary folder renamed into place."""
    if opset not in OPSETS:
        raise QuantgateError(f"unsupported --opset {opset}; choose from {', '.join(map(str, OPSETS))}")
    if graph not in GRAPHS:
        raise QuantgateError(f"unknown --graph {graph!r}; choose from {', '.join(GRAPHS)}")
    if dtype not in DTYPES:
        raise QuantgateError(f"unknown --dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if "quant_scheme" in cfg.extra:
        raise QuantgateError("this model carries a simulated PyTorch quantization scheme; export the float model and "
                             "quantize the ONNX file with `quantgate quantize DIR/model.onnx --scheme ...`")
    out_dir = Path(out_dir)
    check_output(out_dir, "onnx", inputs)
    if cfg.is_moe:
        raise QuantgateError(MOE_REFUSAL)
    pytorch_only(cfg, "ONNX export")
    if without_attention(cfg):
        raise QuantgateError(without_attention(cfg))
    if gdn_op is not None and (graph != "gqa" or not cfg.is_hybrid):
        raise QuantgateError("--gdn-op applies to --graph gqa exports of hybrid (Gated DeltaNet) models")
    if cfg.is_hybrid and graph == "gqa":
        check_gdn_op(gdn_op or default_gdn_op())
    if cfg.is_hybrid and dtype == "fp16":
        raise QuantgateError("--dtype fp16 is not available for hybrid (Gated DeltaNet) models: their recurrent state "
                             "is kept in fp32; export fp32 and quantize it (int8, int4)")
    if graph == "gqa" and opset != 23:
        raise QuantgateError("--graph gqa is built at opset 23 (RMSNormalization); drop --opset 18")
    if graph == "gqa" and (cfg.rotary_dim // 2) % 8:
        raise QuantgateError(f"--graph gqa: ORT's GroupQueryAttention needs rotary_dim/2 to be a multiple of 8 "
                             f"(this model rotates {cfg.rotary_dim} channels); use --graph standard")
    default = "qwen3_5" if cfg.is_hybrid else DEFAULT_LAYOUT_FOR_GATE[cfg.gate]
    lay = LAYOUTS[layout if layout in LAYOUTS and LAYOUTS[layout].cannot_hold(cfg) is None else default]
    with atomic_dir(out_dir, "onnx") as tmp:
        write(tmp / "model.onnx")
        hf = config_to_hf(cfg, lay)
        hf["use_cache"] = True
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        gen = {"bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp)
        meta = {"quantgate_version": __version__, "format": "onnx", "opset": opset, "graph": graph, "dtype": dtype,
                "gate": cfg.gate, "source": str(source), "source_layout": layout or "", "n_layers": cfg.n_layers,
                "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
                "bos_id": cfg.bos_id, "eos_id": cfg.eos_id, "quantization": None,
                **({"layer_types": list(cfg.layer_types)} if cfg.is_hybrid else {}),
                **({"gdn_op": gdn_op or default_gdn_op()} if cfg.is_hybrid and graph == "gqa" else {})}
        (tmp / "quantgate.json").write_text(json.dumps(meta, indent=2) + "\n")
        check_written(tmp, out_dir, checker=dtype != "fp16")
    return out_dir


# What an export that holds the whole model held at its peak per parameter: 14.1 GB for the Qwen3.5-0.8B shape's
# 0.75 B (benchmarks/results/hybrid_laptop_shape.json), measured when every export traced the fp32 model in memory.
# Only the paths that still need the model in memory use it now: --dtype fp16, and a GGUF or ONNX source (read back
# into a model first); both fp32 graphs of a model directory stream.
EXPORT_BYTES_PER_PARAM = 19


# onnxruntime 1.32's CPU provider runs com.microsoft.MoE (probed here), but no exporter of quantgate's maps the
# routed experts to it yet; tracing the Python routing loop would bake one batch's routing into the graph.
MOE_REFUSAL = ("ONNX export of mixture-of-experts models is not supported yet (the routed experts would need "
               "onnxruntime's com.microsoft.MoE op); export to GGUF instead: `quantgate export gguf`")


def check_export_memory(model_path: str | Path, why: str) -> None:
    """Refuse, before anything is read, an export that needs the whole model in memory where it cannot fit."""
    if header_config(model_path).is_moe:
        raise QuantgateError(f"{model_path}: {MOE_REFUSAL}")
    n = param_count(model_path)
    need, avail = EXPORT_BYTES_PER_PARAM * n, available_memory()
    if avail is not None and need > avail:
        raise QuantgateError(f"{model_path}: {why} holds the whole model in memory: about {need / 2**30:.0f} GiB for "
                             f"{n / 1e9:.2f}B parameters (measured: {EXPORT_BYTES_PER_PARAM} bytes per parameter), "
                             f"more than the {avail / 2**30:.1f} GiB available; the fp32 --graph standard export of a "
                             f"model directory streams")


def export_checkpoint(model_path: str | Path, out_dir: str | Path, opset: int = 23, graph: str = "standard",
                      dtype: str = "fp32", gdn_op: str | None = None) -> dict:
    """`quantgate export onnx`: write the ONNX directory of any layout the loader reads (or of a GGUF). The fp32
    standard graph of a model directory is streamed from its safetensors tensor by tensor (write_onnx), so no
    verb holds the model; the other forms load it first."""
    check_output(out_dir, "onnx", (model_path,))
    kind = artifact_kind(model_path)
    if kind == "hf" and dtype == "fp32":
        ckpt = open_hf(model_path)
        cfg = ckpt.cfg
        write = (partial(write_onnx, cfg, ckpt.weights(), opset=opset, dtype=dtype) if graph == "standard"
                 else partial(build_gqa_graph, cfg, ckpt.weights(), gdn_op=gdn_op))
        _export(cfg, ckpt.tokenizer, out_dir, lambda path: write(path=path), opset, graph, dtype, ckpt.layout.name,
                str(model_path), (model_path,), gdn_op)
    else:
        why = "--dtype fp16" if dtype == "fp16" else f"exporting a {kind.upper()} file"
        check_export_memory(model_path, why)
        loaded = load_checkpoint(model_path)
        cfg = loaded.model.cfg
        export_onnx(loaded.model, loaded.tokenizer, out_dir, opset, graph, dtype, layout=loaded.layout,
                    source=str(model_path), inputs=(model_path,), gdn_op=gdn_op)
    size = onnx_bytes(Path(out_dir))
    return {"model": str(model_path), "out": str(out_dir), "gate": cfg.gate, "opset": opset,
            "graph": graph, "dtype": dtype, "bytes": size}
