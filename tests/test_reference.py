"""The compact reference for KL divergence (quantgate.reference): the reference's final normed hidden states are
stored, its logits recomputed from its own head on access; the cache is capped and evicts; a reference the disk
cannot hold is refused in one line, and a disk that fills while it is written leaves nothing."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import randomize_, run_cli, save_tiny_twins, small_filesystem
from quantgate.formats import load_checkpoint, save_checkpoint
from quantgate.errors import QuantgateError
from quantgate.evaluate import compare_to_reference
from quantgate.model import build_model, hybrid, preset
from quantgate.quant.schemes import get
from quantgate.quant.simulate import quantize_
from quantgate.reference import REFERENCE_WINDOWS, ReferenceLogits, cache_size, reference_logits, stored_size
from quantgate.runners import TorchRunner
from quantgate.tokenizer import byte_tokenizer

WINDOWS = np.random.default_rng(0).integers(3, 300, size=(6, 24))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tied and an untied model (one a hybrid), saved with a byte tokenizer."""
    d = tmp_path_factory.mktemp("ref")
    out = {}
    for name, cfg in (("tied", preset("tiny", vocab_size=300, head_dim=32, tie_embeddings=True)),
                      ("hybrid", hybrid(preset("tiny", vocab_size=300, n_layers=4, head_dim=32,
                                               tie_embeddings=False)))):
        m = build_model(cfg, seed=2).eval()
        randomize_(m, 2, std=0.08)
        save_checkpoint(m, d / name, byte_tokenizer())
        out[name] = (d / name, m)
    return out


@pytest.mark.parametrize("name", ["tied", "hybrid"])
def test_stored_hidden_states_give_the_reference_logits(models, name, tmp_path, monkeypatch):
    path, m = models[name]
    monkeypatch.setenv("QUANTGATE_CACHE", str(tmp_path / "cache"))
    ref = reference_logits(str(path), WINDOWS, "test")
    assert isinstance(ref, ReferenceLogits) and ref.shape == (*WINDOWS.shape, m.cfg.vocab_size) and len(ref) == 6
    # what is stored: fp32 hidden states [N, T, D], D/V of the logits' size
    files = list((tmp_path / "cache").glob("ref-hidden-*.npy"))
    assert len(files) == 1 and files[0].stat().st_size == stored_size(6, 24, m.cfg.dim) == cache_size()
    want = TorchRunner(load_checkpoint(path).model).logits(WINDOWS)
    got = np.asarray(ref)
    assert got.dtype == np.float32 and np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.array_equal(ref[2:4], got[2:4])
    # a second call reads the stored states: the model does not run again
    import quantgate.reference as rf
    monkeypatch.setattr(rf, "_reference_runner", lambda *a, **k: pytest.fail("the reference ran again"))
    again = reference_logits(str(path), WINDOWS, "test")
    assert np.array_equal(np.asarray(again), got)


def test_kld_from_the_stored_reference_equals_the_exact_one(models, tmp_path, monkeypatch):
    """The KLD (and ppl, top-1) of a quantized model against the stored reference equal those against the
    reference's own fp32 logits to within 1e-6 relative (the issue asks for 1e-3)."""
    path, m = models["tied"]
    monkeypatch.setenv("QUANTGATE_CACHE", str(tmp_path / "cache"))
    q = quantize_(load_checkpoint(path).model, get("torch", "w4a16-g32"))
    runner = TorchRunner(q, name="w4")
    exact = compare_to_reference(runner, TorchRunner(load_checkpoint(path).model).logits(WINDOWS), WINDOWS)
    stored = compare_to_reference(runner, reference_logits(str(path), WINDOWS, "test"), WINDOWS)
    assert exact["kld_mean"] > 1e-4  # quantized: a KLD to measure
    for k in ("kld_mean", "kld_p99", "ppl", "reference_ppl"):
        assert stored[k] == pytest.approx(exact[k], rel=1e-6), k
    assert stored["top1_agreement"] == exact["top1_agreement"]


def test_the_cache_is_capped_and_evicts_the_least_recently_used(models, tmp_path, monkeypatch):
    path, m = models["tied"]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "notes.txt").write_text("not quantgate's")  # never removed
    one = stored_size(6, 24, m.cfg.dim)
    monkeypatch.setenv("QUANTGATE_CACHE", str(cache))
    monkeypatch.setenv("QUANTGATE_CACHE_MAX_GB", str(2.5 * one / 1e9))  # room for two references, not three
    for key in ("a", "b"):
        reference_logits(str(path), WINDOWS, key)
    first = sorted(cache.glob("ref-hidden-*.npy"), key=lambda p: p.stat().st_mtime)
    assert len(first) == 2
    reference_logits(str(path), WINDOWS, "a")  # "a" used again: "b" is now the least recently used
    reference_logits(str(path), WINDOWS, "c")
    left = set(cache.glob("ref-hidden-*.npy"))
    assert len(left) == 2 and first[1] not in left and first[0] in left
    assert (cache / "notes.txt").read_text() == "not quantgate's" and cache_size(cache) <= 2.5 * one
    # a reference larger than the cap is refused in one line, nothing evicted
    monkeypatch.setenv("QUANTGATE_CACHE_MAX_GB", str(0.5 * one / 1e9))
    with pytest.raises(QuantgateError, match="cache's cap"):
        reference_logits(str(path), WINDOWS, "d")
    assert set(cache.glob("ref-hidden-*.npy")) == left


def test_a_reference_the_disk_cannot_hold_is_refused_before_it_runs(models, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple
    path, _m = models["tied"]
    monkeypatch.setenv("QUANTGATE_CACHE", str(tmp_path / "cache"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 ** 9, 10 ** 9, 1000))
    with pytest.raises(QuantgateError, match="disk has 0.00 GB free.*--max-windows"):
        reference_logits(str(path), WINDOWS, "test")
    assert not any((tmp_path / "cache").glob("*"))


def test_a_disk_that_fills_while_the_reference_is_written_leaves_nothing(models, tmp_path, monkeypatch):
    """Plain writes on a real full filesystem: an OSError and one line, never a memory map's SIGBUS, and no .tmp."""
    import quantgate.reference as rf
    path, _m = models["hybrid"]
    with small_filesystem(tmp_path / "small", "64k") as fs:
        monkeypatch.setenv("QUANTGATE_CACHE", str(fs))
        monkeypatch.setattr(rf, "make_room", lambda folder, need: None)  # skip the estimate: reach the write
        many = np.random.default_rng(1).integers(3, 300, size=(40, 24))  # 40 x 24 x 64 x 4 = 246 kB
        with pytest.raises(QuantgateError, match="(?i)disk|space"):
            reference_logits(str(path), many, "test")
        assert list(fs.iterdir()) == []


def test_eval_reference_on_a_small_disk_gives_one_line_and_no_debris(tmp_path):
    d = save_tiny_twins(tmp_path / "in")
    with small_filesystem(tmp_path / "small", "64k") as fs:
        r = run_cli("eval", str(d / "gated"), "--reference", str(d / "baseline"), "--data", str(d / "text.txt"),
                    "--ctx", "32", env={"QUANTGATE_CACHE": str(fs / "cache")})
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-1500:]
        assert len(lines) == 1 and lines[0].startswith("error: ") and "disk has" in lines[0], lines
        assert not (fs / "cache").exists() or list((fs / "cache").iterdir()) == []


def test_eval_reference_scores_an_even_spread_of_windows_by_default(tmp_path):
    d = save_tiny_twins(tmp_path / "in")
    text = d / "long.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 1200)  # 32,400 bytes: 1,045 windows of 32
    env = {"QUANTGATE_CACHE": str(tmp_path / "cache")}
    r = run_cli("eval", str(d / "gated"), "--reference", str(d / "baseline"), "--data", str(text), "--ctx", "32",
                "--json", env=env)
    assert r.returncode == 0, r.stderr[-1500:]
    res = json.loads(r.stdout)
    assert res["n_windows"] == REFERENCE_WINDOWS
    assert f"--max-windows {32400 // 31}" in r.stderr and "spread evenly" in r.stderr
    every = run_cli("eval", str(d / "gated"), "--data", str(text), "--ctx", "32", "--json", env=env)
    assert json.loads(every.stdout)["n_windows"] == 32400 // 31  # without a reference: every window, as before
