"""Export to ONNX: a decoder with an explicit KV cache that ONNX Runtime runs, and optimum loads.

torch.onnx.export (dynamo) traces our own model through a thin wrapper whose positional inputs are
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

import copy
import json
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from quantgate import __version__
from quantgate.errors import QuantgateError
from quantgate.formats import load_checkpoint
from quantgate.formats.hf import available_memory, config_to_hf
from quantgate.formats.onnx_io import INLINE_LIMIT, io_names, onnx_bytes, save_onnx, weight_bytes
from quantgate.fsio import atomic_dir, check_output
from quantgate.info import header_config, param_count
from quantgate.layouts import DEFAULT_LAYOUT_FOR_GATE, LAYOUTS
from quantgate.model import Model

from .onnx_gqa import build_gqa_graph

# io_names (the I/O spec) lives in quantgate.formats.onnx_io; importable from here for one release

OPSETS = (23, 18)
DTYPES = ("fp32", "fp16")
GRAPHS = ("standard", "gqa")


class DecoderWithPast(nn.Module):
    """(input_ids, attention_mask, position_ids, *past) -> (logits, *present), tensors only; two cache tensors per
    layer: k and v for attention, the conv and recurrent states for a hybrid's Gated DeltaNet layers."""

    def __init__(self, model: Model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past_flat):
        L = self.model.cfg.n_layers
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(L)]
        out = self.model(input_ids, past=past, position_ids=position_ids, key_mask=attention_mask)
        flat = [t for kv in out.past for t in kv]
        return (out.logits, *flat)


def example_inputs(cfg, batch: int = 2, seq: int = 3, past: int = 4) -> tuple:
    """Example tensors with every dynamic dimension >= 2 (1 would be specialised by the exporter)."""
    ids = torch.randint(3, cfg.vocab_size, (batch, seq))
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    cache = []
    for i in range(cfg.n_layers):
        if cfg.layer_type(i) == "linear_attention":
            cache += [torch.randn(batch, cfg.linear_conv_dim, cfg.linear_conv_kernel - 1),
                      0.1 * torch.randn(batch, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim)]
        else:
            cache += [torch.randn(batch, cfg.n_kv_heads, past, cfg.head_dim) for _ in range(2)]
    return (ids, mask, pos, *cache)


def export_copy(model: Model) -> Model:
    """The copy the exporter traces: q and gate in one MatMul per attention layer (qg_proj, as Qwen3-Next computes
    them; q_proj/g_proj stay but are not traced) and every Gated DeltaNet's rule as one scan (an ONNX Scan)."""
    m = copy.deepcopy(model).eval()
    for layer in m.layers:
        if layer.is_linear:
            layer.linear_attn.export_form = True
        else:
            layer.self_attn.fuse_qg()
    return m


def trace_to_onnx(model: Model, path: Path, opset: int = 23, dtype: str = "fp32", graph_form: str = "standard") -> None:
    """torch.onnx.export (dynamo) of a fused copy of `model` to `path` (or, for graph_form 'gqa', the
    hand-built GroupQueryAttention graph of export/onnx_gqa.py)."""
    import onnx
    from torch.export import Dim

    if graph_form == "gqa":
        graph = build_gqa_graph(model)
        inline = weight_bytes(graph) <= INLINE_LIMIT
        if inline:  # the checker serializes a graph it is given: only below protobuf's 2 GiB limit
            onnx.checker.check_model(graph)
        _save(graph, path, dtype)
        if not inline and dtype == "fp32":  # a Qwen3-0.6B-sized graph (2.4 GB) is checked from its file
            onnx.checker.check_model(str(path))
        return

    m = export_copy(model)
    cfg = m.cfg
    args = example_inputs(cfg)
    batch, seq, past = Dim("batch", min=1, max=1024), Dim("sequence_length", min=1, max=cfg.max_seq_len), \
        Dim("past_sequence_length", min=0, max=cfg.max_seq_len)
    total = Dim("total_sequence_length", min=1, max=2 * cfg.max_seq_len)
    cache = [d for i in range(cfg.n_layers) for d in  # GDN states have a fixed size: only the batch varies
             ([{0: batch}] * 2 if cfg.layer_type(i) == "linear_attention" else [{0: batch, 2: past}] * 2)]
    shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq}, tuple(cache))  # *past_flat: one entry
    names_in, names_out = io_names(cfg.layer_types or cfg.n_layers)
    import logging
    import warnings
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # e.g. "torchvision is not installed"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(DecoderWithPast(m), args, dynamo=True, opset_version=opset,
                                 input_names=names_in, output_names=names_out, dynamic_shapes=shapes,
                                 optimize=True, verbose=False)
    traced = Path(tempfile.mkdtemp(prefix="traced-", dir=path.parent))  # the exporter's own file (and its data)
    try:
        prog.save(str(traced / path.name))
        del prog
        graph = onnx.load(str(traced / path.name))
    finally:
        shutil.rmtree(traced, ignore_errors=True)
    name_linear_weights(graph)
    inline = weight_bytes(graph) <= INLINE_LIMIT
    if inline:  # the checker serializes a graph it is given: only below protobuf's limit
        onnx.checker.check_model(graph)
    _save(graph, path, dtype)
    if not inline and dtype == "fp32":  # a graph with external data is checked from its file
        onnx.checker.check_model(str(path))


def _save(graph, path: Path, dtype: str) -> None:
    if dtype == "fp16":
        # ORT's converter (weights and compute in fp16; inputs, outputs and the KV cache stay fp32, as
        # optimum's fp16 exports do). Tracing a half-precision module instead leaves fp32 rope constants
        # that ORT refuses to multiply with fp16 tensors.
        from onnxruntime.transformers.float16 import convert_float_to_float16
        graph = convert_float_to_float16(graph, keep_io_types=True)  # its node order upsets the checker, not ORT
    save_onnx(graph, path)


def name_linear_weights(model) -> None:
    """Give every Linear's MatMul and its (pre-transposed) weight the module's name, e.g.
    `model.layers.0.self_attn.qg_proj.MatMul` and `...qg_proj.weight_T`, so quantizers, the gate-survival
    check and people reading the graph can find them (the exporter's constant folding leaves `val_30`).
    Drops the exporter's per-node stack traces (they hold local paths)."""
    inits = {i.name: i for i in model.graph.initializer}
    uses: dict[str, int] = {}
    for n in model.graph.node:
        for x in n.input:
            uses[x] = uses.get(x, 0) + 1
    renames = {}
    for n in model.graph.node:
        props = {p.key: p.value for p in n.metadata_props}
        for p in [p for p in n.metadata_props if p.key == "pkg.torch.onnx.stack_trace"]:
            n.metadata_props.remove(p)
        if n.op_type != "MatMul" or "pkg.torch.onnx.name_scopes" not in props:
            continue
        scopes = [x.strip(" '") for x in props["pkg.torch.onnx.name_scopes"].strip("[]").split(",")]
        module = next((x for x in reversed(scopes) if LINEAR_MODULE.search(x)), None)
        if module is None:
            continue
        n.name = f"{module}.MatMul"
        b = n.input[1]
        if b in inits and uses.get(b) == 1:
            renames[b] = f"{module}.weight_T"
    for old, new in renames.items():
        inits[old].name = new
        for n in model.graph.node:
            n.input[:] = [new if x == old else x for x in n.input]
    _own_norm_weights(model)
    _own_gdn_decay(model)
    _drop_unused_initializers(model)


def _drop_unused_initializers(model) -> None:
    """Initializers no node reads any more (the shared ones the two functions above replaced): ONNX Runtime would
    warn about each one on every load."""
    import onnx
    used = {x for n in model.graph.node for x in n.input} | {o.name for o in model.graph.output}
    for a in (a for n in model.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH):
        used |= {x for n in a.g.node for x in n.input}  # a Scan body reads outer initializers by name
    keep = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


LINEAR_MODULE = re.compile(r"(_proj|\.in_proj_(qkv|z|a|b)|lm_head)$")  # a Linear's module name (GDN's in_proj_*)


def _scopes(node) -> list[str]:
    props = {p.key: p.value for p in node.metadata_props}
    return [x.strip(" '") for x in props.get("pkg.torch.onnx.name_scopes", "").strip("[]").split(",")]


def _own_gdn_decay(model) -> None:
    """The exporter folds a Gated DeltaNet's -exp(A_log) into an anonymous constant, and shares one dt_bias between
    layers whose values are equal (all ones at init); name them per layer, `<layer>.linear_attn.A` (its value
    -exp(A_log)) and `<layer>.linear_attn.dt_bias`, so the reader finds every layer's parameters again."""
    inits = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:
        module = next((x for x in reversed(_scopes(n)) if x.endswith(".linear_attn")), None)
        if module is None or n.op_type not in ("Mul", "Add"):
            continue
        for k, x in enumerate(n.input):
            t = inits.get(x)
            if t is None or len(t.dims) != 1 or t.dims[0] < 1 or t.data_type not in (1, 10):
                continue
            if n.op_type == "Mul" and not x.startswith("model."):
                _own_initializer(model, inits, n, k, f"{module}.A")
            elif n.op_type == "Add" and x.endswith(".linear_attn.dt_bias"):
                _own_initializer(model, inits, n, k, f"{module}.dt_bias")


def _own_initializer(model, inits: dict, node, k: int, want: str) -> None:
    """Point input k of `node` at an initializer named `want` (a copy of the one it reads, made once)."""
    import copy as _copy
    if node.input[k] == want:
        return
    if want not in inits:
        t = _copy.deepcopy(inits[node.input[k]])
        t.name = want
        model.graph.initializer.append(t)
        inits[want] = t
    node.input[k] = want


def _own_norm_weights(model) -> None:
    """The exporter shares one initializer between equal norm weights (e.g. q_norm and k_norm still at 1.0);
    give every norm its own `<module>.weight` so the weights can be read back by name."""
    import copy as _copy
    inits = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:
        props = {p.key: p.value for p in n.metadata_props}
        scopes = [x.strip(" '") for x in props.get("pkg.torch.onnx.name_scopes", "").strip("[]").split(",")]
        module = next((x for x in reversed(scopes) if x.endswith("norm")), None)
        if module is None or n.op_type not in ("RMSNormalization", "Mul"):
            continue
        want = f"{module}.weight"
        for k, x in enumerate(n.input):  # the scale: a float vector (not an axes or epsilon constant)
            t = inits.get(x)
            if t is not None and len(t.dims) == 1 and t.dims[0] > 1 and t.data_type in (1, 10) and x != want:
                if want not in inits:
                    t = _copy.deepcopy(inits[x])
                    t.name = want
                    model.graph.initializer.append(t)
                    inits[want] = t
                n.input[k] = want


def export_onnx(model: Model, tokenizer, out_dir: str | Path, opset: int = 23, graph: str = "standard",
                dtype: str = "fp32", layout: str | None = None, source: str = "", inputs: tuple = ()) -> Path:
    """Write `out_dir` (atomically): model.onnx, config.json, tokenizer, generation_config.json, quantgate.json."""
    cfg = model.cfg
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
    if cfg.is_hybrid and graph == "gqa":
        raise QuantgateError("--graph gqa is built for all-attention models; export a hybrid (Gated DeltaNet) model "
                             "with --graph standard")
    if cfg.is_hybrid and dtype == "fp16":
        raise QuantgateError("--dtype fp16 is not available for hybrid (Gated DeltaNet) models: their recurrent state "
                             "is kept in fp32; export fp32 and quantize it (int8, int4)")
    default = "qwen3_5" if cfg.is_hybrid else DEFAULT_LAYOUT_FOR_GATE[cfg.gate]
    lay = LAYOUTS[layout if layout in LAYOUTS and LAYOUTS[layout].cannot_hold(cfg) is None else default]
    with atomic_dir(out_dir, "onnx") as tmp:
        if graph == "gqa" and opset != 23:
            raise QuantgateError("--graph gqa is built at opset 23 (RMSNormalization); drop --opset 18")
        if graph == "gqa" and (cfg.rotary_dim // 2) % 8:
            raise QuantgateError(f"--graph gqa: ORT's GroupQueryAttention needs rotary_dim/2 to be a multiple of 8 "
                                 f"(this model rotates {cfg.rotary_dim} channels); use --graph standard")
        trace_to_onnx(model, tmp / "model.onnx", opset, dtype, graph)
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
                **({"layer_types": list(cfg.layer_types)} if cfg.is_hybrid else {})}
        (tmp / "quantgate.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir


# What the ONNX export (torch.onnx's trace of the fp32 model, then the file) held at its peak per parameter:
# 14.1 GB for the Qwen3.5-0.8B shape's 0.75 B (benchmarks/results/hybrid_laptop_shape.json). The export does not
# stream yet, so a model whose estimate exceeds the memory available is refused before the trace starts (the 2B
# shape was killed by the kernel at 24.6 GB after 130 s, benchmarks/results/scale.json).
EXPORT_BYTES_PER_PARAM = 19


# onnxruntime 1.32's CPU provider runs com.microsoft.MoE (probed here), but no exporter of quantgate's maps the
# routed experts to it yet; tracing the Python routing loop would bake one batch's routing into the graph.
MOE_REFUSAL = ("ONNX export of mixture-of-experts models is not supported yet (the routed experts would need "
               "onnxruntime's com.microsoft.MoE op); export to GGUF instead: `quantgate export gguf`")


def check_export_memory(model_path: str | Path) -> None:
    if header_config(model_path).is_moe:
        raise QuantgateError(f"{model_path}: {MOE_REFUSAL}")
    n = param_count(model_path)
    need, avail = EXPORT_BYTES_PER_PARAM * n, available_memory()
    if avail is not None and need > avail:
        raise QuantgateError(f"{model_path}: exporting {n / 1e9:.2f}B parameters to ONNX needs about "
                             f"{need / 2**30:.0f} GiB of memory (measured: {EXPORT_BYTES_PER_PARAM} bytes per "
                             f"parameter), more than the {avail / 2**30:.1f} GiB available; `quantgate export gguf` "
                             f"streams instead")


def export_checkpoint(model_path: str | Path, out_dir: str | Path, opset: int = 23, graph: str = "standard",
                      dtype: str = "fp32") -> dict:
    """`quantgate export onnx`: load any layout the loader reads (or a GGUF) and write the ONNX directory."""
    check_output(out_dir, "onnx", (model_path,))
    check_export_memory(model_path)
    loaded = load_checkpoint(model_path)
    export_onnx(loaded.model, loaded.tokenizer, out_dir, opset, graph, dtype, layout=loaded.layout,
                source=str(model_path), inputs=(model_path,))
    size = onnx_bytes(Path(out_dir))
    return {"model": str(model_path), "out": str(out_dir), "gate": loaded.model.cfg.gate, "opset": opset,
            "graph": graph, "dtype": dtype, "bytes": size}
