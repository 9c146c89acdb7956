"""A quantized KV cache as an ONNX Runtime run option: the same rounding as PyTorch's runner, prefill and cached
decode alike; the export on disk untouched; the GroupQueryAttention graph refused."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from conftest import randomize_, run_cli
from quantgate.errors import QuantgateError
from quantgate.export.onnx import export_checkpoint
from quantgate.formats import save_checkpoint
from quantgate.metrics import position_kld
from quantgate.model import build_model, preset
from quantgate.runners import OrtRunner, TorchRunner
from quantgate.tokenizer import byte_tokenizer

W = np.array([[0] + list(range(3, 30)), [0] + list(range(299, 272, -1))], dtype=np.int64)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    d = tmp_path_factory.mktemp("ortkv")
    m = build_model(preset("tiny", vocab_size=300, gate="elementwise"), seed=0).eval()
    randomize_(m)
    save_checkpoint(m, d / "m", byte_tokenizer())
    export_checkpoint(d / "m", d / "onnx")
    export_checkpoint(d / "m", d / "gqa", graph="gqa")
    return d, m


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("bits", [8, 4])
def test_ort_kv_cache_rounds_as_torch_does(export, bits):
    d, m = export
    before = _digest(d / "onnx")
    ref = TorchRunner(m, kv_bits=bits).logits(W)
    flt = TorchRunner(m).logits(W)
    with OrtRunner(d / "onnx", kv_bits=bits) as r:
        got = r.logits(W)
        lg0, past = r.step(W[:, :20], r._empty_past(2), 0)
        lg1, past = r.step(W[:, 20:21], past, 20)
        lg2, _ = r.step(W[:, 21:], past, 21)
        assert "KV int" in r.name
    # The same rounding, except where a value sits on a rounding boundary: ORT's and torch's k then differ by an
    # ulp, round to neighbouring levels, and the key's position and those after it differ by one level (seen at
    # int8: 12% of positions, all after one flip). So: most positions equal, and what differs is a thousandth of
    # what the quantized cache itself costs.
    cost = position_kld(flt, ref).mean()
    assert cost > 0  # the rounding really happened
    for lg in (got, np.concatenate([lg0, lg1, lg2], axis=1)):
        same = np.abs(lg - ref).max(-1) <= 1e-5 * np.abs(ref).max()
        assert same.mean() >= 0.75 and same[:, :8].all()
        assert position_kld(ref, lg).mean() <= 1e-3 * cost
    assert _digest(d / "onnx") == before


def test_bad_kv_options_are_refused(export):
    d, _ = export
    with pytest.raises(QuantgateError, match="needs the standard graph"):
        OrtRunner(d / "gqa", kv_bits=8)
    with pytest.raises(QuantgateError, match="KV-cache bits must be one of"):
        OrtRunner(d / "onnx", kv_bits=3)


def test_kv_type_is_one_option_on_every_backend(export, tmp_path):
    d, _ = export
    (tmp_path / "t.txt").write_text("def f(x):\n    return x * 2\n" * 200)
    r = run_cli("eval", str(d / "onnx"), "--data", str(tmp_path / "t.txt"), "--ctx", "32", "--max-windows", "4",
                "--reference", str(d / "m"), "--kv-type", "int4", "--json")
    assert r.returncode == 0, r.stderr[-1500:]
    out = json.loads(r.stdout)
    assert out["kv_cache"] == "int4" and out["kld_mean"] > 0
    r = run_cli("generate", str(d / "m"), "--prompt", "def", "--max-tokens", "4", "--kv-type", "q8_0")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
    assert "llama.cpp cache type" in r.stderr and "int8 or int4" in r.stderr
