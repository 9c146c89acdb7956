"""Hybrid GGUFs (Gated DeltaNet + gated attention) in stock llama.cpp's qwen35 graph: real GDN tensors and keys,
no identity layer, the value-head reorder when there are more value heads than key heads, the hybrid baseline as
zero gate rows; logits equal PyTorch's and the file reads back into the same model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import randomize_, rel_err
from quantgate.export.gguf import export_checkpoint
from quantgate.formats import inspect_gguf, load_checkpoint, save_checkpoint
from quantgate.formats.gguf import open_reader
from quantgate.model import hybrid, make_twins, preset
from quantgate.runners import LlamaRunner
from quantgate.tokenizer import byte_tokenizer

WINDOWS = np.array([[0] + list(range(3, 40)), [0] + list(range(299, 262, -1))], dtype=np.int64)


def _twins(r: int):
    """Hybrid twins with 4 layers (three GDN, then full attention), r value heads per key head."""
    cfg = hybrid(preset("tiny", vocab_size=300, n_layers=4, head_dim=32), value_heads_per_key_head=r)
    base, gated = make_twins(cfg, "elementwise", seed=0)
    randomize_(base, 1)
    randomize_(gated, 2)
    return base.eval(), gated.eval()


@pytest.mark.parametrize("r", [1, 2])
def test_hybrid_gguf_runs_in_llama_cpp_with_pytorchs_logits(tmp_path, r):
    for role, m in zip(("baseline", "gated"), _twins(r)):
        save_checkpoint(m, tmp_path / role, byte_tokenizer())
        out = tmp_path / f"{role}.gguf"
        summary = export_checkpoint(tmp_path / role, out, "f32")
        assert (summary["arch"], summary["identity_layers"]) == ("qwen35", 0)
        info = inspect_gguf(out)
        assert info.recurrent_layers == (0, 1, 2) and info.gate == ("none" if role == "baseline" else "elementwise")
        meta = open_reader(out)
        assert meta.get_field("qwen35.ssm.time_step_rank").contents() == m.cfg.linear_value_heads
        assert meta.get_field("qwen35.ssm.group_count").contents() == m.cfg.linear_key_heads
        with torch.no_grad():
            ref = m(torch.as_tensor(WINDOWS)).logits.numpy()
        with LlamaRunner(out, n_ctx=64, kv_type="f32") as run:
            assert rel_err(run.logits(WINDOWS), ref) <= 1e-5, role
        back = load_checkpoint(out).model
        assert back.cfg.layer_types == m.cfg.layer_types and back.cfg.gate == m.cfg.gate
        with torch.no_grad():
            assert rel_err(back(torch.as_tensor(WINDOWS)).logits, ref) <= 1e-6, role


def test_quantized_hybrid_ggufs_keep_both_gates_and_the_small_gdn_tensors(tmp_path):
    """Q8_0, Q4_K_M and gate-aware Q4_K_M of a hybrid load and run in llama.cpp; --gate-bits 8 keeps both gates
    (attention attn_q, GDN attn_gate) at Q8_0, and ssm_alpha/ssm_beta stay Q8_0 in every type; KLD grows as bits
    fall."""
    from quantgate.gate_survival import gate_survival
    from quantgate.quant.llama_cpp import quantize_gguf
    from quantgate.metrics import position_kld
    _, m = _twins(2)
    save_checkpoint(m, tmp_path / "g", byte_tokenizer())
    export_checkpoint(tmp_path / "g", tmp_path / "g.gguf", "f32")
    with torch.no_grad():
        ref = m(torch.as_tensor(WINDOWS)).logits.numpy()
    kld, survival = {}, {}
    for qtype, bits in (("Q8_0", None), ("Q4_K_M", None), ("Q4_K_M", 8)):
        out = tmp_path / f"{qtype}-{bits}.gguf"
        res = quantize_gguf(tmp_path / "g.gguf", out, qtype, gate_bits=bits)
        assert set(res["kept_high"].values()) == {"Q8_0"} and len(res["kept_high"]) == 2 * 3
        if bits:
            assert res["attn_q_types"] == ["Q8_0"] and res["gdn_gate_types"] == ["Q8_0"]
        with LlamaRunner(out, n_ctx=64, kv_type="f32") as run:
            lg = run.logits(WINDOWS)
        assert np.isfinite(lg).all()
        kld[(qtype, bits)] = float(position_kld(ref, lg).mean())
        survival[(qtype, bits)] = gate_survival(load_checkpoint(out).model, m, WINDOWS)
    assert 0 < kld[("Q8_0", None)] < kld[("Q4_K_M", None)]
    # both gates are checked after export, and keeping them at Q8_0 keeps them closer on every gated layer
    kinds = [l["kind"] for l in survival[("Q8_0", None)]["layers"]]
    assert kinds == ["gdn", "gdn", "gdn", "attention"]
    plain, kept = (survival[("Q4_K_M", b)]["layers"] for b in (None, 8))
    assert all(k["mean_abs_diff"] < p["mean_abs_diff"] for p, k in zip(plain, kept))


def test_a_qwen3_5_tokenizer_is_written_as_qwen35_and_tokenizes_as_llama_cpp_does(tmp_path):
    """Qwen3.5's pre-tokenizer (Qwen2's regex with combining marks in letter runs, NFC) becomes tokenizer.ggml.pre
    qwen35; llama.cpp, our rebuilt tokenizer and the original agree on NFC text, combining marks included."""
    import json
    import unicodedata

    from tokenizers import Tokenizer as HFTokenizer

    from quantgate.formats.gguf import tokenizer_from_gguf
    from quantgate.formats.gguf_layout import QWEN35_SPLIT
    from quantgate.tokenizer import Tokenizer, train_bpe
    text = open(torch.__file__).read() * 2 + "e\u0301t\u00e9 na\u0303o \u0915\u093f\u0924\u093e\u092c " * 50
    base = train_bpe([text], 400)
    spec = json.loads(base.tok.to_str())
    spec["normalizer"] = {"type": "NFC"}
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [  # Qwen3.5's tokenizer.json form
        {"type": "Split", "pattern": {"Regex": QWEN35_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    tok = Tokenizer(HFTokenizer.from_str(json.dumps(spec)), base.bos_id, base.eos_id, base.pad_id)
    _, m = _twins(1)
    m = m.__class__(m.cfg.__class__(**{**m.cfg.to_dict(), "vocab_size": 420}))
    save_checkpoint(m.eval(), tmp_path / "m", tok)
    export_checkpoint(tmp_path / "m", tmp_path / "m.gguf")
    reader = open_reader(tmp_path / "m.gguf")
    assert reader.get_field("tokenizer.ggml.pre").contents() == "qwen35"
    rebuilt = tokenizer_from_gguf(reader)
    samples = ["caf\u00e9 na\u0303o \u0915\u093f\u0924\u093e\u092c", "def f(x):\n    return x ** 2  # \u00fcn\u00efc\u00f6d\u00e9",
               text[:2000]]
    # NFC text: llama.cpp does not normalize, so only text already in NFC can agree (Devanagari vowel signs are
    # combining marks that NFC keeps: the \p{M} in the letter runs is exercised)
    samples = [unicodedata.normalize("NFC", x) for x in samples]
    with LlamaRunner(tmp_path / "m.gguf", n_ctx=64) as r:
        for s in samples:
            assert r.tokenize(s) == tok.encode(s) == rebuilt.encode(s), s[:40]
