"""The report's verdicts come from intervals: synthetic cells and attention patterns with a known answer."""
from __future__ import annotations

import numpy as np
import pytest

from quantgate.report.compare import DISAGREE, compare_cells, input_of, sqnr_link
from quantgate.report.conclusion import comparison_line, conclusion, twin_comparisons
from quantgate.report.sinks import SINK_EPSILON, sink_sentence, sink_summary
from quantgate.stats import NOT_RESOLVED, across_seeds, correlation_intervals, delta_ppl_pct, interval

W = 32  # windows


def cell(kld, nll, ref_nll, top1=None, wid="w0") -> dict:
    kld, nll, ref_nll = (np.asarray(a, dtype=np.float64) for a in (kld, nll, ref_nll))
    top1 = np.full(len(kld), 0.9) if top1 is None else np.asarray(top1)
    return {"kld_mean": float(kld.mean()), "delta_ppl_pct": delta_ppl_pct(nll, ref_nll)[0],
            "top1_agreement": float(top1.mean()), "windows_id": wid,
            "per_window": {"kld": kld.tolist(), "nll": nll.tolist(), "ref_nll": ref_nll.tolist(), "top1": top1.tolist()}}


@pytest.fixture
def rng():
    return np.random.default_rng(1)


def test_identical_twins_are_not_resolved(rng):
    kld = rng.gamma(2.0, 0.005, W)
    ref = rng.normal(3.0, 0.3, W)
    nll = ref + rng.normal(0.01, 0.01, W)
    c = compare_cells(cell(kld, nll, ref), cell(kld, nll, ref))
    assert c["verdict"] == NOT_RESOLVED and c["kld_verdict"] == NOT_RESOLVED and c["ppl_verdict"] == NOT_RESOLVED
    assert c["kld_ratio"] == pytest.approx(1.0) and c["kld_ratio_ci95"][0] <= 1.0 <= c["kld_ratio_ci95"][1]


def test_twins_that_differ_by_noise_only_are_not_resolved(rng):
    ref = rng.normal(3.0, 0.3, W)
    a = cell(rng.gamma(2.0, 0.005, W), ref + rng.normal(0.01, 0.02, W), ref)
    b = cell(rng.gamma(2.0, 0.005, W), ref + rng.normal(0.01, 0.02, W), ref)
    assert compare_cells(a, b)["kld_verdict"] == NOT_RESOLVED


def test_clearly_separated_twins_name_the_winner(rng):
    ref = rng.normal(3.0, 0.3, W)
    base_kld = rng.gamma(4.0, 0.005, W)
    gated = cell(0.5 * base_kld, ref + 0.005 + rng.normal(0, 0.001, W), ref)
    base = cell(base_kld, ref + 0.02 + rng.normal(0, 0.001, W), ref)
    c = compare_cells(gated, base)
    assert c["verdict"] == "gated" and c["kld_verdict"] == "gated" and c["ppl_verdict"] == "gated"
    assert c["kld_ratio_ci95"][1] < 1.0 and c["delta_ppl_diff_ci95"][1] < 0
    line = comparison_line("torch x", c, gated, base)
    # a verdict about one pair of checkpoints says so in its sentence (two runs of the demo disagreed)
    assert "the gated twin loses less by both measures (this trained pair of checkpoints; another training run" in line
    noise = compare_cells(cell(base_kld, ref + 0.02, ref), cell(base_kld, ref + 0.02, ref))
    assert "not resolved" in comparison_line("torch y", noise, base, base)
    assert "this trained pair" not in comparison_line("torch y", noise, base, base)
    c = compare_cells(base, gated, ("baseline", "gated"))  # swapped: the same difference, the other name
    assert c["verdict"] == "gated"


def test_kld_and_perplexity_pointing_opposite_ways_is_a_disagreement(rng):
    ref = rng.normal(3.0, 0.3, W)
    base_kld = rng.gamma(4.0, 0.005, W)
    gated = cell(0.5 * base_kld, ref + 0.03 + rng.normal(0, 0.001, W), ref)  # less KLD, more perplexity
    base = cell(base_kld, ref + 0.005 + rng.normal(0, 0.001, W), ref)
    c = compare_cells(gated, base)
    assert c["verdict"] == DISAGREE and c["kld_verdict"] == "gated" and c["ppl_verdict"] == "baseline"
    line = comparison_line("onnx int4", c, gated, base)
    assert "KLD and perplexity disagree" in line and "by KLD the gated twin" in line


def test_cells_on_different_windows_are_compared_unpaired(rng):
    """Two models that tokenize the text differently (Qwen3 beside Qwen3.5) share no windows: each is resampled
    on its own, which still resolves a large difference and never a small one."""
    a = cell(rng.gamma(4, 0.005, W), np.ones(W), np.ones(W), wid="a")
    b = cell(rng.gamma(4, 0.005, W + 5) * 3, np.ones(W + 5), np.ones(W + 5), wid="b")
    c = compare_cells(a, b)
    assert not c["paired"] and c["kld_verdict"] == "gated"
    same = compare_cells(a, {**a, "windows_id": "other"})
    assert not same["paired"] and same["kld_verdict"] == NOT_RESOLVED


def test_failed_cells_are_counted_and_named(rng):
    ref = rng.normal(3.0, 0.3, W)
    good = cell(rng.gamma(2, 0.01, W), ref + 0.01, ref)
    cells = {"onnx/baseline/int4": good, "onnx/gated/int4": {"error": "ONNX Runtime refused the graph"},
             "torch/baseline/w8a8-static": good, "torch/gated/w8a8-static": good}
    comps = twin_comparisons(cells)
    assert "error" in comps["onnx/int4"] and "error" not in comps["torch/w8a8-static"]
    rep = {"outliers": _outliers(), "outlier_comparison": {}, "cells": cells, "comparisons": comps, "gate_aware": {},
           "failed_cells": ["onnx/gated/int4 (ONNX Runtime refused the graph)"], "link": {},
           "statistics": {"method": "paired percentile bootstrap"}}
    text = "\n".join(conclusion(rep))
    assert "1 cells failed or were skipped: onnx/gated/int4 (ONNX Runtime refused the graph)" in text
    assert "1 not compared" in text and "onnx int4: not compared" in text


def _analysis(grid: np.ndarray, ctx: int) -> dict:
    """An analysis dict whose attention layers have these per-window, per-head BOS shares ([W, L, H])."""
    layers = [{"layer": i, "bos_attention_windows": grid[:, i].tolist(), "max_abs": 10.0, "max_over_median": 5.0,
               "max_abs_windows": [10.0] * len(grid)} for i in range(grid.shape[1])]
    return {"layers": layers, "uniform_bos_share": float(np.mean(1.0 / np.arange(2, ctx + 1)))}


def _outliers():
    a = _analysis(np.full((4, 2, 2), 0.1), 64)
    from quantgate.report.sinks import massive_summary
    o = {"max_abs": 10.0, "max_over_median": 5.0, "layers": 2, "bos_attention_layers": 2, "uniform_bos_share": 0.06,
         "sinks": sink_summary(a), "massive": massive_summary(a)}
    return {"baseline": o, "gated": o}


def test_uniform_attention_at_a_short_context_is_not_called_a_sink():
    ctx = 8
    uniform = float(np.mean(1.0 / np.arange(2, ctx + 1)))
    assert uniform < SINK_EPSILON  # 0.245 at ctx 8: below epsilon, so no head is a sink ...
    s = sink_summary(_analysis(np.full((16, 3, 4), uniform), ctx))
    assert s["sink_heads"] == 0 and "0 of 12 heads sink" in sink_sentence("baseline", s)
    ctx = 4  # ... and where uniform attention itself reaches epsilon, no sink verdict is possible
    uniform = float(np.mean(1.0 / np.arange(2, ctx + 1)))
    s = sink_summary(_analysis(np.full((16, 3, 4), uniform), ctx))
    assert not s["readable"] and "cannot be told from uniform attention" in sink_sentence("baseline", s)


def test_a_single_sink_head_among_many_is_found(rng):
    ctx = 256
    uniform = float(np.mean(1.0 / np.arange(2, ctx + 1)))
    grid = np.clip(rng.normal(uniform, 0.002, (16, 6, 12)), 0, 1)
    grid[:, 4, 7] = rng.normal(0.95, 0.01, 16)  # one head of 72 puts 95% of its attention on BOS
    s = sink_summary(_analysis(grid, ctx))
    assert s["sink_heads"] == 1 and s["sink_head_names"] == ["L4.H7"]
    assert s["worst"]["layer"] == 4 and s["worst"]["head"] == 7 and s["worst"]["ci95"][0] > 0.9
    assert "1 of 72 heads sink (L4.H7)" in sink_sentence("baseline", s)
    assert grid.mean(axis=(0, 2)).max() < SINK_EPSILON  # the layer's head mean would have hidden it


def test_link_takes_one_point_per_distinct_input():
    assert input_of("layers.3.self_attn.k_proj") == input_of("layers.3.self_attn.g_proj") == "layers.3.self_attn.input"
    assert input_of("layers.3.mlp.down_proj") == "layers.3.mlp.down_proj"
    names = [f"layers.{i}.{m}" for i in range(5) for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                           "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                           "mlp.down_proj")]
    inf = {n: 10.0 ** (1 + int(n.split(".")[1]) + ("down" in n) + 0.5 * ("o_proj" in n)) for n in names}
    analysis = {"linear_inputs": {n: {"max_abs": inf[n]} for n in names}}
    cell_ = {"layer_sqnr_db": {n: {"output_db": 40.0 - 5 * np.log10(inf[n])} for n in names}}
    link = sqnr_link(analysis, cell_)
    assert len(link["points"]) == 5 * 4  # attention input, o_proj, MLP input, down_proj per layer
    assert link["spearman"] < -0.9 and link["spearman_ci95"][1] < 0


def test_interval_helpers():
    assert interval(lambda a: a.mean(axis=1), [1.0]) is None  # one unit: no interval
    c = correlation_intervals(np.arange(20.0), np.arange(20.0) ** 2)
    assert c["spearman"] == pytest.approx(1.0) and c["pearson"] > 0.9
    s = across_seeds([1.0, 1.2, 0.8])
    assert s["mean"] == pytest.approx(1.0) and s["ci95"][0] < 1.0 < s["ci95"][1] and s["n"] == 3


def test_p99_interval_covers_the_pooled_percentile_and_narrows_with_more_windows(rng):
    from quantgate.stats import quantile_interval
    small, large = rng.exponential(size=(32, 64)), rng.exponential(size=(512, 64))
    for v in (small, large):
        lo, hi = quantile_interval(v, 99)
        assert lo < np.percentile(v, 99) < hi and lo > 0
    assert np.diff(quantile_interval(large, 99))[0] < np.diff(quantile_interval(small, 99))[0]
    assert quantile_interval(small[:4], 99) is None  # too few windows: no interval
    docs = np.repeat(np.arange(16), 2)  # resampled by document: still an interval
    assert quantile_interval(small, 99, docs) is not None


def test_interval_units_read_as_plurals():
    from quantgate.report.conclusion import _plural
    from quantgate.stats import unit_name
    assert _plural(unit_name(None, 40)) == "windows"
    assert _plural(unit_name(list(range(40)), 40)) == "documents"
    few = _plural(unit_name([0, 1] * 20, 40))
    assert few.startswith("blocks of consecutive windows") and "windowss" not in few
