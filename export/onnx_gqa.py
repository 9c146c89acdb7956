"""The `--graph gqa` form: a decoder built node by node on ONNX Runtime's own fused CPU ops.

No exporter emits ORT's contrib ops from PyTorch, so this graph is written by hand (onnx.helper), the way
onnxruntime-genai's builder writes Qwen3.5 (QWEN35.md section 4.1):

- full attention: per layer RMSNorm, one MatMul for q and gate rows (as Qwen3-Next fuses them), k and v MatMuls,
  QK-RMSNorm per head, then `com.microsoft.GroupQueryAttention` with rotary inside (do_rotary=1, cos/sin caches as
  initializers, partial rotary by the caches' width) and the KV cache as its past/present tensors, then
  sigmoid(gate) * attention output before the o_proj MatMul (no ORT attention op takes an output gate, DESIGN
  section 4);
- a hybrid's Gated DeltaNet layers: in_proj_qkv -> `CausalConvWithState` (SiLU inside, its state past.conv.i) ->
  q, k, v; then either (gdn_op "linear_attention", ORT 1.31+) per-head L2 norm (eps inside the root, as HF and
  our model) -> `LinearAttentionGate` (decay, beta) -> `LinearAttention` (gated_delta, state [B, Hv, dk, dv]), or
  (gdn_op "gated_delta_net", ORT 1.32+) one `GatedDeltaNet` with the L2 norm and both gates inside (its state is
  V-major, [B, Hv, dv, dk]); then `GatedRMSNorm` (norm(o) * silu(z)) and out_proj.

Inputs, outputs and weight names match the traced graph (export/onnx_stream.py), so the runner, the quantizers and
the weight reader treat both forms alike. Weights are written to model.onnx.data one tensor at a time as the graph
is built (from a state dict or a checkpoint's lazily read tensors), so the export never holds the model, and folded
into model.onnx when they fit (as write_onnx does).

`logits_to_keep` (an int64 scalar input after the caches) is how many trailing positions get logits: 1 is all a
prompt's prefill and each decode step need (the head is a vocabulary-wide MatMul per position), the sequence length
gives every position's (eval). A required input, not one with a default: ORT cannot bind an overridable initializer
with IOBinding, and warns about it at every session start.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from quantgate.errors import QuantgateError
from quantgate.formats.onnx_io import (EXTERNAL_DATA, INLINE_LIMIT, LOGITS_TO_KEEP, DataWriter, check_model, io_names,
                                      save_onnx)
from quantgate.model import ModelConfig
from quantgate.progress import track

from .onnx_stream import source_tensor

OPSET = 23  # RMSNormalization is a standard op from 23; the fused ops live in com.microsoft
GDN_OPS = ("linear_attention", "gated_delta_net")

L2_EPS = 1e-6  # model.l2norm's eps (HF's and FLA's): inside the root, so ONNX's LpNormalization (no eps) is not used


def default_gdn_op() -> str:
    """LinearAttention: in ORT 1.31 and 1.32, and on Qwen3.5-0.8B's layer shapes (2 threads, fp32) 1.45x
    GatedDeltaNet's prefill and on par at decode, both within 3e-6 of float64 PyTorch
    (benchmarks/results/onnx_gdn_ops.json)."""
    return "linear_attention"


GDN_OP_NEEDS = {"linear_attention": (1, 31), "gated_delta_net": (1, 32)}  # the first ORT with its CPU kernels


def check_gdn_op(gdn_op: str) -> None:
    """The op is known and the installed onnxruntime runs it on the CPU (QWEN35.md section 4.2)."""
    import onnxruntime as ort
    if gdn_op not in GDN_OPS:
        raise QuantgateError(f"unknown --gdn-op {gdn_op!r}; choose from {', '.join(GDN_OPS)}")
    need = GDN_OP_NEEDS[gdn_op]
    if tuple(int(x) for x in ort.__version__.split(".")[:2]) < need:
        raise QuantgateError(f"--graph gqa with --gdn-op {gdn_op} needs onnxruntime >= {need[0]}.{need[1]} (its CPU "
                             f"kernels); this one is {ort.__version__}: upgrade it, or export --graph standard")


def gdn_state_shape(cfg: ModelConfig, gdn_op: str) -> list[int]:
    """A Gated DeltaNet layer's recurrent state without its batch dim, as the op reads it."""
    dk, dv = cfg.linear_key_dim, cfg.linear_value_dim
    return [cfg.linear_value_heads, dv, dk] if gdn_op == "gated_delta_net" else [cfg.linear_value_heads, dk, dv]


class _Builder:
    """Nodes and initializers of one graph; initializers over 1 KiB go straight to the data file."""

    def __init__(self, folder: Path):
        self.nodes, self.inits = [], []
        self.writer = DataWriter(folder / EXTERNAL_DATA)

    def init(self, name: str, array) -> str:
        from onnx import numpy_helper
        a = np.asarray(array)  # not ascontiguousarray, which makes a scalar 1-D
        self.inits.append(self.writer.put(numpy_helper.from_array(a if a.flags.c_contiguous else a.copy(), name)))
        return name

    def node(self, op: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        from onnx import helper
        outs = [f"{name}/out{k}" for k in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain, **attrs))
        return outs


def build_gqa_graph(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], path: Path,
                    gdn_op: str | None = None) -> None:
    """Write the decoder of `cfg` with `weights` (our parameter names -> tensors of any float dtype) to `path`
    (model.onnx, and model.onnx.data beside it when the weights are over 1 GiB), in a folder this call owns."""
    import onnx
    from onnx import TensorProto, helper

    gdn_op = gdn_op or default_gdn_op()
    check_gdn_op(gdn_op)
    b = _Builder(path.parent)
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def weight(param: str) -> np.ndarray:
        return source_tensor(weights, cfg, param).float().numpy()

    def linear(x: str, module: str, param: str) -> str:
        w = b.init(f"{module}.weight_T", weight(param).T)
        return b.node("MatMul", [x, w], f"{module}.MatMul")[0]

    def rmsnorm(x: str, param: str, scope: str) -> str:
        return b.node("RMSNormalization", [x, b.init(f"model.{param}", weight(param))], f"{scope}/RMSNorm",
                      axis=-1, epsilon=cfg.norm_eps)[0]

    def const(name: str, values, dtype=np.int64) -> str:
        return b.init(name, np.array(values, dtype=dtype))

    names_in, names_out = io_names(cfg.layer_types or cfg.n_layers)
    bs_heads, bs_flat = const("shape_bs_h_hd", [0, 0, -1, hd]), const("shape_bs_flat", [0, 0, -1])
    h = b.node("Gather", [b.init("model.embed_tokens.weight", weight("embed_tokens.weight")), "input_ids"],
               "embed")[0]
    if cfg.full_attention_layers:
        seqlens_k, total = _seqlens(b)
        cos, sin = _rope_caches(b, cfg)
    def add_norm(h: str, o: str, param: str, scope: str) -> tuple[str, str]:
        """(RMSNorm(h + o), h + o) in one node: ORT's SkipSimplifiedLayerNormalization, the residual add fused
        with the next norm (two fewer kernel launches per layer, as onnxruntime-genai's graphs have it)."""
        outs = b.node("SkipSimplifiedLayerNormalization", [h, o, b.init(f"model.{param}", weight(param))],
                      f"{scope}/SkipRMSNorm", n_out=4, domain="com.microsoft", epsilon=cfg.norm_eps)
        b.nodes[-1].output[1:3] = ["", ""]  # mean and inverse std: not needed
        return outs[0], outs[3]

    x = rmsnorm(h, "layers.0.input_layernorm.weight", "model.layers.0/input_norm")
    layers = range(cfg.n_layers)
    for i in track(layers, f"writing {path.name}", total=cfg.n_layers, memory=True):
        p, m = f"layers.{i}", f"model.layers.{i}"
        past, present = names_in[3 + 2 * i: 5 + 2 * i], names_out[1 + 2 * i: 3 + 2 * i]
        if cfg.layer_type(i) == "linear_attention":
            o = _gated_delta_net(b, cfg, i, x, past, present, gdn_op, weight, linear)
        else:
            o = _attention(b, cfg, i, x, past, present, (seqlens_k, total, cos, sin), bs_heads, bs_flat,
                           linear, rmsnorm)
        x, h = add_norm(h, o, f"{p}.post_attention_layernorm.weight", f"{m}/post_norm")
        gate = linear(x, f"{m}.mlp.gate_proj", f"{p}.mlp.gate_proj.weight")
        up = linear(x, f"{m}.mlp.up_proj", f"{p}.mlp.up_proj.weight")
        silu = b.node("Mul", [gate, b.node("Sigmoid", [gate], f"{m}/mlp_sigmoid")[0]], f"{m}/mlp_silu")[0]
        down = linear(b.node("Mul", [silu, up], f"{m}/mlp_mul")[0], f"{m}.mlp.down_proj", f"{p}.mlp.down_proj.weight")
        if i + 1 < cfg.n_layers:  # the next layer's input norm
            x, h = add_norm(h, down, f"layers.{i + 1}.input_layernorm.weight", f"model.layers.{i + 1}/input_norm")
        else:  # the last: sliced to logits_to_keep before the final norm
            h = b.node("Add", [h, down], f"{m}/residual_mlp")[0]
    # the last logits_to_keep positions only (default 1: what a prefill needs), before the norm and the head
    start = b.node("Neg", [b.node("Unsqueeze", [LOGITS_TO_KEEP, const("axis0", [0])], "keep/unsqueeze")[0]],
                   "keep/neg")[0]
    h = b.node("Slice", [h, start, const("int64_max", [np.iinfo(np.int64).max]), const("axis1", [1])], "keep/slice")[0]
    h = rmsnorm(h, "norm.weight", "model/final_norm")
    if cfg.tie_embeddings:  # one stored matrix, as in the traced graph (quantize_onnx gives the head its own copy)
        w_t = b.node("Transpose", ["model.embed_tokens.weight"], "model.lm_head/Transpose", perm=[1, 0])[0]
        b.node("MatMul", [h, w_t], "model.lm_head.MatMul")
    else:
        linear(h, "model.lm_head", "lm_head.weight")
    b.nodes[-1].output[0] = "logits"  # the graph output's name

    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total_sequence_length"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", "logits_length", cfg.vocab_size])]
    for i in range(cfg.n_layers):
        past, present = names_in[3 + 2 * i: 5 + 2 * i], names_out[1 + 2 * i: 3 + 2 * i]
        if cfg.layer_type(i) == "linear_attention":
            shapes = [[cfg.linear_conv_dim, cfg.linear_conv_kernel - 1], gdn_state_shape(cfg, gdn_op)]
            inputs += [helper.make_tensor_value_info(n, f32, ["batch", *s]) for n, s in zip(past, shapes)]
            outputs += [helper.make_tensor_value_info(n, f32, ["batch", *s]) for n, s in zip(present, shapes)]
        else:
            inputs += [helper.make_tensor_value_info(n, f32, ["batch", KV, "past_sequence_length", hd]) for n in past]
            outputs += [helper.make_tensor_value_info(n, f32, ["batch", KV, "total_sequence_length", hd])
                        for n in present]
    inputs.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, []))
    b.writer.close()
    graph = helper.make_graph(b.nodes, "quantgate_gqa_decoder", inputs, outputs, b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              producer_name="quantgate")
    model.ir_version = 10  # ORT 1.31 refuses onnx 1.23's default IR 14
    onnx.save(model, str(path))
    check_model(path)  # from the file: external data's headers, not its bytes
    if b.writer.offset <= INLINE_LIMIT:  # a small model is one file, as every export of quantgate's
        whole = onnx.load(str(path))
        (path.parent / EXTERNAL_DATA).unlink()
        save_onnx(whole, path)


def _seqlens(b: _Builder) -> tuple[str, str]:
    """GroupQueryAttention's seqlens_k (cached + new tokens - 1, per row) and total length, from attention_mask."""
    from onnx import TensorProto
    lens = b.node("ReduceSum", ["attention_mask", b.init("axis1_sum", np.array([1], dtype=np.int64))], "seqlens/sum",
                  keepdims=0)[0]
    lens = b.node("Sub", [lens, b.init("one_i64", np.array(1, dtype=np.int64))], "seqlens/sub")[0]
    seqlens_k = b.node("Cast", [lens], "seqlens/cast", to=TensorProto.INT32)[0]
    total = b.node("Shape", ["attention_mask"], "total/shape", start=1, end=2)[0]
    total = b.node("Squeeze", [total], "total/squeeze")[0]
    return seqlens_k, b.node("Cast", [total], "total/cast", to=TensorProto.INT32)[0]


def _rope_caches(b: _Builder, cfg: ModelConfig) -> tuple[str, str]:
    """cos/sin caches: positions x (rotary_dim / 2), NEOX order, as model.rope_cache computes them."""
    r = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    freqs = torch.arange(cfg.max_seq_len, dtype=torch.float32)[:, None] * inv[None]
    return b.init("cos_cache", freqs.cos().numpy()), b.init("sin_cache", freqs.sin().numpy())


def _attention(b: _Builder, cfg: ModelConfig, i: int, x: str, past, present, rope, bs_heads, bs_flat,
               linear, rmsnorm) -> str:
    """One full-attention layer's mixer output (before the residual add)."""
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    p, m = f"layers.{i}", f"model.layers.{i}"
    if cfg.gate != "none":
        qg = linear(x, f"{m}.self_attn.qg_proj", f"{p}.self_attn.qg_proj.weight")
        q, g = b.node("Split", [qg, b.init(f"{m}/split_sizes", np.array([H * hd, cfg.gate_dim], dtype=np.int64))],
                      f"{m}/split_qg", n_out=2, axis=-1)
    else:
        q, g = linear(x, f"{m}.self_attn.q_proj", f"{p}.self_attn.q_proj.weight"), None
    k = linear(x, f"{m}.self_attn.k_proj", f"{p}.self_attn.k_proj.weight")
    v = linear(x, f"{m}.self_attn.v_proj", f"{p}.self_attn.v_proj.weight")
    if cfg.qk_norm:  # per head: [B, S, heads, hd] -> RMSNorm over hd -> back
        q, k = (b.node("Reshape", [rmsnorm(b.node("Reshape", [t, bs_heads], f"{m}/{n}_heads")[0],
                                           f"{p}.self_attn.{n}_norm.weight", f"{m}/{n}_norm"), bs_flat],
                       f"{m}/{n}_flat")[0] for n, t in (("q", q), ("k", k)))
    seqlens_k, total, cos, sin = rope
    attn = b.node("GroupQueryAttention", [q, k, v, past[0], past[1], seqlens_k, total, cos, sin],
                  f"{m}.self_attn/GroupQueryAttention", n_out=3, domain="com.microsoft", num_heads=H,
                  kv_num_heads=KV, do_rotary=1, rotary_interleaved=0, scale=float(hd) ** -0.5)[0]
    b.nodes[-1].output[1:] = present
    if g is not None:  # the gate: sigmoid(X W_g) per head (headwise) or per channel (elementwise)
        sg = b.node("Sigmoid", [g], f"{m}/gate_sigmoid")[0]
        if cfg.gate == "headwise":
            a = b.node("Reshape", [attn, bs_heads], f"{m}/attn_heads")[0]
            sg = b.node("Unsqueeze", [sg, b.init(f"{m}/axis_last", np.array([-1], dtype=np.int64))],
                        f"{m}/gate_unsqueeze")[0]
            attn = b.node("Reshape", [b.node("Mul", [a, sg], f"{m}/gate_mul")[0], bs_flat], f"{m}/attn_flat")[0]
        else:
            attn = b.node("Mul", [attn, sg], f"{m}/gate_mul")[0]
    return linear(attn, f"{m}.self_attn.o_proj", f"{p}.self_attn.o_proj.weight")


def _gated_delta_net(b: _Builder, cfg: ModelConfig, i: int, x: str, past, present, gdn_op: str, weight,
                     linear) -> str:
    """One Gated DeltaNet layer's mixer output (before the residual add), on ORT's fused ops."""
    Hk, Hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    p, m = f"layers.{i}.linear_attn", f"model.layers.{i}.linear_attn"
    qkv = linear(x, f"{m}.in_proj_qkv", f"{p}.in_proj_qkv.weight")
    qkv = b.node("Transpose", [qkv], f"{m}/to_channels", perm=[0, 2, 1])[0]             # [B, C, T]
    conv = b.node("CausalConvWithState", [qkv, b.init(f"{m}.conv1d.weight", weight(f"{p}.conv1d.weight")), "",
                                          past[0]], f"{m}/CausalConvWithState", n_out=2, domain="com.microsoft",
                  activation="silu", ndim=1)
    b.nodes[-1].output[1] = present[0]
    mixed = b.node("Transpose", [conv[0]], f"{m}/to_tokens", perm=[0, 2, 1])[0]          # [B, T, C]
    qk, v = b.node("Split", [mixed, b.init(f"{m}/split_sizes", np.array([2 * Hk * dk, Hv * dv], np.int64))],
                   f"{m}/split_qk_v", n_out=2, axis=-1)
    a = linear(x, f"{m}.in_proj_a", f"{p}.in_proj_a.weight")
    beta = linear(x, f"{m}.in_proj_b", f"{p}.in_proj_b.weight")
    dt_bias = b.init(f"{m}.dt_bias", weight(f"{p}.dt_bias"))
    flat = b.init(f"{m}/shape_flat", np.array([0, 0, -1], np.int64))
    # L2 norm per head here (eps inside the root), not GatedDeltaNet's qk_l2_norm: with it the logits were 1.2e-5
    # of the largest from PyTorch's, 3e-6 without (tiny hybrid, ORT 1.32). q's dk^-0.5 is the op's `scale`.
    qk = _l2norm_heads(b, qk, 2 * Hk, dk, f"{m}/qk_l2")  # [B, T, 2 Hk, dk]
    if gdn_op == "gated_delta_net":
        q4, k4 = b.node("Split", [qk], f"{m}/split_qk", n_out=2, axis=2, num_outputs=2)
        v4 = b.node("Reshape", [v, b.init(f"{m}/shape_v", np.array([0, 0, Hv, dv], np.int64))], f"{m}/v_heads")[0]
        o, _ = b.node("GatedDeltaNet", [q4, k4, v4, "", a, beta, past[1], b.init(f"{m}.A_log", weight(f"{p}.A_log")),
                                        dt_bias], f"{m}/GatedDeltaNet", n_out=2, domain="com.microsoft",
                      gate_activation="softplus", beta_activation="sigmoid", qk_l2_norm=0, scale=dk ** -0.5,
                      update_rule="gated_delta")
        b.nodes[-1].output[1] = present[1]
        o = b.node("Reshape", [o, flat], f"{m}/o_flat")[0]
    else:
        q, k = b.node("Split", [b.node("Reshape", [qk, flat], f"{m}/qk_flat")[0]], f"{m}/split_qk", n_out=2, axis=-1,
                      num_outputs=2)
        decay, beta = b.node("LinearAttentionGate", [a, dt_bias, b.init(f"{m}.A", -np.exp(weight(f"{p}.A_log"))), beta],
                             f"{m}/LinearAttentionGate", n_out=2, domain="com.microsoft")
        o, _ = b.node("LinearAttention", [q, k, v, past[1], decay, beta], f"{m}/LinearAttention", n_out=2,
                      domain="com.microsoft", q_num_heads=Hk, kv_num_heads=Hv, update_rule="gated_delta",
                      scale=dk ** -0.5)
        b.nodes[-1].output[1] = present[1]
    z = linear(x, f"{m}.in_proj_z", f"{p}.in_proj_z.weight")
    y = b.node("GatedRMSNorm", [o, b.init(f"{m}.norm.weight", weight(f"{p}.norm.weight")), z], f"{m}/GatedRMSNorm",
               domain="com.microsoft", activation="silu", epsilon=cfg.norm_eps)[0]
    return linear(y, f"{m}.out_proj", f"{p}.out_proj.weight")


def _l2norm_heads(b: _Builder, t: str, heads: int, d: int, scope: str) -> str:
    """t / sqrt(sum(t^2) + eps) per head, [B, T, heads * d] -> [B, T, heads, d] (model.l2norm): one
    RMSNormalization, since x / sqrt(sum x^2 + eps) = RMSNorm(x, eps / d) / sqrt(d), so its weight is 1 / sqrt(d)
    (3 nodes a layer where ReduceSumSquare, Add, Sqrt, Div and Mul took 7 for each of q and k)."""
    x = b.node("Reshape", [t, b.init(f"{scope}/shape", np.array([0, 0, heads, d], np.int64))], f"{scope}/heads")[0]
    return b.node("RMSNormalization", [x, b.init(f"{scope}/weight", np.full(d, d ** -0.5, np.float32))],
                  f"{scope}/RMSNorm", axis=-1, epsilon=L2_EPS / d)[0]
