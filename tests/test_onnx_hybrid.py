"""Hybrid exports (Gated DeltaNet + gated attention) in ONNX Runtime: each GDN layer's conv and recurrent states as
extra past/present I/O (past.conv.i, past.recurrent.i), its rule as one ONNX Scan; prefill, decode and a chunk on a
cache equal PyTorch's; the weights read back; int4, int4 with both gates at 8 bits and int8 load and run; the
quantized KV cache rounds only the attention layers' cache; `generate` streams from it."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from conftest import dir_snapshot, randomize_, rel_err, run_cli
from quantgate.errors import QuantgateError
from quantgate.export.onnx import export_checkpoint, export_onnx
from quantgate.formats import save_checkpoint
from quantgate.formats.onnx import load_onnx_model
from quantgate.metrics import position_kld
from quantgate.model import hybrid, make_twins, preset
from quantgate.runners import OrtRunner, TorchRunner
from quantgate.tokenizer import byte_tokenizer

W = np.array([[0] + list(range(3, 30)), [0] + list(range(299, 272, -1))], dtype=np.int64)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Hybrid twins (three GDN layers, then full attention; two value heads per key head, untied), saved and
    exported through the checkpoint path the CLI takes."""
    d = tmp_path_factory.mktemp("onnx-hybrid")
    cfg = hybrid(preset("tiny", vocab_size=300, n_layers=4, head_dim=32), value_heads_per_key_head=2)
    base, gated = make_twins(cfg, "elementwise", seed=0)
    randomize_(base, 1)
    randomize_(gated, 2)
    models = {"baseline": base.eval(), "gated": gated.eval()}
    for role, m in models.items():
        save_checkpoint(m, d / role, byte_tokenizer())
        export_checkpoint(d / role, d / f"{role}-onnx")
    (d / "calib.txt").write_text("def f(x):\n    return x * 2\n" * 200)
    return d, models


@pytest.mark.parametrize("role", ["baseline", "gated"])
def test_hybrid_onnx_matches_pytorch_on_prefill_decode_and_a_chunk_on_a_cache(exported, role):
    d, models = exported
    m = models[role]
    graph = onnx.load(str(d / f"{role}-onnx" / "model.onnx"), load_external_data=False)
    names = [i.name for i in graph.graph.input]
    assert names[3:] == ["past.conv.0", "past.recurrent.0", "past.conv.1", "past.recurrent.1", "past.conv.2",
                         "past.recurrent.2", "past_key_values.3.key", "past_key_values.3.value"]
    shapes = {i.name: [x.dim_value or x.dim_param for x in i.type.tensor_type.shape.dim] for i in graph.graph.input}
    cfg = m.cfg
    assert shapes["past.conv.0"][1:] == [cfg.linear_conv_dim, cfg.linear_conv_kernel - 1]
    assert shapes["past.recurrent.0"][1:] == [cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim]
    assert "Scan" in {n.op_type for n in graph.graph.node}
    with torch.no_grad():
        ref = m(torch.as_tensor(W)).logits.numpy()
    with OrtRunner(d / f"{role}-onnx") as r:
        assert r.layer_types == list(cfg.layer_types)
        assert rel_err(r.logits(W), ref) <= 1e-5  # prefill from empty states
        lg0, past = r.step(W[:, :10], r._empty_past(2), 0)
        lg1, past = r.step(W[:, 10:11], past, 10)   # one decode step
        lg2, past = r.step(W[:, 11:18], past, 11)   # a chunk of 7 on the cache
        lg3, _ = r.step(W[:, 18:], past, 18)
    assert rel_err(np.concatenate([lg0, lg1, lg2, lg3], axis=1), ref) <= 1e-5


def test_hybrid_onnx_reads_back_into_the_same_model(exported):
    d, models = exported
    for role, m in models.items():
        back = load_onnx_model(d / f"{role}-onnx").model
        assert back.cfg.layer_types == m.cfg.layer_types and back.cfg.gate == m.cfg.gate
        ours, theirs = m.state_dict(), back.state_dict()
        assert set(ours) == set(theirs)
        worst = max(rel_err(theirs[k], ours[k]) for k in ours)
        assert worst <= 1e-6, role  # A_log comes back through log(-A), A = -exp(A_log) as the graph holds it


def test_quantized_hybrid_exports_run_and_keep_both_gates_at_8_bits_on_request(exported, tmp_path):
    from quantgate.gate_survival import gate_survival
    from quantgate.quant.ort import quantize_onnx
    d, models = exported
    m = models["gated"]
    with torch.no_grad():
        ref = m(torch.as_tensor(W)).logits.numpy()
    kld, survival = {}, {}
    for scheme, bits in (("int8-dynamic", None), ("int8-static", None), ("int4", None), ("int4", 8)):
        out = tmp_path / f"{scheme}-{bits}"
        res = quantize_onnx(d / "gated-onnx", out, scheme, gate_bits=bits, calib_data=str(d / "calib.txt"),
                            calib_windows=4, ctx=32)
        assert res["gate_matmuls"] == 4  # three GDN output gates (in_proj_z) and one fused q|gate
        assert len(res["kept_float"]) == 6  # in_proj_a and in_proj_b of each GDN layer
        graph = onnx.load(str(out / "model.onnx"))
        inits = {i.name for i in graph.graph.initializer}
        assert {f"model.layers.{i}.linear_attn.in_proj_{ab}.weight_T" for i in range(3) for ab in "ab"} <= inits, scheme
        if bits:
            nbits = {n.name: {a.name: a.i for a in n.attribute}["bits"] for n in graph.graph.node
                     if n.op_type == "MatMulNBits"}
            gates = {k: v for k, v in nbits.items() if ".qg_proj." in k or ".in_proj_z." in k}
            assert len(gates) == 4 and set(gates.values()) == {8}
            assert {v for k, v in nbits.items() if k not in gates} == {4}
        with OrtRunner(out) as r:
            lg = r.logits(W)
        assert np.isfinite(lg).all()
        kld[(scheme, bits)] = float(position_kld(ref, lg).mean())
        if scheme == "int4":
            survival[bits] = gate_survival(load_onnx_model(out).model, m, W)
    assert 0 < kld[("int8-dynamic", None)] < kld[("int4", None)]
    assert kld[("int8-static", None)] > 0
    plain, kept = (survival[b]["layers"] for b in (None, 8))
    assert [x["kind"] for x in plain] == ["gdn", "gdn", "gdn", "attention"]
    assert all(k["mean_abs_diff"] < p["mean_abs_diff"] for p, k in zip(plain, kept))


def test_quantized_kv_cache_rounds_only_the_attention_layers_cache(exported):
    d, models = exported
    m = models["gated"]
    ref = TorchRunner(m, kv_bits=8).logits(W)
    flt = TorchRunner(m).logits(W)
    with OrtRunner(d / "gated-onnx", kv_bits=8) as r:
        got = r.logits(W)
    cost = position_kld(flt, ref).mean()
    assert cost > 0
    same = np.abs(got - ref).max(-1) <= 1e-5 * np.abs(ref).max()  # see test_ort_kv: rounding-boundary flips
    assert same.mean() >= 0.75 and same[:, :8].all()
    assert position_kld(ref, got).mean() <= 1e-3 * cost


def test_generate_streams_from_a_hybrid_export_as_pytorch_does(exported):
    d, _ = exported
    g = run_cli("generate", str(d / "gated-onnx"), "--prompt", "def f", "--max-tokens", "10")
    t = run_cli("generate", str(d / "gated"), "--prompt", "def f", "--max-tokens", "10")
    assert g.returncode == 0 and t.returncode == 0, g.stderr[-2000:]
    assert "decode" in g.stderr and g.stdout == t.stdout  # greedy: ORT == PyTorch
    info = run_cli("info", str(d / "gated-onnx"), "--json")
    assert info.returncode == 0, info.stderr[-2000:]
    assert json.loads(info.stdout)["layer_types"].startswith("3 linear_attention (Gated DeltaNet), 1 full_attention")


def test_hybrid_export_options_it_cannot_honour_are_refused(exported, tmp_path):
    d, models = exported
    before = dir_snapshot(d)
    for opts, needle in ((dict(graph="gqa"), "--graph standard"), (dict(dtype="fp16"), "fp32")):
        with pytest.raises(QuantgateError, match=needle):
            export_onnx(models["gated"], byte_tokenizer(), tmp_path / "x", **opts)
        assert not (tmp_path / "x").exists()
    assert dir_snapshot(d) == before


@pytest.mark.slow  # moved out of the default step (its 25-minute limit); CI's slow step runs it
def test_weights_over_the_inline_limit_go_to_one_external_data_file(tmp_path, monkeypatch):
    """A real hybrid (Qwen3.5-0.8B: 3 GB of fp32) is over protobuf's 2 GiB: export and quantizers write the weights to
    model.onnx.data beside the graph. Shown with the limit lowered to 1 KiB."""
    import quantgate.export.onnx as exporter
    import quantgate.formats.onnx_io as onnx_io
    import quantgate.quant.ort as onnx_quantize
    from quantgate.model import build_model
    from quantgate.quant.ort import quantize_onnx
    for mod in (exporter, onnx_io, onnx_quantize):
        monkeypatch.setattr(mod, "INLINE_LIMIT", 1024)
    m = build_model(preset("tiny", vocab_size=300, gate="elementwise"), seed=0).eval()
    randomize_(m)
    summary = export_onnx(m, byte_tokenizer(), tmp_path / "onnx")
    assert summary == tmp_path / "onnx" and (tmp_path / "onnx" / "model.onnx.data").is_file()
    assert onnx_io.onnx_bytes(tmp_path / "onnx") > (tmp_path / "onnx" / "model.onnx").stat().st_size
    with torch.no_grad():
        ref = m(torch.as_tensor(W)).logits.numpy()
    with OrtRunner(tmp_path / "onnx") as r:
        assert rel_err(r.logits(W), ref) <= 1e-5
    for scheme in ("int4", "int8-dynamic"):  # MatMulNBits (saved by us) and quantize_dynamic (saved by ORT)
        res = quantize_onnx(tmp_path / "onnx", tmp_path / scheme, scheme)
        assert (tmp_path / scheme / "model.onnx.data").is_file(), scheme
        assert res["bytes"] == onnx_io.onnx_bytes(tmp_path / scheme)
        with OrtRunner(tmp_path / scheme) as q:
            assert 0 < position_kld(ref, q.logits(W)).mean() < 0.1, scheme
    assert sorted(p.name for p in (tmp_path / "onnx").iterdir() if p.name.startswith(("model", "traced"))) == \
        ["model.onnx", "model.onnx.data"]  # the tracer's own file went with its folder
