"""Qwen3.5 hybrid checkpoints: written as Qwen3_5ForCausalLM and read back exactly (gated twin, and the baseline
as zero gate rows with o_proj doubled), multimodal Qwen3_5ForConditionalGeneration folders read past their vision
tower and MTP head, rope_parameters honoured, and bad hybrid configs refused in one line."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import randomize_, rel_err, run_cli
from quantgate.errors import QuantgateError
from quantgate.formats import load_checkpoint, save_checkpoint
from quantgate.model import build_model, hybrid, make_twins, preset
from quantgate.tokenizer import byte_tokenizer

IDS = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))


def _cfg(r: int = 1, **kw):
    return hybrid(preset("tiny", vocab_size=300, n_layers=4, **kw), value_heads_per_key_head=r)


@pytest.mark.parametrize("r", [1, 2])
def test_gated_hybrid_round_trips_in_the_qwen3_5_layout(tmp_path, r):
    m = build_model(_cfg(r, gate="elementwise"), seed=0).eval()
    randomize_(m)
    save_checkpoint(m, tmp_path / "m", byte_tokenizer())
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"]) == ("qwen3_5_text", ["Qwen3_5ForCausalLM"])
    assert hf["layer_types"] == list(m.cfg.layer_types) and hf["linear_num_value_heads"] == r * hf["linear_num_key_heads"]
    assert hf["rope_parameters"]["rope_theta"] == m.cfg.rope_theta
    sd = load_file(tmp_path / "m" / "model.safetensors")
    ours = m.state_dict()
    # zero-centred norms are stored as w - 1, the GDN's gated norm as it is
    assert torch.equal(sd["model.layers.0.input_layernorm.weight"], ours["layers.0.input_layernorm.weight"] - 1)
    assert torch.equal(sd["model.layers.0.linear_attn.norm.weight"], ours["layers.0.linear_attn.norm.weight"])
    assert "model.layers.0.self_attn.q_proj.weight" not in sd and "model.layers.3.linear_attn.A_log" not in sd
    back = load_checkpoint(tmp_path / "m")
    assert back.layout == "qwen3_5" and back.model.cfg.layer_types == m.cfg.layer_types
    with torch.no_grad():
        assert torch.equal(back.model(IDS).logits, m(IDS).logits)


def test_hybrid_baseline_is_written_with_zero_gate_rows_and_reads_back_gate_free(tmp_path):
    base, gated = make_twins(_cfg(), "elementwise", seed=0)
    randomize_(base, 2)
    save_checkpoint(base, tmp_path / "b", byte_tokenizer())
    sd = load_file(tmp_path / "b" / "model.safetensors")
    q = sd["model.layers.3.self_attn.q_proj.weight"].view(base.cfg.n_heads, 2, base.cfg.head_dim, -1)
    assert q[:, 1].abs().max() == 0  # per head [q_h | gate_h]: the gate rows are zero
    o = base.state_dict()["layers.3.self_attn.o_proj.weight"]
    assert torch.equal(sd["model.layers.3.self_attn.o_proj.weight"], 2 * o)
    # what a stock reader runs (sigmoid(0) = 1/2 on every channel, o_proj doubled) is the baseline's function
    stock = build_model(_cfg(gate="elementwise"), seed=None).eval()
    stock.load_state_dict({**base.state_dict(), "layers.3.self_attn.o_proj.weight": 2 * o,
                           "layers.3.self_attn.g_proj.weight": torch.zeros_like(q[:, 1].reshape(-1, q.shape[-1]))})
    back = load_checkpoint(tmp_path / "b")
    assert back.model.cfg.gate == "none"
    with torch.no_grad():
        ref = base.eval()(IDS).logits
        assert torch.equal(back.model(IDS).logits, ref)
        assert rel_err(stock(IDS).logits, ref) < 1e-6
    # a "gate-free" file whose gate rows are not zero is refused
    sd["model.layers.3.self_attn.q_proj.weight"] = sd["model.layers.3.self_attn.q_proj.weight"] + 1e-3
    save_file(sd, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(QuantgateError, match="gate rows are not zero"):
        load_checkpoint(tmp_path / "b")


def _as_multimodal(src, dst):
    """A Qwen3_5ForConditionalGeneration folder holding src's text model: nested text_config, text weights under
    model.language_model.*, and a (fake) vision tower and MTP head."""
    dst.mkdir()
    hf = json.loads((src / "config.json").read_text())
    tie = hf.pop("tie_word_embeddings")
    top = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": tie,
           "text_config": hf, "vision_config": {"depth": 1}}
    (dst / "config.json").write_text(json.dumps(top))
    sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
          for k, v in load_file(src / "model.safetensors").items()}
    sd.update({"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(4, 8),
               "mtp.norm.weight": torch.zeros(4)})
    save_file(sd, str(dst / "model.safetensors"))
    (dst / "tokenizer.json").write_text((src / "tokenizer.json").read_text())


def test_a_multimodal_checkpoint_reads_its_text_model_and_says_what_it_skipped(tmp_path):
    m = build_model(_cfg(gate="elementwise", rope_theta=1e7), seed=0).eval()
    randomize_(m, 3)
    save_checkpoint(m, tmp_path / "m", byte_tokenizer())
    _as_multimodal(tmp_path / "m", tmp_path / "mm")
    back = load_checkpoint(tmp_path / "mm")
    assert back.model.cfg.rope_theta == 1e7
    assert back.model.cfg.extra["skipped_tensors"] == {"vision tower": 1, "multi-token-prediction head": 2}
    with torch.no_grad():
        assert torch.equal(back.model(IDS).logits, m(IDS).logits)
    r = run_cli("info", str(tmp_path / "mm"))
    assert r.returncode == 0, r.stderr[-1500:]
    assert "vision tower" in r.stdout and "linear_attention" in r.stdout


def test_rope_parameters_theta_is_read_not_the_default(tmp_path):
    m = build_model(_cfg(gate="elementwise"), seed=0)
    save_checkpoint(m, tmp_path / "m")
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    hf.pop("rope_theta")
    hf["rope_parameters"]["rope_theta"] = 1e7
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf))
    assert load_checkpoint(tmp_path / "m").model.cfg.rope_theta == 1e7


@pytest.mark.parametrize("edit,match", [
    (lambda hf, sd: hf.update(layer_types=hf["layer_types"][:3]), "layer_types must list"),
    (lambda hf, sd: hf.update(model_type="qwen3_5_moe_text"), "mlp.gate.weight is missing"),
    (lambda hf, sd: hf.update(model_type="qwen3_5_vision"), "not supported"),
    (lambda hf, sd: sd.update({"model.layers.0.linear_attn.A_log": torch.zeros(3)}), "linear_attn.A_log has shape"),
    (lambda hf, sd: sd.pop("model.layers.1.linear_attn.conv1d.weight"), "conv1d.weight is missing"),
])
def test_bad_hybrid_checkpoints_are_refused(tmp_path, edit, match):
    m = build_model(_cfg(gate="elementwise"), seed=0)
    save_checkpoint(m, tmp_path / "m", byte_tokenizer())
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    sd = load_file(tmp_path / "m" / "model.safetensors")
    edit(hf, sd)
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf))
    save_file(sd, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(QuantgateError, match=match):
        load_checkpoint(tmp_path / "m")
    if "layer_types" in match:  # and through the CLI: one line, a non-zero exit
        r = run_cli("info", str(tmp_path / "m"))
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert r.returncode != 0 and len(lines) == 1 and match in lines[0], r.stderr[-800:]


@pytest.mark.parametrize("scheme", ["w8a8-static", "w4a16-g32-qgate8"])
def test_torch_quantized_hybrids_save_and_reload_with_their_scheme(tmp_path, scheme):
    """Simulated quantization takes every block Linear of a hybrid (GDN projections too); the checkpoint reloads
    with its scheme and gives the same logits; the gate scope keeps the attention q|gate rows at 8 bits."""
    from quantgate.quant.torch_backend import quantize_checkpoint
    m = build_model(_cfg(gate="elementwise"), seed=0).eval()
    randomize_(m)
    save_checkpoint(m, tmp_path / "m", byte_tokenizer())
    (tmp_path / "t.txt").write_text("def f(x):\n    return x * 2\n" * 200)
    quantize_checkpoint(str(tmp_path / "m"), scheme, str(tmp_path / "q"), calib_data=str(tmp_path / "t.txt"),
                        n_windows=4, ctx=32)
    q = load_checkpoint(tmp_path / "q").model
    bits = {n: getattr(mod, "weight_bits", None) for n, mod in q.named_modules() if hasattr(mod, "weight_bits")}
    assert any(".linear_attn.in_proj_qkv" in n for n in bits)
    if scheme.startswith("w4"):
        assert bits["layers.3.self_attn.g_proj"] == 8 and bits["layers.0.linear_attn.in_proj_qkv"] == 4
        assert bits["layers.0.linear_attn.in_proj_z"] == 8  # the GDN's gate is in the scope too, as --list says
    # the same calibration in memory gives the same model: the reload lost nothing (ranges, bits, layout)
    from quantgate.calib_data import calibration_windows
    from quantgate.quant import get
    from quantgate.quant.simulate import quantize_
    fresh = build_model(_cfg(gate="elementwise"), seed=0).eval()
    fresh.load_state_dict(m.state_dict())
    wins = calibration_windows(byte_tokenizer(), str(tmp_path / "t.txt"), 4, 32, 0)
    quantize_(fresh, get("torch", scheme), wins)
    with torch.no_grad():
        a, b, f = q(IDS).logits, fresh(IDS).logits, m(IDS).logits
    assert rel_err(a, b) <= 1e-6 and rel_err(a, f) > 1e-3


@pytest.fixture
def all_linear(tmp_path):
    """A hybrid whose every layer is Gated DeltaNet (transformers accepts such a config): no attention, no gate."""
    cfg = dataclasses.replace(_cfg(gate="elementwise"), layer_types=("linear_attention",) * 4)
    save_checkpoint(build_model(cfg, seed=0).eval(), tmp_path / "m", byte_tokenizer())
    return tmp_path / "m"


def test_a_hybrid_without_full_attention_runs_in_torch_and_its_exports_are_refused(all_linear, tmp_path):
    from conftest import dir_snapshot
    assert load_checkpoint(all_linear).model.cfg.full_attention_layers == []
    before = dir_snapshot(tmp_path)
    for argv in (["export", "gguf", str(all_linear), "--out", str(tmp_path / "x.gguf")],
                 ["export", "onnx", str(all_linear), "--out", str(tmp_path / "x-onnx")]):
        r = run_cli(*argv)
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "no full-attention layer" in lines[0], r.stderr[-2000:]
    assert dir_snapshot(tmp_path) == before


def test_a_gguf_without_full_attention_is_refused_in_one_line(all_linear, tmp_path, monkeypatch):
    """Such a file from elsewhere (here: written with the export's check switched off) is refused by the reader."""
    import quantgate.export.gguf as gguf_export
    from quantgate.errors import QuantgateError
    from quantgate.formats.gguf import inspect_gguf
    monkeypatch.setattr(gguf_export, "without_attention", lambda cfg: None)
    with pytest.raises(QuantgateError, match="nothing was kept"):  # the writer's own read-back refuses it ...
        gguf_export.export_checkpoint(all_linear, tmp_path / "x.gguf")
    assert list(tmp_path.iterdir()) == [all_linear]  # ... and keeps nothing
    monkeypatch.setattr(gguf_export, "inspect_gguf", lambda path: None)  # the read-back off too: a foreign file
    loaded = load_checkpoint(all_linear)
    gguf_export.export_gguf(loaded.model, loaded.tokenizer, tmp_path / "y.gguf")
    with pytest.raises(QuantgateError, match="every layer is recurrent"):
        inspect_gguf(tmp_path / "y.gguf")
    r = run_cli("info", str(tmp_path / "y.gguf"))
    assert r.returncode == 2 and "every layer is recurrent" in r.stderr and "Traceback" not in r.stderr
