"""The decode bound (quantgate.bandwidth), the tied logits matrix in ONNX quantization, and the bound KV cache."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from conftest import randomize_, run_cli
from quantgate.bandwidth import (copy_bandwidth, gguf_decode_bytes, onnx_decode_bytes, read_bandwidth,
                                 torch_decode_bytes)
from quantgate.formats import load_checkpoint, save_checkpoint
from quantgate.export.gguf import export_checkpoint as export_gguf
from quantgate.export.onnx import export_checkpoint as export_onnx
from quantgate.formats.gguf import open_reader
from quantgate.model import build_model, hybrid, preset
from quantgate.quant.ort import quantize_onnx
from quantgate.runners import OrtRunner
from quantgate.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tied gated model (rows multiples of 256) saved, exported to F16 GGUF and fp32 ONNX, and int4-quantized."""
    d = tmp_path_factory.mktemp("bw")
    cfg = preset("tiny", vocab_size=512, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                 gate="elementwise", tie_embeddings=True)
    m = build_model(cfg, seed=1).eval()
    randomize_(m, 1, std=0.06)
    save_checkpoint(m, d / "m", byte_tokenizer())
    export_gguf(d / "m", d / "m.gguf", "f16")
    export_onnx(d / "m", d / "fp32")
    quantize_onnx(d / "fp32", d / "int4", "int4")
    return d, m


def test_bandwidths_are_plausible_rates():
    for bw in (copy_bandwidth(32 << 20, repeats=3), read_bandwidth(64 << 20, repeats=3, threads=1)):
        assert 1e8 < bw < 1e13  # 0.1 GB/s .. 10 TB/s: a number, not a cache artefact of a tiny buffer


def test_gguf_decode_bytes_count_a_tied_embedding_once_and_the_f16_cache(tied):
    d, m = tied
    sizes = {t.name: int(t.n_bytes) for t in open_reader(d / "m.gguf").tensors}
    db = gguf_decode_bytes(d / "m.gguf")
    assert "output.weight" not in sizes and db.weights == sum(sizes.values())  # tied: token_embd is the output
    cfg = m.cfg
    assert db.kv_per_position == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2
    assert db.at(10) == db.weights + 10 * db.kv_per_position
    assert db.bound_tps(1e9, 0) == pytest.approx(1e9 / db.weights)


def test_onnx_int4_quantizes_the_tied_logits_matrix_and_leaves_the_export_alone(tied):
    d, m = tied
    before = (d / "fp32" / "model.onnx").read_bytes()
    g = onnx.load(str(d / "int4" / "model.onnx"))
    nbits = {n.name for n in g.graph.node if n.op_type == "MatMulNBits"}
    assert any(n.startswith("model.lm_head.MatMul") for n in nbits)
    # the export's logits MatMul reads a Transpose of the Gather's table (ORT folds it into a second float copy at
    # load); after quantization no Transpose of that table is left
    f = onnx.load(str(d / "fp32" / "model.onnx"))
    table = next(n.input[0] for n in f.graph.node if n.op_type == "Gather")
    assert any(n.op_type == "Transpose" and n.input[0] == table for n in f.graph.node)
    assert not any(n.op_type == "Transpose" and n.input[0] == table for n in g.graph.node)
    assert (d / "fp32" / "model.onnx").read_bytes() == before  # the input export is not changed
    fp32, int4 = onnx_decode_bytes(d / "fp32"), onnx_decode_bytes(d / "int4")
    V, D = m.cfg.vocab_size, m.cfg.dim
    # fp32: the tied table is read whole by the logits MatMul (through its Transpose); int4: the embedding is one
    # packed int4 table (GatherBlockQuantized) that the logits MatMulNBits reads too, about an eighth of it
    assert fp32.weights > V * D * 4 and int4.weights < fp32.weights / 4
    assert sum(n.op_type == "GatherBlockQuantized" for n in g.graph.node) == 1
    # the dequantized model read back from the int4 file is tied again (one table); its logits are ONNX Runtime's on
    # that file (far closer than the float model's)
    loaded = load_checkpoint(d / "int4").model
    assert loaded.cfg.tie_embeddings and loaded.lm_head.weight is loaded.embed_tokens.weight
    import torch
    w = np.random.default_rng(0).integers(3, 259, (2, 24))
    with torch.no_grad():
        a, b = m(torch.as_tensor(w)).logits.numpy(), loaded(torch.as_tensor(w)).logits.numpy()
    with OrtRunner(d / "int4", threads=1) as r:
        ort = r.logits(w)
    # (MatMulNBits at accuracy level 4 rounds its activations to int8 too: close, not equal)
    assert np.abs(b - ort).max() < 0.2 * np.abs(a - ort).max()


def test_bound_cache_decodes_exactly_as_arrays_do(tied):
    d, _ = tied
    ids = [0, 5, 9, 200, 31, 7]
    with OrtRunner(d / "int4", threads=1) as r:
        first = r.prefill(ids[:3])
        steps = [r.decode(t) for t in ids[3:]]  # bound: OrtValues fed back
        logits, past = r.step(np.asarray([ids[:3]]), r._empty_past(1), 0)  # arrays
        ref = [logits[0, -1]]
        for k, t in enumerate(ids[3:]):
            lg, past = r.step(np.asarray([[t]]), past, 3 + k)
            ref.append(lg[0, -1])
    np.testing.assert_array_equal(np.stack([first, *steps]), np.stack(ref))


def test_torch_decode_bytes_of_a_hybrid_counts_its_states():
    cfg = hybrid(preset("tiny", vocab_size=300, n_layers=4, head_dim=32, tie_embeddings=False))
    m = build_model(cfg, seed=0)
    db = torch_decode_bytes(m)
    n_params = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("embed_tokens"))
    assert db.weights == 4 * n_params
    assert db.kv_per_position == 2 * 1 * cfg.n_kv_heads * cfg.head_dim * 4  # one full-attention layer of four
    assert db.state == 3 * 4 * cfg.linear_value_heads * cfg.linear_key_dim * cfg.linear_value_dim


def test_generate_reports_the_fraction_of_the_bandwidth_bound(tied):
    d, _ = tied
    r = run_cli("generate", str(d / "m.gguf"), "--prompt", "hello", "--max-tokens", "8", "--threads", "1")
    assert r.returncode == 0, r.stderr[-1000:]
    line = [ln for ln in r.stderr.splitlines() if "decode" in ln][-1]
    assert "of the memory-bandwidth bound" in line and "MB read per token at" in line
    pct = float(line.split("tok/s (")[1].split("%")[0])
    assert 0 < pct < 1000  # a decode rate over a copy bound: can exceed 100% only when the file fits in cache
    assert line.endswith("; threads 1")  # speeds on a loaded machine swing with the threads: said
    default = run_cli("generate", str(d / "m.gguf"), "--prompt", "hello", "--max-tokens", "2")
    line = [ln for ln in default.stderr.splitlines() if "decode" in ln][-1]
    assert "threads " in line and "(the default, min(cores, 8); --threads sets it)" in line, line


def test_info_on_onnx_exports_reports_the_sources_parameters_and_what_the_logits_read(tied, tmp_path):
    """The read-back of an int4 file once counted the logits' int4 copy as a second table and called the export untied:
    info now reports the source's parameters and tying, the scheme, and what the logits MatMul reads."""
    from quantgate.info import model_info
    d, m = tied
    quantize_onnx(d / "fp32", tmp_path / "int8", "int8-dynamic")
    seen = {}
    for name, path in (("fp32", d / "fp32"), ("int4", d / "int4"), ("int8", tmp_path / "int8")):
        got = model_info(str(path))
        assert got["params"] == m.num_params() and got["tied_embeddings"], (name, got["params"], m.num_params())
        seen[name] = got["onnx"]
    assert seen["fp32"]["scheme"] == "fp32" and "shared with the lookup" in seen["fp32"]["logits"]
    assert seen["int4"]["scheme"] == "int4" and "one packed int4 table shared" in seen["int4"]["logits"]
    assert seen["int8"]["scheme"] == "int8-dynamic" and "copy of the tied embedding table" in seen["int8"]["logits"]
    assert seen["int4"]["bits_per_weight"] < seen["int8"]["bits_per_weight"] < seen["fp32"]["bits_per_weight"]
    r = run_cli("info", str(d / "int4"))
    assert r.returncode == 0 and "one packed int4 table" in r.stdout, r.stderr[-1500:]
