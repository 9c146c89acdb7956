"""ONNX export, onnxruntime quantization and the ONNX Runtime runner, against PyTorch and optimum."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import randomize_, rel_err, run_cli
from quantgate.formats import load_checkpoint, save_checkpoint
from quantgate.export.onnx import export_checkpoint
from quantgate.metrics import position_kld
from quantgate.model import build_model, preset
from quantgate.runners import OrtRunner
from quantgate.tokenizer import byte_tokenizer

W = np.array([[0] + list(range(3, 30)), [0] + list(range(299, 272, -1))], dtype=np.int64)


def _model(gate: str, seed: int = 0, **kw):
    m = build_model(preset("tiny", vocab_size=300, gate=gate, **kw), seed=seed).eval()
    randomize_(m, seed)
    return m


class _Exports:
    """The module's folder: `exports / "headwise-18"` is that gate mode's opset-18 export (`-23`, `-gqa`), made the
    first time a test asks for it, so that the default step exports only what its tests read."""

    def __init__(self, root: Path):
        self.root = root

    def __truediv__(self, name: str) -> Path:
        p = self.root / name
        if not p.exists():
            gate, form = name.split("-")
            export_checkpoint(self.root / gate, p, **({"graph": "gqa"} if form == "gqa" else {"opset": int(form)}))
        return p


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Model directories for the three gate modes, and their opset-23 / opset-18 / GQA exports on demand."""
    d = tmp_path_factory.mktemp("onnx")
    out = {}
    for gate in ("none", "headwise", "elementwise"):
        m = _model(gate)
        save_checkpoint(m, d / gate, byte_tokenizer())
        out[gate] = m
    return _Exports(d), out


# the baseline in every form and each gate at opset 23 in the default step; the gated graphs' other forms (an export
# each, ~10 s) in CI's slow step (the default step's 25-minute limit)
FORMS = [pytest.param(g, f, id=f"{g}-{f}", marks=[pytest.mark.slow] if g != "none" and f != "23" else [])
         for f in ("23", "18", "gqa") for g in ("none", "headwise", "elementwise")]


@pytest.mark.parametrize("gate, form", FORMS)
def test_onnx_logits_match_pytorch_prefill_decode_and_chunk(exports, gate, form):
    d, models = exports
    # GroupQueryAttention on CPU takes several new tokens on a cache only for batch 1
    w = W[:1] if form == "gqa" else W
    with torch.no_grad():
        ref = models[gate](torch.as_tensor(W)).logits.numpy()
    with OrtRunner(d / f"{gate}-{form}") as r:
        assert rel_err(r.logits(W), ref) <= 1e-5  # prefill on an empty cache
        lg0, past = r.step(w[:, :20], r._empty_past(len(w)), 0)
        lg1, past = r.step(w[:, 20:21], past, 20)  # one decode step
        lg2, _ = r.step(w[:, 21:], past, 21)  # several tokens on a cache
    assert rel_err(np.concatenate([lg0, lg1, lg2], axis=1), ref[: len(w)]) <= 1e-5


@pytest.mark.slow  # the gated GQA export: CI's slow step
def test_gqa_graph_uses_group_query_attention_with_the_gate_after_it(exports):
    import onnx
    d, _ = exports
    g = onnx.load(str(d / "elementwise-gqa" / "model.onnx"))
    ops = [n.op_type for n in g.graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "Attention" not in ops
    for i in range(2):
        mul = next(n for n in g.graph.node if n.name == f"model.layers.{i}/gate_mul")
        assert any("GroupQueryAttention" in x for x in mul.input)
    assert len([n for n in g.graph.node if ".qg_proj." in n.name]) == 2


def test_gate_is_one_fused_matmul_and_attention_is_the_onnx_op(exports):
    import onnx
    d, _ = exports
    g = onnx.load(str(d / "elementwise-23" / "model.onnx"))
    ops = [n.op_type for n in g.graph.node]
    base = [n.op_type for n in onnx.load(str(d / "none-23" / "model.onnx")).graph.node]
    assert ops.count("Attention") == 2 and ops.count("Sigmoid") - base.count("Sigmoid") == 2  # + SiLU's in both
    qg = [n.name for n in g.graph.node if n.op_type == "MatMul" and ".qg_proj." in n.name]
    assert len(qg) == 2 and not any(".q_proj." in n.name or ".g_proj." in n.name for n in g.graph.node)
    g18 = onnx.load(str(d / "elementwise-18" / "model.onnx"))
    assert "Attention" not in {n.op_type for n in g18.graph.node}


OPTIMUM = os.environ.get("QUANTGATE_OPTIMUM_PYTHON")


@pytest.mark.skipif(not OPTIMUM, reason="QUANTGATE_OPTIMUM_PYTHON (a venv with quantgate[optimum]; optimum-onnx pins "
                                        "transformers < 4.58) is not set; .ci/run builds one")
def test_optimum_opens_the_baseline_export_and_generates(exports, tmp_path):
    """optimum's ORTModelForCausalLM, in its own interpreter (tests/optimum_reference.py), on our baseline export."""
    d, models = exports
    ids = W[:1, :10]
    np.save(tmp_path / "ids.npy", ids)
    r = subprocess.run([OPTIMUM, str(Path(__file__).with_name("optimum_reference.py")), str(d / "none-23"),
                        str(tmp_path / "ids.npy"), str(tmp_path / "out.npz")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    with torch.no_grad():
        ref = models["none"](torch.as_tensor(ids)).logits.numpy()
    assert rel_err(out["logits"], ref) <= 1e-5
    gen = torch.as_tensor(out["generated"])
    ours = [int(models["none"](gen[:, :k]).logits.argmax(-1)[0, -1]) for k in range(10, 16)]
    assert gen[0, 10:].tolist() == ours  # greedy continuation equals our model's


@pytest.mark.parametrize("name", ["headwise-23", "elementwise-18", "none-gqa"])
def test_loaded_back_from_onnx_equals_the_source(exports, name):
    d, models = exports
    gate = name.split("-")[0]
    back = load_checkpoint(d / name)
    with torch.no_grad():
        a, b = back.model(torch.as_tensor(W)).logits, models[gate](torch.as_tensor(W)).logits
    assert back.model.cfg.gate == gate and rel_err(a, b) <= 1e-6


@pytest.mark.slow  # moved out of the default step (its 25-minute limit); CI's slow step runs it
def test_fp16_export_runs_close_to_fp32(tmp_path):
    m = build_model(preset("tiny", vocab_size=300, gate="elementwise"), seed=0).eval()
    save_checkpoint(m, tmp_path / "m", byte_tokenizer())
    export_checkpoint(tmp_path / "m", tmp_path / "o16", dtype="fp16")
    with torch.no_grad():
        ref = m(torch.as_tensor(W)).logits.numpy()
    import onnx
    g = onnx.load(str(tmp_path / "o16" / "model.onnx"))
    assert {i.data_type for i in g.graph.initializer if i.name.endswith("weight_T")} == {onnx.TensorProto.FLOAT16}
    with OrtRunner(tmp_path / "o16") as r:
        assert rel_err(r.logits(W), ref) <= 1e-3


# --- quantization -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qmodel(tmp_path_factory):
    d = tmp_path_factory.mktemp("oq")
    cfg = preset("tiny", vocab_size=300, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, gate="elementwise")
    m = build_model(cfg, seed=1).eval()
    randomize_(m, 1, std=0.06)
    save_checkpoint(m, d / "m", byte_tokenizer())
    export_checkpoint(d / "m", d / "fp32")
    (d / "calib.txt").write_text(open(torch.__file__).read() * 4)
    w = np.random.default_rng(0).integers(3, 259, (4, 64))
    w[:, 0] = 0
    with torch.no_grad():
        ref = m(torch.as_tensor(w)).logits.numpy()
    return d, m, w, ref


def _kld(path, w, ref):
    with OrtRunner(path) as r:
        return float(position_kld(ref, r.logits(w)).mean())


def test_every_scheme_quantizes_runs_and_int4_costs_most(qmodel):
    from quantgate.quant.ort import quantize_onnx
    d, _, w, ref = qmodel
    kld, size = {}, {}
    for s in ("int8-dynamic", "int8-static", "int8-weight", "int4"):
        res = quantize_onnx(d / "fp32", d / s, s, calib_data=str(d / "calib.txt"), calib_windows=4, ctx=64)
        kld[s], size[s] = _kld(d / s, w, ref), res["bytes"]
        assert json.loads((d / s / "quantgate.json").read_text())["quantization"]["scheme"] == s
    assert all(v > 0 for v in kld.values())
    assert kld["int8-weight"] < kld["int4"] and kld["int8-dynamic"] < kld["int4"]
    assert size["int4"] < size["int8-weight"] < (d / "fp32" / "model.onnx").stat().st_size


def test_int4_gate_bits_keep_the_gate_matmul_at_8_bits(qmodel):
    import onnx

    from quantgate.gate_survival import gate_survival
    from quantgate.quant.ort import quantize_onnx
    d, m, w, ref = qmodel
    quantize_onnx(d / "fp32", d / "i4", "int4")
    quantize_onnx(d / "fp32", d / "i4g8", "int4", gate_bits=8)
    g = onnx.load(str(d / "i4g8" / "model.onnx"))
    bits = {n.name: {a.name: a.i for a in n.attribute}["bits"] for n in g.graph.node if n.op_type == "MatMulNBits"}
    assert all(b == 8 for n, b in bits.items() if ".qg_proj." in n) and sum(".qg_proj." in n for n in bits) == 2
    assert all(b == 4 for n, b in bits.items() if ".qg_proj." not in n)
    assert _kld(d / "i4g8", w, ref) <= _kld(d / "i4", w, ref)
    exact = gate_survival(load_checkpoint(d / "fp32").model, m, w)
    g4 = gate_survival(load_checkpoint(d / "i4").model, m, w)
    g8 = gate_survival(load_checkpoint(d / "i4g8").model, m, w)
    assert exact["worst_mean_abs_diff"] < 1e-6 < g8["worst_mean_abs_diff"] < g4["worst_mean_abs_diff"]


def test_eval_generate_quantize_cli_on_onnx(qmodel, tmp_path):
    d, _, _, _ = qmodel
    q = run_cli("quantize", str(d / "fp32"), "--scheme", "int8-dynamic", "--out", str(tmp_path / "q"))
    # nothing on stderr but the peak-memory line every long verb ends with (no warnings)
    assert q.returncode == 0 and [ln for ln in q.stderr.splitlines() if ln.strip()] == [
        next(ln for ln in q.stderr.splitlines() if ln.startswith("peak memory: "))], q.stderr
    r = run_cli("eval", str(tmp_path / "q"), "--data", str(d / "calib.txt"), "--ctx", "32", "--max-windows", "4",
                "--reference", str(d / "m"), "--json", env={"QUANTGATE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["backend"] == "onnxruntime:int8-dynamic" and 0 < res["kld_mean"] < 1 and res["n_windows"] == 4
    g = run_cli("generate", str(d / "fp32"), "--prompt", "hello", "--max-tokens", "10")
    t = run_cli("generate", str(d / "m"), "--prompt", "hello", "--max-tokens", "10")
    assert g.returncode == 0 and "decode" in g.stderr and g.stdout == t.stdout  # greedy: ORT == PyTorch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_execution_provider_matches_cpu(qmodel):
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu in place of the CPU onnxruntime the package pins "
                    "(pip uninstall onnxruntime; pip install onnxruntime-gpu)")
    d, _, w, ref = qmodel
    with OrtRunner(d / "fp32", device="cuda:0") as r:  # the runner turns TF32 off: fp32 parity, not TF32's 1e-3
        assert rel_err(r.logits(w), ref) <= 1e-4
        toks = list(r.generate([0, 5, 6, 7], 8))
    with OrtRunner(d / "fp32") as c:
        assert toks == list(c.generate([0, 5, 6, 7], 8))
