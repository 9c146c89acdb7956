"""ONNX weight-only quantization (int4, int4 with the gates at 8 bits, int8 blocks) one MatMul at a time
(quantgate/onnx_weight_only.py), against onnxruntime's MatMulNBitsQuantizer run on the whole graph in memory.

Asserted: for tied and untied, hybrid and all-attention exports, inline or with external data in and out, every
MatMulNBits node has the same inputs and attributes as ORT's own quantizer gives it and every weight the same
bytes; each weight reaches ORT's kernel mapped from disk, not copied; the quantized file runs in ONNX Runtime.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import quantgate.export.onnx as onnx_export
import quantgate.quant.ort_weight_only as weight_only
from quantgate.formats.onnx_io import EXTERNAL_DATA
from quantgate.quant.ort import gate_matmuls, kept_float_matmuls, untie_lm_head
from quantgate.runners import OrtRunner
from test_streaming import CASES, _model, _save

W = np.array([[0] + list(range(3, 30))], dtype=np.int64)


def _reference(src, scheme: str, block: int = 32):
    """MatMulNBitsQuantizer on the whole untied graph, as onnx_quantize ran it before streaming."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    graph = onnx.load(str(src))
    untie_lm_head(graph)
    gates, kept = gate_matmuls(graph), kept_float_matmuls(graph)

    def run(g, bits, include=None, exclude=()):
        q = MatMulNBitsQuantizer(g, bits=bits, block_size=block, is_symmetric=True, accuracy_level=4,
                                 nodes_to_include=include, nodes_to_exclude=list(exclude))
        q.process()
        return q.model.model

    if scheme == "int8-weight":
        return run(graph, 8, exclude=kept)
    if scheme == "int4":
        return run(graph, 4, exclude=kept)
    return run(run(graph, 4, exclude=gates + kept), 8, include=gates, exclude=kept)


def _bits_of(graph, scheme: str):
    gates, kept = set(gate_matmuls(graph)), set(kept_float_matmuls(graph))
    return lambda n: None if n in kept else (8 if scheme == "int8-weight" or (scheme == "int4+gate8" and n in gates)
                                             else 4, 32)


def _summary(model, base):
    nodes = {n.name: (list(n.input), sorted((a.name, a.i) for a in n.attribute))
             for n in model.graph.node if n.op_type == "MatMulNBits"}
    read = {x for n in model.graph.node for x in n.input}
    inits = {t.name: numpy_helper.to_array(t, str(base)).tobytes() for t in model.graph.initializer if t.name in read}
    return nodes, inits


@pytest.fixture(scope="module")
def fp32_exports(tmp_path_factory):
    """One fp32 export per case, shared by its three schemes (an export is most of each test's time)."""
    made = {}

    def get(case):
        if case not in made:
            gate, layout, is_hybrid, tied = CASES[case]
            d = tmp_path_factory.mktemp(case)
            onnx_export.export_checkpoint(_save(_model(gate, is_hybrid, tied), layout, d / "ckpt", bf16=False),
                                          d / "fp32")
            made[case] = d / "fp32"
        return made[case]
    return get


# ONNX Runtime's int4 quantizer takes half a minute a model: one model's int4 cases in the default step, the others' in
# CI's slow step (the default step's 25-minute limit)
MATMUL_CASES = [pytest.param(c, s, id=f"{c}-{s}", marks=[pytest.mark.slow] if s.startswith("int4") and c != "qwen35-baseline-tied"
                             else []) for c in ("qwen35-baseline-tied", "qwen35-gated-r2", "official-headwise")
                for s in ("int4", "int4+gate8", "int8-weight")]


@pytest.mark.parametrize("case, scheme", MATMUL_CASES)
def test_one_matmul_at_a_time_equals_onnxruntimes_quantizer(tmp_path, fp32_exports, case, scheme):
    fp32 = fp32_exports(case)
    src = fp32 / "model.onnx"
    (tmp_path / "q").mkdir()
    graph = onnx.load(str(src), load_external_data=False)
    counts = weight_only.quantize_weight_only(src, tmp_path / "q" / "model.onnx", _bits_of(graph, scheme))
    ours = onnx.load(str(tmp_path / "q" / "model.onnx"))
    ref_nodes, ref_inits = _summary(_reference(src, scheme), tmp_path)
    our_nodes, our_inits = _summary(ours, tmp_path / "q")
    assert our_nodes == ref_nodes and our_inits == ref_inits
    assert counts["int4" if scheme.startswith("int4") else "int8"] > 0
    assert counts["float"] == len(kept_float_matmuls(graph))  # a Gated DeltaNet's in_proj_a and in_proj_b
    for f in ("config.json", "quantgate.json", "tokenizer.json"):
        (tmp_path / "q" / f).write_bytes((fp32 / f).read_bytes())
    with OrtRunner(tmp_path / "q") as r:
        assert np.isfinite(r.logits(W)).all()


@pytest.mark.slow  # moved out of the default step (its 25-minute limit); CI's slow step runs it
def test_external_data_in_and_out_and_every_weight_mapped_not_copied(tmp_path, monkeypatch):
    gate, layout, is_hybrid, tied = CASES["qwen35-baseline-tied"]
    d = _save(_model(gate, is_hybrid, tied), layout, tmp_path / "ckpt", bf16=True)
    monkeypatch.setattr(onnx_export, "INLINE_LIMIT", 0)
    onnx_export.export_checkpoint(d, tmp_path / "fp32")
    src = tmp_path / "fp32" / "model.onnx"
    assert (tmp_path / "fp32" / EXTERNAL_DATA).is_file()
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer
    seen: list[tuple[bool, int]] = []
    real = DefaultWeightOnlyQuantizer.qbits_block_quant

    def recording(self, w):
        seen.append((isinstance(w, np.memmap), w.nbytes))
        return real(self, w)

    monkeypatch.setattr(DefaultWeightOnlyQuantizer, "qbits_block_quant", recording)
    monkeypatch.setattr(weight_only, "INLINE_LIMIT", 0)
    (tmp_path / "q").mkdir()
    graph = onnx.load(str(src), load_external_data=False)
    weight_only.quantize_weight_only(src, tmp_path / "q" / "model.onnx", _bits_of(graph, "int4"))
    assert (tmp_path / "q" / EXTERNAL_DATA).is_file()
    # every weight reached ORT's kernel mapped from a file (the export's data, or the untied head's scratch file),
    # never as an in-memory copy; the scratch file is gone
    assert seen and all(mapped for mapped, _ in seen), seen
    assert not (tmp_path / "q" / ".untied-lm-head.bin").exists()
    ours = _summary(onnx.load(str(tmp_path / "q" / "model.onnx")), tmp_path / "q")
    assert ours == _summary(_reference(src, "int4"), tmp_path / "fp32")


@pytest.mark.slow  # moved out of the default step (its 25-minute limit); CI's slow step runs it
def test_the_whole_graph_schemes_are_refused_where_the_export_cannot_fit(tmp_path, monkeypatch):
    import quantgate.quant.ort as onnx_quantize
    from quantgate.errors import QuantgateError
    gate, layout, is_hybrid, tied = CASES["official-headwise"]
    d = _save(_model(gate, is_hybrid, tied), layout, tmp_path / "ckpt", bf16=False)
    onnx_export.export_checkpoint(d, tmp_path / "fp32")
    monkeypatch.setattr(onnx_quantize, "available_memory", lambda: 10 ** 5)
    for scheme in ("int8-dynamic", "int8-static"):
        with pytest.raises(QuantgateError, match=f"{scheme} runs onnxruntime.quantization on the whole graph"):
            onnx_quantize.quantize_onnx(tmp_path / "fp32", tmp_path / scheme, scheme)
        assert not (tmp_path / scheme).exists()
    summary = onnx_quantize.quantize_onnx(tmp_path / "fp32", tmp_path / "int4", "int4")  # streams: not refused
    assert summary["bytes"] > 0


@pytest.mark.parametrize("case", ["qwen35-gated-r2", "qwen35-baseline-tied"])
def test_the_allocators_units_are_the_matmuls_the_recipes_quantize(fp32_exports, case):
    """quant.allocate_onnx's units on a hybrid and a tied export: every MatMul the int4 recipe turns into
    MatMulNBits (a tied head as the embedding's unit, the GDN's in_proj_a/in_proj_b left float), its [K, N] from
    the initializer; the gate units are exactly the recipes' gate MatMuls (fused q|gate, GDN in_proj_z)."""
    from quantgate.quant.allocate_onnx import units_of
    src = fp32_exports(case) / "model.onnx"
    graph = onnx.load(str(src), load_external_data=False)
    g = units_of(src)
    names = {u.name for u in g.units}
    inits = {t.name: t for t in graph.graph.initializer}
    matmuls = {n.name: n for n in graph.graph.node if n.op_type == "MatMul" and n.input[1] in inits}
    kept = set(kept_float_matmuls(graph))
    assert names - {g.embed} == set(matmuls) - kept and not names & kept
    assert {u.name for u in g.units if u.is_gate} == set(gate_matmuls(graph))
    for u in g.units:
        if u.name in matmuls:
            assert [u.k, u.n] == list(inits[matmuls[u.name].input[1]].dims)
    assert bool(g.head_of) == case.endswith("tied")
