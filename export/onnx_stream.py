"""The ONNX decoder traced without its weights, and the weights streamed into it tensor by tensor.

torch.onnx.export (dynamo) traces our Model built on the meta device: the graph comes out with every parameter as a
named initializer that holds no data (`model.layers.3.self_attn.qg_proj.weight`). The exporter's optimizer (constant
folding, shape inference) then runs with those initializers empty, so it folds the shape arithmetic but never a
weight. What it would have folded on weights we do here, by rule, once per parameter:

    Transpose(W) -> MatMul   becomes   MatMul reading `<module>.weight_T` = W.T ([in, out], what ORT's quantizers
                                       and quantgate's reader expect)
    Neg(Exp(A_log))          becomes   `<layer>.linear_attn.A` = -exp(A_log) (a Gated DeltaNet's decay rate)
    anything else            reads     the parameter itself (norm scales, dt_bias, conv weights, the embedding)

Each weight is then written to `model.onnx.data` straight from a mapping of our parameter names to tensors: the
in-memory model's state_dict, or a checkpoint's CheckpointWeights, which reads one tensor from the mmapped
safetensors when asked (bf16 stays bf16 until it is converted, a slice of rows at a time, to the fp32 written). No
fp32 copy of the model is ever built, so the export's peak is set by its largest tensor, not by the model; and the
file from a checkpoint is byte for byte the file from the same checkpoint loaded into memory.

Written by hand because torch.onnx's own paths (export with weights, ONNXProgram.apply_weights) hold every weight
in memory at once, and onnxruntime-genai's builder targets transformers' models, not ours.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import copy

import numpy as np
import torch
import torch.nn as nn

from quantgate.formats.onnx_io import EXTERNAL_DATA, io_names
from quantgate.memory import release_freed
from quantgate.model import Model, ModelConfig
from quantgate.progress import track

CHUNK_BYTES = 64 << 20  # fp32 bytes converted at a time when a large tensor is written (a vocabulary table: 2 GB)
ALIGN = 4096  # ORT memory-maps external data whose offset is page-aligned


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


@dataclass(frozen=True)
class Weight:
    """One initializer of the traced graph: its name there, the parameter of ours it comes from, and the rule:
    '' (as is), 'T' (transposed, a Linear's weight for MatMul) or 'negexp' (-exp, a GDN's A from A_log)."""
    name: str
    param: str
    rule: str
    shape: tuple[int, ...]


def trace_graph(cfg: ModelConfig, opset: int = 23):
    """(onnx_ir Model with every weight an empty initializer, [Weight] in the order they are to be written)."""
    from torch.export import Dim

    with torch.device("meta"):
        m = export_copy(Model(cfg).eval())
    args = tuple(a.to("meta") for a in example_inputs(cfg))
    batch, seq = Dim("batch", min=1, max=1024), Dim("sequence_length", min=1, max=cfg.max_seq_len)
    past = Dim("past_sequence_length", min=0, max=cfg.max_seq_len)
    total = Dim("total_sequence_length", min=1, max=2 * cfg.max_seq_len)
    cache = [d for i in range(cfg.n_layers) for d in  # GDN states have a fixed size: only the batch varies
             ([{0: batch}] * 2 if cfg.layer_type(i) == "linear_attention" else [{0: batch, 2: past}] * 2)]
    shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq}, tuple(cache))  # *past_flat: one entry
    names_in, names_out = io_names(cfg.layer_types or cfg.n_layers)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # e.g. "torchvision is not installed"
    # "skipped deduplication of initializer ... as it has no constant value": empty by design, see above
    logging.getLogger("onnx_ir.passes.common.initializer_deduplication").setLevel(logging.ERROR)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(DecoderWithPast(m).eval(), args, dynamo=True, opset_version=opset,
                                 input_names=names_in, output_names=names_out, dynamic_shapes=shapes,
                                 optimize=False, verbose=False)
    graph = prog.model.graph
    for v in graph.initializers.values():  # meta tensors: no data, so nothing downstream may fold them
        v.const_value = None
    prog.optimize()
    return prog.model, _fold_weight_rules(prog.model.graph)


def _fold_weight_rules(graph) -> list[Weight]:
    """Replace the weight-only subgraphs named in the module docstring by initializers of their result."""
    import onnx_ir as ir
    out: list[Weight] = []
    for name, v in list(graph.initializers.items()):
        if v.const_value is not None:  # a folded constant (shape arithmetic): stays in the graph as it is
            continue
        param, shape = name.removeprefix("model."), tuple(int(d) for d in v.shape)
        users = [u.node for u in v.uses()]
        node = users[0] if len(users) == 1 else None
        consumers = list(node.outputs[0].consumers()) if node is not None else []
        if node is not None and node.op_type == "Transpose" and len(shape) == 2 and consumers \
                and all(c.op_type == "MatMul" for c in consumers):
            new = ir.Value(name=name.removesuffix(".weight") + ".weight_T", shape=ir.Shape(shape[::-1]), type=v.type)
            rule, shape, drop = "T", shape[::-1], [node]
        elif node is not None and node.op_type == "Exp" and name.endswith(".A_log") and len(consumers) == 1 \
                and consumers[0].op_type == "Neg":
            new = ir.Value(name=name.removesuffix("_log"), shape=v.shape, type=v.type)
            rule, drop = "negexp", [consumers[0], node]
        else:
            out.append(Weight(name, param, "", shape))
            continue
        drop[0].outputs[0].replace_all_uses_with(new)
        graph.remove(drop, safe=True)
        graph.initializers.pop(name)
        graph.initializers[new.name] = new
        out.append(Weight(new.name, param, rule, shape))
    return out


def source_tensor(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, param: str) -> torch.Tensor:
    """The tensor of our parameter `param` in `weights` (any dtype); the traced copy's fused q-and-gate Linear is
    [q_proj; g_proj] (Attention.fuse_qg's rule), a tied head is the embedding."""
    if param.endswith(".self_attn.qg_proj.weight"):
        base = param.removesuffix("qg_proj.weight")
        return torch.cat([weights[base + "q_proj.weight"], weights[base + "g_proj.weight"]], dim=0)
    if param == "lm_head.weight" and cfg.tie_embeddings and param not in weights:
        return weights["embed_tokens.weight"]
    return weights[param]


def _pieces(t: torch.Tensor, rule: str):
    """The fp32 bytes of `t` under `rule`, in row-major order, CHUNK_BYTES at a time."""
    if rule == "negexp":
        yield (-torch.exp(t.float())).contiguous().numpy().tobytes()
        return
    if rule == "T":  # rows of W.T are columns of W
        step = max(1, CHUNK_BYTES // (4 * t.shape[0]))
        for c in range(0, t.shape[1], step):
            yield t[:, c:c + step].float().T.contiguous().numpy().tobytes()
        return
    if t.dim() == 0 or 4 * t.numel() <= CHUNK_BYTES:
        yield t.float().contiguous().numpy().tobytes()
        return
    row = 4 * (t.numel() // t.shape[0])
    step = max(1, CHUNK_BYTES // row)
    for r in range(0, t.shape[0], step):
        yield t[r:r + step].float().contiguous().numpy().tobytes()


def write_weights(graph, plan: list[Weight], weights: Mapping[str, torch.Tensor], cfg: ModelConfig,
                  folder: Path, label: str = "writing weights") -> int:
    """Write every planned weight to folder/model.onnx.data (fp32, page-aligned) and point its initializer there;
    returns the bytes written."""
    import onnx_ir as ir
    offset = 0
    with open(folder / EXTERNAL_DATA, "wb") as f:
        for w in track(plan, label, total=len(plan), memory=True):
            t = source_tensor(weights, cfg, w.param)
            want = tuple(t.shape[::-1]) if w.rule == "T" else tuple(t.shape)
            if want != w.shape:
                raise ValueError(f"{w.param}: shape {tuple(t.shape)} does not fit the traced graph's {w.shape}")
            pad = -offset % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            start = offset
            for piece in _pieces(t, w.rule):
                f.write(piece)
                offset += len(piece)
            del t
            v = graph.initializers[w.name]
            v.const_value = ir.ExternalTensor(EXTERNAL_DATA, start, offset - start, ir.DataType.FLOAT,
                                              shape=ir.Shape(w.shape), name=w.name, base_dir=str(folder))
            release_freed()
    return offset


def plan_bytes(plan: list[Weight]) -> int:
    return sum(4 * int(np.prod(w.shape, dtype=np.int64)) for w in plan)
