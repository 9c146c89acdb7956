"""Exports that stream a checkpoint tensor by tensor (issue 25), against the in-memory path they replaced.

Asserted: the GGUF written from a model directory, read one tensor at a time in its stored dtype, is byte for byte
the file written from the same model loaded whole in fp32, for every layout, fp32 and bf16 checkpoints and every
out type; while writing, only a layer's worth of read tensors is alive at once; `info` reads no tensor; a Qwen3.5
checkpoint's MTP head is kept as llama.cpp's converter keeps it (block L, nextn.*), dropped with --no-mtp, and the
file still runs in llama.cpp with the trunk's logits unchanged.
"""
from __future__ import annotations

import json
import weakref

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import randomize_, run_cli
from quantgate.errors import QuantgateError
from quantgate.export.gguf import export_checkpoint, export_gguf
from quantgate.formats import inspect_gguf, load_checkpoint, save_checkpoint
from quantgate.formats import hf as hf_format
from quantgate.formats.gguf import open_reader
from quantgate.info import model_info
from quantgate.model import build_model, hybrid, preset
from quantgate.tokenizer import byte_tokenizer

CASES = {  # name: (gate, layout, hybrid, tied)
    "qwen3-baseline": ("none", "qwen3", False, False),
    "official-headwise": ("headwise", "official", False, True),
    "qwen3next-elementwise": ("elementwise", "qwen3_next", False, False),
    "qwen35-gated-r2": ("elementwise", "qwen3_5", True, False),
    "qwen35-baseline-tied": ("none", "qwen3_5", True, True),
}


def _model(gate: str, is_hybrid: bool, tied: bool, seed: int = 0):
    cfg = preset("tiny", vocab_size=300, n_layers=4, head_dim=32, gate=gate, tie_embeddings=tied)
    if is_hybrid:
        cfg = hybrid(cfg, value_heads_per_key_head=2)
    m = build_model(cfg, seed=seed).eval()
    randomize_(m, seed + 1)
    return m


def _save(m, layout: str, d, bf16: bool):
    save_checkpoint(m, d, byte_tokenizer(), layout=layout)
    if bf16:  # as released checkpoints are stored
        sd = load_file(d / "model.safetensors")
        save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-stored", "bf16-stored"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_gguf_is_byte_identical_to_the_in_memory_export(tmp_path, case, bf16):
    gate, layout, is_hybrid, tied = CASES[case]
    d = _save(_model(gate, is_hybrid, tied), layout, tmp_path / "ckpt", bf16)
    loaded = load_checkpoint(d)
    for outtype in ("f32", "f16", "bf16"):
        (tmp_path / outtype).mkdir()
        streamed = export_checkpoint(d, tmp_path / outtype / "s.gguf", outtype)["out"]
        whole = export_gguf(loaded.model, loaded.tokenizer, tmp_path / outtype / "w.gguf", outtype,
                            source_layout=loaded.layout, name=d.name)
        assert open(streamed, "rb").read() == open(whole, "rb").read(), (case, outtype)


def test_the_streamed_export_holds_one_layer_of_tensors_at_a_time(tmp_path, monkeypatch):
    m = _model("elementwise", True, False)
    d = _save(m, "qwen3_5", tmp_path / "ckpt", bf16=True)
    alive: list[tuple[str, weakref.ref]] = []
    peak = {"alive": 0, "reads": 0, "with_lm_head": None}
    real = hf_format.TensorSource.get_stored

    def counting(self, name):
        alive[:] = [(n, r) for n, r in alive if r() is not None]
        if name.endswith("lm_head.weight"):  # the two largest tensors are never held together
            peak["with_lm_head"] = [n for n, _ in alive]
        t = real(self, name)
        alive.append((name, weakref.ref(t)))
        peak["alive"], peak["reads"] = max(peak["alive"], len(alive)), peak["reads"] + 1
        return t

    monkeypatch.setattr(hf_format.TensorSource, "get_stored", counting)
    export_checkpoint(d, tmp_path / "m.gguf", "bf16")
    assert peak["reads"] >= len(m.state_dict()) - 1  # every tensor was read (q and gate share one)
    # a Gated DeltaNet layer's 9 tensors are reordered together; nothing else is held past its write
    assert peak["alive"] <= 9, peak
    assert peak["with_lm_head"] == [], peak


def test_info_reads_headers_only(tmp_path, monkeypatch):
    d = _save(_model("elementwise", True, False), "qwen3_5", tmp_path / "ckpt", bf16=True)
    export_checkpoint(d, tmp_path / "m.gguf", "f16")
    whole = load_checkpoint(d).model

    def refuse(*a, **k):
        raise AssertionError("info read a tensor")

    monkeypatch.setattr(hf_format.TensorSource, "get_stored", refuse)
    monkeypatch.setattr("quantgate.formats.gguf.read_tensor", refuse)
    got = model_info(str(d))
    assert got["params"] == whole.num_params()
    assert got["weights"]["dtypes"] == "BF16" and got["weights"]["stored_bytes"] == 2 * sum(
        v.numel() for k, v in whole.state_dict().items() if k != "lm_head.weight" or not whole.cfg.tie_embeddings)
    g = model_info(str(tmp_path / "m.gguf"))
    assert g["params"] == whole.num_params() and g["gguf"]["file_type"] == "F16"
    assert g["dims"] == got["dims"]


# --- the multi-token-prediction head -------------------------------------------------------------------------

def mtp_head(cfg, seed: int = 0, fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """A random MTP head of Qwen3.5's shape (`mtp.*`): its projection of [embedding | hidden], three norms and one
    full-attention decoder layer (q_proj with per-head gate rows), norms stored zero-centred. For a MoE the layer's
    MLP is the routed one: router, shared expert and its gate, and experts per expert or fused 3-D."""
    g = torch.Generator().manual_seed(seed)
    D, H, KV, hd, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    shapes = {"mtp.fc.weight": (D, 2 * D), "mtp.pre_fc_norm_embedding.weight": (D,),
              "mtp.pre_fc_norm_hidden.weight": (D,), "mtp.norm.weight": (D,),
              "mtp.layers.0.input_layernorm.weight": (D,), "mtp.layers.0.post_attention_layernorm.weight": (D,),
              "mtp.layers.0.self_attn.q_proj.weight": (2 * H * hd, D), "mtp.layers.0.self_attn.k_proj.weight": (KV * hd, D),
              "mtp.layers.0.self_attn.v_proj.weight": (KV * hd, D), "mtp.layers.0.self_attn.o_proj.weight": (D, H * hd),
              "mtp.layers.0.self_attn.q_norm.weight": (hd,), "mtp.layers.0.self_attn.k_norm.weight": (hd,),
              "mtp.layers.0.mlp.gate_proj.weight": (F, D), "mtp.layers.0.mlp.up_proj.weight": (F, D),
              "mtp.layers.0.mlp.down_proj.weight": (D, F)}
    if cfg.is_moe:
        E, Fe, Fs, p = cfg.n_experts, cfg.expert_ffn_dim, cfg.shared_expert_ffn_dim, "mtp.layers.0.mlp."
        shapes = {k: v for k, v in shapes.items() if not k.startswith(p)}
        shapes |= {p + "gate.weight": (E, D), p + "shared_expert.gate_proj.weight": (Fs, D),
                   p + "shared_expert.up_proj.weight": (Fs, D), p + "shared_expert.down_proj.weight": (D, Fs),
                   p + "shared_expert_gate.weight": (1, D)}
        if fused_experts:
            shapes |= {p + "experts.gate_up_proj": (E, 2 * Fe, D), p + "experts.down_proj": (E, D, Fe)}
        else:
            shapes |= {f"{p}experts.{k}.{n}.weight": sh for k in range(E)
                       for n, sh in (("gate_proj", (Fe, D)), ("up_proj", (Fe, D)), ("down_proj", (D, Fe)))}
    return {k: 0.1 * torch.randn(s, generator=g) for k, s in shapes.items()}


def with_mtp(src, dst, cfg, fused_experts: bool = False):
    """src's checkpoint with an MTP head added, and `mtp_num_hidden_layers` in its config as released files have."""
    dst.mkdir()
    sd = load_file(src / "model.safetensors")
    sd.update(mtp_head(cfg, fused_experts=fused_experts))
    save_file(sd, str(dst / "model.safetensors"))
    hf = json.loads((src / "config.json").read_text())
    hf["mtp_num_hidden_layers"] = 1
    (dst / "config.json").write_text(json.dumps(hf))
    (dst / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    return dst


def test_the_mtp_head_is_kept_as_llama_cpps_converter_keeps_it_and_dropped_on_request(tmp_path):
    m = _model("elementwise", True, False)
    d = with_mtp(_save(m, "qwen3_5", tmp_path / "plain", bf16=False), tmp_path / "mtp", m.cfg)
    kept = export_checkpoint(d, tmp_path / "kept.gguf", "f32")
    dropped = export_checkpoint(d, tmp_path / "dropped.gguf", "f32", mtp=False)
    assert (kept["mtp_layers"], dropped["mtp_layers"]) == (1, 0)
    L = m.cfg.n_layers
    r = open_reader(tmp_path / "kept.gguf")
    names = {t.name for t in r.tensors}
    assert {f"blk.{L}.nextn.eh_proj.weight", f"blk.{L}.nextn.enorm.weight", f"blk.{L}.nextn.hnorm.weight",
            f"blk.{L}.nextn.shared_head_norm.weight", f"blk.{L}.attn_q.weight", f"blk.{L}.ffn_down.weight"} <= names
    assert r.fields["qwen35.block_count"].contents() == L + 1
    assert r.fields["qwen35.nextn_predict_layers"].contents() == 1
    assert r.fields["qwen35.attention.recurrent_layers"].contents()[L] is False
    head = mtp_head(m.cfg)
    t = {x.name: x for x in r.tensors}
    # norms zero-centred on disk get + 1; matrices go as stored ([q | gate] per head included)
    assert np.array_equal(np.asarray(t[f"blk.{L}.nextn.enorm.weight"].data),
                          (head["mtp.pre_fc_norm_embedding.weight"] + 1).numpy())
    assert np.array_equal(np.asarray(t[f"blk.{L}.attn_q.weight"].data),
                          head["mtp.layers.0.self_attn.q_proj.weight"].numpy())
    assert not any(n.startswith(f"blk.{L}.") for n in {x.name for x in open_reader(tmp_path / "dropped.gguf").tensors})
    info = inspect_gguf(tmp_path / "kept.gguf")
    assert (info.n_layers, info.nextn_layers) == (L, 1)
    back = load_checkpoint(tmp_path / "kept.gguf").model  # the trunk, MTP left out
    with torch.no_grad():
        ids = torch.tensor([[0, 5, 9, 77, 3]])
        assert torch.allclose(back(ids).logits, m(ids).logits, atol=1e-5)


def test_a_file_with_the_mtp_head_runs_in_llama_cpp_with_the_trunks_logits(tmp_path):
    from quantgate.runners import LlamaRunner
    m = _model("elementwise", True, False)
    d = with_mtp(_save(m, "qwen3_5", tmp_path / "plain", bf16=False), tmp_path / "mtp", m.cfg)
    export_checkpoint(d, tmp_path / "kept.gguf", "f32")
    export_checkpoint(d, tmp_path / "dropped.gguf", "f32", mtp=False)
    w = np.array([[0] + list(range(3, 40))], dtype=np.int64)
    out = {}
    for name in ("kept", "dropped"):
        with LlamaRunner(tmp_path / f"{name}.gguf", n_ctx=64) as r:
            out[name] = r.logits(w)
    assert np.allclose(out["kept"], out["dropped"], atol=1e-5)


def _drop_all_but(keep):
    return lambda sd: {k: v for k, v in sd.items() if not k.startswith("mtp.") or k in keep}


def _renumbered(sd):
    return {k.replace("mtp.layers.0.", "mtp.layers.1."): v for k, v in sd.items()}


MTP_DEFECTS = {  # what the held-out sweep found written, then refused by the file's own check (or a KeyError)
    "only fc and norm": (_drop_all_but({"mtp.fc.weight", "mtp.norm.weight"}), "incomplete: missing"),
    "one tensor missing": (lambda sd: {k: v for k, v in sd.items() if k != "mtp.layers.0.self_attn.k_proj.weight"},
                           "missing mtp.layers.0.self_attn.k_proj.weight"),
    "blocks numbered from 1": (_renumbered, "numbered from 0"),
    "wrong shape": (lambda sd: {**sd, "mtp.layers.0.mlp.up_proj.weight": sd["mtp.layers.0.mlp.up_proj.weight"][:-1]},
                    "shapes are not the trunk's: mtp.layers.0.mlp.up_proj.weight"),
    "fc wrong shape": (lambda sd: {**sd, "mtp.fc.weight": sd["mtp.fc.weight"][:, :8].contiguous()},
                       "mtp.fc.weight"),
    "a dtype quantgate does not read": (
        lambda sd: {**sd, "mtp.norm.weight": sd["mtp.norm.weight"].to(torch.float8_e4m3fn)}, "F8_E4M3"),
}


@pytest.mark.parametrize("defect", list(MTP_DEFECTS))
def test_a_defective_mtp_head_is_refused_before_anything_is_written(tmp_path, monkeypatch, defect):
    edit, needle = MTP_DEFECTS[defect]
    m = _model("elementwise", True, False)
    d = with_mtp(_save(m, "qwen3_5", tmp_path / "plain", bf16=False), tmp_path / "mtp", m.cfg)
    save_file(edit(load_file(d / "model.safetensors")), str(d / "model.safetensors"))
    import gguf as gguf_py
    monkeypatch.setattr(gguf_py, "GGUFWriter", lambda *a, **k: pytest.fail("a GGUF was started"))
    with pytest.raises(QuantgateError, match="--no-mtp") as e:
        export_checkpoint(d, tmp_path / "x.gguf", "f32")
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mtp", "plain"]
    monkeypatch.undo()
    r = run_cli("export", "gguf", str(d), "--out", str(tmp_path / "y.gguf"), "--no-mtp")
    assert r.returncode == 0, r.stderr[-800:]


def test_an_unknown_mtp_tensor_is_refused_not_dropped(tmp_path):
    m = _model("elementwise", True, False)
    d = with_mtp(_save(m, "qwen3_5", tmp_path / "plain", bf16=False), tmp_path / "mtp", m.cfg)
    sd = load_file(d / "model.safetensors")
    sd["mtp.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(4, 4)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(QuantgateError, match="multi-token-prediction tensor"):
        export_checkpoint(d, tmp_path / "x.gguf", "f32")
    assert not (tmp_path / "x.gguf").exists()
    r = run_cli("export", "gguf", str(d), "--out", str(tmp_path / "y.gguf"), "--no-mtp")
    assert r.returncode == 0, r.stderr[-800:]
    assert "peak memory:" in r.stderr


def test_an_export_the_disk_cannot_hold_is_refused_before_writing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple
    d = _save(_model("elementwise", True, False), "qwen3_5", tmp_path / "ckpt", bf16=True)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 ** 6, 10 ** 6 - 1000, 1000))
    with pytest.raises(QuantgateError, match="needs 0.00 GB and its disk has 0.00 GB free"):
        export_checkpoint(d, tmp_path / "out" / "m.gguf", "bf16")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_a_gguf_is_parsed_once_until_it_changes(tmp_path, monkeypatch):
    import quantgate.formats.gguf as gguf_format
    parses = []
    real = gguf_format.GGUFReader
    monkeypatch.setattr(gguf_format, "GGUFReader", lambda *a, **k: parses.append(a) or real(*a, **k))
    gguf_format._checked_reader.cache_clear()
    m = _model("elementwise", True, False)
    f = tmp_path / "m.gguf"
    export_gguf(m, byte_tokenizer(), f, "f32")
    inspect_gguf(f), open_reader(f), model_info(str(f))
    assert len(parses) == 1
    export_gguf(_model("elementwise", True, False, seed=5), byte_tokenizer(), f, "f16")  # replaced in place
    assert inspect_gguf(f).file_type == "F16" and len(parses) == 2
