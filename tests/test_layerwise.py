"""The layer-by-layer PyTorch path (quantgate.layerwise): a model directory run one block at a time over every
window gives the in-memory model's numbers (analysis report, perplexity, reference logits and KL divergence), holds
one block's weights at a time, and is what `eval`/`analyze` use when the fp32 model does not fit (`--layerwise`
forces it)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from conftest import run_cli, save_random_models
from quantgate.analyze import analyze
from quantgate.errors import QuantgateError
from quantgate.evaluate import evaluate_model
from quantgate.formats.hf import open_hf
from quantgate.layerwise import LayerwiseModel, LayerwiseRunner
from quantgate.model import build_model, hybrid, make_twins, preset

MODELS = {
    "gated-attention": lambda: make_twins(preset("tiny", vocab_size=300, n_layers=3), "elementwise", 0)[1],
    "hybrid-tied": lambda: build_model(dataclasses.replace(hybrid(preset("tiny", vocab_size=300, n_layers=4)),
                                                           gate="elementwise"), 0),
    "moe": lambda: build_model(dataclasses.replace(
        hybrid(preset("tiny", vocab_size=300, n_layers=4, tie_embeddings=False), value_heads_per_key_head=2),
        gate="elementwise", linear_key_heads=2, n_experts=8, n_experts_used=2, expert_ffn_dim=32,
        shared_expert_ffn_dim=64), 0),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_random_models(tmp_path_factory.mktemp("layerwise"), MODELS)


def _same(a, b, path=""):
    """Equal reports: the same keys and values, floats to 1e-6 relative (NaN equal to NaN)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-6 * max(1.0, abs(a)), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layerwise_analysis_is_the_in_memory_report(saved, name):
    a = analyze(str(saved / name), str(saved / "t.txt"), ctx=32, n_windows=6, layerwise=False)
    b = analyze(str(saved / name), str(saved / "t.txt"), ctx=32, n_windows=6, layerwise=True)
    assert a.pop("layerwise") is False and b.pop("layerwise") is True
    _same(a, b)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layerwise_perplexity_and_kld_are_the_in_memory_ones(saved, name, tmp_path, monkeypatch):
    """The model evaluated layer by layer, and the reference's logits computed layer by layer (a fresh cache)."""
    t = str(saved / "t.txt")
    a = evaluate_model(str(saved / name), t, ctx=32, max_windows=6, layerwise=False)
    b = evaluate_model(str(saved / name), t, ctx=32, max_windows=6, layerwise=True)
    assert (a["backend"], b["backend"]) == ("torch", "torch (layer by layer)")
    assert abs(a["ppl"] - b["ppl"]) <= 1e-9 * a["ppl"]
    other = "moe" if name != "moe" else "hybrid-tied"  # any second model of the same tokenizer
    monkeypatch.setenv("QUANTGATE_CACHE", str(tmp_path / "in-memory"))
    ra = evaluate_model(str(saved / other), t, ctx=32, max_windows=6, reference=str(saved / name), layerwise=False)
    import quantgate.reference as rf
    real = rf.torch_runner
    monkeypatch.setattr(rf, "torch_runner", lambda path, name="torch", layerwise=None: real(path, name, True))
    monkeypatch.setenv("QUANTGATE_CACHE", str(tmp_path / "layerwise"))
    rb = evaluate_model(str(saved / other), t, ctx=32, max_windows=6, reference=str(saved / name), layerwise=True)
    for k in ("ppl", "reference_ppl", "kld_mean", "top1_agreement"):
        assert abs(ra[k] - rb[k]) <= 1e-6 * max(1.0, abs(ra[k])), (k, ra[k], rb[k])


def test_only_one_block_is_in_memory_at_a_time(saved):
    """While block i runs, every other block's parameters are on the meta device (nothing allocated)."""
    lw = LayerwiseModel(open_hf(saved / "moe"))
    seen = []

    def on_layer(i, first, h, probs):
        real = [j for j, blk in enumerate(lw.model.layers) if any(p.device.type != "meta" for p in blk.parameters())]
        seen.append((i, real))

    lw.hidden(np.array([[0, 5, 9, 12]] * 3), batch=2, on_layer=on_layer)
    assert seen == [(i, [i]) for i in range(4) for _ in range(2)]
    assert all(p.device.type == "meta" for p in lw.model.parameters())


def test_runner_logits_match_the_model(saved):
    from quantgate.formats import load_checkpoint
    ids = np.random.default_rng(0).integers(3, 300, size=(3, 20))
    ids[:, 0] = 0
    for name in MODELS:
        with torch.no_grad():
            want = load_checkpoint(saved / name).model(torch.as_tensor(ids)).logits.numpy()
        got = LayerwiseRunner(open_hf(saved / name), batch_size=2).logits(ids)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), name


def test_a_quantized_checkpoint_runs_layer_by_layer_with_its_scheme(saved, tmp_path):
    """A quantgate-quantized checkpoint's QuantLinears are built on the meta device too (its perplexity against the
    in-memory path: tests/test_quantize_layerwise.py)."""
    from quantgate.quant.qlinear import QuantLinear
    from quantgate.quant.torch_backend import quantize_checkpoint
    quantize_checkpoint(str(saved / "hybrid-tied"), "w8a16", str(tmp_path / "q"))
    lw = LayerwiseModel(open_hf(tmp_path / "q"))
    assert any(isinstance(m, QuantLinear) for m in lw.model.modules())


def test_layerwise_refuses_what_it_cannot_run(saved):
    with pytest.raises(QuantgateError, match="does not combine"):
        evaluate_model(str(saved / "moe"), str(saved / "t.txt"), ctx=32, max_windows=2, layerwise=True, kv_type="int8")


def test_cli_layerwise_flag(saved):
    r = run_cli("eval", str(saved / "moe"), "--data", str(saved / "t.txt"), "--ctx", "32", "--max-windows", "2",
                "--layerwise", "--json")
    assert r.returncode == 0 and '"torch (layer by layer)"' in r.stdout, r.stderr[-800:]
    r = run_cli("analyze", str(saved / "moe"), "--data", str(saved / "t.txt"), "--ctx", "32", "--windows", "2",
                "--layerwise")
    assert r.returncode == 0 and "expert routing" in r.stdout, r.stderr[-800:]
