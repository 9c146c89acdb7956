"""One registry of schemes for every backend: `quantize --list`, gguf-py's enums, and gate-aware cells that
keep the same tensors at 8 bits on torch, ONNX Runtime and llama.cpp."""
import json
import re

import gguf
import pytest

from conftest import run_cli, save_k_quant_model
from quantgate.quant import SCHEMES, get, names, plain_of


def test_list_json_names_every_scheme_of_every_backend_with_its_bits_and_scope():
    r = run_cli("quantize", "--list", "--json")
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    rows = {row["key"]: row for row in json.loads(r.stdout)}
    assert set(rows) == set(SCHEMES) and {k.partition(":")[0] for k in rows} == {"torch", "onnx", "gguf", "torchao"}
    assert all(isinstance(row["weight_bits"], int) or row["weight_bits"] is None for row in rows.values())
    assert rows["torch:w4a16-g32"]["weight_bits"] == 4 and rows["gguf:Q8_0"]["weight_bits"] == 8
    assert rows["torch:w4a16-g32-gate8"]["keep"] == {"bits": 8, "scope": "gate", "tensors": "the gate rows W_g only"}
    assert rows["torch:w4a16-g32-qgate8"]["keep"] == rows["onnx:int4+gate8"]["keep"] == rows["gguf:Q4_K_M+gate8"]["keep"]
    assert rows["onnx:int4+gate8"]["keep"]["scope"] == "q_and_gate" and rows["onnx:int4"]["keep"] is None
    assert rows["torch:w8a8-static"]["calibration"] and not rows["torch:w4a16-g32"]["calibration"]
    text = run_cli("quantize", "--list", "--backend", "llama.cpp")
    assert text.returncode == 0 and "Q4_K_M+gate8" in text.stdout and "w8a8-static" not in text.stdout


def test_a_model_and_out_are_still_required_without_list(tmp_path):
    for args, needle in ((["--scheme", "int4", "--out", "x"], "missing MODEL"), (["m", "--scheme", "int4"], "missing --out")):
        r = run_cli("quantize", *args, cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
        assert not any(tmp_path.iterdir())


def test_gguf_types_are_gguf_py_enums():
    from quantgate.formats.gguf import FILE_TYPE_NAMES
    from quantgate.quant.llama_cpp import FILE_TYPES
    members = gguf.LlamaFileType.__members__
    assert all(f"MOSTLY_{get('gguf', n).file_type}" in members for n in names("gguf"))  # every offered type exists
    assert FILE_TYPES["Q4_K_M"] == 15 and FILE_TYPE_NAMES[0] == "F32" and FILE_TYPE_NAMES[15] == "Q4_K_M"


def _report_gate_aware(schemes: dict) -> dict:
    return {(b, n): get(b, n) for b, ns in schemes.items() for n in ns if get(b, n).keep is not None}


def test_the_reports_gate_aware_cells_name_one_scope_and_their_plain_partner():
    from quantgate.demo import DEMO_SCHEMES
    from quantgate.report import DEFAULT_SCHEMES
    for schemes in (DEFAULT_SCHEMES, DEMO_SCHEMES):
        aware = _report_gate_aware(schemes)
        assert {b for b, _ in aware} == {"torch", "onnx", "gguf"}
        assert len({s.keep for s in aware.values()}) == 1, aware  # the same tensors kept on every backend
        assert all(plain_of(s) in schemes[b] for (b, _), s in aware.items())


def _kept_at_8_bits(backend: str, path) -> dict[int, set]:
    """Per layer, which rows of the attention input projection an artifact stores at 8 bits ("q", "gate"),
    read back from what was written: config.json's stored bits, ONNX MatMulNBits attributes, GGUF types."""
    kept: dict[int, set] = {}
    if backend == "torch":
        bits = json.loads((path / "config.json").read_text())["quantgate"]["quant_state"]["weight_bits"]
        for name, b in bits.items():
            m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
            if b == 8:
                kept.setdefault(int(m[1]), set()).update(
                    {"self_attn.q_proj": {"q"}, "self_attn.g_proj": {"gate"}}.get(m[2], {m[2]}))
        return kept
    if backend == "onnx":
        import onnx
        for n in onnx.load(str(path / "model.onnx")).graph.node:
            if n.op_type == "MatMulNBits" and {a.name: a.i for a in n.attribute}["bits"] == 8:
                m = re.search(r"layers\.(\d+)\.(.+)\.MatMul", n.name)
                kept.setdefault(int(m[1]), set()).update({"q", "gate"} if m[2] == "self_attn.qg_proj" else {m[2]})
        return kept
    from quantgate.formats.gguf import inspect_gguf
    for name, t in inspect_gguf(path).tensor_types.items():
        m = re.fullmatch(r"blk\.(\d+)\.(.+)\.weight", name)
        if m and t == "Q8_0":
            kept.setdefault(int(m[1]), set()).update({"q", "gate"} if m[2] == "attn_q" else {m[2]})
    return kept


@pytest.mark.slow  # moved out of the default step (its 25-minute limit); CI's slow step runs it
def test_gate_aware_cells_keep_the_same_tensors_at_8_bits_on_torch_onnx_and_gguf(tmp_path):
    from quantgate.export.onnx import export_checkpoint as export_onnx
    from quantgate.quant import quantize
    from quantgate.report import DEFAULT_SCHEMES
    m = save_k_quant_model(tmp_path)  # k-quants take every tensor: no Q8_0 fallbacks to confuse the count
    export_onnx(tmp_path / "m", tmp_path / "fp32")
    sources = {"torch": tmp_path / "m", "onnx": tmp_path / "fp32", "gguf": tmp_path / "m.gguf"}
    kept = {}
    for (backend, name), scheme in _report_gate_aware(DEFAULT_SCHEMES).items():
        out = tmp_path / f"{backend}-{name}" if backend != "gguf" else tmp_path / f"{name}.gguf"
        quantize(sources[backend], scheme, out)
        kept[backend] = _kept_at_8_bits(backend, out)
    want = {i: {"q", "gate"} for i in range(m.cfg.n_layers)}
    assert kept == {"torch": want, "onnx": want, "gguf": want}, kept


def test_the_keep_scope_names_gated_deltanet_layers_only_for_a_hybrid(tmp_path):
    """`quantize --list` with a model says what each keep scope holds in that model; without one, the general rule."""
    from conftest import save_tiny_twins
    from quantgate.formats import save_checkpoint
    from quantgate.model import build_model, hybrid, preset
    from quantgate.tokenizer import byte_tokenizer
    d = save_tiny_twins(tmp_path)
    save_checkpoint(build_model(hybrid(preset("tiny", vocab_size=300, n_layers=4, head_dim=32))), tmp_path / "h",
                    byte_tokenizer())
    words = {}
    for name, args in (("none", []), ("dense", [str(d / "gated")]), ("hybrid", [str(tmp_path / "h")])):
        r = run_cli("quantize", *args, "--list", "--json")
        assert r.returncode == 0, r.stderr[-1000:]
        words[name] = {row["keep"]["tensors"] for row in json.loads(r.stdout) if row["keep"]}
    assert any("in a hybrid also every Gated DeltaNet" in w for w in words["none"])
    assert not any("Gated DeltaNet" in w for w in words["dense"]) and words["dense"]
    assert any(w.endswith(", and every Gated DeltaNet's output-gate projection (in_proj_z)") for w in words["hybrid"])
    assert not any("in a hybrid" in w for w in words["hybrid"])


def test_each_backend_runs_the_config_object_it_is_given():
    """quant.build hands each backend the scheme's config object; what runs is read from its fields (a hand-made
    config with another keep scope is refused by the backend, not silently run as its name's registry entry)."""
    from dataclasses import replace

    import pytest

    from quantgate.errors import QuantgateError
    from quantgate.quant import KeepAt
    from quantgate.quant.llama_cpp import gguf_scheme
    from quantgate.quant.ort import onnx_scheme
    g = get("gguf", "Q4_K_M+gate8")
    assert gguf_scheme(g) is g and gguf_scheme("q4_k_m", gate_bits=8) == g
    assert gguf_scheme("Q4_K_M", imatrix="auto").imatrix
    with pytest.raises(QuantgateError, match="keeps gate at 8 bits"):
        gguf_scheme(replace(g, keep=KeepAt(8, "gate")))  # a GGUF stores q and gate rows in one tensor
    with pytest.raises(QuantgateError, match="KV-cache type chosen at run time"):
        gguf_scheme(get("gguf", "kv-q8_0"))
    o = get("onnx", "int4+gate8")
    assert onnx_scheme(o).keep == o.keep and onnx_scheme("int4", gate_bits=8).keep == o.keep
    assert onnx_scheme(o, block_size=64).block_size == 64
    with pytest.raises(QuantgateError, match="keeps q_and_gate at 4 bits"):
        onnx_scheme(replace(o, keep=KeepAt(4, "q_and_gate")))
    with pytest.raises(QuantgateError, match="export itself"):
        onnx_scheme(get("onnx", "fp32"))
