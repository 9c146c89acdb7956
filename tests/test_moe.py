"""Qwen3.5-MoE (`qwen3_5_moe`): routed experts plus a gated shared expert, end to end on tiny random configs.

Parity both ways with stock transformers 5 (`Qwen3_5MoeForCausalLM`, `Qwen3_5MoeForConditionalGeneration`, run by
tests/tf5_reference.py in a child interpreter); a checkpoint with fused 3-D experts reads as the per-expert one;
the qwen35moe GGUF runs in llama.cpp and reads back; llama.cpp's quantizer keeps the router and the shared expert's
gate F32 and takes a per-expert importance matrix; torch schemes leave both float; analyze reports the routing;
what quantgate does not do for MoE is refused in one line. Equality with llama.cpp's own converter is in
tests/test_llama_convert.py (slow)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_refused, randomize_, rel_err, run_cli
from quantgate.errors import QuantgateError
from quantgate.formats import load_checkpoint, save_checkpoint
from quantgate.formats.hf import open_hf
from quantgate.model import SparseMoE, build_model, hybrid, make_twins, preset
from quantgate.tokenizer import byte_tokenizer

from test_parity_qwen35 import IDS, SCRIPT, TF5, assert_stock_agrees, pytestmark as needs_tf5  # the same reference run, ids and skip

E, K, FE, FS = 8, 2, 32, 64
SPEC = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=FE,
            shared_expert_intermediate_size=FS, tie_word_embeddings=False, rms_norm_eps=1e-6,
            max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True}, moe=True)


def moe_cfg(gate: str = "elementwise", **kw):
    cfg = hybrid(preset("tiny", vocab_size=300, n_layers=4, tie_embeddings=False, rope_theta=1e7),
                 value_heads_per_key_head=2)
    return dataclasses.replace(cfg, gate=gate, linear_key_heads=2, n_experts=E, n_experts_used=K, expert_ffn_dim=FE,
                               shared_expert_ffn_dim=FS, **kw)


def moe_model(seed: int = 1, gate: str = "elementwise"):
    m = build_model(moe_cfg(gate), seed=0).eval()
    randomize_(m, seed)
    return m


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """One run of the transformers-5 interpreter: stock random MoE models (text-only and multimodal) with their
    logits, and its logits of our MoE twins saved by save_checkpoint."""
    d = tmp_path_factory.mktemp("tf5-moe")
    np.save(d / "ids.npy", IDS)
    jobs, ours = [], {}
    for mm in (False, True):
        key = "stock-mm" if mm else "stock-text"
        (d / f"{key}.json").write_text(json.dumps({**SPEC, "multimodal": mm}))
        jobs.append(["make", str(d / f"{key}.json"), str(d / key), str(d / "ids.npy"), str(d / f"{key}.npz")])
    base, gated = make_twins(moe_cfg(), "elementwise", seed=0)
    for role, m, seed in (("baseline", base, 1), ("gated", gated, 2)):
        randomize_(m, seed)
        save_checkpoint(m.eval(), d / f"ours-{role}", byte_tokenizer())
        jobs.append(["logits", str(d / f"ours-{role}"), str(d / "ids.npy"), str(d / f"ours-{role}.npz")])
        ours[role] = m
    (d / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([TF5, str(SCRIPT), str(d / "jobs.json")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, ours


@needs_tf5
@pytest.mark.parametrize("multimodal", [False, True])
def test_stock_qwen3_5_moe_checkpoints_load_with_their_logits(ref, multimodal):
    d, _ = ref
    key = "stock-mm" if multimodal else "stock-text"
    logits = np.load(d / f"{key}.npz")
    assert str(logits["cls"]) == ("Qwen3_5MoeForConditionalGeneration" if multimodal else "Qwen3_5MoeForCausalLM")
    loaded = load_checkpoint(d / key)
    cfg = loaded.model.cfg
    assert loaded.layout == "qwen3_5_moe" and cfg.is_moe and cfg.is_hybrid
    assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn_dim, cfg.shared_expert_ffn_dim) == (E, K, FE, FS)
    with torch.no_grad():
        ours = loaded.model(torch.as_tensor(IDS)).logits
    assert rel_err(ours, logits["full"]) <= 1e-5
    assert rel_err(logits["cached"], logits["full"]) <= 1e-5
    if multimodal:
        assert set(cfg.extra["skipped_tensors"]) == {"vision tower"}


@needs_tf5
@pytest.mark.parametrize("role", ["baseline", "gated"])
def test_our_moe_twins_open_in_stock_transformers(ref, role):
    """Written per expert, as transformers 5 itself saves; a baseline through zero gate rows and 2 * o_proj."""
    d, ours = ref
    assert_stock_agrees(d / f"ours-{role}.npz", ours[role], "Qwen3_5MoeForCausalLM")
    names = load_file(d / f"ours-{role}" / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names and "intermediate_size" not in \
        json.loads((d / f"ours-{role}" / "config.json").read_text())


def _fuse_experts(src: Path, dst: Path, dtype=torch.float32) -> None:
    """src's per-expert checkpoint rewritten with each layer's experts fused 3-D (gate_up_proj [E, 2F, D], gate rows
    first; down_proj [E, D, F]): transformers 5's in-memory form."""
    sd = load_file(src / "model.safetensors")
    for i in range(4):
        p = f"model.layers.{i}.mlp.experts"
        gate = [sd.pop(f"{p}.{j}.gate_proj.weight") for j in range(E)]
        up = [sd.pop(f"{p}.{j}.up_proj.weight") for j in range(E)]
        down = [sd.pop(f"{p}.{j}.down_proj.weight") for j in range(E)]
        sd[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        sd[f"{p}.down_proj"] = torch.stack(down)
    dst.mkdir()
    save_file({k: v.to(dtype).contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"))
    for f in ("config.json", "tokenizer.json"):
        (dst / f).write_text((src / f).read_text())


def test_fused_expert_checkpoints_read_as_the_per_expert_one(tmp_path):
    """Each expert's projection is sliced out of the fused tensors (only its rows read): the same state dict, the
    same shapes from the headers alone, and a bf16 fused file stays bf16 until asked."""
    m = moe_model()
    save_checkpoint(m, tmp_path / "per", byte_tokenizer())
    _fuse_experts(tmp_path / "per", tmp_path / "fused")
    a, b = load_checkpoint(tmp_path / "per").model.state_dict(), load_checkpoint(tmp_path / "fused").model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _fuse_experts(tmp_path / "per", tmp_path / "fused-bf16", torch.bfloat16)
    ck = open_hf(tmp_path / "fused-bf16")
    w, meta = ck.weights(), ck.weights(meta=True)
    for k in ("layers.2.mlp.experts.5.gate_proj.weight", "layers.2.mlp.experts.5.up_proj.weight",
              "layers.2.mlp.experts.5.down_proj.weight"):
        assert w[k].dtype == torch.bfloat16 and tuple(meta[k].shape) == tuple(w[k].shape) == tuple(a[k].shape)
        assert torch.equal(w[k].float(), a[k].to(torch.bfloat16).float())


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    from quantgate.export.gguf import export_checkpoint
    d = tmp_path_factory.mktemp("moe-gguf")
    m = moe_model()
    save_checkpoint(m, d / "m", byte_tokenizer())
    summary = export_checkpoint(d / "m", d / "m.gguf", "f32")
    return d, m, summary


def test_moe_gguf_runs_in_llama_cpp_and_reads_back(moe_gguf):
    """qwen35moe: llama.cpp's logits near PyTorch's. The bound is 1e-4, not the dense hybrid's 1e-5: measured
    relative errors were 1.0e-5 and 6.5e-5 on two random models of this shape, 4.9e-6 with a single expert (no
    routing) and 4.8e-6 for the dense twin; a 1e-7 relative change of the routing weights alone moved the logits by
    2.7e-6 here. Read back into PyTorch the file gives bit-identical logits."""
    from quantgate.formats.gguf import inspect_gguf, load_gguf_model
    from quantgate.runners import LlamaRunner
    d, m, summary = moe_gguf
    assert summary["arch"] == "qwen35moe" and summary["identity_layers"] == 0
    info = inspect_gguf(d / "m.gguf")
    assert info.moe == {"experts": E, "used": K, "expert_ffn": FE, "shared_ffn": FS}
    with torch.no_grad():
        want = m(torch.as_tensor(IDS)).logits.numpy()
        back = load_gguf_model(d / "m.gguf").model(torch.as_tensor(IDS)).logits.numpy()
    assert np.array_equal(back, want)
    with LlamaRunner(d / "m.gguf", n_ctx=64, kv_type="f32") as r:
        got = r.logits(IDS)
    assert rel_err(got, want) <= 1e-4


def test_decode_bytes_count_only_the_experts_a_token_runs(moe_gguf):
    from quantgate.bandwidth import gguf_decode_bytes, torch_decode_bytes
    from quantgate.formats.gguf import open_reader
    d, m, _ = moe_gguf
    sizes = {t.name: int(t.n_bytes) for t in open_reader(d / "m.gguf").tensors}
    experts = sum(b for n, b in sizes.items() if n.endswith("_exps.weight"))
    rest = sum(b for n, b in sizes.items() if not n.endswith("_exps.weight") and n != "token_embd.weight")
    assert gguf_decode_bytes(d / "m.gguf").weights == int(rest + experts * K / E)
    assert torch_decode_bytes(m).weights == gguf_decode_bytes(d / "m.gguf").weights  # both fp32, same tensors


def test_llama_cpp_quantization_keeps_router_and_shared_gate_f32(moe_gguf, tmp_path):
    """Q4_K_M with an importance matrix (one row per expert, over the tokens routed to it) and --gate-bits 8."""
    from quantgate.quant.llama_cpp import importance_matrix, quantize_gguf
    d, m, _ = moe_gguf
    (tmp_path / "t.txt").write_text("def f(x):\n    return x * 2\n" * 200)
    r = quantize_gguf(d / "m.gguf", tmp_path / "q.gguf", "Q4_K_M", imatrix="auto", gate_bits=8,
                      calib_data=str(tmp_path / "t.txt"), calib_windows=4, ctx=32)
    assert r["router_types"] == ["F32"] and r["shared_expert_gate_types"] == ["F32"]
    assert r["attn_q_types"] == ["Q8_0"] and r["gdn_gate_types"] == ["Q8_0"]
    wins = np.random.default_rng(0).integers(3, 300, size=(4, 32))
    wins[:, 0] = 0
    im = importance_matrix(m, wins)
    assert im["blk.0.ffn_down_exps.weight"].shape == (E * FE,) and im["blk.0.ffn_gate_exps.weight"].shape == (E * 64,)
    assert im["blk.0.ffn_gate_inp.weight"].shape == (64,)


def test_torch_schemes_quantize_experts_and_keep_router_float():
    from quantgate.quant.qlinear import QuantLinear
    from quantgate.quant import get
    from quantgate.quant.simulate import quantize_
    m, q = moe_model(), quantize_(moe_model(), get("torch", "w8a16"))
    for blk, ref in zip(q.layers, m.layers):
        mlp = blk.mlp
        assert isinstance(mlp, SparseMoE) and isinstance(mlp.experts[3].down_proj, QuantLinear)
        assert isinstance(mlp.shared_expert.up_proj, QuantLinear)
        assert type(mlp.gate) is torch.nn.Linear and type(mlp.shared_expert_gate) is torch.nn.Linear
        assert torch.equal(mlp.gate.weight, ref.mlp.gate.weight)
        assert torch.equal(mlp.shared_expert_gate.weight, ref.mlp.shared_expert_gate.weight)
    with torch.no_grad():
        assert rel_err(q(torch.as_tensor(IDS)).logits, m(torch.as_tensor(IDS)).logits) > 1e-5


def test_analyze_reports_routing_as_the_model_routes():
    """Every layer's expert loads are the model's own routing decisions, counted (keep_route records them)."""
    from quantgate.outliers import LayerAccumulator, analyze_model, routing_stats
    m = moe_model()
    wins = np.random.default_rng(1).integers(3, 300, size=(2, 32))
    wins[:, 0] = 0
    rep = analyze_model(m, wins)
    for blk in m.layers:
        blk.mlp.keep_route = True
    with torch.no_grad():
        m(torch.as_tensor(wins))
    for i, blk in enumerate(m.layers):
        r = rep["layers"][i]["routing"]
        counts = torch.bincount(blk.mlp.last_route.reshape(-1), minlength=E).double()
        assert r["tokens"] == 2 * 32 and np.allclose(r["expert_share"], (counts / counts.sum()).numpy())
        assert r["dead_experts"] == int((counts == 0).sum())
        assert 0 < r["load_entropy"] <= 1 and 1 / K <= r["top1_weight_mean"] <= 1 and 0 < r["shared_gate_mean"] < 1
    acc = LayerAccumulator(expert_load=torch.tensor([0.0, 2, 2, 0]), route_count=2, top1_sum=1.2, shared_sum=1.0,
                           shared_count=2)
    r = routing_stats(acc)  # two of four experts never chosen: two dead, max share twice uniform, entropy 1/2
    assert r["dead_experts"] == 2 and r["max_share_over_uniform"] == 2.0 and abs(r["load_entropy"] - 0.5) < 1e-12


def test_cli_info_and_analyze_show_experts(tmp_path):
    save_checkpoint(moe_model(), tmp_path / "m", byte_tokenizer())
    r = run_cli("info", str(tmp_path / "m"))
    assert r.returncode == 0 and "active_params" in r.stdout, r.stderr[-500:]
    r = run_cli("analyze", str(tmp_path / "m"), "--windows", "2", "--ctx", "32")
    assert r.returncode == 0 and "expert routing" in r.stdout and "load entropy" in r.stdout, r.stderr[-500:]


def _moe_dir(tmp_path: Path, **changes) -> Path:
    save_checkpoint(moe_model(), tmp_path / "m", byte_tokenizer())
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    hf.update(changes)
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf))
    return tmp_path / "m"


@pytest.mark.parametrize("changes, needle", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"model_type": "qwen3_moe"}, "qwen3_moe"),
])
def test_bad_moe_configs_are_refused_in_one_line(cli_server, tmp_path, changes, needle):
    d = _moe_dir(tmp_path, **changes)
    assert_refused(cli_server.run("info", d, timeout=300), needle)


def test_what_quantgate_does_not_do_for_moe_is_refused_in_one_line(cli_server, tmp_path):
    from quantgate.export.gguf import export_gguf
    d = _moe_dir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_refused(cli_server.run("export", "onnx", d, "--out", tmp_path / "o", timeout=300), "com.microsoft.MoE")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    all_attention = build_model(dataclasses.replace(moe_cfg(), layer_types=("full_attention",) * 4), seed=0)
    with pytest.raises(QuantgateError, match="without Gated DeltaNet"):
        export_gguf(all_attention, byte_tokenizer(), tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(QuantgateError, match="qwen3_5_moe layout"):
        save_checkpoint(moe_model(), tmp_path / "q", byte_tokenizer(), layout="qwen3_5")


def test_streamed_moe_export_equals_the_in_memory_one_from_either_expert_form(tmp_path):
    """export gguf streams the checkpoint (each expert's projections read, stacked, written, let go): the file is
    byte for byte export_gguf of the loaded model, from per-expert and from fused storage alike."""
    from quantgate.export.gguf import export_checkpoint, export_gguf
    m = moe_model()
    save_checkpoint(m, tmp_path / "per", byte_tokenizer())
    _fuse_experts(tmp_path / "per", tmp_path / "fused")
    export_gguf(load_checkpoint(tmp_path / "per").model, byte_tokenizer(), tmp_path / "mem.gguf", "bf16",
                source_layout="qwen3_5_moe", name="m")
    for form in ("per", "fused"):
        export_checkpoint(tmp_path / form, tmp_path / f"{form}.gguf", "bf16")
    # the files differ only in general.name, which each names after its source: compare the tensor data
    from quantgate.formats.gguf import open_reader
    ref = {t.name: np.asarray(t.data).tobytes() for t in open_reader(tmp_path / "mem.gguf").tensors}
    for form in ("per", "fused"):
        got = {t.name: np.asarray(t.data).tobytes() for t in open_reader(tmp_path / f"{form}.gguf").tensors}
        assert got == ref, form


@pytest.mark.parametrize("scheme", ["gptq-w4a16-g32", "w8a8-static", "w8a8-static-pct"])
def test_experts_no_calibration_token_reached_still_quantize(scheme):
    """One calibration window of 2 tokens routes to at most 4 of 8 experts per layer: the rest get round-to-nearest
    (no GPTQ Hessian) and, for static activations, the union of the ranges their siblings saw."""
    from quantgate.quant.qlinear import QuantLinear
    from quantgate.quant import get
    from quantgate.quant.simulate import quantize_
    m = moe_model()
    calib = np.array([[0, 17]], dtype=np.int64)
    m.layers[0].mlp.keep_route = True
    with torch.no_grad():
        m(torch.as_tensor(calib))
    unseen = sorted(set(range(E)) - set(m.layers[0].mlp.last_route.reshape(-1).tolist()))
    assert unseen
    q = quantize_(m, get("torch", scheme), calib)
    lin = q.layers[0].mlp.experts[unseen[0]].gate_proj
    assert isinstance(lin, QuantLinear) and lin.weight_bits in (4, 8)
    if scheme.startswith("w8a8-static"):
        seen = [q.layers[0].mlp.experts[j].gate_proj.act_range for j in range(E) if j not in unseen]
        assert (lin.act_range.lo, lin.act_range.hi) == (min(r.lo for r in seen), max(r.hi for r in seen))
    with torch.no_grad():
        assert torch.isfinite(q(torch.as_tensor(IDS)).logits).all()


def test_moe_mtp_head_is_written_from_either_expert_form(tmp_path):
    """A MoE checkpoint's MTP head (block L: attention, the routed MLP, nextn.*) goes into the GGUF with its experts
    stacked from per-expert tensors or split from a fused gate_up_proj: the same tensors either way; --no-mtp drops
    it. (Equality with llama.cpp's converter: tests/test_llama_convert.py's moe-gated-r2-mtp.)"""
    from quantgate.export.gguf import export_checkpoint
    from quantgate.formats.gguf import inspect_gguf, open_reader
    from test_streaming import mtp_head, with_mtp
    m = moe_model()
    save_checkpoint(m, tmp_path / "trunk", byte_tokenizer())
    with_mtp(tmp_path / "trunk", tmp_path / "per", m.cfg)
    with_mtp(tmp_path / "trunk", tmp_path / "fused-src", m.cfg, fused_experts=True)
    # the fused head holds the per-expert head's values: rebuild it from the per-expert tensors
    per = mtp_head(m.cfg)
    sd = load_file(tmp_path / "fused-src" / "model.safetensors")
    p = "mtp.layers.0.mlp.experts"
    sd[f"{p}.gate_up_proj"] = torch.stack([torch.cat([per[f"{p}.{k}.gate_proj.weight"], per[f"{p}.{k}.up_proj.weight"]])
                                           for k in range(E)])
    sd[f"{p}.down_proj"] = torch.stack([per[f"{p}.{k}.down_proj.weight"] for k in range(E)])
    save_file(sd, str(tmp_path / "fused-src" / "model.safetensors"))
    for form in ("per", "fused-src"):
        export_checkpoint(tmp_path / form, tmp_path / f"{form}.gguf", "f32")
    a, b = ({t.name: np.asarray(t.data).tobytes() for t in open_reader(tmp_path / f"{f}.gguf").tensors}
            for f in ("per", "fused-src"))
    assert a == b and "blk.4.ffn_gate_exps.weight" in a and "blk.4.nextn.eh_proj.weight" in a
    assert inspect_gguf(tmp_path / "per.gguf").nextn_layers == 1
    export_checkpoint(tmp_path / "per", tmp_path / "nomtp.gguf", "f32", mtp=False)
    assert not any(t.name.startswith("blk.4.") for t in open_reader(tmp_path / "nomtp.gguf").tensors)
