"""The torch allocator (quantgate.quant.allocate_torch): int bits and group size per block Linear under a bits-per-
weight budget, from per-Linear KLD measured by the PyTorch runner; the saved checkpoint holds the planned bits and
groups (and `quantgate info` counts them as the plan did), the gate A/B holds the gates, hybrid and MoE models
get their gates and stacked experts as units, and bad budgets or flags are one line with nothing written."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import run_cli, save_tiny_twins, tree_snapshot
from quantgate.errors import QuantgateError
from quantgate.formats import load_checkpoint
from quantgate.model import build_model, hybrid, preset
from quantgate.quant import TorchBudget, get
from quantgate.quant import allocate_torch as at
from quantgate.quant.build import CalibSettings, quantize
from quantgate.quant.simulate import block_bits_per_weight, block_linears


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    return save_tiny_twins(tmp_path_factory.mktemp("torch-alloc"))


def _calib(d):
    return ["--calib-data", str(d / "text.txt"), "--calib-windows", "4", "--ctx", "64"]


def test_the_bit_count_is_what_the_checkpoint_stores(twins):
    """For random options, the units' bits equal `quantgate info`'s block_bits_per_weight of the model they produce,
    so a budget met by the plan is met by the saved checkpoint."""
    model = load_checkpoint(twins / "gated").model
    units, kept = at.units_of(model)
    assert kept == 0 and any(u.is_gate for u in units)
    rng = np.random.default_rng(0)
    for _ in range(3):
        m = load_checkpoint(twins / "gated").model
        options = {u.name: str(rng.choice(u.candidates())) for u in units}
        at._apply(m, units, options)
        planned = 8 * sum(u.bytes(options[u.name]) for u in units) / sum(u.n_elements for u in units)
        assert block_bits_per_weight(m) == pytest.approx(planned, rel=1e-9)
        lin = block_linears(m)
        for u in units:
            bits, group = at.spec(options[u.name])
            w = lin[u.linears[0]].weight
            # the stored weight is on that grid: at most 2^bits levels per group of `group` inputs
            levels = max(len(torch.unique(w[r, c:c + group])) for r in range(2) for c in range(0, u.k, group))
            assert levels <= 2 ** bits and (lin[u.linears[0]].weight_bits, lin[u.linears[0]].group_size) == (bits, group)


def test_cli_allocates_under_the_budget_and_beats_the_uniform_scheme(twins, tmp_path):
    """`quantize DIR --target-bpw 4.5` writes a checkpoint at <= 4.5 block bits per weight that reloads with every
    Linear's planned bits and group, records its allocation, and carries less KLD on held-out text than the uniform
    w4a16-g32 at the same 4.5 bits (the uniform assignment is one the allocator could have chosen)."""
    out = tmp_path / "a45"
    r = run_cli("quantize", str(twins / "gated"), "--target-bpw", "4.5", *_calib(twins), "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert 4.4 < summary["bits_per_weight"] <= 4.5 and summary["sensitivity_kind"] == "measured"
    side = json.loads((out / "allocation.json").read_text())
    assert side["types"] == summary["types"] and side["sensitivity"]["kind"] == "measured"
    m = load_checkpoint(out).model
    assert m.cfg.extra["quant_scheme"]["allocated"] and block_bits_per_weight(m) == pytest.approx(
        summary["bits_per_weight"], abs=1e-4)
    lin = block_linears(m)
    for unit, option in summary["types"].items():
        assert (lin[unit].weight_bits, lin[unit].group_size) == at.spec(option)
    sens = summary["sensitivity"]
    uniform_pred = sens["base_kld"] + sum(d["int4/32"] for d in sens["delta"].values())
    assert summary["predicted_kld"] <= uniform_pred
    r = run_cli("quantize", str(twins / "gated"), "--scheme", "w4a16-g32", "--out", str(tmp_path / "w4"))
    assert r.returncode == 0, r.stderr[-2000:]
    kld = {}
    for name in ("a45", "w4"):
        r = run_cli("eval", str(tmp_path / name), "--reference", str(twins / "gated"), "--data", str(twins / "text.txt"),
                    "--ctx", "64", "--max-windows", "16", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        kld[name] = json.loads(r.stdout)["kld_mean"]
    assert kld["a45"] < kld["w4"], kld


def test_held_gates_take_the_base_option_and_report_cells_allocate(twins, tmp_path):
    """`torch:auto@5+held` (a report cell's config, through quant.build.quantize) holds every gate unit at the option
    most of the other weights took; the free arm at the same budget is another allocation of the same bytes."""
    from quantgate.report.settings import ReportSettings, check_settings
    sch = get("torch", "auto@5+held")
    assert isinstance(sch, TorchBudget) and sch.hold_gates and sch.target_bpw == 5.0
    check_settings(ReportSettings("b", "g", str(tmp_path / "r"), backends=("torch",),
                                  schemes={"torch": ["w8a16", "auto@5", "auto@5+held"]}))
    with pytest.raises(QuantgateError, match="unknown scheme"):
        get("torch", "auto@5", "scheme")  # --scheme names a recipe; a budget is --target-bpw
    calib = CalibSettings(str(twins / "text.txt"), 4, 64)
    free = quantize(twins / "gated", get("torch", "auto@5"), tmp_path / "free", calib)
    held = quantize(twins / "gated", sch, tmp_path / "held", calib)
    units, _ = at.units_of(load_checkpoint(twins / "gated").model)
    weight = {}
    for u in units:
        if not u.is_gate:
            weight[free["types"][u.name]] = weight.get(free["types"][u.name], 0) + u.n_elements
    base = max(weight, key=weight.get)
    assert held["gate_types"] and set(held["gate_types"].values()) == {base}
    assert held["bits_per_weight"] <= 5.0 and free["bits_per_weight"] <= 5.0
    assert load_checkpoint(tmp_path / "held").model.cfg.extra["allocation"]["hold_gates"] is True


def test_hybrid_and_moe_units():
    """A hybrid's Gated DeltaNet projections z, a, b and out are gate units (GGUF's attn_gate, ssm_alpha, ssm_beta,
    ssm_out); a MoE layer's experts' same projection is one unit (llama.cpp stacks them), its router stays float."""
    from test_moe import moe_model
    m = build_model(hybrid(preset("tiny", vocab_size=300, n_layers=4, gate="elementwise")), seed=0)
    units, _ = at.units_of(m)
    gates = {u.name.rpartition(".")[2] for u in units if u.is_gate}
    assert gates == {"in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "g_proj"}
    units, _ = at.units_of(moe_model())
    experts = [u for u in units if ".experts.*." in u.name]
    assert experts and all(len(u.linears) == 8 for u in experts)
    assert not any(u.name.endswith((".mlp.gate", "shared_expert_gate")) for u in units)
    assert sum(u.n_elements for u in units) == sum(lin.weight.numel() for lin in block_linears(moe_model()).values())


def test_proxy_orders_options_by_weight_error(twins):
    """The weight-error proxy: more bits or smaller groups never raise a unit's error, and BASE is its zero."""
    model = load_checkpoint(twins / "gated").model
    units, _ = at.units_of(model)
    sens = at.proxy_sensitivity(model, units)
    for u in units:
        d = sens.delta[u.name]
        assert d[at.BASE] == 0.0
        groups = sorted({at.spec(o)[1] for o in u.candidates()}, reverse=True)
        assert groups == ([128, 64, 32] if u.k % 128 == 0 else [64, 32])
        for g in groups:
            assert d[f"int3/{g}"] > d[f"int4/{g}"] > d[f"int5/{g}"] > d[f"int6/{g}"] > d[f"int8/{g}"] - 1e-12
        for b in (3, 4, 5, 6):
            errs = [d[f"int{b}/{g}"] for g in groups]
            assert errs == sorted(errs, reverse=True)


@pytest.mark.parametrize("args, needle", [
    (["--target-bpw", "3"], "below the smallest the options give (3.2"),  # k=64 rows: int3/64, k=128: int3/128
    (["--target-bpw", "32"], "not below float"),
    (["--target-size", "40MB"], "--target-size does not apply to a torch allocation"),
    (["--target-bpw", "5", "--decode-floor", "40"], "--decode-floor does not apply to a torch allocation"),
    (["--target-bpw", "5", "--imatrix", "auto"], "--imatrix does not apply to a torch allocation"),
    (["--target-bpw", "5", "--scheme", "w8a16"], "replace --type, --scheme and --gate-bits"),
])
def test_bad_budgets_are_one_line_and_write_nothing(twins, tmp_path, args, needle):
    before = tree_snapshot(twins)
    r = run_cli("quantize", str(twins / "gated"), *args, *_calib(twins), "--out", str(tmp_path / "x"))
    assert r.returncode != 0 and needle in r.stderr, r.stderr[-1500:]
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists() and tree_snapshot(twins) == before


def test_an_allocated_input_and_bad_saved_groups_are_refused(twins, tmp_path):
    """Allocating from an allocated checkpoint is refused (start from the float one); a hand-edited group size that
    does not divide its Linear's width is one line when the checkpoint is opened."""
    calib = CalibSettings(str(twins / "text.txt"), 4, 64)
    out = tmp_path / "a"
    quantize(twins / "gated", get("torch", "auto@6"), out, calib)
    with pytest.raises(QuantgateError, match="already quantized"):
        at.allocate_torch(out, tmp_path / "b", 5.0, str(twins / "text.txt"), 4, 64)
    assert not (tmp_path / "b").exists()
    cfg = json.loads((out / "config.json").read_text())
    groups = cfg["quantgate"]["quant_state"]["group_sizes"] if "quantgate" in cfg else None
    if groups is None:  # the block lives wherever the layout keeps quantgate's extras
        pytest.fail(f"no quant_state.group_sizes in config.json: {sorted(cfg)}")
    groups[next(iter(groups))] = 48
    (out / "config.json").write_text(json.dumps(cfg))
    r = run_cli("info", str(out))
    assert r.returncode != 0 and "group_sizes" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    with pytest.raises(QuantgateError, match="bits per weight"):
        get("torch", "auto@40MB")


@pytest.mark.parametrize("kind", ["hybrid", "moe"])
def test_hybrid_and_moe_checkpoints_allocate_and_reload(tmp_path, kind):
    """A Qwen3.5-style hybrid and a MoE hybrid (saved in their qwen3_5 / qwen3_5_moe layouts) allocate end to end: the
    checkpoint reloads with every Linear at its unit's bits and group (a MoE layer's experts all at one option), the
    bits counted as planned, and its logits are the in-memory allocation's."""
    from conftest import save_random_models
    from test_moe import moe_model
    from quantgate.runners import TorchRunner

    def make_hybrid():
        return build_model(hybrid(preset("tiny", vocab_size=300, n_layers=4, gate="elementwise")), seed=0)
    d = save_random_models(tmp_path, {kind: make_hybrid if kind == "hybrid" else moe_model})
    out = tmp_path / "a"
    s = at.allocate_torch(d / kind, out, 5.0, str(d / "t.txt"), 2, 32)
    m = load_checkpoint(out).model
    lin = block_linears(m)
    units, _ = at.units_of(m)
    for u in units:
        assert {(lin[n].weight_bits, lin[n].group_size) for n in u.linears} == {at.spec(s["types"][u.name])}
    assert block_bits_per_weight(m) == pytest.approx(s["bits_per_weight"], abs=1e-4) and s["bits_per_weight"] <= 5.0
    if kind == "moe":
        assert any(len(u.linears) > 1 for u in units)
    ref = load_checkpoint(d / kind).model
    at._apply(ref, units, s["types"])
    w = np.random.default_rng(0).integers(3, 250, size=(2, 24))
    np.testing.assert_allclose(TorchRunner(m).logits(w), TorchRunner(ref).logits(w), rtol=1e-5, atol=1e-5)


def test_report_cells_take_torch_budgets(twins, tmp_path):
    """`report --schemes torch:auto@5,torch:auto@5+held` scores allocated checkpoints as cells: each at <= 5 block bits
    per weight, the gated twin's held arm a different checkpoint from its free one."""
    r = run_cli("report", "--models", str(twins / "baseline"), str(twins / "gated"), "--data", str(twins / "text.txt"),
                "--backends", "torch", "--schemes", "torch:w4a16-g32,torch:auto@5,torch:auto@5+held", "--windows", "8",
                "--ctx", "64", "--calib-windows", "4", "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr[-2000:]
    cells = json.loads((tmp_path / "rep" / "report.json").read_text())["cells"]
    for twin in ("baseline", "gated"):
        for s in ("auto@5", "auto@5+held"):
            c = cells[f"torch/{twin}/{s}"]
            assert 4.9 < c["bits_per_weight"] <= 5.0 and c["kld_mean"] > 0
    free, held = (load_checkpoint(cells[f"torch/gated/{s}"]["artifact"]).model for s in ("auto@5", "auto@5+held"))
    assert free.cfg.extra["allocation"]["hold_gates"] is False and held.cfg.extra["allocation"]["hold_gates"] is True
