"""The `--graph gqa` form of a hybrid: ONNX Runtime's fused CPU ops (GroupQueryAttention for the gated attention
layers; CausalConvWithState, LinearAttentionGate + LinearAttention or GatedDeltaNet, GatedRMSNorm for the Gated
DeltaNet layers), written node by node and streamed (export/onnx_gqa.py).

Asserted: prefill, decode and a chunk on a cache equal PyTorch's logits for both GDN ops; the logits of the last
position only unless logits_to_keep asks for more; the weights read back; int4 and int8-weight quantize the
embedding table (GatherBlockQuantized) and a tied head reads that one table; `generate` streams PyTorch's tokens;
generation through the in-place SharedCache (growing past its capacity) gives the same logits, bit for bit, as
fresh cache outputs every step; options the graph cannot honour are refused in one line."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from conftest import randomize_, rel_err, run_cli
from quantgate.errors import QuantgateError
from quantgate.export.onnx import export_checkpoint
from quantgate.formats import save_checkpoint
from quantgate.formats.onnx import load_onnx_model, read_embedding
from quantgate.formats.onnx_io import onnx_bytes
from quantgate.metrics import position_kld
from quantgate.model import build_model, hybrid, preset
from quantgate.runners import OrtRunner
from quantgate.runners.ort import SharedCache
from quantgate.tokenizer import byte_tokenizer

IDS = np.random.default_rng(0).integers(3, 300, size=(2, 24)).astype(np.int64)
IDS[:, 0] = 0
GDN_FUSED = {"CausalConvWithState", "GatedRMSNorm", "GroupQueryAttention"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tied gated hybrid (two value heads per key head; head_dim 64, so GroupQueryAttention's rotary takes its 16
    rotated channels) exported from its checkpoint with each GDN op, and its standard export."""
    d = tmp_path_factory.mktemp("onnx-fused")
    cfg = hybrid(preset("tiny", vocab_size=300, n_layers=4, head_dim=64, gate="elementwise", tie_embeddings=True),
                 value_heads_per_key_head=2)
    m = build_model(cfg, seed=0).eval()
    randomize_(m, 3)
    save_checkpoint(m, d / "ckpt", byte_tokenizer())
    for op in ("linear_attention", "gated_delta_net"):
        export_checkpoint(d / "ckpt", d / op, graph="gqa", gdn_op=op)
    export_checkpoint(d / "ckpt", d / "standard")
    return d, m


@pytest.mark.parametrize("op", ["linear_attention", "gated_delta_net"])
def test_fused_hybrid_graph_matches_pytorch_on_prefill_decode_and_a_chunk(exports, op):
    d, m = exports
    graph = onnx.load(str(d / op / "model.onnx"))
    ops = {n.op_type for n in graph.graph.node}
    rule = {"linear_attention": {"LinearAttention", "LinearAttentionGate"}, "gated_delta_net": {"GatedDeltaNet"}}[op]
    assert GDN_FUSED | rule <= ops and "Scan" not in ops
    assert json.loads((d / op / "quantgate.json").read_text())["gdn_op"] == op
    with torch.no_grad():
        ref = m(torch.as_tensor(IDS)).logits.numpy()
    with OrtRunner(d / op) as r:
        assert r.layer_types == list(m.cfg.layer_types)
        assert rel_err(r.logits(IDS), ref) <= 1e-5
        steps, (lg, past) = [], r.step(IDS[:, :10], r._empty_past(2), 0)
        steps.append(lg)
        for t in range(10, IDS.shape[1]):  # one token at a time on the cache, batch 2
            lg, past = r.step(IDS[:, t:t + 1], past, t)
            steps.append(lg)
        assert rel_err(np.concatenate(steps, axis=1), ref) <= 1e-5
        for row in range(2):  # GroupQueryAttention takes several new tokens on a cache at batch 1
            lg0, past = r.step(IDS[row:row + 1, :10], r._empty_past(1), 0)
            lg1, past = r.step(IDS[row:row + 1, 10:17], past, 10)
            lg2, _ = r.step(IDS[row:row + 1, 17:], past, 17)
            assert rel_err(np.concatenate([lg0, lg1, lg2], axis=1), ref[row:row + 1]) <= 1e-5


def test_fused_graph_computes_the_last_positions_logits_unless_asked_for_more(exports):
    d, m = exports
    with torch.no_grad():
        ref = m(torch.as_tensor(IDS[:1])).logits.numpy()
    with OrtRunner(d / "linear_attention") as r:
        last, _ = r.step(IDS[:1], r._empty_past(1), 0, last_only=True)
        assert last.shape == (1, 1, 300) and rel_err(last[0, 0], ref[0, -1]) <= 1e-5
        feed = {"input_ids": IDS[:1], "attention_mask": np.ones((1, 24), np.int64),
                "position_ids": np.arange(24)[None], **r._empty_past(1), "logits_to_keep": np.array(5)}
        five = r.session.run(["logits"], feed)[0]
        assert five.shape == (1, 5, 300) and rel_err(five, ref[:, -5:]) <= 1e-5
        assert rel_err(r.prefill(list(IDS[0])), ref[0, -1]) <= 1e-5
    with OrtRunner(d / "standard") as r:  # the traced graph has no such input: all positions, last_only or not
        assert r.step(IDS[:1], r._empty_past(1), 0, last_only=True)[0].shape == (1, 24, 300)


@pytest.mark.parametrize("op", ["linear_attention", "gated_delta_net"])
def test_fused_hybrid_graph_reads_back_into_the_same_model(exports, op):
    d, m = exports
    back = load_onnx_model(d / op).model
    assert back.cfg.layer_types == m.cfg.layer_types and back.cfg.tie_embeddings
    ours, theirs = m.state_dict(), back.state_dict()
    assert max(rel_err(theirs[k], ours[k]) for k in ours) <= 1e-6


@pytest.mark.parametrize("scheme,bits", [("int4", 4), ("int8-weight", 8)])
def test_weight_only_schemes_quantize_the_embedding_and_a_tied_head_reads_that_one_table(exports, tmp_path,
                                                                                         scheme, bits):
    from quantgate.quant.ort import quantize_onnx
    d, m = exports
    with torch.no_grad():
        ref = m(torch.as_tensor(IDS)).logits.numpy()
    V, D = m.cfg.vocab_size, m.cfg.dim
    kld = {}
    for form in ("linear_attention", "standard"):
        out = tmp_path / form
        quantize_onnx(d / form, out, scheme)
        graph = onnx.load(str(out / "model.onnx"))
        gbq = [n for n in graph.graph.node if n.op_type == "GatherBlockQuantized"]
        assert len(gbq) == 1 and {a.name: a.i for a in gbq[0].attribute}["bits"] == bits
        assert "Gather" not in {n.op_type for n in graph.graph.node}
        vocab_sized = {i.name for i in graph.graph.initializer if V in i.dims}
        assert vocab_sized == {gbq[0].input[0], gbq[0].input[2]}, form  # the packed table and its scales, once
        head = next(n for n in graph.graph.node if n.name.startswith("model.lm_head.MatMul"))
        assert head.op_type == "MatMulNBits"
        reshape = next(n for n in graph.graph.node if n.output[0] == head.input[1])
        assert reshape.op_type == "Reshape" and reshape.input[0] == gbq[0].input[0] and head.input[2] == gbq[0].input[2]
        table = read_embedding(graph)
        scales = np.repeat(onnx.numpy_helper.to_array(
            next(i for i in graph.graph.initializer if i.name == gbq[0].input[2])), 32, axis=1)
        err = np.abs(table - m.embed_tokens.weight.detach().numpy())
        s = np.abs(scales)  # ORT signs each scale so the block's extreme is -2^(bits-1): the other side clips at +2^(bits-1)-1
        assert 0 < err.max() and (err <= s + 1e-6).all() and err.mean() <= 0.35 * s.mean()
        with OrtRunner(out) as r:
            kld[form] = float(position_kld(ref, r.logits(IDS)).mean())
        back = load_onnx_model(out).model
        assert back.cfg.tie_embeddings and np.array_equal(back.embed_tokens.weight.detach().numpy(), table)
    assert 0 < kld["linear_attention"] < (1.0 if bits == 4 else 0.02)  # random tiny weights: int4 costs 0.22
    assert abs(kld["linear_attention"] - kld["standard"]) <= 0.1 * kld["standard"]  # the same quantized weights
    assert onnx_bytes(tmp_path / "linear_attention") < (0.25 if bits == 4 else 0.4) * onnx_bytes(d / "linear_attention")


def test_generate_streams_pytorchs_tokens_from_the_fused_graph(exports):
    d, _ = exports
    g = run_cli("generate", str(d / "linear_attention"), "--prompt", "def f", "--max-tokens", "10")
    t = run_cli("generate", str(d / "ckpt"), "--prompt", "def f", "--max-tokens", "10")
    assert g.returncode == 0 and t.returncode == 0, g.stderr[-2000:]
    assert g.stdout == t.stdout


@pytest.mark.parametrize("op", ["linear_attention", "gated_delta_net", "gqa-baseline"])
def test_the_shared_in_place_cache_gives_the_logits_of_fresh_outputs_bit_for_bit(exports, tmp_path, monkeypatch, op):
    """The KV buffers are GroupQueryAttention's past and present at once, the GDN states are updated in place, and
    the capacity (8 here) doubles twice on the way: a kernel that read what it had already written, or a growth
    that lost cached positions, would change the logits."""
    d, _ = exports
    if op == "gqa-baseline":  # a plain decoder (no GDN layer) takes the same path
        m = build_model(preset("tiny", vocab_size=300, n_layers=2, head_dim=64), seed=1).eval()
        save_checkpoint(m, tmp_path / "ckpt", byte_tokenizer())
        export_checkpoint(tmp_path / "ckpt", tmp_path / op, graph="gqa")
        path = tmp_path / op
    else:
        path = d / op
    monkeypatch.setattr(SharedCache, "ROUND", 8)
    prompt, steps = [int(t) for t in IDS[0, :5]], [int(t) for t in IDS[1, :20]]
    with OrtRunner(path) as r:
        assert r.shares_cache
        got = [r.prefill(prompt)] + [r.decode(t) for t in steps]
        assert isinstance(r._past, SharedCache) and r._past.capacity == 32  # 8 -> 16 -> 32
        r.shares_cache = False
        want = [r.prefill(prompt)] + [r.decode(t) for t in steps]
        assert isinstance(r._past, dict)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_options_the_fused_graph_cannot_honour_are_refused(exports, tmp_path):
    d, _ = exports
    for kw, needle in ((dict(graph="gqa", gdn_op="scan"), "unknown --gdn-op"),
                       (dict(gdn_op="linear_attention"), "--gdn-op applies to --graph gqa"),
                       (dict(graph="gqa", dtype="fp16"), "fp32")):
        with pytest.raises(QuantgateError, match=needle):
            export_checkpoint(d / "ckpt", tmp_path / "x", **kw)
        assert not (tmp_path / "x").exists()
    narrow = hybrid(preset("tiny", vocab_size=300, n_layers=4, head_dim=32, gate="elementwise"))
    save_checkpoint(build_model(narrow, seed=0), tmp_path / "narrow", byte_tokenizer())
    with pytest.raises(QuantgateError, match="multiple of 8"):  # 8 rotated channels: GQA's rotary wants 16+
        export_checkpoint(tmp_path / "narrow", tmp_path / "x", graph="gqa")
    assert not (tmp_path / "x").exists()
