"""The ONNX export streamed from a model directory (issue 25): the graph traced on the meta device, every weight
written to model.onnx.data from the mmapped safetensors one tensor at a time (export/onnx_stream.py).

Asserted: the export of a directory is byte for byte the export of the same checkpoint loaded whole, for every
layout stored in bf16 (one in fp32 too), tied and untied heads; it still equals it when every large tensor is converted in
small chunks; only the tensors of one weight are alive while it is written; a model whose weights go to external data
runs in ONNX Runtime with PyTorch's logits and reads back; only the forms that hold the model in memory (--dtype
fp16, a GGUF source) are refused where it cannot fit, before anything is read; the hand-built --graph gqa streams too,
and its file from a directory is byte for byte its file from the model in memory.
"""
from __future__ import annotations

import weakref

import numpy as np
import onnx
import pytest
import torch

import quantgate.export.onnx as onnx_export
import quantgate.export.onnx_stream as onnx_stream
from conftest import rel_err
from quantgate.errors import QuantgateError
from quantgate.formats import hf as hf_format
from quantgate.formats import load_checkpoint
from quantgate.formats.onnx import load_onnx_model
from quantgate.formats.onnx_io import EXTERNAL_DATA
from quantgate.runners import OrtRunner
from test_streaming import CASES, _model, _save

W = np.array([[0] + list(range(3, 30)), [0] + list(range(299, 272, -1))], dtype=np.int64)


def _files(d) -> dict[str, bytes]:
    return {f: (d / f).read_bytes() for f in ("model.onnx", EXTERNAL_DATA) if (d / f).exists()}


# every layout as released checkpoints are stored (bf16), and one stored in fp32 (each case traces twice: ~20 s)
STORED = [(case, True) for case in sorted(CASES)] + [("qwen35-gated-r2", False)]
DEFAULT_RUN = {("qwen35-gated-r2", True), ("official-headwise", True)}  # a hybrid and an attention layout; the rest
# (each ~35 s of tracing) run in CI's slow step
STORED = [pytest.param(c, b, marks=() if (c, b) in DEFAULT_RUN else pytest.mark.slow) for c, b in STORED]


@pytest.mark.slow  # ~45 s: the default step keeps the external-data export run below
@pytest.mark.parametrize("case,bf16", STORED, ids=[f"{p.values[0]}-{'bf16' if p.values[1] else 'fp32'}-stored" for p in STORED])
def test_streamed_onnx_is_byte_identical_to_the_in_memory_export(tmp_path, case, bf16):
    gate, layout, is_hybrid, tied = CASES[case]
    d = _save(_model(gate, is_hybrid, tied), layout, tmp_path / "ckpt", bf16)
    onnx_export.export_checkpoint(d, tmp_path / "streamed")
    loaded = load_checkpoint(d)
    onnx_export.export_onnx(loaded.model, loaded.tokenizer, tmp_path / "whole", layout=loaded.layout)
    streamed, whole = _files(tmp_path / "streamed"), _files(tmp_path / "whole")
    assert list(streamed) == ["model.onnx"] and streamed == whole, case  # small weights are folded into the graph


@pytest.mark.slow  # ~22 s
def test_small_chunks_write_the_same_file_and_one_weight_is_alive_at_a_time(tmp_path, monkeypatch):
    m = _model("elementwise", True, False)
    d = _save(m, "qwen3_5", tmp_path / "ckpt", bf16=True)
    onnx_export.export_checkpoint(d, tmp_path / "default")
    monkeypatch.setattr(onnx_stream, "CHUNK_BYTES", 1024)  # every matrix and the vocabulary table in pieces
    alive: list[tuple[str, weakref.ref]] = []
    peak = {"alive": 0, "reads": 0}
    real = hf_format.TensorSource.get_stored

    def counting(self, name):
        alive[:] = [(n, r) for n, r in alive if r() is not None]
        t = real(self, name)
        alive.append((name, weakref.ref(t)))
        peak["alive"], peak["reads"] = max(peak["alive"], len(alive)), peak["reads"] + 1
        return t

    monkeypatch.setattr(hf_format.TensorSource, "get_stored", counting)
    onnx_export.export_checkpoint(d, tmp_path / "chunked")
    assert _files(tmp_path / "chunked") == _files(tmp_path / "default")
    assert peak["reads"] >= len(m.state_dict()) - 1
    assert peak["alive"] <= 2, peak  # the fused q-and-gate weight reads its two halves; nothing else overlaps


@pytest.mark.parametrize("case", ["qwen35-gated-r2", pytest.param("official-headwise", marks=pytest.mark.slow)])
def test_external_data_export_runs_with_pytorchs_logits_and_reads_back(tmp_path, monkeypatch, case):
    gate, layout, is_hybrid, tied = CASES[case]
    m = _model(gate, is_hybrid, tied)
    d = _save(m, layout, tmp_path / "ckpt", bf16=False)
    monkeypatch.setattr(onnx_export, "INLINE_LIMIT", 0)  # as a model over 1 GiB is written
    onnx_export.export_checkpoint(d, tmp_path / "onnx")
    out = tmp_path / "onnx"
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False)
    external = [t for t in graph.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    weights = [t for t in graph.graph.initializer if t.name.startswith("model.")]
    assert (out / EXTERNAL_DATA).is_file() and len(weights) >= m.cfg.n_layers and external == weights
    offsets = [int({e.key: e.value for e in t.external_data}["offset"]) for t in external]
    assert all(o % onnx_stream.ALIGN == 0 for o in offsets)  # ORT maps page-aligned weights
    with torch.no_grad():
        ref = m(torch.as_tensor(W)).logits.numpy()
    with OrtRunner(out) as r:
        assert rel_err(r.logits(W), ref) <= 1e-5
    back = load_onnx_model(out).model.state_dict()
    ours = m.state_dict()
    assert max(rel_err(back[k], ours[k]) for k in ours) <= 1e-6


@pytest.mark.slow  # moved out of the default step (its 25-minute limit); CI's slow step runs it
def test_only_the_in_memory_forms_are_refused_where_the_model_cannot_fit(tmp_path, monkeypatch):
    d = _save(_model("elementwise", False, False), "qwen3_next", tmp_path / "ckpt", bf16=True)
    monkeypatch.setattr(onnx_export, "available_memory", lambda: 10 ** 6)
    monkeypatch.setattr(onnx_export, "load_checkpoint", lambda *a: pytest.fail("loaded the model"))
    with pytest.raises(QuantgateError, match="--dtype fp16 holds the whole model in memory.*streams"):
        onnx_export.export_checkpoint(d, tmp_path / "refused", dtype="fp16")
    assert not (tmp_path / "refused").exists()
    for graph in ("standard", "gqa"):  # the fp32 graphs never load it
        summary = onnx_export.export_checkpoint(d, tmp_path / graph, graph=graph)
        assert summary["bytes"] > 0 and (tmp_path / graph / "model.onnx").is_file()


def test_the_gqa_graph_streamed_from_a_directory_is_the_one_built_from_the_model(tmp_path, monkeypatch):
    """The hand-built graph reads each weight from the checkpoint when it writes it: the same bytes as from the
    model in memory, also when the weights go to external data (limit lowered to 1 KiB)."""
    import quantgate.export.onnx_gqa as onnx_gqa
    m = _model("elementwise", False, False)
    d = _save(m, "qwen3_next", tmp_path / "ckpt", bf16=True)
    loaded = load_checkpoint(d).model
    for limit in (onnx_gqa.INLINE_LIMIT, 1024):
        monkeypatch.setattr(onnx_gqa, "INLINE_LIMIT", limit)
        onnx_export.export_checkpoint(d, tmp_path / f"dir-{limit}", graph="gqa")
        onnx_export.export_onnx(loaded, None, tmp_path / f"mem-{limit}", graph="gqa")
        for f in ("model.onnx", EXTERNAL_DATA):
            a, b = tmp_path / f"dir-{limit}" / f, tmp_path / f"mem-{limit}" / f
            assert a.is_file() == b.is_file() == (f == "model.onnx" or limit == 1024)
            if a.is_file():
                assert a.read_bytes() == b.read_bytes(), (limit, f)
