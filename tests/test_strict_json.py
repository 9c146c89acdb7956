"""Every JSON quantgate writes is strict: a non-finite number (the kurtosis of a constant input) is null, never the
bare NaN that Python's json module writes and other parsers reject."""
from __future__ import annotations

import json
import math

import numpy as np
import torch

from conftest import run_cli
from quantgate.formats import save_checkpoint
from quantgate.fsio import strict_json, write_json
from quantgate.model import build_model, preset
from quantgate.tokenizer import byte_tokenizer


def _strict_load(text: str):
    def refuse(c):
        raise ValueError(f"non-strict JSON constant {c}")
    return json.loads(text, parse_constant=refuse)


def test_strict_json_nulls_every_non_finite_number(tmp_path):
    obj = {"a": float("nan"), "b": [1.0, float("inf"), {"c": np.float32("nan"), "d": np.float64(2.5)}],
           "e": (float("-inf"), 3), "f": "NaN"}
    assert strict_json(obj) == {"a": None, "b": [1.0, None, {"c": None, "d": 2.5}], "e": [None, 3], "f": "NaN"}
    write_json(tmp_path / "x.json", obj)
    assert _strict_load((tmp_path / "x.json").read_text())["b"][2] == {"c": None, "d": 2.5}


def test_analyze_json_of_a_constant_input_is_strict(tmp_path):
    """A zero input-norm weight makes the first block's q|k|v input constant: its kurtosis is NaN."""
    m = build_model(preset("tiny", vocab_size=300), seed=0)
    with torch.no_grad():
        m.layers[0].input_layernorm.weight.zero_()
    save_checkpoint(m, tmp_path / "m", byte_tokenizer())
    (tmp_path / "t.txt").write_text("def f(x):\n    return x * 2\n" * 200)
    out = tmp_path / "a.json"
    r = run_cli("analyze", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt"), "--ctx", "32", "--windows", "2",
                "--json", str(out))
    assert r.returncode == 0, r.stderr[-1500:]
    text = out.read_text()
    rep = _strict_load(text)
    assert "NaN" not in text and "Infinity" not in text

    def values(o):
        if isinstance(o, dict):
            for v in o.values():
                yield from values(v)
        elif isinstance(o, list):
            for v in o:
                yield from values(v)
        else:
            yield o
    first = next(iter(rep["reports"].values()))["linear_inputs"]["layers.0.self_attn.q_proj"]
    assert first["max_abs"] == 0.0 and first["kurtosis"] is None  # the non-finite kurtosis is there, as null
    assert all(not isinstance(v, float) or math.isfinite(v) for v in values(rep))
