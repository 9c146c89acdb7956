"""Rope settings read from wherever config.json keeps them (issue 26): transformers 5 writes rope_theta (and partial
rotary) only inside `rope_parameters`; transformers 4 at the top level. A wrong theta is a silent wrong result (exit
0, other logits), so every layout is checked both ways:

- stock transformers 5 models with a non-default theta (and partial rotary), saved by save_pretrained, load here
  with transformers' own logits (run by tests/tf5_reference.py in the transformers-5 interpreter);
- our checkpoint of every layout, its config.json rewritten the way transformers 5 writes it, loads with the same
  logits as the model saved.
Scaled ropes and malformed blocks are refused in one line (tests/bad_inputs/test_values.py)."""
from __future__ import annotations

import dataclasses
import json
import subprocess

import numpy as np
import pytest
import torch

from conftest import randomize_, rel_err
from quantgate.formats import load_checkpoint, save_checkpoint
from quantgate.layouts import read_rope
from quantgate.model import build_model, hybrid, preset
from quantgate.errors import QuantgateError
from test_parity_qwen35 import SCRIPT, TF5, pytestmark as needs_tf5

IDS = np.random.default_rng(1).integers(3, 300, size=(1, 40)).astype(np.int64)
IDS[:, 0] = 0
DENSE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=0,
             eos_token_id=1)
HYBRID = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
              linear_key_head_dim=16, linear_value_head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
              bos_token_id=0, eos_token_id=1, pad_token_id=2)
MOE = dict(HYBRID, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=64)
# name -> (tf5_reference spec, theta, rotary dims of head_dim 16): every theta is off its model_type's default
STOCK = {
    "qwen3": (dict(DENSE, kind="Qwen3", rope_theta=1e6), 1e6, 16),
    "qwen3_next": (dict(DENSE, kind="Qwen3Next", rope_theta=5e5, partial_rotary_factor=0.5,
                        layer_types=["full_attention"] * 2, mlp_only_layers=[0, 1]), 5e5, 8),
    "qwen3_5": (dict(HYBRID, rope_parameters={"rope_type": "default", "rope_theta": 3e5, "partial_rotary_factor": 0.5,
                                              "mrope_section": [2, 1, 1], "mrope_interleaved": True}), 3e5, 8),
    "qwen3_5_moe": (dict(MOE, moe=True, rope_parameters={"rope_type": "default", "rope_theta": 2e4,
                                                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                                         "mrope_interleaved": True}), 2e4, 4),
}


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    d = tmp_path_factory.mktemp("tf5-rope")
    np.save(d / "ids.npy", IDS)
    jobs = []
    for name, (spec, _, _) in STOCK.items():
        (d / f"{name}.json").write_text(json.dumps(spec))
        jobs.append(["make", str(d / f"{name}.json"), str(d / name), str(d / "ids.npy"), str(d / f"{name}.npz")])
    (d / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([TF5, str(SCRIPT), str(d / "jobs.json")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


@needs_tf5
@pytest.mark.parametrize("name", list(STOCK))
def test_transformers5_checkpoints_with_a_non_default_theta_load_with_their_logits(stock, name):
    _, theta, rotary = STOCK[name]
    hf = json.loads((stock / name / "config.json").read_text())
    assert hf["rope_parameters"]["rope_theta"] == theta  # the transformers 5 form ...
    if name in ("qwen3", "qwen3_5", "qwen3_5_moe"):
        assert "rope_theta" not in hf  # ... with nothing at the top level, the case that read the default before
    loaded = load_checkpoint(stock / name)
    cfg = loaded.model.cfg
    assert (cfg.rope_theta, cfg.rotary_dim) == (theta, rotary)
    with torch.no_grad():
        ours = loaded.model(torch.as_tensor(IDS)).logits
    want = np.load(stock / f"{name}.npz")["full"]
    assert rel_err(ours, want) <= 1e-5
    # the check can fail: the model_type's default theta gives other logits on these 40 positions
    default = 1e7 if name.startswith("qwen3_5") else 1e4
    wrong = build_model(dataclasses.replace(cfg, rope_theta=default)).eval()
    wrong.load_state_dict(loaded.model.state_dict())
    with torch.no_grad():
        assert rel_err(wrong(torch.as_tensor(IDS)).logits, want) > 1e-3


def _ours(layout: str):
    tiny = preset("tiny", vocab_size=300, rope_theta=3e5)
    cfg = {"qwen3": dataclasses.replace(tiny, gate="none"), "official": dataclasses.replace(tiny, gate="headwise"),
           "qwen3_next": dataclasses.replace(tiny, gate="elementwise", partial_rotary=0.5),
           "qwen3_5": dataclasses.replace(hybrid(dataclasses.replace(tiny, n_layers=4, gate="elementwise")),
                                          partial_rotary=0.5)}[layout]
    m = build_model(cfg, seed=0).eval()
    randomize_(m, 3)
    return m


def _as_transformers5_writes_it(config: dict) -> dict:
    """Move every rope field into rope_parameters and drop the top-level ones (transformers 5's save_pretrained)."""
    text = config.get("text_config", config)
    rp = dict(text.get("rope_parameters") or {"rope_type": "default"})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in text:
            rp[key] = text.pop(key)
    text.pop("rope_scaling", None)
    text["rope_parameters"] = rp
    return config


@pytest.mark.parametrize("layout", ["qwen3", "official", "qwen3_next", "qwen3_5"])
def test_every_layout_reads_rope_from_rope_parameters(tmp_path, layout):
    m = _ours(layout)
    save_checkpoint(m, tmp_path / "m", layout=layout)
    f = tmp_path / "m" / "config.json"
    f.write_text(json.dumps(_as_transformers5_writes_it(json.loads(f.read_text()))))
    assert "rope_theta" not in json.loads(f.read_text())
    cfg = load_checkpoint(tmp_path / "m").model.cfg
    assert (cfg.rope_theta, cfg.partial_rotary) == (m.cfg.rope_theta, m.cfg.partial_rotary)
    ids = torch.as_tensor(IDS)
    with torch.no_grad():
        assert torch.equal(load_checkpoint(tmp_path / "m").model(ids).logits, m(ids).logits)


def test_rope_fields_follow_transformers5_precedence_or_are_refused():
    assert read_rope({}, "c") == (None, None)
    assert read_rope({"rope_theta": 5e5}, "c") == (5e5, None)
    # the block wins over the top level (transformers 5 writes a stale top-level partial_rotary_factor beside it)
    assert read_rope({"rope_theta": 1e4, "partial_rotary_factor": 0.25,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
                     "c") == (1e6, 0.5)
    assert read_rope({"rope_scaling": {"rope_type": "default"}, "partial_rotary_factor": 0.25}, "c") == (None, 0.25)
    assert read_rope({"rope_scaling": {"rope_type": "default", "rope_theta": 2e5},
                      "rope_parameters": {"rope_theta": 3e5}}, "c") == (2e5, None)  # rope_scaling, when set, first
    for bad, needle in (({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "scaled rope"),
                        ({"rope_scaling": {"type": "longrope"}}, "scaled rope"),
                        ({"rope_parameters": {"rope_type": "ntk-by-parts"}}, "not a rope type quantgate knows"),
                        ({"rope_parameters": {"partial_rotary_factor": 1.5}}, "at most 1"),
                        ({"rope_theta": "1e6", "rope_parameters": {"rope_theta": 1e6}}, "rope_theta must be"),
                        ({"rope_parameters": "default"}, "must be a JSON object")):
        with pytest.raises(QuantgateError, match=needle):
            read_rope(bad, "c")
