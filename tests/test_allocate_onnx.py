"""The ONNX allocator (quantgate.quant.allocate_onnx): MatMulNBits bits and block size per node under a size budget,
from per-node KLD measured by ONNX Runtime; the byte model is ORT's own, the written graph holds the planned nodes,
the gate A/B holds the gates, and bad budgets or GGUF-only flags are one line with nothing written."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from conftest import run_cli, save_tiny_twins
from quantgate.quant import allocate_onnx as ao
from quantgate.runners import OrtRunner

W = np.random.default_rng(0).integers(3, 250, size=(2, 48))


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    d = save_tiny_twins(tmp_path_factory.mktemp("onnx-alloc"))
    r = run_cli("export", "onnx", str(d / "gated"), "--out", str(d / "onnx"))
    assert r.returncode == 0, r.stderr[-2000:]
    return d / "onnx"


def _nodes(folder):
    """{unit name: option} read back from the written graph, and each node's stored bytes (packed + scales)."""
    m = onnx.load(str(folder / "model.onnx"))
    inits = {t.name: t for t in m.graph.initializer}
    got, stored = {}, {}
    for n in m.graph.node:
        if n.op_type not in ("MatMulNBits", "GatherBlockQuantized"):
            continue
        a = {x.name: x.i for x in n.attribute}
        name = n.name.rsplit("_Q", 1)[0] if n.op_type == "MatMulNBits" else n.input[0].rsplit("_Q", 1)[0]
        got[name] = f"int{a['bits']}/{a['block_size']}"
        if n.op_type == "MatMulNBits" and n.input[1] not in inits:
            continue  # a tied head reading the embedding's table (its bytes are the table's)
        own = n.input[1:3] if n.op_type == "MatMulNBits" else (n.input[0], n.input[2])
        stored[name] = sum(numpy_helper.to_array(inits[i]).nbytes for i in own)
    return got, stored


def test_the_byte_model_is_what_ort_writes_for_every_option(export, tmp_path):
    """Each unit's predicted bytes at each option equal the packed blocks and scales ORT's quantizer wrote, so a
    budget in bytes is met by the file, not only by the plan."""
    graph = ao.units_of(export / "model.onnx")
    assert graph.embed is not None and any(u.is_gate for u in graph.units)
    rng = np.random.default_rng(0)
    for i in range(3):
        options = {u.name: str(rng.choice(u.candidates())) for u in graph.units}
        folder = tmp_path / f"g{i}"
        folder.mkdir()
        ao.write_graph(export / "model.onnx", export, folder, graph, options, {"quantization": {"scheme": "t"}})
        got, stored = _nodes(folder)
        matmuls = {u.name for u in graph.units} - {graph.embed}
        assert {k: v for k, v in got.items() if k in matmuls} == {k: options[k] for k in matmuls}
        for u in graph.units:
            if u.name in matmuls:
                assert stored[u.name] == u.bytes(options[u.name]), (u.name, options[u.name])
        table = [v for k, v in stored.items() if k not in matmuls]
        assert table == [graph.units[[u.name for u in graph.units].index(graph.embed)].bytes(options[graph.embed])]
        with OrtRunner(folder) as r:
            assert np.isfinite(r.logits(W)).all()


def test_quantize_target_bpw_on_an_onnx_export(export, tmp_path):
    out = tmp_path / "auto"
    r = run_cli("quantize", str(export), "--target-bpw", "6", "--out", str(out), "--calib-windows", "4", "--ctx", "64",
                "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert s["bits_per_weight"] <= 6.0 and s["predicted_kld"] > 0
    got, _ = _nodes(out)
    assert {k: v for k, v in got.items() if k in s["types"]} == {k: v for k, v in s["types"].items() if k in got}
    assert len(set(s["types"].values())) > 1  # a budget between the options mixes them
    sens = s["sensitivity"]["delta"]
    # measured, not assumed: every unit's deltas exist for its options, and int4 in blocks of 32 costs more KLD than
    # int8 in blocks of 32 for most units (the base's deltas are 0)
    units = {u.name: u for u in ao.units_of(export / "model.onnx").units}
    assert set(sens) == set(units)
    assert all(d[ao.BASE] == 0.0 and set(d) == set(units[n].candidates()) for n, d in sens.items())
    assert np.mean([d["int4/32"] > 0 for d in sens.values()]) > 0.7
    meta = json.loads((out / "quantgate.json").read_text())["quantization"]
    assert meta["scheme"] == "auto@6 bpw" and meta["options"] == s["types"]
    assert json.loads((out / "allocation.json").read_text())["types"] == s["types"]
    with OrtRunner(out) as runner:
        assert np.isfinite(runner.logits(W)).all()
    # the held arm: gates at the allocation's base option, the budget still met; and the folder is replaced
    r = run_cli("quantize", str(export), "--target-bpw", "6", "--hold-gates", "--out", str(out), "--calib-windows", "4",
                "--ctx", "64", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    held = json.loads(r.stdout)
    assert held["bits_per_weight"] <= 6.0 and held["gate_types"]
    weight: dict = {}
    for name, o in held["types"].items():
        if name not in held["gate_types"]:
            weight[o] = weight.get(o, 0) + units[name].n_elements
    base = max(weight, key=weight.get)
    for name, o in held["gate_types"].items():
        u = units[name]
        assert abs(u.bits(o) - u.bits(base)) == min(abs(u.bits(t) - u.bits(base)) for t in u.candidates())
    assert held["predicted_kld"] >= s["predicted_kld"] - 1e-12  # the free arm's optimum is the lower bound


@pytest.mark.parametrize("args, needle", [
    (["--target-bpw", "3"], "below the smallest graph"),
    (["--target-size", "10MB"], "not below the fp32 export"),
    (["--target-bpw", "5", "--decode-floor", "Q4_K_M"], "a uniform option (int4/32)"),
    (["--target-bpw", "5", "--decode-floor", "1e9"], "give tok/s"),
    (["--target-bpw", "5", "--types", "Q4_K"], "--types applies to a GGUF allocation"),
    (["--target-bpw", "5", "--scheme", "int4"], "replace --type, --scheme"),
])
def test_bad_onnx_budgets_are_one_line_and_write_nothing(export, tmp_path, args, needle):
    out = tmp_path / "x"
    r = run_cli("quantize", str(export), *args, "--out", str(out), "--calib-windows", "2", "--ctx", "32")
    _refused(r, needle)
    assert not out.exists() and not list(tmp_path.glob(".x*"))


def test_a_quantized_export_is_refused(export, tmp_path):
    q = tmp_path / "int4"
    assert run_cli("quantize", str(export), "--scheme", "int4", "--out", str(q)).returncode == 0
    _refused(run_cli("quantize", str(q), "--target-bpw", "6", "--out", str(tmp_path / "y")), "already quantized")


def _refused(r, needle: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


def test_onnx_budget_cells_parse_and_run_through_the_one_quantize_door(export, tmp_path):
    """`onnx:auto@6` (and `+held`, `auto@40MB`) is a config the report's cells and `quant.quantize` take; a bad one
    is one line before anything runs."""
    from quantgate.errors import QuantgateError
    from quantgate.quant import get
    from quantgate.quant.build import CalibSettings, quantize
    from quantgate.report.settings import ReportSettings, check_settings
    s = get("onnx", "auto@6+held")
    assert (s.target_bpw, s.target_bytes, s.hold_gates, s.tool) == (6.0, None, True, "budget")
    assert get("onnx", "auto@40MB").target_bytes == 40_000_000
    check_settings(ReportSettings("b", "g", str(tmp_path / "r"), backends=("onnx",), schemes={"onnx": ["int4", "auto@6"]}))
    for bad, needle in (("auto@0.5", "between 1 and 32"), ("auto@6+imatrix", "unknown onnx scheme")):
        with pytest.raises(QuantgateError, match=needle):
            get("onnx", bad)
    with pytest.raises(QuantgateError, match="unknown ONNX scheme"):
        get("onnx", "auto@6", "ONNX scheme")  # --scheme names a recipe; a budget is --target-bpw
    summary = quantize(export, get("onnx", "auto@6"), tmp_path / "cell", CalibSettings(windows=4, ctx=64))
    assert summary["bits_per_weight"] <= 6.0 and json.loads((tmp_path / "cell" / "allocation.json").read_text())[
        "types"] == summary["types"]


def test_the_proxy_dequantizes_orts_blocks_as_matmulnbits_reads_them(tmp_path):
    """dequantize_blocks against ONNX Runtime's own MatMulNBits kernel (accuracy_level 0: fp32 compute) fed the
    identity, for both bits and two block sizes, including a K that is no multiple of the block."""
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from quantgate.quant.ort_weight_only import block_quantizer
    rng = np.random.default_rng(0)
    for bits, block, k in ((4, 32, 96), (8, 32, 96), (4, 128, 256), (8, 64, 80)):
        w = rng.standard_normal((k, 24)).astype(np.float32)
        packed, scales, _ = block_quantizer(bits, block).qbits_block_quant(w)
        node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=k, N=24, bits=bits,
                                block_size=block, accuracy_level=0)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, 24])],
                              [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "s")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        y = ort.InferenceSession(m.SerializeToString()).run(None, {"x": np.eye(k, dtype=np.float32)})[0]
        np.testing.assert_allclose(ao.dequantize_blocks(packed, scales, bits, block, k), y, rtol=1e-6, atol=1e-6)
        assert np.abs(y - w).max() > 0  # it is quantized


def test_onnx_proxy_allocation_within_the_budget(export, tmp_path):
    """`--sensitivity proxy` (automatic above 100M weights): no calibration run, the budget met, the folder says
    which sensitivity chose, no predicted KLD; int4 errors exceed int8's for every unit."""
    out = tmp_path / "proxy"
    r = run_cli("quantize", str(export), "--target-bpw", "6", "--sensitivity", "proxy", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert s["sensitivity_kind"] == "proxy" and s["predicted_kld"] is None and s["predicted_proxy_error"] > 0
    assert s["bits_per_weight"] <= 6.0 and len(set(s["types"].values())) > 1
    assert all(d["int4/32"] > d["int8/32"] == 0.0 for d in s["sensitivity"]["delta"].values())
    assert json.loads((out / "quantgate.json").read_text())["quantization"]["sensitivity"] == "proxy"
    with OrtRunner(out) as runner:
        assert np.isfinite(runner.logits(W)).all()


def test_a_target_size_is_the_folders_bytes(export, tmp_path):
    """`--target-size`: model.onnx and its data come out no larger than asked, though every MatMulNBits node adds
    names and attributes to the graph the budget cannot see until it is written."""
    from quantgate.formats.onnx_io import onnx_bytes
    graph = ao.units_of(export / "model.onnx")
    lo = sum(min(u.bytes(o) for o in u.candidates()) for u in graph.units)
    hi = sum(max(u.bytes(o) for o in u.candidates()) for u in graph.units)
    target = onnx_bytes(export) - graph.unit_float_bytes + (lo + hi) // 2
    out = tmp_path / "sized"
    r = run_cli("quantize", str(export), "--target-size", str(target), "--sensitivity", "proxy", "--out", str(out),
                "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert onnx_bytes(out) <= target and json.loads(r.stdout)["bytes"] == onnx_bytes(out)


def test_an_onnx_decode_floor_is_met_as_predicted_and_one_out_of_reach_is_one_line(export, tmp_path):
    """`--decode-floor int4/32` (or a fraction of it, or tok/s): per-option decode timings taken here, the graph
    predicted at least that fast, the written graph timed against the floor, both in the folder's metadata (a floor
    far under int4/32's speed: the check's loop is the scripted test's business); a floor no allocation reaches is
    one line."""
    out = tmp_path / "floored"
    r = run_cli("quantize", str(export), "--target-bpw", "6", "--sensitivity", "proxy", "--decode-floor",
                "0.5xINT4/32", "--threads", "1", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert s["decode_floor"] == "0.5xint4/32" and s["predicted_decode_tps"] >= s["floor_tps"] * (1 - 1e-9)
    assert set(s["decode_cost"]["measured_s"]) == set(ao.OPTIONS) and s["decode_cost"]["protocol"]["kv"] == "f32"
    check = s["floor_checks"][-1]
    assert check["written_tps"] >= check["floor_tps"] > 0
    assert "the graph measured" in json.loads((out / "quantgate.json").read_text())["quantization"]["decode_floor"]
    far = run_cli("quantize", str(export), "--target-bpw", "6", "--sensitivity", "proxy", "--decode-floor", "1000000",
                  "--threads", "1", "--out", str(tmp_path / "far"))
    _refused(far, "decode floor out of reach")
    assert not (tmp_path / "far").exists()


@pytest.mark.parametrize("floor, script, needle", [
    ("0.5xint4/32", [(90.0, 100.0), (120.0, 100.0)], None),
    ("0.5xint4/32", [(99.0, 100.0)] * 3, "recipe"),
    ("1", [(0.99, 1.0)] * 3, "not met by the written graph: 0.99 tok/s measured against the floor's 1 after 3 graphs"),
    ("1", [(1e-9, 1.0)], "not met by the written graph: 1e-09 tok/s measured against the floor's 1, and no allocation"),
])
def test_the_written_graph_is_timed_against_the_floor(export, tmp_path, monkeypatch, floor, script, needle):
    """As for GGUF: a graph measurably short of the floor (scripted timings, every round at the scripted ratio)
    makes the allocation ask its speed model for that much more and write again, the folder holding the last graph;
    still short after FLOOR_TRIES graphs, the floor's own uniform recipe where the floor names one (it decodes as the
    floor), else one line with nothing written, as for a shortfall no allocation is predicted to make up."""
    from quantgate.errors import QuantgateError
    from quantgate.quant.decode_cost import FloorCheck
    from quantgate.quant.targets import parse_floor
    calls = iter(script)

    def check(*_a, **_k):
        got, want = next(calls)
        return FloorCheck(got, want, [got / want] * 9)
    monkeypatch.setattr(ao, "floor_check", check)
    out = tmp_path / "f"
    floor = parse_floor(floor, references=ao.OPTIONS)
    if needle == "recipe":
        s = ao.allocate_onnx(export, out, 6.0, sensitivity="proxy", threads=1, decode_floor=floor)
        assert s["floor_recipe"] == "int4/32" and len(s["floor_checks"]) == ao.FLOOR_TRIES
        assert s["types"] == ao.uniform_types(ao.units_of(export / "model.onnx"), "int4/32")
        assert "met by int4/32's own options" in json.loads((out / "quantgate.json").read_text())["quantization"][
            "decode_floor"]
        return
    if needle:
        with pytest.raises(QuantgateError, match=needle):
            ao.allocate_onnx(export, out, 6.0, sensitivity="proxy", threads=1, decode_floor=floor)
        assert not out.exists() and not list(tmp_path.iterdir())
        return
    s = ao.allocate_onnx(export, out, 6.0, sensitivity="proxy", threads=1, decode_floor=floor)
    first, second = s["floor_checks"]
    assert (first["written_tps"], second["written_tps"]) == (90.0, 120.0)
    assert second["predicted_tps"] >= s["floor_tps"] / 0.9 * (1 - 1e-9) and s["bits_per_weight"] <= 6.0
    got, _ = _nodes(out)
    assert {k: v for k, v in got.items() if k in s["types"]} == {k: v for k, v in s["types"].items() if k in got}
