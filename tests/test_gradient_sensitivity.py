"""The allocator's gradient and calibrated sensitivities (quantgate.quant.gradient, issue 50): the streamed
block-by-block Fisher equals the whole model's squared per-window gradient in the GGUF's own layout, its KLD
predictions track measured KLD, the calibrated kind equals the measurement where it measured, and quantize writes
files from both."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import randomize_, run_cli


def _gguf(d, cfg, seed: int = 0):
    from quantgate.export.gguf import export_checkpoint
    from quantgate.formats import save_checkpoint
    from quantgate.model import build_model
    from quantgate.tokenizer import byte_tokenizer
    m = build_model(cfg, seed=seed).eval()
    randomize_(m, seed, std=0.08)
    save_checkpoint(m, d / "m", byte_tokenizer())
    export_checkpoint(d / "m", d / "m.gguf", "f32")
    return d / "m.gguf"


def _configs():
    from quantgate.model import hybrid, preset
    return {"baseline, untied": preset("tiny", vocab_size=300, n_layers=2, tie_embeddings=False),
            "gated, tied": preset("tiny", vocab_size=300, n_layers=2, gate="elementwise"),
            "hybrid gated": hybrid(preset("tiny", vocab_size=300, n_layers=4, gate="elementwise",
                                          tie_embeddings=False))}


@pytest.mark.parametrize("which", list(_configs()))
def test_the_streamed_fisher_is_the_whole_models_squared_gradient_in_the_files_layout(tmp_path, which):
    """Independent check: the in-memory model (loaded from the same GGUF), one autograd backward per window of the
    same labels' log-likelihood, squared and summed, taken to GGUF names and layout by the exporter's own tensor
    map (gguf_tensors: permutations and fusions, which commute with squaring). The streamed pass (block by block,
    GGUF tensors as leaves, head a vocabulary slice at a time) must give the same Fisher for every unit."""
    from quantgate.export.gguf import gguf_tensors
    from quantgate.formats.gguf import load_gguf_model
    from quantgate.quant import gradient
    from quantgate.quant.allocate import units_of
    src = _gguf(tmp_path, _configs()[which])
    loaded = load_gguf_model(src)
    model, cfg = loaded.model, loaded.model.cfg
    rng = np.random.default_rng(1)
    windows = rng.integers(3, 300, size=(3, 24))
    windows[:, 0] = cfg.bos_id
    labels = rng.integers(0, 300, size=windows.shape)
    units = units_of(src)
    old = gradient.VOCAB_SLICE
    gradient.VOCAB_SLICE = 128  # three slices of the 300-row head: the slicing is exercised
    try:
        got = gradient.fisher_rows(src, units, windows, labels=labels, batch=2).by_unit
    finally:
        gradient.VOCAB_SLICE = old
    params = dict(model.named_parameters())
    ref = {n: torch.zeros_like(p) for n, p in params.items()}
    for w in range(len(windows)):
        model.zero_grad()
        logp = torch.log_softmax(model(torch.as_tensor(windows[w:w + 1])).logits[0], -1)
        logp[torch.arange(windows.shape[1]), torch.as_tensor(labels[w])].sum().backward()
        for n, p in params.items():
            ref[n] += p.grad.detach() ** 2
    if cfg.tie_embeddings:
        ref["lm_head.weight"] = ref["embed_tokens.weight"]
    ref_gguf = dict(gguf_tensors(cfg, ref))
    # an all-attention qwen35 file carries llama.cpp's identity recurrent layer, which no output depends on: no Fisher
    inert = [u for u in units if u.name not in ref_gguf]
    assert all(u.name.startswith(f"blk.{cfg.n_layers}.") for u in inert) and not set(got) & {u.name for u in inert}
    assert set(got) == {u.name for u in units} - {u.name for u in inert}
    for u in (u for u in units if u.name in ref_gguf):
        want = ref_gguf[u.name].reshape(-1, u.row).numpy()
        rows, f, scale = got[u.name]
        dense = np.zeros_like(want)
        dense[rows] = f
        assert np.all(scale == 1)  # tiny tensors keep every row with a gradient
        np.testing.assert_allclose(dense, want, rtol=2e-4, atol=2e-6 * want.max(), err_msg=u.name)


def test_rows_drawn_by_fisher_mass_give_an_unbiased_total():
    """A large tensor is represented by rows drawn in proportion to their mass, each weighted 1/(k p): the mean of
    many such estimates is the exact weighted total; a row without mass is never drawn."""
    from quantgate.quant.gradient import pick_rows
    rng = np.random.default_rng(0)
    mass = rng.gamma(0.3, size=2000) * (rng.random(2000) > 0.4)
    err = mass * rng.uniform(0.5, 2.0, size=2000)  # a weighted error roughly in proportion to the mass
    est = []
    for _ in range(400):
        idx, scale = pick_rows(mass, rng, rows=64)
        assert mass[idx].min() > 0 and len(idx) == 64
        est.append(float((err[idx] * scale).sum()))
    assert np.mean(est) == pytest.approx(err.sum(), rel=0.02)
    assert np.std(est) / err.sum() < 0.1  # spent where the mass is, the draw is tight
    idx, scale = pick_rows(mass, rng, rows=64, keep_all=True)
    assert set(idx) == set(np.flatnonzero(mass > 0)) and np.all(scale == 1)


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory):
    """A small gated model whose rows take llama.cpp's k-quants (random weights, large enough that its outputs are
    far from uniform)."""
    from quantgate.model import preset
    d = tmp_path_factory.mktemp("grad")
    return _gguf(d, preset("tiny", vocab_size=300, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                           n_layers=2, gate="elementwise", tie_embeddings=False), seed=3)


KW = dict(calib_data="embedded", n_windows=4, ctx=64, seed=0)


@pytest.mark.slow
def test_the_gradient_predicts_measured_kld_tensor_by_tensor(k_quant_gguf, tmp_path, monkeypatch):
    """Per (tensor, type), the Fisher's predicted KLD increase ranks as llama.cpp's measured one does and is of its
    size: Spearman's rho over pairs above 0.8 and the median ratio within 2x (120 measured probes: slow)."""
    from quantgate.quant.allocate import gradient_sensitivity, measure_sensitivity, units_of
    monkeypatch.setenv("QUANTGATE_CACHE", str(tmp_path / "cache"))
    units = units_of(k_quant_gguf)
    g = gradient_sensitivity(k_quant_gguf, units, **KW)
    m = measure_sensitivity(k_quant_gguf, units, **KW, work=tmp_path)
    assert g.kind == "gradient" and g.in_kld and g.base_kld > 0
    pairs = [(m.delta[n][t], g.delta[n][t]) for n in m.delta for t in m.delta[n] if t != "Q8_0"]
    a, b = np.array(pairs).T
    rho = np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1]
    ratio = float(np.median(b[a > 0] / a[a > 0]))
    assert rho > 0.8 and 0.5 < ratio < 2.0, (rho, ratio)


def test_the_gradient_sensitivity_is_cached_by_content(k_quant_gguf, tmp_path, monkeypatch):
    from quantgate.quant.allocate import gradient_sensitivity, units_of
    monkeypatch.setenv("QUANTGATE_CACHE", str(tmp_path / "cache"))
    units = units_of(k_quant_gguf)
    g = gradient_sensitivity(k_quant_gguf, units, **KW)
    assert g.kind == "gradient" and g.in_kld and g.base_kld > 0
    assert all(d["Q2_K"] > d["Q4_K"] > d["Q6_K"] > 0 for d in g.delta.values() if d["Q2_K"] > 0)
    files = list((tmp_path / "cache").glob("sens-*.json"))
    again = gradient_sensitivity(k_quant_gguf, units, **KW)  # read back: the same numbers
    assert again.delta == g.delta and len(files) == 1
    other = gradient_sensitivity(k_quant_gguf, units, **{**KW, "seed": 1})  # other windows: computed anew
    assert other.delta != g.delta and len(list((tmp_path / "cache").glob("sens-*.json"))) == 2


@pytest.mark.slow  # moved out of the default step (its 25-minute limit); CI's slow step runs it
def test_the_calibrated_sensitivity_is_the_measurement_where_it_measured(k_quant_gguf, tmp_path, monkeypatch):
    """One probe per tensor at Q4_K (the bulk of a Q4_K_M file): its delta there is what the measured sensitivity gives
    for that tensor and type (measured here on Q4_K alone), its other types keep the gradient's ratios, the base
    KLD is measured."""
    from quantgate.quant.allocate import (calibrated_sensitivity, gradient_sensitivity, measure_sensitivity,
                                          units_of)
    monkeypatch.setenv("QUANTGATE_CACHE", str(tmp_path / "cache"))
    units = units_of(k_quant_gguf)
    g = gradient_sensitivity(k_quant_gguf, units, **KW)
    c = calibrated_sensitivity(k_quant_gguf, units, g, **KW, work=tmp_path)
    m = measure_sensitivity(k_quant_gguf, units_of(k_quant_gguf, ("Q4_K",)), **KW, work=tmp_path)
    assert c.kind == "calibrated" and c.base_kld == pytest.approx(m.base_kld, rel=1e-9)
    assert set(c.probe) == set(m.delta)
    scaled = 0
    for n, (t, measured) in c.probe.items():
        assert t == "Q4_K" and measured == pytest.approx(m.delta[n][t], rel=1e-9, abs=1e-15)
        if measured > 0 and g.delta[n][t] > 0:
            assert c.delta[n][t] == pytest.approx(measured, rel=1e-9)
            scaled += 1
        if g.delta[n]["Q2_K"] > 0:
            s = c.delta[n]["Q2_K"] / g.delta[n]["Q2_K"]
            assert c.delta[n]["Q6_K"] == pytest.approx(s * g.delta[n]["Q6_K"], rel=1e-9)
    assert scaled >= len(c.probe) // 2


@pytest.mark.parametrize("kind", ["gradient", "calibrated"])
def test_quantize_with_a_gradient_sensitivity_writes_a_file_within_the_budget(k_quant_gguf, tmp_path, kind):
    from gguf import GGUFReader

    from quantgate.formats import inspect_gguf
    out = tmp_path / f"{kind}.gguf"
    r = run_cli("quantize", k_quant_gguf, "--target-bpw", "5", "--sensitivity", kind, "--calib-windows", "4",
                "--ctx", "64", "--decode-floor", "none", "--out", out, "--json", env={"QUANTGATE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert s["sensitivity_kind"] == kind and s["predicted_kld"] > 0
    info = inspect_gguf(out)
    assert info.bits_per_weight <= 5.0 and all(info.tensor_types[n] == t for n, t in s["types"].items())
    assert len(set(s["types"].values())) >= 2
    assert GGUFReader(out).fields["quantgate.allocation.sensitivity"].contents() == kind


def test_auto_takes_the_best_sensitivity_its_time_budget_holds():
    from quantgate.quant.allocate import choose_sensitivity
    pred = {"measured": 900.0, "calibrated": 200.0, "gradient": 50.0}
    per = lambda n: 10.0 * n  # noqa: E731  the gradient's seconds on n windows
    assert choose_sensitivity(pred, per, 5, 1000) == ("measured", 5)
    assert choose_sensitivity(pred, per, 5, 300) == ("calibrated", 5)
    assert choose_sensitivity(pred, per, 5, 60) == ("gradient", 5)
    assert choose_sensitivity(pred, per, 5, 35) == ("gradient", 3)  # fewer windows where all of them do not fit
    assert choose_sensitivity(pred, per, 5, 5) == ("proxy", 5)


@pytest.mark.parametrize("bad", ["0", "-3", "x", "nanx", "0x", "inf"])
def test_a_bad_sensitivity_time_is_one_line(k_quant_gguf, tmp_path, bad):
    r = run_cli("quantize", k_quant_gguf, "--target-bpw", "5", "--sensitivity-time", bad, "--out", tmp_path / "a.gguf")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--sensitivity-time" in lines[0], r.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_the_default_time_budget_is_half_a_plain_quantize_and_at_least_two_minutes():
    from quantgate.quant.allocate import auto_budget
    assert auto_budget(None, None, 1.0) == 120 and auto_budget(None, None, 600.0) == 300
    assert auto_budget(None, 0.5, 1.0) == 0.5 and auto_budget(30.0, None, 600.0) == 30


def test_auto_says_what_it_chose_and_why(k_quant_gguf, tmp_path):
    """auto on a small model with 30 s: a KLD-based sensitivity predicted within them, the choice and each
    candidate's predicted seconds in the summary and the file's metadata; a budget of a millisecond leaves the
    proxy."""
    from gguf import GGUFReader
    env = {"QUANTGATE_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "auto.gguf"
    r = run_cli("quantize", k_quant_gguf, "--target-bpw", "5", "--calib-windows", "4", "--ctx", "64", "--out", out,
                "--sensitivity-time", "30", "--decode-floor", "none", "--json", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    auto = s["sensitivity_auto"]
    assert auto["chose"] == s["sensitivity_kind"] != "proxy" and auto["budget_s"] == 30
    assert auto["predicted_s"][auto["chose"]] <= auto["budget_s"]
    assert set(auto["predicted_s"]) == {"measured", "calibrated", "gradient"}
    assert auto["predicted_s"]["measured"] > auto["predicted_s"]["calibrated"] > auto["predicted_s"]["gradient"]
    meta = GGUFReader(out).fields
    assert meta["quantgate.allocation.sensitivity"].contents() == s["sensitivity_kind"]
    assert meta["quantgate.allocation.sensitivity_auto"].contents().startswith(f"auto: {auto['chose']}")
    quick = run_cli("quantize", k_quant_gguf, "--target-bpw", "5", "--sensitivity-time", "0.001", "--out",
                    tmp_path / "quick.gguf", "--json", env=env)  # the default floor too is off at that budget
    assert quick.returncode == 0, quick.stderr[-2000:]
    assert json.loads(quick.stdout)["sensitivity_kind"] == "proxy"


def test_the_default_floor_is_the_standard_type_the_budget_names(k_quant_gguf, tmp_path):
    """With nothing but a budget, the file is held to 1x the largest standard type whose own tensors fit it (the
    file it would be compared with), and says so; where no standard type fits, no floor, and the file says why."""
    from gguf import GGUFReader

    from quantgate.formats.gguf import open_reader
    from quantgate.quant.allocate import FLOOR_STANDARD
    env = {"QUANTGATE_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "d.gguf"
    r = run_cli("quantize", k_quant_gguf, "--target-bpw", "5", "--sensitivity", "gradient", "--calib-windows", "2",
                "--ctx", "32", "--out", out, "--json", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    auto, sizes = s["decode_floor_auto"], s["decode_floor_auto"]["standard_unit_bytes"]
    tensors = open_reader(k_quant_gguf).tensors
    total = sum(int(np.prod([int(d) for d in t.shape])) for t in tensors)
    budget = int(5 * total / 8) - sum(int(t.n_bytes) for t in tensors if t.name not in s["types"])  # budget_from's
    order = [t for t in FLOOR_STANDARD if sizes[t] is not None]
    floor = auto["floor"]
    assert floor in order and s["decode_floor"] == floor and sizes[floor] <= budget
    assert all(sizes[t] > budget for t in order[order.index(floor) + 1:])  # the largest that fits
    assert s["floor_recipe"] == floor or s["floor_checks"][-1]["met"]  # met by a file or by the type's own recipe
    meta = GGUFReader(out).fields["quantgate.allocation.decode_floor"].contents()
    assert meta.startswith(f"auto: {floor}")
    assert not list(tmp_path.glob(".quantgate-*"))  # the standard files written to learn their sizes are gone
    low = run_cli("quantize", k_quant_gguf, "--target-bpw", "3.2", "--sensitivity", "gradient", "--calib-windows",
                  "2", "--ctx", "32", "--out", tmp_path / "low.gguf", "--json", env=env)
    assert low.returncode == 0, low.stderr[-2000:]
    lo = json.loads(low.stdout)
    assert lo["decode_floor_auto"]["floor"] is None and "no standard type" in lo["decode_floor_auto"]["why"]
    assert "decode_cost" not in lo
    assert GGUFReader(tmp_path / "low.gguf").fields["quantgate.allocation.decode_floor"].contents().startswith("auto off")
