"""PyTorch quantization schemes on planted and random models."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from quantgate.errors import QuantgateError
from quantgate.evaluate import token_nll
from quantgate.metrics import logit_errors
from quantgate.model import build_model, preset
from quantgate.quant.qlinear import ActRange, QuantLinear, fake_quant_per_token, fake_quant_static, quantize_weight
from quantgate.runners import TorchRunner
from quantgate.quant.simulate import block_linears, quantize_
from quantgate.quant.schemes import TORCH_SCHEMES, get
from test_outliers import planted_model, windows


def logits_of(model, w):
    with torch.inference_mode():
        return model(torch.as_tensor(w)).logits.numpy()


def ppl(logits, w):
    return float(np.exp(token_nll(logits, w).mean()))


def test_weight_rtn_grid_and_groups():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    q4 = quantize_weight(w, 4, 32)
    for row in range(8):
        for g in range(2):
            block = q4[row, g * 32:(g + 1) * 32]
            scale = w[row, g * 32:(g + 1) * 32].abs().max() / 7
            assert torch.allclose(block / scale, (block / scale).round(), atol=1e-4)  # on the int grid
            assert len(torch.unique((block / scale).round())) <= 16
    assert (quantize_weight(w, 8) - w).abs().max() < (q4 - w).abs().max()
    with pytest.raises(QuantgateError, match="does not divide"):
        quantize_weight(w, 4, 48)


def test_activation_quantizers():
    x = torch.linspace(-3, 5, 1000)
    sym = fake_quant_static(x, ActRange(-3, 5), 8, symmetric=True)
    asym = fake_quant_static(x, ActRange(-3, 5), 8, symmetric=False)
    assert (asym - x).abs().max() < (sym - x).abs().max()  # asymmetric uses the whole grid
    assert (asym - x).abs().max() <= 8 / 255 / 2 + 1e-6
    assert fake_quant_static(torch.zeros(3), ActRange(1, 2), 8, False).abs().max() == 0  # 0 is on the grid
    tok = torch.tensor([[1e-3, 2e-3], [100.0, -50.0]])
    assert torch.allclose(fake_quant_per_token(tok, 8)[0], tok[0], rtol=1e-2)  # small rows keep their own scale


@pytest.fixture(scope="module")
def trained_spiked(tmp_path_factory):
    """A tiny baseline trained for a few hundred steps, then given a planted BOS spike in layer 1."""
    from conftest import plant_bos_spike
    from quantgate.calib_data import load_corpus, sample_windows, tokenize_corpus
    from quantgate.formats import load_checkpoint
    from quantgate.train import TrainConfig, train
    out = train(TrainConfig(preset="tiny", gate="none", byte_tokenizer=True, max_chars=400_000, steps=200,
                            batch_size=8, ctx=64, lr=3e-3, warmup=20, threads=2, ckpt_every=1000),
                tmp_path_factory.mktemp("run"))
    loaded = load_checkpoint(out["baseline"])
    model = plant_bos_spike(loaded.model, spike_layer=1, spike_channel=7)
    held_out = tokenize_corpus(load_corpus("embedded", max_chars=3_000_000).split("valid"), loaded.tokenizer)
    calib = sample_windows(held_out, 8, 64, seed=1)
    test = sample_windows(held_out, 16, 64, seed=2)
    return model, calib, test


def test_per_tensor_w8a8_loses_far_more_than_per_token_on_a_bos_spike(trained_spiked):
    m, calib, w = trained_spiked
    ref = logits_of(m, w)
    static = quantize_(copy.deepcopy(m), get("torch", "w8a8-static"), calib_windows=calib)
    dynamic = quantize_(copy.deepcopy(m), get("torch", "w8a8-dynamic"))
    sink = quantize_(copy.deepcopy(m), get("torch", "w8a8-static-sink"), calib_windows=calib)
    e_static, e_dyn, e_sink = (logit_errors(ref, logits_of(q, w)) for q in (static, dynamic, sink))
    assert e_static["kld_mean"] > 10 * e_dyn["kld_mean"]
    p_ref = ppl(ref, w)
    d_static = ppl(logits_of(static, w), w) / p_ref - 1
    d_dyn = ppl(logits_of(dynamic, w), w) / p_ref - 1
    assert d_static > 0.02 and d_static > 10 * abs(d_dyn)  # per-tensor W8A8 loses perplexity; per-token barely
    # keeping BOS in float and out of calibration removes most of the static loss
    assert e_sink["kld_mean"] < e_static["kld_mean"] / 10
    assert e_dyn["top1_agreement"] > e_static["top1_agreement"]


def test_calibrated_range_comes_from_the_spike():
    m = planted_model(gate="none", spike_layer=1, spike_channel=7)
    w = windows(4, 32)
    q = quantize_(copy.deepcopy(m), get("torch", "w8a8-static"), calib_windows=w)
    down = q.layers[1].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.act_range.hi > 1e4
    qs = quantize_(copy.deepcopy(m), get("torch", "w8a8-static-sink"), calib_windows=w)
    assert qs.layers[1].mlp.down_proj.act_range.hi < 1.0  # without BOS the unit is silent
    # the spike is 4 of 4 x 64 x 256 inputs (0.006%): the 99.99th percentile of them all lies below it
    qp = quantize_(copy.deepcopy(m), get("torch", "w8a8-static-pct"), calib_windows=windows(4, 64))
    assert qp.layers[1].mlp.down_proj.act_range.hi < down.act_range.hi / 10


@pytest.mark.parametrize("scope", ["gate", "q_and_gate"])
def test_gate_aware_scheme_keeps_gate_rows_at_8_bits(scope):
    m = build_model(preset("tiny", gate="elementwise"), seed=0)
    name = "w4a16-g32-gate8" if scope == "gate" else "w4a16-g32-qgate8"
    orig = {n: l.weight.detach().clone() for n, l in block_linears(m).items()}
    quantize_(m, get("torch", name))
    for n, lin in block_linears(m).items():
        w = lin.weight.detach()
        expect8 = n.endswith("g_proj") or (scope == "q_and_gate" and n.endswith("q_proj"))
        assert lin.weight_bits == (8 if expect8 else 4)
        assert torch.equal(w, quantize_weight(orig[n], 8 if expect8 else 4, 32)), n
        groups = (w.reshape(w.shape[0], -1, 32) / (orig[n].reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True)
                                                   / (127 if expect8 else 7)))
        levels = len(torch.unique(groups.round()))
        assert levels > 16 if expect8 else levels <= 16


def test_bad_scheme_inputs():
    with pytest.raises(QuantgateError, match="unknown scheme"):
        get("torch", "w3a7-magic", "scheme")
    m = build_model(preset("tiny"), seed=0)
    with pytest.raises(QuantgateError, match="no attention gate"):
        quantize_(m, get("torch", "w4a16-g32-gate8"))
    with pytest.raises(QuantgateError, match="calibration"):
        quantize_(m, get("torch", "w8a8-static"), calib_windows=np.zeros((0, 16), dtype=np.int64))
    with pytest.raises(QuantgateError, match="layers.0.self_attn.q_proj: group size 48 does not divide"):
        quantize_(build_model(preset("tiny"), seed=0), get("torch", "w4a16-g32", group_size=48))


def test_every_named_scheme_runs_and_stays_close_on_a_random_model():
    m = build_model(preset("tiny", gate="elementwise", vocab_size=64, dim=128, head_dim=32), seed=0).eval()
    w = windows(4, 32)
    ref = logits_of(m, w)
    for name in [sch.name for sch in TORCH_SCHEMES]:
        q = quantize_(copy.deepcopy(m), get("torch", name), calib_windows=w)
        e = logit_errors(ref, logits_of(q, w))
        assert e["top1_agreement"] > 0.8 and e["kld_mean"] < 0.05, (name, e)
        assert q.cfg.extra["quant_scheme"]["name"] == name


def test_gptq_beats_rtn_on_strongly_correlated_inputs():
    from quantgate.quant.gptq import gptq_quantize, input_hessian
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(8, 128, generator=g)
    draw = lambda n: torch.randn(n, 8, generator=g) @ mix + 0.05 * torch.randn(n, 128, generator=g)  # noqa: E731
    x, test_x = draw(4096), draw(1024)  # inputs of rank ~8 plus a little noise; held-out rows for the error
    w = torch.randn(64, 128, generator=g)
    H = input_hessian(x)
    for bits, group in ((4, 32), (4, None), (3, 32)):
        rtn, gptq = quantize_weight(w, bits, group), gptq_quantize(w, H, bits, group)
        err = lambda q: float(((test_x @ (w - q).T) ** 2).mean())  # noqa: E731
        assert err(gptq) < 0.5 * err(rtn), (bits, group, err(gptq), err(rtn))


def test_gptq_scheme_runs_through_quantize_():
    m = build_model(preset("tiny", vocab_size=64), seed=0).eval()
    w = windows(4, 32)
    ref = logits_of(m, w)
    q = quantize_(copy.deepcopy(m), get("torch", "gptq-w4a16-g32"), calib_windows=w)
    r = quantize_(copy.deepcopy(m), get("torch", "w4a16-g32"))
    assert logit_errors(ref, logits_of(q, w))["kld_mean"] < logit_errors(ref, logits_of(r, w))["kld_mean"]
    with pytest.raises(QuantgateError, match="calibration"):
        quantize_(copy.deepcopy(m), get("torch", "gptq-w4a16-g32"))


@pytest.fixture(scope="module")
def twin_dirs(tmp_path_factory):
    from quantgate.train import TrainConfig, train
    return train(TrainConfig(preset="tiny", twins=True, byte_tokenizer=True, max_chars=400_000, steps=30,
                             batch_size=4, ctx=64, warmup=5, threads=2, ckpt_every=1000),
                 tmp_path_factory.mktemp("twins"))


def test_quantize_cli_writes_a_checkpoint_that_reloads_with_its_scheme(tmp_path, twin_dirs):
    import json

    from conftest import run_cli
    from quantgate.formats import load_checkpoint
    env = {"QUANTGATE_CACHE": str(tmp_path / "cache")}
    src = twin_dirs["gated"]
    r = run_cli("quantize", str(src), "--scheme", "w8a8-static-sink", "--out", str(tmp_path / "q"),
                "--calib-windows", "4", "--ctx", "64", env=env)
    assert r.returncode == 0, r.stderr
    loaded = load_checkpoint(tmp_path / "q")
    down = loaded.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.act == "static" and down.skip_first_position
    assert loaded.model.cfg.extra["quant_scheme"]["name"] == "w8a8-static-sink"
    import transformers  # stock tools still open it (as a plain model with rounded weights)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 300)
    e = run_cli("eval", str(tmp_path / "q"), "--reference", str(src), "--data", str(text), "--ctx", "64", "--json",
                env=env)
    assert e.returncode == 0, e.stderr
    res = json.loads(e.stdout)
    assert 0 < res["kld_mean"] < 0.1 and 0.5 < res["top1_agreement"] <= 1.0  # quantized: KLD > 0
    assert res["delta_ppl"] == pytest.approx(res["ppl"] - res["reference_ppl"])
    sq = res["layer_sqnr_db"]["layers.0.mlp.down_proj"]
    assert 10 < sq["input_db"] < 120 and 10 < sq["output_db"] < 120
    assert len(list((tmp_path / "cache").glob("ref-hidden-*.npy"))) == 1
    again = run_cli("eval", str(tmp_path / "q"), "--reference", str(src), "--data", str(text), "--ctx", "64",
                    "--json", env=env)
    assert json.loads(again.stdout)["kld_mean"] == res["kld_mean"]  # the cached reference gives the same answer
    same = run_cli("eval", str(src), "--reference", str(src), "--data", str(text), "--ctx", "64", "--json", env=env)
    assert json.loads(same.stdout)["kld_mean"] == pytest.approx(0, abs=1e-9)
    assert json.loads(same.stdout)["top1_agreement"] == 1.0 and "layer_sqnr_db" not in json.loads(same.stdout)


@pytest.mark.parametrize("args,needle", [
    (["--scheme", "w3a7-magic"], "unknown scheme"),
    (["--scheme", "w4a16-g32-gate8", "--model-role", "baseline"], "no attention gate"),
    (["--scheme", "w8a8-static", "--calib-data", "EMPTY"], "empty"),
])
def test_quantize_cli_bad_inputs(tmp_path, twin_dirs, args, needle):
    from conftest import dir_snapshot, run_cli
    role = "gated"
    if "--model-role" in args:
        role = args[args.index("--model-role") + 1]
        args = args[:args.index("--model-role")]
    if "EMPTY" in args:
        (tmp_path / "empty.txt").write_text("")
        args = [str(tmp_path / "empty.txt") if a == "EMPTY" else a for a in args]
    before = dir_snapshot(twin_dirs[role])
    r = run_cli("quantize", str(twin_dirs[role]), *args, "--out", str(tmp_path / "q"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q").exists() and dir_snapshot(twin_dirs[role]) == before


def test_smoothquant_keeps_the_float_function_and_flattens_activations():
    from quantgate.quant.smoothquant import channel_absmax, smooth_
    m = build_model(preset("tiny", gate="elementwise", vocab_size=64), seed=0).eval()
    w = windows(4, 32)
    with torch.no_grad():  # an outlier channel in every token's normed input, as in real LLMs
        m.layers[0].input_layernorm.weight[5] = 40.0
    ref = logits_of(m, w)
    spread = lambda a: float(a.max() / a.median())  # noqa: E731
    before = channel_absmax(m, w)["layers.0.input_layernorm"]
    s = smooth_(copy.deepcopy(m), w, alpha=0.5)
    assert np.allclose(logits_of(s, w), ref, rtol=1e-4, atol=1e-4)
    after = channel_absmax(s, w)["layers.0.input_layernorm"]
    assert spread(after) < spread(before) / 3
    q = quantize_(copy.deepcopy(m), get("torch", "w8a8-smoothquant"), calib_windows=w)
    plain = quantize_(copy.deepcopy(m), get("torch", "w8a8-static"), calib_windows=w)
    assert q.cfg.extra["quant_scheme"]["smooth_alpha"] == 0.5
    assert logit_errors(ref, logits_of(q, w))["kld_mean"] < logit_errors(ref, logits_of(plain, w))["kld_mean"]


def test_kv_cache_quantization():
    m = build_model(preset("tiny", gate="elementwise", vocab_size=64), seed=0).eval()
    w = windows(4, 32)
    ref = logits_of(m, w)
    q8 = quantize_(copy.deepcopy(m), get("torch", "kv-int8"))
    q4 = quantize_(copy.deepcopy(m), get("torch", "kv-int4"))
    assert isinstance(q8.layers[0].self_attn.q_proj, torch.nn.Linear)  # weights untouched
    assert not isinstance(q8.layers[0].self_attn.q_proj, QuantLinear)
    e8, e4 = (logit_errors(ref, TorchRunner(q).logits(w))["kld_mean"] for q in (q8, q4))  # runs use the scheme's
    assert 0 < e8 < e4
    # rounding is per token, so a cached decode sees exactly what a full forward sees
    idx = torch.as_tensor(w[:1])
    with torch.inference_mode():
        full = q4(idx, kv_bits=4).logits
        pre = q4(idx[:, :20], past=None, start_pos=0, return_hidden=True, kv_bits=4)
        step = q4(idx[:, 20:21], past=pre.past, start_pos=20, kv_bits=4)
    assert torch.allclose(step.logits, full[:, 20:21], atol=1e-5)


def test_layer_sqnr_points_at_the_spiked_layer():
    from quantgate.metrics import layer_sqnr
    m = planted_model(gate="none", spike_layer=1, spike_channel=7)
    w = windows(4, 32)
    q = quantize_(copy.deepcopy(m), get("torch", "w8a8-static"), calib_windows=w)
    s = layer_sqnr(m, q, w)
    worst = min(s, key=lambda n: s[n]["input_db"])  # every input is quantized under W8A8
    assert worst == "layers.1.mlp.down_proj"  # its range is set by the BOS spike
    assert s[worst]["input_db"] < s["layers.0.mlp.down_proj"]["input_db"] - 10
    w8 = layer_sqnr(m, quantize_(copy.deepcopy(m), get("torch", "w8a16")), w)
    w4 = layer_sqnr(m, quantize_(copy.deepcopy(m), get("torch", "w4a16-g32")), w)
    assert w8["layers.0.self_attn.q_proj"]["input_db"] is None  # weight-only: inputs untouched
    assert w8["layers.0.mlp.up_proj"]["output_db"] > w4["layers.0.mlp.up_proj"]["output_db"] + 15  # ~6 dB/bit


def test_attribution_finds_the_spiked_down_proj():
    from quantgate.attribution import attribute_error
    m = planted_model(gate="none", spike_layer=1, spike_channel=7)
    w = windows(4, 32)
    rep = attribute_error(m, get("torch", "w8a8-static"), w, w)
    assert max(rep["groups_share"], key=rep["groups_share"].get) == "down_proj"
    assert max(rep["layers_share"], key=rep["layers_share"].get) == "1"
    assert max(rep["cells_share"], key=rep["cells_share"].get) == "1.down_proj"
    assert rep["cells_share"]["1.down_proj"] > 0.5
    assert sum(rep["groups_share"].values()) == pytest.approx(1.0)
    with pytest.raises(QuantgateError, match="nothing to attribute"):
        attribute_error(m, get("torch", "kv-int8"), None, w)


def test_attribute_cli(tmp_path, twin_dirs):
    import json

    from conftest import run_cli
    text = tmp_path / "t.txt"
    text.write_text("class A:\n    def f(self, x):\n        return [x] * 3\n" * 200)
    r = run_cli("attribute", str(twin_dirs["gated"]), "--scheme", "w8a8-static", "--data", str(text),
                "--windows", "4", "--calib-windows", "4", "--ctx", "64", "--json", str(tmp_path / "a.json"))
    assert r.returncode == 0, r.stderr
    assert "group down_proj" in r.stdout
    rep = json.loads((tmp_path / "a.json").read_text())
    assert set(rep["groups"]) == {"qkv_gate", "o_proj", "gate_up", "down_proj"} and len(rep["layers"]) == 2
    assert rep["kld_all"] > 0 and sum(rep["layers_share"].values()) == pytest.approx(1.0)
