"""GGUF export, llama.cpp's quantizer and runner, against PyTorch and transformers (independent code).

Every llama.cpp call runs in stock llama.cpp (llama-cpp-python from PyPI) in a worker process.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_hf_qwen3, make_hf_qwen3_next, randomize_, rel_err, run_cli, save_k_quant_model
from quantgate.formats import load_checkpoint, save_checkpoint
from quantgate.errors import QuantgateError
from quantgate.export.gguf import export_checkpoint, export_gguf, rope_sections
from quantgate.formats.gguf import inspect_gguf, open_reader, tokenizer_from_gguf
from quantgate.runners.llama import LlamaRunner
from quantgate.metrics import position_kld
from quantgate.model import build_model, preset
from quantgate.tokenizer import byte_tokenizer, train_bpe

WINDOWS = np.array([[0] + list(range(3, 50)), [0] + list(range(299, 252, -1))], dtype=np.int64)


def _ours(gate: str, seed: int = 0, std: float = 0.1, **kw):
    m = build_model(preset("tiny", vocab_size=300, gate=gate, **kw), seed=seed).eval()
    randomize_(m, seed, std)
    return m


def _checkpoint(kind: str, d, std: float = 0.1):
    """(model directory, reference logits) for each input layout the loader reads. std: weight scale
    (0.1: every conversion error shows; 0.02: the scale of trained and freshly initialised models)."""
    tok = byte_tokenizer()
    if kind in ("qwen3-hf", "qwen3next-hf"):
        hf = make_hf_qwen3() if kind == "qwen3-hf" else make_hf_qwen3_next(partial_rotary=0.25)
        randomize_(hf, 0, std)
        hf.save_pretrained(d)
        tok.save(d)
        with torch.no_grad():  # transformers itself is the reference here
            ref = hf(torch.as_tensor(WINDOWS), use_cache=False).logits.numpy()
        return d, ref
    gate, layout = {"baseline": ("none", None), "headwise": ("headwise", None),
                    "elementwise": ("elementwise", None), "official-elementwise": ("elementwise", "official")}[kind]
    m = _ours(gate, std=std)
    save_checkpoint(m, d, tok, layout=layout)
    with torch.no_grad():
        ref = load_checkpoint(d).model(torch.as_tensor(WINDOWS)).logits.numpy()
    return d, ref


KINDS = ["baseline", "headwise", "elementwise", "official-elementwise", "qwen3-hf", "qwen3next-hf"]


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_logits_match_pytorch(tmp_path, kind):
    d, ref = _checkpoint(kind, tmp_path / "m")
    info = export_checkpoint(d, tmp_path / "m.gguf", "f32")
    assert info["arch"] == ("qwen3" if kind in ("baseline", "qwen3-hf") else "qwen35")
    with LlamaRunner(tmp_path / "m.gguf", n_ctx=64, kv_type="f32") as r:
        assert rel_err(r.logits(WINDOWS), ref) <= 1e-5
    # F16: llama.cpp rounds weights and matmul activations to fp16. At weight scale 0.1 that alone is
    # ~2e-3 (PyTorch with fp16-rounded weights is 1e-3..2e-3 off too); at trained scale it is < 1e-3.
    d2, ref2 = _checkpoint(kind, tmp_path / "m2", std=0.02)
    export_checkpoint(d2, tmp_path / "m16.gguf", "f16")
    with LlamaRunner(tmp_path / "m16.gguf", n_ctx=64, kv_type="f32") as r:
        assert rel_err(r.logits(WINDOWS), ref2) <= 1e-3
    reader = open_reader(tmp_path / "m.gguf")
    meta = {k: reader.get_field(k).contents() for k in ("quantgate.gate", "quantgate.source_layout", "general.name")}
    assert meta["quantgate.source_layout"] == load_checkpoint(d).layout


def test_rope_sections_rotate_every_pair():
    assert rope_sections(64) == [11, 11, 10, 0]
    assert rope_sections(32) == [6, 5, 5, 0]
    for r in range(2, 130, 2):
        s = rope_sections(r)
        assert sum(s) == r // 2 and s[3] == 0 and all(i < 3 * s[i % 3] for i in range(r // 2))


def test_headwise_gate_is_expanded_into_equal_rows(tmp_path):
    m = _ours("headwise")
    export_gguf(m, byte_tokenizer(), tmp_path / "h.gguf")
    back = load_checkpoint(tmp_path / "h.gguf").model
    g = back.layers[0].self_attn.g_proj.weight.view(4, 16, -1)  # [heads, head_dim rows, dim]
    assert torch.equal(g, m.layers[0].self_attn.g_proj.weight[:, None, :].expand_as(g))


def test_embedded_tokenizer_matches_llama_cpp_and_ours(tmp_path):
    text = open(torch.__file__).read() * 3
    tok = train_bpe([text], 400)
    m = build_model(preset("tiny", vocab_size=420, gate="elementwise"), seed=0).eval()
    export_gguf(m, tok, tmp_path / "t.gguf")
    rebuilt = tokenizer_from_gguf(open_reader(tmp_path / "t.gguf"))
    samples = ["def f(x):\n    return x ** 2  # ünïcödé ✓ 日本語", "  many   spaces\t\ttabs\r\n", "<|bos|> stays text",
               text[:3000]]
    with LlamaRunner(tmp_path / "t.gguf", n_ctx=64) as r:
        for s in samples:
            ours = tok.encode(s)
            assert r.tokenize(s) == ours
            assert rebuilt.encode(s) == ours
    assert (rebuilt.bos_id, rebuilt.eos_id) == (tok.bos_id, tok.eos_id)


# --- llama.cpp quantizer --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quant_model(tmp_path_factory):
    """A gated model with rows that are multiples of 256 (real k-quants, no fallbacks), its F32 GGUF and
    reference logits."""
    d = tmp_path_factory.mktemp("q")
    m = save_k_quant_model(d)
    w = np.random.default_rng(0).integers(3, 259, (4, 64))
    w[:, 0] = 0
    with torch.no_grad():
        ref = m(torch.as_tensor(w)).logits.numpy()
    return d, w, ref


def _kld(path, w, ref) -> float:
    with LlamaRunner(path, n_ctx=64) as r:
        return float(position_kld(ref, r.logits(w)).mean())


TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K_M", "Q2_K"]


def test_every_type_quantizes_loads_and_kld_grows_as_bits_fall(quant_model):
    from quantgate.quant.llama_cpp import quantize_gguf
    d, w, ref = quant_model
    kld, bpw = {}, {}
    for t in TYPES:
        res = quantize_gguf(d / "m.gguf", d / f"{t}.gguf", t)
        assert inspect_gguf(d / f"{t}.gguf").file_type == t
        bpw[t] = res["bits_per_weight"]
        kld[t] = _kld(d / f"{t}.gguf", w, ref)
    assert all(v > 0 for v in kld.values())
    for hi, lo in [("Q8_0", "Q6_K"), ("Q6_K", "Q5_K_M"), ("Q5_K_M", "Q4_K_M"), ("Q4_K_M", "Q3_K_M"), ("Q3_K_M", "Q2_K")]:
        assert kld[hi] < kld[lo], (hi, lo, kld)
        assert bpw[hi] > bpw[lo], (hi, lo, bpw)


def test_gate_bits_keep_attn_q_at_q8_and_do_not_hurt(quant_model):
    from quantgate.quant.llama_cpp import quantize_gguf
    d, w, ref = quant_model
    quantize_gguf(d / "m.gguf", d / "plain.gguf", "Q4_K_M")
    res = quantize_gguf(d / "m.gguf", d / "g8.gguf", "Q4_K_M", gate_bits=8)
    types = inspect_gguf(d / "g8.gguf").tensor_types  # read back with gguf-py
    assert all(types[f"blk.{i}.attn_q.weight"] == "Q8_0" for i in range(2))
    assert types["blk.0.attn_k.weight"] != "Q8_0" and res["attn_q_types"] == ["Q8_0"]
    assert inspect_gguf(d / "plain.gguf").tensor_types["blk.0.attn_q.weight"] != "Q8_0"
    assert _kld(d / "g8.gguf", w, ref) <= _kld(d / "plain.gguf", w, ref)


def test_imatrix_auto_reaches_llama_cpp(quant_model, tmp_path):
    from quantgate.quant.llama_cpp import importance_matrix, quantize_gguf
    d, w, ref = quant_model
    im = importance_matrix(load_checkpoint(d / "m.gguf").model, w)
    assert set(im) >= {"blk.0.attn_q.weight", "blk.1.ffn_down.weight"} and im["blk.1.ffn_down.weight"].shape == (512,)
    text = tmp_path / "calib.txt"
    text.write_text(open(torch.__file__).read() * 4)
    quantize_gguf(d / "m.gguf", d / "iq.gguf", "IQ4_XS", calib_data=str(text), calib_windows=8, ctx=64)
    quantize_gguf(d / "m.gguf", d / "iq-im.gguf", "IQ4_XS", imatrix="auto", calib_data=str(text), calib_windows=8,
                  ctx=64)
    a, b = (open_reader(d / f).tensors for f in ("iq.gguf", "iq-im.gguf"))
    diff = [x.name for x, y in zip(a, b) if x.name.endswith("ffn_down.weight") and not np.array_equal(x.data, y.data)]
    assert diff  # llama.cpp used the importance matrix: the same type, different rounding
    assert np.isfinite(_kld(d / "iq-im.gguf", w, ref))


# --- gate survival ----------------------------------------------------------------------------------

def test_gate_survival_exact_at_f32_flags_quantization_and_a_wrong_row_order(quant_model):
    from quantgate.gate_survival import gate_survival
    from quantgate.quant.llama_cpp import quantize_gguf
    d, w, _ = quant_model
    ref = load_checkpoint(d / "m").model
    exact = gate_survival(load_checkpoint(d / "m.gguf").model, ref, w)
    assert exact["worst_mean_abs_diff"] < 1e-6 and exact["max_frac_crossed_0.5"] == 0
    quantize_gguf(d / "m.gguf", d / "q2.gguf", "Q2_K")
    q2 = gate_survival(load_checkpoint(d / "q2.gguf").model, ref, w)
    assert q2["worst_mean_abs_diff"] > 100 * exact["worst_mean_abs_diff"] + 1e-4
    bad = load_checkpoint(d / "m").model  # an exporter that forgot to interleave: gate rows are q rows
    for layer in bad.layers:
        layer.self_attn.g_proj.weight.data.copy_(layer.self_attn.q_proj.weight.data)
    wrong = gate_survival(bad, ref, w)
    assert wrong["worst_mean_abs_diff"] > 0.05 and wrong["max_frac_crossed_0.5"] > 0.1


# --- runner, generation, KV-cache types ---------------------------------------------------------------

def test_kv_cache_types_run_and_quantized_kv_costs_accuracy(quant_model):
    d, w, ref = quant_model
    kld = {}
    for kv in ("f32", "f16", "q8_0", "q4_0"):
        with LlamaRunner(d / "m.gguf", n_ctx=64, kv_type=kv) as r:
            kld[kv] = float(position_kld(ref, r.logits(w)).mean())
    assert kld["f32"] < 1e-9 < kld["f16"] < kld["q4_0"] and kld["q8_0"] < kld["q4_0"]


def test_the_kv_rotation_rule_is_llama_cpps_own(quant_model, tmp_path, monkeypatch):
    """runners.llama.attn_rotation says llama.cpp rotates Q/K/V for a quantized KV cache at head dimension 64 and
    not at 32, nor with LLAMA_ATTN_ROT_DISABLE=1: llama.cpp's logits agree (they change with the variable only
    where the rule says the rotation was on)."""
    from quantgate.export.gguf import export_gguf
    from quantgate.runners.llama import attn_rotation
    from quantgate.tokenizer import byte_tokenizer
    d, w, _ = quant_model
    m32 = build_model(preset("tiny", vocab_size=300, head_dim=32, gate="elementwise"), seed=2).eval()
    randomize_(m32, 2, std=0.06)
    export_gguf(m32, byte_tokenizer(), tmp_path / "hd32.gguf")
    for path, head_dim in ((d / "m.gguf", 64), (tmp_path / "hd32.gguf", 32)):
        logits = {}
        for disable in ("0", "1"):
            monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", disable)
            with LlamaRunner(path, n_ctx=64, kv_type="q4_0") as r:
                logits[disable] = r.logits(w)
                assert r.kv_rotation["k"] == (head_dim == 64 and disable == "0")
        rotated = attn_rotation(head_dim, "q4_0", {"LLAMA_ATTN_ROT_DISABLE": "0"})["k"]
        assert rotated == (not np.array_equal(logits["0"], logits["1"])), (head_dim, rotated)
    assert not attn_rotation(64, "f16", {})["k"] and "not quantized" in attn_rotation(64, "f16", {})["reading"]


def test_eval_and_generate_cli_on_gguf(quant_model, tmp_path):
    d, _, _ = quant_model
    text = tmp_path / "t.txt"
    text.write_text("hello world, this is text. " * 100)
    r = run_cli("eval", str(d / "m.gguf"), "--data", str(text), "--ctx", "32", "--reference", str(d / "m"), "--json",
                env={"QUANTGATE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    import json
    res = json.loads(r.stdout)
    assert res["backend"] == "llama.cpp:F32" and res["kld_mean"] < 1e-9 and res["top1_agreement"] == 1.0
    assert abs(res["ppl"] / res["reference_ppl"] - 1) < 1e-5
    g = run_cli("generate", str(d / "m.gguf"), "--prompt", "hello", "--max-tokens", "12")
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("hello") and "decode" in g.stderr and "tok/s" in g.stderr
    t = run_cli("generate", str(d / "m"), "--prompt", "hello", "--max-tokens", "12")
    assert t.returncode == 0 and t.stdout == g.stdout  # greedy: PyTorch and llama.cpp agree on the text


def test_runner_survives_a_llama_cpp_abort(tmp_path):
    """A qwen35 file without the identity recurrent layer makes llama.cpp abort on decode (DESIGN 3):
    the worker dies, the caller gets one QuantgateError and can go on using llama.cpp."""
    m = _ours("elementwise")
    export_gguf(m, byte_tokenizer(), tmp_path / "abort.gguf", identity_layers=0)
    export_gguf(m, byte_tokenizer(), tmp_path / "ok.gguf")
    with pytest.raises(QuantgateError, match="llama.cpp stopped"):
        with LlamaRunner(tmp_path / "abort.gguf", n_ctx=64) as r:
            r.logits(WINDOWS)
    with LlamaRunner(tmp_path / "ok.gguf", n_ctx=64) as r:
        assert r.logits(WINDOWS).shape == (2, 48, 300)
