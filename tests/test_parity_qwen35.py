"""Qwen3.5 hybrids against stock transformers 5 (Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration), run by
tests/tf5_reference.py in a child interpreter (this one, which `.[test]` gives transformers >= 5.2, or the one
QUANTGATE_TF5_PYTHON names), in two shapes:
tied embeddings with as many value heads as key heads, and untied with twice as many value heads.

Both directions: a stock random model saved by save_pretrained is read by our loader (logits within 1e-5 of the
largest), and our hybrid twins saved by save_checkpoint are opened by stock transformers (the same bound, its own
cache too). `quantgate eval`'s perplexity equals the one transformers' logits give under our convention. Our ONNX
export of each stock checkpoint runs in ONNX Runtime with transformers' logits (prefill, decode, a chunk), as does the
--graph gqa form (ORT's fused ops, both GDN ops) of a third, wider one."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import randomize_, rel_err, transformers5_python
from quantgate.calib_data import eval_windows, load_corpus, tokenize_corpus
from quantgate.evaluate import evaluate_model
from quantgate.formats import load_checkpoint, save_checkpoint
from quantgate.metrics import token_nll
from quantgate.model import hybrid, make_twins, preset
from quantgate.tokenizer import byte_tokenizer

TF5 = os.environ.get("QUANTGATE_TF5_PYTHON") or transformers5_python()
pytestmark = pytest.mark.skipif(not TF5, reason="needs transformers >= 5.2 (pip install '.[test]') or "
                                                 "QUANTGATE_TF5_PYTHON naming an interpreter that has it")
SCRIPT = Path(__file__).with_name("tf5_reference.py")
IDS = np.random.default_rng(0).integers(3, 300, size=(2, 24)).astype(np.int64)
IDS[:, 0] = 0
SHAPES = {  # Qwen3_5TextConfig fields (tiny), and our twin of each
    "tied-r1": dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                    linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True),
    "untied-r2": dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      tie_word_embeddings=False),
}
# for the --graph gqa export: GroupQueryAttention rotates 16+ channels (rotary_dim/2 a multiple of 8), so head_dim 64
WIDE = dict(SHAPES["untied-r2"], head_dim=64)
WIDE_ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
             "mrope_interleaved": True}
COMMON = dict(rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=2,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                               "mrope_section": [1, 1, 0], "mrope_interleaved": True})


def _spec(shape: str, multimodal: bool) -> dict:
    return {**SHAPES[shape], **COMMON, "multimodal": multimodal}


def _our_cfg(shape: str):
    s = SHAPES[shape]
    cfg = hybrid(preset("tiny", vocab_size=300, n_layers=4, tie_embeddings=s["tie_word_embeddings"], rope_theta=1e7))
    return dataclasses.replace(cfg, linear_key_heads=2, linear_value_heads=s["linear_num_value_heads"])


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """Everything transformers 5 is asked, in one run of the reference interpreter: stock random models (both
    shapes, text-only and multimodal) with their logits, and its logits of our saved twins and eval windows."""
    d = tmp_path_factory.mktemp("tf5")
    np.save(d / "ids.npy", IDS)
    jobs, ours = [], {}
    for shape in SHAPES:
        for mm in (False, True):
            key = f"{shape}-{'mm' if mm else 'text'}"
            (d / f"{key}.json").write_text(json.dumps(_spec(shape, mm)))
            jobs.append(["make", str(d / f"{key}.json"), str(d / key), str(d / "ids.npy"), str(d / f"{key}.npz")])
        base, gated = make_twins(_our_cfg(shape), "elementwise", seed=0)
        randomize_(base, 1)
        randomize_(gated, 2)
        for role, m in (("baseline", base), ("gated", gated)):
            key = f"ours-{shape}-{role}"
            save_checkpoint(m.eval(), d / key, byte_tokenizer())
            jobs.append(["logits", str(d / key), str(d / "ids.npy"), str(d / f"{key}.npz")])
            ours[key] = m
    text = d / "t.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 40)
    tok = byte_tokenizer()
    np.save(d / "wins.npy", eval_windows(tokenize_corpus(load_corpus(str(text)).split("all"), tok).ids, 24, tok.bos_id, 3))
    jobs.append(["logits", str(d / "ours-untied-r2-gated"), str(d / "wins.npy"), str(d / "wins.npz")])
    (d / "wide-text.json").write_text(json.dumps({**WIDE, **COMMON, "rope_parameters": WIDE_ROPE, "multimodal": False}))
    jobs.append(["make", str(d / "wide-text.json"), str(d / "wide-text"), str(d / "ids.npy"), str(d / "wide-text.npz")])
    (d / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([TF5, str(SCRIPT), str(d / "jobs.json")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, ours


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("multimodal", [False, True])
def test_stock_qwen3_5_checkpoints_load_with_their_logits(ref, shape, multimodal):
    d, _ = ref
    key = f"{shape}-{'mm' if multimodal else 'text'}"
    logits = np.load(d / f"{key}.npz")
    assert str(logits["cls"]) == ("Qwen3_5ForConditionalGeneration" if multimodal else "Qwen3_5ForCausalLM")
    loaded = load_checkpoint(d / key)
    cfg = loaded.model.cfg
    assert loaded.layout == "qwen3_5" and cfg.gate == "elementwise" and cfg.rope_theta == 1e7
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    with torch.no_grad():
        ours = loaded.model(torch.as_tensor(IDS)).logits
    assert rel_err(ours, logits["full"]) <= 1e-5
    assert rel_err(logits["cached"], logits["full"]) <= 1e-5  # the reference's own cache agrees with it
    if multimodal:
        assert set(cfg.extra["skipped_tensors"]) == {"vision tower"}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("role", ["baseline", "gated"])
def test_our_hybrid_twins_open_in_stock_transformers(ref, shape, role):
    """The baseline opens through zero gate rows and 2 * o_proj; stock's cached decode agrees too."""
    d, ours = ref
    key = f"ours-{shape}-{role}"
    assert_stock_agrees(d / f"{key}.npz", ours[key], "Qwen3_5ForCausalLM")


def assert_stock_agrees(npz, model, cls: str) -> None:
    """transformers' logits of our saved model (class `cls`), full and on its own cache, are ours within 1e-5."""
    logits = np.load(npz)
    assert str(logits["cls"]) == cls
    with torch.no_grad():
        mine = model(torch.as_tensor(IDS)).logits
    assert rel_err(mine, logits["full"]) <= 1e-5
    assert rel_err(mine, logits["cached"]) <= 1e-5


def test_eval_perplexity_equals_transformers_under_our_convention(ref):
    """`quantgate eval`: windows of BOS + 23 tokens, every token scored; ppl = exp(mean NLL) of transformers'
    logits on the same windows."""
    d, _ = ref
    res = evaluate_model(str(d / "ours-untied-r2-gated"), str(d / "t.txt"), ctx=24, max_windows=3)
    wins = np.load(d / "wins.npy")
    ppl = float(np.exp(token_nll(np.load(d / "wins.npz")["full"], wins).mean()))
    assert res["n_windows"] == 3 and abs(res["ppl"] - ppl) <= 1e-5 * ppl


@pytest.fixture(scope="module")
def onnx_exports(ref, tmp_path_factory):
    """Our ONNX export of each stock text checkpoint (what `quantgate export onnx` writes for it)."""
    from quantgate.export.onnx import export_checkpoint
    d, _ = ref
    out = tmp_path_factory.mktemp("tf5-onnx")
    for shape in SHAPES:
        export_checkpoint(d / f"{shape}-text", out / shape)
    return out


@pytest.mark.parametrize("op", ["linear_attention", "gated_delta_net"])
def test_fused_onnx_export_of_a_stock_checkpoint_has_transformers_logits(ref, tmp_path, op):
    """The --graph gqa form (ORT's fused GroupQueryAttention and Gated DeltaNet ops) of a stock checkpoint against
    transformers 5: prefill, one token at a time on the cache (batch 2), and a chunk on the cache (batch 1, which
    GroupQueryAttention needs for several new tokens after a cache)."""
    from quantgate.export.onnx import export_checkpoint
    from quantgate.runners import OrtRunner
    d, _ = ref
    logits = np.load(d / "wide-text.npz")
    export_checkpoint(d / "wide-text", tmp_path / op, graph="gqa", gdn_op=op)
    with OrtRunner(tmp_path / op) as r:
        assert rel_err(r.logits(IDS), logits["full"]) <= 1e-5
        steps, (lg, past) = [], r.step(IDS[:, :10], r._empty_past(2), 0)
        steps.append(lg)
        for t in range(10, IDS.shape[1]):
            lg, past = r.step(IDS[:, t:t + 1], past, t)
            steps.append(lg)
        assert rel_err(np.concatenate(steps, axis=1), logits["cached"]) <= 1e-5
        for row in range(2):
            lg0, past = r.step(IDS[row:row + 1, :10], r._empty_past(1), 0)
            lg1, past = r.step(IDS[row:row + 1, 10:17], past, 10)
            lg2, _ = r.step(IDS[row:row + 1, 17:], past, 17)
            assert rel_err(np.concatenate([lg0, lg1, lg2], axis=1), logits["full"][row:row + 1]) <= 1e-5


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_onnx_export_of_a_stock_checkpoint_runs_in_onnx_runtime_with_transformers_logits(ref, onnx_exports, shape):
    """ONNX Runtime on the export, against transformers 5 on the checkpoint: prefill from empty states, prefill(10)
    then one token at a time, and prefill(10) + a chunk of 7 on the cache + the rest."""
    from quantgate.runners import OrtRunner
    d, _ = ref
    logits = np.load(d / f"{shape}-text.npz")
    with OrtRunner(onnx_exports / shape) as r:
        assert rel_err(r.logits(IDS), logits["full"]) <= 1e-5
        steps, (lg, past) = [], r.step(IDS[:, :10], r._empty_past(2), 0)
        steps.append(lg)
        for t in range(10, IDS.shape[1]):
            lg, past = r.step(IDS[:, t:t + 1], past, t)
            steps.append(lg)
        assert rel_err(np.concatenate(steps, axis=1), logits["cached"]) <= 1e-5
        lg0, past = r.step(IDS[:, :10], r._empty_past(2), 0)
        lg1, past = r.step(IDS[:, 10:17], past, 10)
        lg2, _ = r.step(IDS[:, 17:], past, 17)
        assert rel_err(np.concatenate([lg0, lg1, lg2], axis=1), logits["full"]) <= 1e-5
