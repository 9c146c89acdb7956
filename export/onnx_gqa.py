"""The `--graph gqa` form: a decoder built node by node around ORT's `com.microsoft.GroupQueryAttention`.

No exporter emits GroupQueryAttention from PyTorch, so this graph is written by hand (onnx.helper), the
way onnxruntime-genai's builder writes Qwen3.5: per layer RMSNorm, one MatMul for q and gate rows (as
Qwen3-Next fuses them), k and v MatMuls, QK-RMSNorm per head, then GroupQueryAttention with rotary
inside (do_rotary=1, cos/sin caches as initializers) and the KV cache as its past/present tensors, then
sigmoid(gate) * attention output before the o_proj MatMul (no ORT attention op takes an output gate,
DESIGN section 4). Inputs, outputs and weight names match the traced graph, so the runner, the
quantizers and the gate-survival reader treat both forms alike.
"""
from __future__ import annotations

import numpy as np
import torch

from quantgate.formats.onnx_io import io_names
from quantgate.model import Model

OPSET = 23  # RMSNormalization is a standard op from 23; GroupQueryAttention lives in com.microsoft


def build_gqa_graph(model: Model):
    from onnx import TensorProto, helper, numpy_helper

    cfg = model.cfg
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    nodes, inits = [], []

    def init(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(op: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        outs = [f"{name}/out{k}" for k in range(n_out)]
        nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain, **attrs))
        return outs

    def linear(x: str, module: str, weight: np.ndarray) -> str:
        w = init(f"{module}.weight_T", weight.T)
        return node("MatMul", [x, w], f"{module}.MatMul")[0]

    def rmsnorm(x: str, weight_name: str, scope: str) -> str:
        return node("RMSNormalization", [x, init(weight_name, sd[weight_name[len('model.'):]])], f"{scope}/RMSNorm",
                    axis=-1, epsilon=cfg.norm_eps)[0]

    def shape_const(name: str, values: list[int]) -> str:
        return init(name, np.array(values, dtype=np.int64))

    names_in, names_out = io_names(cfg.n_layers)
    # rotary caches: positions x (rotary_dim / 2), NEOX order, as our rope_cache computes them
    r = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    freqs = torch.arange(cfg.max_seq_len, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = init("cos_cache", freqs.cos().numpy()), init("sin_cache", freqs.sin().numpy())

    h = node("Gather", [init("model.embed_tokens.weight", sd["embed_tokens.weight"]), "input_ids"], "embed")[0]
    lens = node("ReduceSum", ["attention_mask", shape_const("axis1", [1])], "seqlens/sum", keepdims=0)[0]
    lens = node("Sub", [lens, init("one_i64", np.array(1, dtype=np.int64))], "seqlens/sub")[0]
    seqlens_k = node("Cast", [lens], "seqlens/cast", to=TensorProto.INT32)[0]
    total = node("Shape", ["attention_mask"], "total/shape", start=1, end=2)[0]
    total = node("Squeeze", [total], "total/squeeze")[0]
    total = node("Cast", [total], "total/cast", to=TensorProto.INT32)[0]
    bs_heads = shape_const("shape_bs_h_hd", [0, 0, -1, hd])
    bs_flat = shape_const("shape_bs_flat", [0, 0, -1])

    for i in range(cfg.n_layers):
        p, m = f"layers.{i}", f"model.layers.{i}"
        x = rmsnorm(h, f"{m}.input_layernorm.weight", f"{m}/input_norm")
        q_rows = H * hd
        if cfg.gate != "none":
            w_qg = np.concatenate([sd[f"{p}.self_attn.q_proj.weight"], sd[f"{p}.self_attn.g_proj.weight"]], axis=0)
            qg = linear(x, f"{m}.self_attn.qg_proj", w_qg)
            q, g = node("Split", [qg, init(f"{m}/split_sizes", np.array([q_rows, cfg.gate_dim], dtype=np.int64))],
                        f"{m}/split_qg", n_out=2, axis=-1)
        else:
            q, g = linear(x, f"{m}.self_attn.q_proj", sd[f"{p}.self_attn.q_proj.weight"]), None
        k = linear(x, f"{m}.self_attn.k_proj", sd[f"{p}.self_attn.k_proj.weight"])
        v = linear(x, f"{m}.self_attn.v_proj", sd[f"{p}.self_attn.v_proj.weight"])
        if cfg.qk_norm:  # per head: [B, S, heads, hd] -> RMSNorm over hd -> back
            for name in ("q", "k"):
                t = q if name == "q" else k
                t = node("Reshape", [t, bs_heads], f"{m}/{name}_heads")[0]
                t = rmsnorm(t, f"{m}.self_attn.{name}_norm.weight", f"{m}/{name}_norm")
                t = node("Reshape", [t, bs_flat], f"{m}/{name}_flat")[0]
                q, k = (t, k) if name == "q" else (q, t)
        attn, present_k, present_v = node(
            "GroupQueryAttention", [q, k, v, names_in[3 + 2 * i], names_in[4 + 2 * i], seqlens_k, total, cos, sin],
            f"{m}.self_attn/GroupQueryAttention", n_out=3, domain="com.microsoft", num_heads=H, kv_num_heads=KV,
            do_rotary=1, rotary_interleaved=0, scale=float(hd) ** -0.5)
        nodes[-1].output[1:] = [names_out[1 + 2 * i], names_out[2 + 2 * i]]
        if g is not None:  # the gate: sigmoid(X W_g) per head (headwise) or per channel (elementwise)
            sg = node("Sigmoid", [g], f"{m}/gate_sigmoid")[0]
            if cfg.gate == "headwise":
                a = node("Reshape", [attn, bs_heads], f"{m}/attn_heads")[0]
                sg = node("Unsqueeze", [sg, shape_const(f"{m}/axis_last", [-1])], f"{m}/gate_unsqueeze")[0]
                attn = node("Reshape", [node("Mul", [a, sg], f"{m}/gate_mul")[0], bs_flat], f"{m}/attn_flat")[0]
            else:
                attn = node("Mul", [attn, sg], f"{m}/gate_mul")[0]
        o = linear(attn, f"{m}.self_attn.o_proj", sd[f"{p}.self_attn.o_proj.weight"])
        h = node("Add", [h, o], f"{m}/residual_attn")[0]
        x = rmsnorm(h, f"{m}.post_attention_layernorm.weight", f"{m}/post_norm")
        gate = linear(x, f"{m}.mlp.gate_proj", sd[f"{p}.mlp.gate_proj.weight"])
        up = linear(x, f"{m}.mlp.up_proj", sd[f"{p}.mlp.up_proj.weight"])
        silu = node("Mul", [gate, node("Sigmoid", [gate], f"{m}/mlp_sigmoid")[0]], f"{m}/mlp_silu")[0]
        down = linear(node("Mul", [silu, up], f"{m}/mlp_mul")[0], f"{m}.mlp.down_proj", sd[f"{p}.mlp.down_proj.weight"])
        h = node("Add", [h, down], f"{m}/residual_mlp")[0]
    h = rmsnorm(h, "model.norm.weight", "model/final_norm")
    if cfg.tie_embeddings:  # one stored matrix, as in the traced graph (which also leaves it unquantized)
        w_t = node("Transpose", ["model.embed_tokens.weight"], "model.lm_head/Transpose", perm=[1, 0])[0]
        node("MatMul", [h, w_t], "model.lm_head.MatMul")
    else:
        linear(h, "model.lm_head", sd["lm_head.weight"])
    nodes[-1].output[0] = "logits"  # the graph output's name

    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total_sequence_length"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence_length"])]
    inputs += [helper.make_tensor_value_info(n, f32, ["batch", KV, "past_sequence_length", hd]) for n in names_in[3:]]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", "sequence_length", cfg.vocab_size])]
    outputs += [helper.make_tensor_value_info(n, f32, ["batch", KV, "total_sequence_length", hd]) for n in names_out[1:]]
    graph = helper.make_graph(nodes, "quantgate_gqa_decoder", inputs, outputs, inits)
    model_proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                          helper.make_opsetid("com.microsoft", 1)],
                                    producer_name="quantgate")
    model_proto.ir_version = 10
    return model_proto
