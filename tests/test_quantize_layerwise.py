"""`quantgate quantize --backend torch` one decoder block at a time (quantgate.quant.layerwise): the streamed
safetensors writer writes save_file's bytes; quantizing block by block writes the same file and config.json as the
in-memory path for every kind of scheme and model; the quantized checkpoint runs layer by layer to the in-memory
perplexity; refusals come before anything is written."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from conftest import run_cli, save_random_models
from quantgate.errors import QuantgateError
from quantgate.evaluate import evaluate_model
from quantgate.formats.safetensors_stream import SafetensorsWriter
from quantgate.model import build_model, hybrid, make_twins, preset
from quantgate.quant.layerwise import check_disk
from quantgate.quant.torch_backend import quantize_checkpoint

MODELS = {
    "baseline": lambda: make_twins(preset("tiny", vocab_size=300, n_layers=3), "elementwise", 0)[0],
    "gated-attention": lambda: make_twins(preset("tiny", vocab_size=300, n_layers=3), "elementwise", 0)[1],
    "hybrid-tied": lambda: build_model(dataclasses.replace(hybrid(preset("tiny", vocab_size=300, n_layers=4)),
                                                           gate="elementwise"), 0),
    "moe": lambda: build_model(dataclasses.replace(
        hybrid(preset("tiny", vocab_size=300, n_layers=4, tie_embeddings=False), value_heads_per_key_head=2),
        gate="elementwise", linear_key_heads=2, n_experts=8, n_experts_used=2, expert_ffn_dim=32,
        shared_expert_ffn_dim=64), 0),
}
# one of each kind: static min-max, sampled percentiles, GPTQ Hessians, RTN with the gate kept, sink-aware, KV only
SCHEMES = ["w8a8-static", "w8a8-static-pct", "gptq-w4a16-g32", "w4a16-g32-gate8", "w8a8-static-sink", "kv-int8"]
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_random_models(tmp_path_factory.mktemp("quantize-layerwise"), MODELS)


def test_streamed_writer_writes_save_files_bytes_in_any_order(tmp_path):
    g = torch.Generator().manual_seed(0)
    t = {"layers.10.w": torch.randn(3, 5, generator=g), "layers.2.w": torch.randn(7, generator=g),
         "b": torch.randn(2, 2, generator=g).bfloat16(), "z": torch.ones(3, dtype=torch.float16),
         "a": torch.randn(4, generator=g).double(), "empty": torch.zeros(0, 3)}
    save_file(t, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    w = SafetensorsWriter(tmp_path / "ours.safetensors", {k: (DTYPE_NAMES[v.dtype], tuple(v.shape)) for k, v in t.items()},
                          {"format": "pt"})
    for k in reversed(list(t)):
        w.write(k, t[k])
    w.close()
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_streamed_writer_converts_and_refuses(tmp_path):
    w = SafetensorsWriter(tmp_path / "x.safetensors", {"a": ("F32", (2, 3)), "b": ("F32", (1,))})
    w.write("a", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))  # stored dtype in, file dtype out (exact)
    with pytest.raises(ValueError, match="already written"):
        w.write("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shape"):
        w.write("b", torch.zeros(2))
    with pytest.raises(RuntimeError, match="never written"):
        w.close()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layer_by_layer_quantize_writes_the_in_memory_file(saved, name, tmp_path):
    t = str(saved / "t.txt")
    for scheme in SCHEMES:
        try:
            a = quantize_checkpoint(str(saved / name), scheme, str(tmp_path / f"{scheme}-mem"), t, 6, 32,
                                    layerwise=False)
        except QuantgateError as e:  # the scheme does not apply to this model: the streamed path says the same
            with pytest.raises(QuantgateError, match=re.escape(str(e)[:40])):
                quantize_checkpoint(str(saved / name), scheme, str(tmp_path / f"{scheme}-lw"), t, 6, 32,
                                    layerwise=True)
            assert not (tmp_path / f"{scheme}-lw").exists()
            continue
        b = quantize_checkpoint(str(saved / name), scheme, str(tmp_path / f"{scheme}-lw"), t, 6, 32, layerwise=True)
        assert (a.pop("layerwise"), b.pop("layerwise")) == (False, True)
        assert a | {"out": None} == b | {"out": None}
        for f in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
            assert (tmp_path / f"{scheme}-mem" / f).read_bytes() == (tmp_path / f"{scheme}-lw" / f).read_bytes(), \
                (scheme, f)
        state = json.loads((tmp_path / f"{scheme}-lw" / "config.json").read_text())["quantgate"]["quant_state"]
        assert bool(state["weight_bits"]) == (scheme != "kv-int8")


@pytest.mark.parametrize("name", ["hybrid-tied", "moe"])
def test_quantized_checkpoint_runs_layer_by_layer_to_the_in_memory_perplexity(saved, name, tmp_path):
    t = str(saved / "t.txt")
    for scheme in ("w8a8-static", "kv-int8"):
        out = tmp_path / scheme
        quantize_checkpoint(str(saved / name), scheme, str(out), t, 6, 32, layerwise=True)
        a = evaluate_model(str(out), t, ctx=32, max_windows=6, layerwise=False)
        b = evaluate_model(str(out), t, ctx=32, max_windows=6, layerwise=True)
        assert (a["backend"], b["backend"]) == ("torch", "torch (layer by layer)")
        assert abs(a["ppl"] - b["ppl"]) <= 1e-9 * a["ppl"]
        assert a.get("kv_cache") == b.get("kv_cache") == ("int8" if scheme == "kv-int8" else None)
        float_ppl = evaluate_model(str(saved / name), t, ctx=32, max_windows=6)["ppl"]
        assert a["ppl"] != float_ppl  # the scheme changed the model it runs


def test_layer_by_layer_refusals_write_nothing(saved, tmp_path):
    t = str(saved / "t.txt")
    with pytest.raises(QuantgateError, match="SmoothQuant"):
        quantize_checkpoint(str(saved / "gated-attention"), "w8a8-smoothquant", str(tmp_path / "sq"), t, 6, 32,
                            layerwise=True)
    out = tmp_path / "q"
    quantize_checkpoint(str(saved / "gated-attention"), "w4a16-g32", str(out), layerwise=True)
    with pytest.raises(QuantgateError, match="already quantized"):
        quantize_checkpoint(str(out), "w4a16-g32", str(tmp_path / "q2"), layerwise=True)
    with pytest.raises(QuantgateError, match="GB free"):
        check_disk(tmp_path / "huge", {"w": ("F32", (1 << 40, 1 << 10))})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_quantize_cli_layerwise(saved, tmp_path):
    out = tmp_path / "q"
    r = run_cli("quantize", str(saved / "hybrid-tied"), "--scheme", "w8a8-static", "--layerwise", "--calib-data",
                str(saved / "t.txt"), "--calib-windows", "4", "--ctx", "32", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layerwise"] is True and (out / "model.safetensors").is_file()
    assert "peak memory" in r.stderr
    gguf = tmp_path / "m.gguf"
    r = run_cli("quantize", str(saved / "hybrid-tied"), "--type", "Q8_0", "--backend", "llama.cpp", "--layerwise",
                "--out", str(gguf))
    assert r.returncode != 0 and "--layerwise applies to PyTorch schemes" in r.stderr and not gguf.exists()
