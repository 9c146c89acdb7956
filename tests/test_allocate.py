"""The bit allocator (quantgate.quant.allocate): per-tensor llama.cpp types under a size budget, from measured
per-tensor KLD; the budget is met, llama.cpp writes exactly the chosen types, and bad budgets are one line."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from conftest import run_cli
from quantgate.errors import QuantgateError
from quantgate.quant.allocate import Sensitivity, Unit, allocate, held_gates
from quantgate.quant.targets import parse_floor, parse_size


def _sens(units, rng):
    """Deltas that fall with bits, each unit its own scale."""
    delta = {}
    for u in units:
        scale = rng.uniform(0.1, 5.0)
        delta[u.name] = {t: scale * 2.0 ** (-{"IQ4_NL": 4.7, "Q4_0": 4.5, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5}[t]) * (t != "Q8_0")
                         for t in u.candidates()}
    return Sensitivity(0.01, delta, 4, 64, "embedded")


@pytest.mark.parametrize("seed", range(5))
def test_allocation_meets_the_budget_and_beats_every_uniform_type_that_fits(seed):
    rng = np.random.default_rng(seed)
    units = [Unit(f"blk.{i}.ffn_up.weight", int(rng.integers(1, 9)) * 4096, 64) for i in range(6)]
    sens = _sens(units, rng)
    lo, hi = sum(u.bytes("Q4_0") for u in units), sum(u.bytes("Q8_0") for u in units)
    for budget in np.linspace(lo, hi, 7).astype(int):
        plan = allocate(units, sens, int(budget))
        assert plan.unit_bytes <= budget
        assert plan.predicted_kld == pytest.approx(0.01 + sum(sens.delta[n][t] for n, t in plan.types.items()))
        for t in units[0].candidates():  # the standard answer: one type everywhere
            if sum(u.bytes(t) for u in units) <= budget:
                assert plan.predicted_kld <= 0.01 + sum(sens.delta[u.name][t] for u in units) + 1e-12
        best = min(0.01 + sum(sens.delta[u.name][t] for u, t in zip(units, combo))
                   for combo in itertools.product(units[0].candidates(), repeat=len(units))
                   if sum(u.bytes(t) for u, t in zip(units, combo)) <= budget)
        assert plan.predicted_kld <= best * 1.02 + 1e-9  # the dynamic program: the exact optimum, to its rounding


def _cost(units, rng):
    """A speed model in which the types decode at their own pace, none in order of its bits (as on a CPU, where
    Q5_0 dequantizes slower than Q8_0)."""
    from quantgate.quant.decode_cost import DecodeCost
    per = {"IQ4_NL": 3e-9, "Q4_0": -1e-9, "Q5_0": 4e-9, "Q5_1": 5e-9, "Q8_0": 0.0}
    return DecodeCost(1e-3, {t: v * rng.uniform(0.5, 1.5) for t, v in per.items()}, {}, 1, {})


@pytest.mark.parametrize("seed", range(4))
def test_a_decode_floor_is_met_and_costs_no_more_kld_than_it_must(seed):
    """Under a floor the allocation is predicted at least that fast, meets the byte budget, is no worse than any
    uniform type that meets both, and is the unconstrained answer where that is already fast enough; a floor no
    allocation can reach is one line."""
    rng = np.random.default_rng(seed)
    units = [Unit(f"blk.{i}.ffn_up.weight", int(rng.integers(1, 9)) * 4096, 64) for i in range(6)]
    sens, cost = _sens(units, rng), _cost(units, rng)
    budget = int(np.mean([sum(u.bytes("Q5_0") for u in units), sum(u.bytes("Q8_0") for u in units)]))
    free = allocate(units, sens, budget)
    t_free = cost.predict(units, free.types)
    assert allocate(units, sens, budget, None, cost, t_free * 1.01).types == free.types
    combos = [dict(zip([u.name for u in units], c)) for c in
              itertools.product(units[0].candidates(), repeat=len(units))]
    fits = [c for c in combos if sum(u.bytes(c[u.name]) for u in units) <= budget]
    fastest = min(cost.predict(units, c) for c in fits)
    moved = 0
    for limit in np.linspace(fastest, t_free, 5)[:-1]:
        plan = allocate(units, sens, budget, None, cost, float(limit))
        moved += plan.types != free.types
        assert plan.unit_bytes <= budget and plan.predicted_decode_s <= limit * (1 + 1e-9)
        assert plan.predicted_decode_s == pytest.approx(cost.predict(units, plan.types))
        assert plan.predicted_kld >= free.predicted_kld - 1e-12  # speed is bought with KLD, never the reverse
        for t in units[0].candidates():
            uni = {u.name: t for u in units}
            if sum(u.bytes(t) for u in units) <= budget and cost.predict(units, uni) <= limit:
                assert plan.predicted_kld <= sens.base_kld + sum(sens.delta[u.name][t] for u in units) + 1e-12
    assert moved or fastest == pytest.approx(t_free)  # the floor changed the answer where it bound
    with pytest.raises(QuantgateError, match="decode floor out of reach"):
        allocate(units, sens, budget, None, cost, fastest * 0.9)


@pytest.mark.parametrize("seed", range(4))
def test_a_floor_named_by_a_type_is_never_allocated_worse_than_that_types_recipe(seed):
    """With a floor of at most 1x a llama.cpp type, that type's own per-tensor types meet it by definition: where
    they are predicted to lose less than the allocation predicted fast enough, or where no allocation is predicted
    fast enough, they are the answer. A floor above 1x, a recipe over the budget or with a type a unit does not take
    leaves the allocation (or the out-of-reach line) as it was."""
    from quantgate.quant.allocate import floor_plan, recipe_plan
    rng = np.random.default_rng(seed)
    units = [Unit(f"blk.{i}.ffn_up.weight", int(rng.integers(1, 9)) * 4096, 64) for i in range(6)]
    sens, cost = _sens(units, rng), _cost(units, rng)
    cost.reference_types = {u.name: "Q5_0" if i % 2 else "Q4_0" for i, u in enumerate(units)}
    recipe_s = cost.predict(units, cost.reference_types)
    budget = int(np.mean([sum(u.bytes("Q5_0") for u in units), sum(u.bytes("Q8_0") for u in units)]))
    floor = parse_floor("Q4_0")
    recipe = recipe_plan(units, sens, cost, floor, budget)
    assert recipe.types == cost.reference_types and recipe.recipe == "Q4_0"
    assert recipe.predicted_kld == pytest.approx(0.01 + sum(sens.delta[n][t] for n, t in recipe.types.items()))
    for limit in (recipe_s * 0.5, recipe_s, recipe_s * 1.5):
        plan = floor_plan(units, sens, budget, cost, limit, floor)
        try:
            alloc = allocate(units, sens, budget, None, cost, limit)
        except QuantgateError:
            assert plan.types == recipe.types  # nothing predicted fast enough: the recipe
            continue
        assert plan.predicted_kld == pytest.approx(min(alloc.predicted_kld, recipe.predicted_kld))
        assert (plan.recipe == "Q4_0") == (recipe.predicted_kld < alloc.predicted_kld)
    assert recipe_plan(units, sens, cost, parse_floor("1.1xQ4_0"), budget) is None
    assert recipe_plan(units, sens, cost, floor, recipe.unit_bytes - 1) is None
    cost.reference_types[units[0].name] = "Q6_K"  # not a candidate of these rows
    assert recipe_plan(units, sens, cost, floor, budget) is None
    with pytest.raises(QuantgateError, match="decode floor out of reach"):
        floor_plan(units, sens, budget, cost, 1e-12, floor)


def test_exchanges_close_the_price_on_times_gap_to_the_best_assignment(monkeypatch):
    """A price on decode time finds only the convex hull of (KLD, time); exchanges from its answer reach the best
    assignment under the limit, found here by brute force over every assignment (5 units, 5 types), and never end
    worse than the priced answer alone."""
    from quantgate.quant import allocate as alloc_mod
    found, closed = [], 0
    for seed in range(8):
        rng = np.random.default_rng(seed)
        units = [Unit(f"blk.{i}.ffn_up.weight", int(rng.integers(1, 9)) * 4096, 64) for i in range(5)]
        sens, cost = _sens(units, rng), _cost(units, rng)
        budget = int(np.mean([sum(u.bytes("Q5_0") for u in units), sum(u.bytes("Q8_0") for u in units)]))
        combos = [dict(zip([u.name for u in units], c)) for c in
                  itertools.product(units[0].candidates(), repeat=len(units))]
        fits = [c for c in combos if sum(u.bytes(c[u.name]) for u in units) <= budget]
        t_free = cost.predict(units, allocate(units, sens, budget).types)
        for limit in np.linspace(min(cost.predict(units, c) for c in fits), t_free, 6)[1:-1]:
            best = min(sens.base_kld + sum(sens.delta[u.name][c[u.name]] for u in units)
                       for c in fits if cost.predict(units, c) <= limit)
            plan = allocate(units, sens, budget, None, cost, float(limit))
            with monkeypatch.context() as m:
                m.setattr(alloc_mod, "_exchange", lambda types, *a, **k: dict(types))
                priced = allocate(units, sens, budget, None, cost, float(limit))
            assert plan.unit_bytes <= budget and plan.predicted_decode_s <= limit * (1 + 1e-9)
            assert best * (1 - 1e-9) <= plan.predicted_kld <= priced.predicted_kld + 1e-12
            found.append(plan.predicted_kld / best - 1)
            closed += priced.predicted_kld > plan.predicted_kld + 1e-12
    assert max(found) < 1e-9 and closed >= 1  # every gap closed here, and the price alone left some open


def _quant_time(units, rng, factor: float):
    """A quantizer-time model in which the types quantize at their own pace (IQ4_NL slowest, as ggml's is)."""
    from quantgate.quant.proxy import QuantizeTime
    per = {t: v * rng.uniform(0.8, 1.2) for t, v in
           {"IQ4_NL": 2e-7, "Q4_0": 2e-8, "Q5_0": 6e-8, "Q5_1": 5e-8, "Q8_0": 3e-9}.items()}
    ref = sum(u.n_elements * per["Q5_0"] for u in units)
    return QuantizeTime(per, ref, factor * ref, factor, 1)


@pytest.mark.parametrize("seed", range(4))
def test_a_quantize_time_limit_is_met_and_costs_no_more_kld_than_it_must(seed):
    """Under a limit on llama.cpp's predicted quantizer time the allocation keeps it and the byte budget, is the
    unconstrained answer where that already fits, buys its time only with KLD, is no worse than any uniform type that
    fits both; with a decode floor too both times are kept; a limit no allocation reaches is one line."""
    rng = np.random.default_rng(seed)
    units = [Unit(f"blk.{i}.ffn_up.weight", int(rng.integers(1, 9)) * 4096, 64) for i in range(6)]
    sens = _sens(units, rng)
    for u in units:  # IQ4_NL the best 4-bit type, as IQ4_XS is on k-quant rows: the one a free allocation picks
        sens.delta[u.name]["IQ4_NL"] = sens.delta[u.name]["Q4_0"] * 0.3
    budget = int(np.mean([sum(u.bytes("Q4_0") for u in units), sum(u.bytes("Q5_0") for u in units)]))
    free = allocate(units, sens, budget)
    q = _quant_time(units, rng, 1.0)
    t_free = q.predict(units, free.types)
    q.limit_s = t_free * 1.01
    assert allocate(units, sens, budget, quant=q).types == free.types
    combos = [dict(zip([u.name for u in units], c)) for c in
              itertools.product(units[0].candidates(), repeat=len(units))]
    fits = [c for c in combos if sum(u.bytes(c[u.name]) for u in units) <= budget]
    quickest = min(q.predict(units, c) for c in fits)
    assert quickest < t_free  # the free allocation is slow to quantize here: the limit can bind
    for limit in np.linspace(quickest, t_free, 5)[:-1]:
        q.limit_s = float(limit)
        plan = allocate(units, sens, budget, quant=q)
        assert plan.unit_bytes <= budget and plan.predicted_quantize_s <= limit * (1 + 1e-9)
        assert plan.predicted_quantize_s == pytest.approx(q.predict(units, plan.types))
        assert plan.predicted_kld >= free.predicted_kld - 1e-12 and plan.types != free.types
        for t in units[0].candidates():
            uni = {u.name: t for u in units}
            if sum(u.bytes(t) for u in units) <= budget and q.predict(units, uni) <= limit:
                assert plan.predicted_kld <= sens.base_kld + sum(sens.delta[u.name][t] for u in units) + 1e-12
    cost = _cost(units, rng)
    q.limit_s = float(np.mean([quickest, t_free]))
    both = [c for c in fits if q.predict(units, c) <= q.limit_s]
    dec = float(np.median([cost.predict(units, c) for c in both]))
    plan = allocate(units, sens, budget, None, cost, dec, q)
    assert plan.predicted_quantize_s <= q.limit_s * (1 + 1e-9) and plan.predicted_decode_s <= dec * (1 + 1e-9)
    q.limit_s = quickest * 0.9
    with pytest.raises(QuantgateError, match="quantize-time limit out of reach"):
        allocate(units, sens, budget, quant=q)


def test_the_proxy_limits_llama_cpps_quantizer_time_and_says_what_it_cost(f32_gguf, tmp_path, monkeypatch):
    """With the proxy, each type's quantizer is timed on the sampled rows (ggml's IQ4_NL slower than its Q8_0); the
    written file's types are predicted within the limit, and the summary and the file's metadata say the limit,
    the prediction and the unlimited allocation's predicted error and time. Factor 0: no limit, nothing said."""
    from gguf import GGUFReader

    from quantgate.quant import proxy
    from quantgate.quant.allocate import allocate_gguf
    monkeypatch.setattr(proxy, "QUANTIZE_SLACK_S", 0.0)  # a tiny model's quantizer takes milliseconds
    s = allocate_gguf(f32_gguf, tmp_path / "q.gguf", target_bpw=5.0, sensitivity="proxy", quantize_factor=1.0,
                      decode_floor=None)
    q = s["quantize_time"]
    speeds = q["cpu_s_per_weight"]
    assert set(speeds) >= {"IQ4_NL", "Q4_0", "Q5_0", "Q8_0"} and all(v > 0 for v in speeds.values())
    assert speeds["IQ4_NL"] > 3 * speeds["Q8_0"]
    assert q["limit_s"] == pytest.approx(q["reference_s"]) and q["predicted_s"] <= q["limit_s"] * (1 + 1e-9)
    # unlimited, this model's allocation is predicted several times over the limit: it binds, at a price
    assert q["binds"] is True and q["unlimited_predicted_proxy_error"] <= q["predicted_proxy_error"]
    said = GGUFReader(tmp_path / "q.gguf").fields["quantgate.allocation.quantize_time"].contents()
    assert "at most 1x" in said and "or 0 s more" in said and q["slack_s"] == 0
    free = allocate_gguf(f32_gguf, tmp_path / "f.gguf", target_bpw=5.0, sensitivity="proxy", quantize_factor=0,
                         decode_floor=None)
    assert "quantize_time" not in free
    assert "quantgate.allocation.quantize_time" not in GGUFReader(tmp_path / "f.gguf").fields
    assert free["predicted_proxy_error"] == pytest.approx(q["unlimited_predicted_proxy_error"])


def test_a_floor_named_by_a_type_is_planned_as_the_model_predicts_that_types_recipe():
    """The speed model is additive and predicts a mixture only roughly, so a floor named by a type is planned against
    the model's prediction of that type's own recipe (over its fraction), not its file's measured time: the recipe
    then sits exactly at the limit. A tok/s floor, or a recipe holding a type the model never timed, keeps the
    measured limit."""
    from quantgate.quant.allocate import floor_plan
    rng = np.random.default_rng(0)
    units = [Unit(f"blk.{i}.ffn_up.weight", int(rng.integers(1, 9)) * 4096, 64) for i in range(6)]
    sens, cost = _sens(units, rng), _cost(units, rng)
    cost.reference_types = {u.name: "Q5_0" if i % 2 else "Q4_0" for i, u in enumerate(units)}
    predicted = cost.predict(units, cost.reference_types)
    cost.reference_s = {"Q4_0": predicted * 0.93}  # the file measured faster than the model puts its recipe
    assert cost.limit_s(parse_floor("Q4_0")) == pytest.approx(predicted * 0.93)
    assert cost.plan_limit_s(parse_floor("Q4_0"), units) == pytest.approx(predicted)
    assert cost.plan_limit_s(parse_floor("0.9xQ4_0"), units) == pytest.approx(predicted / 0.9)
    assert cost.plan_limit_s(parse_floor("40"), units) == pytest.approx(1 / 40)
    budget = int(np.mean([sum(u.bytes("Q5_0") for u in units), sum(u.bytes("Q8_0") for u in units)]))
    floor = parse_floor("Q4_0")
    plan = floor_plan(units, sens, budget, cost, cost.plan_limit_s(floor, units), floor)
    assert plan.predicted_decode_s <= predicted * (1 + 1e-9)  # never out of reach: the recipe itself fits
    with pytest.raises(QuantgateError, match="out of reach"):  # the measured limit: the recipe predicted too slow
        allocate(units, sens, budget, None, cost, float(cost.limit_s(floor) * 0.9))
    cost.reference_types[units[0].name] = "Q6_K"  # a type the model did not time
    assert cost.plan_limit_s(floor, units) == pytest.approx(predicted * 0.93)


def test_a_written_file_misses_its_floor_only_when_measurably_slower():
    """The floor check: a file meets its floor where its median per-round ratio is at least CHECK_MEDIAN (0.98: room
    for the noise between the check and a later timing inside the goal's 0.95) and it is not measurably slower, i.e.
    more than sign_k(n) of n alternated rounds as fast as the floor (P <= 5% for a file no slower); the ratio it
    replans by is the median per-round ratio."""
    from quantgate.quant.decode_cost import CHECK_MEDIAN, FloorCheck, sign_k
    assert [sign_k(n) for n in (1, 4, 5, 9, 20)] == [-1, -1, 0, 1, 5] and CHECK_MEDIAN == 0.98
    noisy = FloorCheck(99.0, 100.0, [0.7, 1.2, 0.99, 1.05, 0.8, 1.3, 0.95, 0.9, 1.1])
    assert noisy.met and noisy.ratio == pytest.approx(0.99)
    assert not FloorCheck(95.0, 100.0, [0.7, 1.2, 0.9, 1.05, 0.8, 1.3, 0.95, 0.9, 1.1]).met  # median 0.95
    steady = FloorCheck(99.0, 100.0, [0.99, 0.985, 0.995, 0.99, 1.0, 0.99, 0.99, 0.985, 0.99])
    assert steady.ratio >= CHECK_MEDIAN and not steady.met  # one round of nine as fast: measurably slower
    short = FloorCheck(90.0, 100.0, [0.9, 0.92, 0.88, 1.01, 0.9, 0.95, 0.85, 0.9, 0.93])
    assert not short.met and short.ratio == pytest.approx(0.9)
    d = short.to_dict()
    assert d["rounds"] == 9 and d["ratio_range"] == [0.85, 1.01] and d["met"] is False


@pytest.mark.parametrize("sets, met, timed", [
    ([[1.0] * 9], True, 1),                                   # met at once: timed once
    ([[0.9] * 9], False, 1),                                  # measurably slower at once: no second timing
    ([[0.96, 1.0, 1.01, 0.95, 0.97, 1.02, 0.96, 0.97, 1.0], [1.0, 1.02, 0.99, 1.01, 1.0, 1.03, 0.99, 1.01, 1.0]],
     True, 2),                                                # median 0.97 but 4 of 9 as fast: timed again, met
    ([[0.96, 1.0, 1.01, 0.95, 0.97, 1.02, 0.96, 0.97, 1.0]] * 3, False, 3),  # inconclusive every time: 3 sets, then no
])
def test_an_inconclusive_floor_check_is_timed_again_and_decided_on_every_round(monkeypatch, sets, met, timed):
    """check_against: a median under CHECK_MEDIAN that the sign test does not back is timed again (at most
    CHECK_EXTENSIONS more sets of rounds) and decided on all of them; a met or measurably slower check is not."""
    from pathlib import Path

    from quantgate.quant import decode_cost
    from quantgate.quant.targets import DecodeFloor
    calls = []

    def rounds(files, threads, kv):
        ratio = sets[len(calls)]
        calls.append(1)
        return {"written": [1.0 / r for r in ratio], "reference": [1.0] * len(ratio)}
    monkeypatch.setattr(decode_cost, "decode_rounds", rounds)
    check = decode_cost.check_against({"written": Path("w"), "reference": Path("r")}, DecodeFloor(reference="Q4_K_M"), 1)
    assert check.met is met and len(calls) == timed and len(check.ratios) == 9 * timed
    assert decode_cost.CHECK_EXTENSIONS == 2


def test_decode_floors_parse_and_bad_ones_are_one_line():
    assert parse_floor("40").tps == 40.0 and str(parse_floor("40")) == "40 tok/s"
    f = parse_floor("0.95*q4_k_m")
    assert (f.reference, f.fraction, str(f)) == ("Q4_K_M", 0.95, "0.95xQ4_K_M") and parse_floor("0.95xQ4_K_M") == f
    assert parse_floor("Q8_0").reference == "Q8_0" and parse_floor("Q8_0").fraction == 1.0
    for bad, needle in (("0", "above 0"), ("fast", "give tok/s"), ("5*Q4_K_M", "between 0.1 and 2"),
                        ("0.9*Q9_K", "give tok/s"), ("", "give tok/s")):
        with pytest.raises(QuantgateError, match=needle):
            parse_floor(bad)


def test_a_budget_below_the_smallest_types_is_refused():
    units = [Unit("a.weight", 4096, 64)]
    with pytest.raises(QuantgateError, match="smallest types take"):
        allocate(units, _sens(units, np.random.default_rng(0)), units[0].bytes("Q4_0") - 1)


def test_held_gates_take_the_base_type_of_the_rest():
    units = [Unit("blk.0.attn_q.weight", 4096, 64), Unit("blk.0.ffn_up.weight", 8192, 64)]
    free = allocate(units, _sens(units, np.random.default_rng(1)), units[0].bytes("Q8_0") + units[1].bytes("Q5_0"))
    held = held_gates(units, free)
    assert held == {"blk.0.attn_q.weight": free.types["blk.0.ffn_up.weight"]}


def test_sizes_parse_and_bad_ones_are_one_line():
    assert parse_size("2.6GB") == 2_600_000_000 and parse_size("900MB") == 900_000_000
    assert parse_size("1GiB") == 1 << 30 and parse_size("12345") == 12345
    for bad in ("two GB", "-1GB", "0", "3XB"):
        with pytest.raises(QuantgateError, match="--target-size"):
            parse_size(bad)


@pytest.fixture(scope="module")
def sens_cache(tmp_path_factory):
    """One cache for the module: the sensitivity measured by the first test is read back by the next."""
    return tmp_path_factory.mktemp("sens-cache")


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    from quantgate.export.gguf import export_checkpoint
    from quantgate.formats import save_checkpoint
    from quantgate.model import build_model, preset
    from quantgate.tokenizer import byte_tokenizer
    d = tmp_path_factory.mktemp("alloc")
    save_checkpoint(build_model(preset("tiny", vocab_size=300, n_layers=1), seed=0), d / "m", byte_tokenizer())
    export_checkpoint(d / "m", d / "m.gguf", "f32")
    return d / "m.gguf"


def test_quantize_target_bpw_writes_the_chosen_types_within_the_budget(f32_gguf, tmp_path, sens_cache):
    from quantgate.formats import inspect_gguf
    from quantgate.runners import LlamaRunner
    out = tmp_path / "auto.gguf"
    none = ("--sensitivity", "measured", "--decode-floor", "none")  # the default floor has its own test
    r = run_cli("quantize", f32_gguf, "--target-bpw", "6", "--calib-windows", "2", "--ctx", "32", "--out", out,
                "--json", *none, env={"QUANTGATE_CACHE": str(sens_cache)})
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    info = inspect_gguf(out)
    assert info.bits_per_weight <= 6.0 and summary["bits_per_weight"] == pytest.approx(info.bits_per_weight, abs=1e-3)
    assert all(info.tensor_types[n] == t for n, t in summary["types"].items())
    assert len(set(summary["types"].values())) >= 2  # a mixture, not one type
    side = json.loads((tmp_path / "auto.gguf.allocation.json").read_text())
    assert side["types"] == summary["types"] and side["sensitivity"]["base_type"] == "Q8_0"
    from gguf import GGUFReader
    fields = GGUFReader(out).fields  # the type map is in the file too
    in_file = dict(x.split("=") for x in fields["quantgate.allocation.tensor_types"].contents())
    assert in_file == summary["types"] and fields["quantgate.allocation.target"].contents() == "6 bpw"
    assert fields["quantgate.allocation.predicted_kld"].contents() == pytest.approx(summary["predicted_kld"], rel=1e-6)
    shown = run_cli("info", out, "--json")  # info reads the allocation back from the file
    assert shown.returncode == 0, shown.stderr[-2000:]
    alloc = json.loads(shown.stdout)["allocation"]
    assert alloc["target"] == "6 bpw" and sum(alloc["tensor_type_counts"].values()) == len(summary["types"])
    with LlamaRunner(out, n_ctx=32) as runner:  # stock llama.cpp opens it
        assert np.isfinite(runner.logits(np.array([[1, 2, 3, 4]]))).all()
    # the gate A/B's held arm, from the cached sensitivity: the gates take the allocation's base type
    held = run_cli("quantize", f32_gguf, "--target-bpw", "6", "--calib-windows", "2", "--ctx", "32", "--hold-gates",
                   "--out", tmp_path / "held.gguf", "--json", *none, env={"QUANTGATE_CACHE": str(sens_cache)})
    assert held.returncode == 0, held.stderr[-2000:]
    h = json.loads(held.stdout)
    from quantgate.formats.gguf import open_reader
    size = {t.name: int(np.prod([int(d) for d in t.shape])) for t in open_reader(f32_gguf).tensors}
    weight: dict = {}
    for n, t in h["types"].items():  # the base type: the one most of the other units' weights take
        if n not in h["gate_types"]:
            weight[t] = weight.get(t, 0) + size[n]
    base = max(weight, key=weight.get)
    assert h["gate_types"] and set(h["gate_types"].values()) == {base} and h["bits_per_weight"] <= 6.0
    # a size target counts the whole file, the type map in its metadata included
    target = out.stat().st_size - 1
    sized = run_cli("quantize", f32_gguf, "--target-size", str(target), "--calib-windows", "2", "--ctx", "32",
                    "--out", tmp_path / "sized.gguf", "--json", *none, env={"QUANTGATE_CACHE": str(sens_cache)})
    assert sized.returncode == 0, sized.stderr[-2000:]
    assert (tmp_path / "sized.gguf").stat().st_size <= target


@pytest.mark.slow  # each type's decode timed: moved out of the default step (its 25-minute limit); CI's slow step
def test_a_decode_floor_is_timed_predicted_and_said_in_the_file(f32_gguf, tmp_path, sens_cache):
    """A decode floor: each type's decode timed here, the allocation predicted at least that fast, the written file
    timed against the floor, said in the file (a floor far under Q8_0's speed: the written file's check, a timing on
    a shared machine, is the scripted test's business below); a floor out of reach is one line."""
    from gguf import GGUFReader
    fl = run_cli("quantize", f32_gguf, "--target-bpw", "6", "--calib-windows", "2", "--ctx", "32", "--decode-floor",
                 "0.5xQ8_0", "--threads", "1", "--sensitivity", "measured", "--out", tmp_path / "floor.gguf", "--json",
                 env={"QUANTGATE_CACHE": str(sens_cache)})
    assert fl.returncode == 0, fl.stderr[-2000:]
    f = json.loads(fl.stdout)
    cost = f["decode_cost"]
    assert f["predicted_decode_tps"] >= f["floor_tps"] * (1 - 1e-9) and f["bits_per_weight"] <= 6.0
    assert f["floor_tps"] == pytest.approx(0.5 / cost["reference_s"]["Q8_0"])
    check = f["floor_checks"][-1]
    assert check["written_tps"] >= check["floor_tps"] > 0
    assert set(cost["measured_s"]) >= {"Q8_0", "reference"} and all(v > 0 for v in cost["measured_s"].values())
    fields = GGUFReader(tmp_path / "floor.gguf").fields
    assert fields["quantgate.allocation.decode_floor"].contents().startswith("0.5xQ8_0 (")
    assert fields["quantgate.allocation.predicted_decode_tps"].contents() == pytest.approx(f["predicted_decode_tps"])
    assert not list(tmp_path.glob(".quantgate-*"))  # the timed files are gone
    far = run_cli("quantize", f32_gguf, "--target-bpw", "6", "--calib-windows", "2", "--ctx", "32", "--decode-floor",
                  "1000000000", "--threads", "1", "--sensitivity", "measured", "--out", tmp_path / "far.gguf",
                  env={"QUANTGATE_CACHE": str(sens_cache)})
    assert far.returncode == 2 and "decode floor out of reach" in far.stderr, far.stderr[-2000:]
    assert not (tmp_path / "far.gguf").exists() and not list(tmp_path.glob(".quantgate-*"))


@pytest.mark.parametrize("target, needle", [(["--target-bpw", "1.5"], "below the smallest file"),
                                            (["--target-bpw", "32"], "not below the float file"),
                                            (["--target-size", "1KB"], "below the smallest file"),
                                            (["--target-bpw", "4", "--type", "Q4_K_M"], "replace --type"),
                                            (["--hold-gates"], "--hold-gates applies to an allocation"),
                                            (["--decode-floor", "Q4_K_M"], "--decode-floor applies to an allocation"),
                                            (["--sensitivity", "proxy"], "--sensitivity applies to an allocation"),
                                            (["--target-bpw", "6", "--decode-floor", "0.9*Q9"], "give tok/s"),
                                            (["--target-bpw", "6", "--decode-floor", "1e9"], "give tok/s"),
                                            (["--quantize-time", "2"], "--quantize-time applies to an allocation"),
                                            (["--target-bpw", "6", "--quantize-time", "-1"], "--quantize-time must"),
                                            (["--target-bpw", "6", "--quantize-time", "0.5"], "--quantize-time must"),
                                            (["--target-bpw", "6", "--quantize-time", "nan"], "--quantize-time must")])
def test_a_budget_the_model_cannot_meet_is_one_line_and_writes_nothing(f32_gguf, tmp_path, target, needle):
    r = run_cli("quantize", f32_gguf, *target, "--out", tmp_path / "x.gguf",
                env={"QUANTGATE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_metadata_copy_keeps_every_tensor_byte_and_adds_or_replaces_keys(f32_gguf, tmp_path):
    from gguf import GGUFReader

    from quantgate.formats.gguf_metadata import copy_with_metadata
    from quantgate.quant.llama_cpp import run_quantizer
    q = tmp_path / "q.gguf"
    run_quantizer(f32_gguf, q, "Q4_K_M", [])
    out = tmp_path / "q-meta.gguf"
    copy_with_metadata(q, out, {"quantgate.test.names": ["a=Q4_K", "b=Q8_0"], "quantgate.test.n": 3,
                                "general.name": "renamed"})
    a, b = GGUFReader(q), GGUFReader(out)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.tensor_type == tb.tensor_type and np.array_equal(np.asarray(ta.data), np.asarray(tb.data)), ta.name
    assert b.fields["quantgate.test.names"].contents() == ["a=Q4_K", "b=Q8_0"]
    assert b.fields["quantgate.test.n"].contents() == 3 and b.fields["general.name"].contents() == "renamed"
    kept = set(a.fields) - {"general.name"}
    assert all(str(a.fields[k].contents()) == str(b.fields[k].contents()) for k in kept if not k.startswith("GGUF."))


@pytest.mark.parametrize("cut", ["in the magic", "in a key", "in the tensor table"])
def test_a_truncated_header_is_one_error_and_no_guess(f32_gguf, tmp_path, cut):
    """The header is walked by hand (gguf-py's reader takes ~30 s on a 248K vocabulary): a file cut short inside it
    is a QuantgateError naming the file, never a header spliced from what the cut left."""
    from gguf import GGUFReader

    from quantgate.errors import QuantgateError
    from quantgate.formats.gguf_metadata import copy_with_metadata
    r = GGUFReader(f32_gguf)
    at = {"in the magic": 3, "in a key": r.fields["tokenizer.ggml.tokens"].offset + 20,
          "in the tensor table": r.tensors[0].field.offset + 5}[cut]
    del r
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(f32_gguf.read_bytes()[:at])
    with pytest.raises(QuantgateError, match="cut.gguf"):
        copy_with_metadata(bad, tmp_path / "out.gguf", {"quantgate.test.n": 1})


@pytest.mark.parametrize("path", ["kernel", "kernel refuses part-way", "no kernel copy"])
def test_the_data_copy_appends_every_byte_from_the_offset(tmp_path, monkeypatch, path):
    """copy_with_metadata's tail copy: the kernel's copy_file_range, a refusal after part of it (the rest by
    chunks, from where it stopped), and a system without it give the same bytes at the writer's position."""
    import os

    from quantgate.formats import gguf_metadata
    data = np.random.default_rng(0).integers(0, 256, size=3_000_017, dtype=np.uint8).tobytes()
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    monkeypatch.setattr(gguf_metadata, "COPY_CHUNK", 65_536)
    if path == "kernel refuses part-way":
        real, calls = os.copy_file_range, []

        def partial(fi, fo, n, a, b):
            calls.append(n)
            if len(calls) > 1:
                raise OSError(22, "refused")
            return real(fi, fo, min(n, 1_000_003), a, b)
        monkeypatch.setattr(os, "copy_file_range", partial)
    elif path == "no kernel copy":
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    with open(src, "rb") as fin, open(tmp_path / "out.bin", "wb") as out:
        out.write(b"header--")
        gguf_metadata.copy_tail(fin, 1234, out)
        out.write(b"!")
    assert (tmp_path / "out.bin").read_bytes() == b"header--" + data[1234:] + b"!"
    assert src.read_bytes() == data


@pytest.mark.slow  # moved out of the default step (its 25-minute limit); CI's slow step runs it
def test_a_budget_scheme_runs_the_allocator_with_an_importance_matrix(f32_gguf, tmp_path, monkeypatch, sens_cache):
    """`gguf:auto@6+imatrix`, as a report cell names it: the registry's config, quantize's one door, and
    sensitivity measured with the importance matrix (other numbers than without it; the plain one is the CLI
    test's, read back from the cache)."""
    from gguf import GGUFReader

    from quantgate.quant import CalibSettings, get, quantize
    monkeypatch.setenv("QUANTGATE_CACHE", str(sens_cache))
    calib = CalibSettings(windows=2, ctx=32)
    plain = quantize(f32_gguf, get("gguf", "auto@6"), tmp_path / "plain.gguf", calib)
    with_im = quantize(f32_gguf, get("gguf", "auto@6+imatrix"), tmp_path / "im.gguf", calib)
    assert with_im["imatrix"] and not plain["imatrix"] and with_im["bits_per_weight"] <= 6.0
    assert GGUFReader(tmp_path / "im.gguf").fields["quantgate.allocation.imatrix"].contents() is True
    d0, d1 = plain["sensitivity"]["delta"], with_im["sensitivity"]["delta"]
    assert d0.keys() == d1.keys() and d0 != d1
    assert len(list(sens_cache.glob("sens-*.json"))) == 2
    fl = quantize(f32_gguf, get("gguf", "auto@6+floor=0.5xQ8_0"), tmp_path / "fl.gguf", calib, threads=1)
    assert fl["decode_floor"] == "0.5xQ8_0" and fl["predicted_decode_tps"] >= fl["floor_tps"] * (1 - 1e-9)
    with pytest.raises(QuantgateError, match="between 1 and 32"):
        get("gguf", "auto@64")


@pytest.mark.parametrize("script, needle", [
    ([(90.0, 100.0), (120.0, 100.0)], None),
    ([(99.0, 100.0)] * 3, "not met by the written file: 99 tok/s measured against the floor's 100 after 3 files"),
    ([(1.0, 100.0)], "not met by the written file: 1 tok/s measured against the floor's 100, and no allocation"),
])
def test_the_written_file_is_timed_against_the_floor(f32_gguf, tmp_path, monkeypatch, sens_cache, script, needle):
    """The speed model is only roughly right for a mixture, so the written file is timed against the floor (here the
    timings are scripted: a real one is a shared machine's noise). A file 10% short makes the allocation ask its model
    for 10% more speed and write again; one still short after FLOOR_TRIES files, or short by more than any allocation
    under the budget is predicted to make up, is one line with nothing written."""
    from quantgate.quant import allocate as al
    monkeypatch.setenv("QUANTGATE_CACHE", str(sens_cache))
    from quantgate.quant.decode_cost import FloorCheck
    calls = iter(script)

    def check(*_a, **_k):  # every round at the scripted ratio
        got, want = next(calls)
        return FloorCheck(got, want, [got / want] * 9)
    monkeypatch.setattr(al, "floor_check", check)
    out = tmp_path / "f.gguf"
    args = (f32_gguf, out, 6.0, None, "embedded", 2, 32, 0, 1, False, False, parse_floor("0.5xQ8_0"))
    if needle:
        with pytest.raises(QuantgateError, match=needle):
            al.allocate_gguf(*args)
        assert not out.exists() and not list(tmp_path.glob(".quantgate-*"))
        return
    s = al.allocate_gguf(*args)
    first, second = s["floor_checks"]
    assert (first["written_tps"], second["written_tps"]) == (90.0, 120.0)
    # the second file was planned for 1/0.9 of the floor's predicted speed
    assert second["predicted_tps"] >= s["floor_tps"] / 0.9 * (1 - 1e-9) and s["bits_per_weight"] <= 6.0
    assert s["predicted_decode_tps"] == pytest.approx(second["predicted_tps"])


def test_a_floor_file_short_every_time_gets_the_floor_types_own_recipe(f32_gguf, tmp_path, monkeypatch, sens_cache):
    """A floor named by a type that fits the budget: files measurably slower ask for more speed, and where none is
    predicted (or after FLOOR_TRIES files) the file is the floor type's own recipe, byte for byte its tensor types,
    which the metadata and the summary say (scripted timings; the recipe is not timed)."""
    from gguf import GGUFReader

    from quantgate.quant import allocate as al
    from quantgate.quant.decode_cost import FloorCheck
    from quantgate.quant.llama_cpp import run_quantizer
    monkeypatch.setenv("QUANTGATE_CACHE", str(sens_cache))
    checks = []

    def check(*_a, **_k):
        checks.append(FloorCheck(50.0, 100.0, [0.5] * 9))
        return checks[-1]
    monkeypatch.setattr(al, "floor_check", check)
    out = tmp_path / "f.gguf"
    s = al.allocate_gguf(f32_gguf, out, 7.0, None, "embedded", 2, 32, 0, 1, False, False, parse_floor("Q4_K_M"))
    assert s["floor_recipe"] == "Q4_K_M" and len(s["floor_checks"]) == len(checks) <= al.FLOOR_TRIES
    assert all(not c["met"] for c in s["floor_checks"]) and s["bits_per_weight"] <= 7.0
    ref = run_quantizer(f32_gguf, tmp_path / "q4_k_m.gguf", "Q4_K_M", [])
    assert s["types"] == {n: ref.tensor_types[n] for n in s["types"]}
    assert GGUFReader(out).fields["quantgate.allocation.decode_floor"].contents().startswith(
        "Q4_K_M (met by Q4_K_M's own tensor types")


def test_report_settings_take_budget_cells_and_refuse_bad_ones(tmp_path):
    from quantgate.report.settings import ReportSettings, check_settings
    s = ReportSettings("b", "g", str(tmp_path / "r"), backends=("gguf",),
                       schemes={"gguf": ["Q4_K_M", "auto@4.5", "auto@5+imatrix+held"]})
    check_settings(s)
    for bad, needle in (("auto@0.5", "between 1 and 32"), ("auto@", "unknown gguf scheme"),
                        ("auto@4.5+fast", "unknown gguf scheme")):
        with pytest.raises(QuantgateError, match=needle):
            check_settings(ReportSettings("b", "g", str(tmp_path / "r"), backends=("gguf",), schemes={"gguf": [bad]}))


def test_budget_names_take_sizes_and_floors_and_refuse_bad_ones():
    """Report cells name what the CLI's options say: `auto@2.6GB`, `+floor=0.95xQ4_K_M`; a bad one is one line
    before any cell runs."""
    from quantgate.quant import get
    s = get("gguf", "auto@2.6GB+floor=0.95xQ4_K_M+imatrix")
    assert (s.target_bpw, s.target_bytes, s.imatrix, s.hold_gates) == (None, 2_600_000_000, True, False)
    assert parse_floor(s.decode_floor) == parse_floor("0.95*Q4_K_M") and "0.95xQ4_K_M" in s.describe()["weights"]
    s = get("gguf", "auto@5+held+floor=40")
    assert (s.target_bpw, s.target_bytes, s.hold_gates, parse_floor(s.decode_floor).tps) == (5.0, None, True, 40.0)
    assert get("gguf", "auto@900MiB").target_bytes == 900 * 2 ** 20
    for bad, needle in (("auto@5+floor=Q9", "the floor"), ("auto@5+held+held", "at most once"),
                        ("auto@0GB", "the size"), ("auto@5+floor=40+floor=Q8_0", "at most once"),
                        ("auto@5+floor=0xQ8_0", "between 0.1 and 2")):
        with pytest.raises(QuantgateError, match=needle):
            get("gguf", bad)


def test_the_weight_error_proxy_is_ggmls_own_error_and_falls_with_bits(f32_gguf):
    """The proxy's errors, from ggml's row quantizers in the llama.cpp worker, equal gguf-py's independent numpy
    quantizers where both exist (Q8_0, Q4_0, Q5_0; every row sampled) and fall as the bits rise."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    from quantgate.formats.gguf import open_reader
    from quantgate.quant.allocate import units_of
    from quantgate.quant.proxy import weight_errors
    units = units_of(f32_gguf)
    errors = weight_errors(f32_gguf, units, rows=10_000)
    tensors = {t.name: t for t in open_reader(f32_gguf).tensors}
    for u in units:
        e = errors[u.name]
        w = np.asarray(tensors[u.name].data, dtype=np.float32).reshape(-1, u.row)
        assert e["sampled"] == e["rows"] == len(w)
        for t in [t for t in ("Q8_0", "Q4_0", "Q5_0") if t in u.candidates()]:
            q = GGMLQuantizationType[t]
            ref = float(((w - gguf.quants.dequantize(gguf.quants.quantize(w, q), q)) ** 2).sum())
            assert e["err"][t] == pytest.approx(ref, rel=1e-4), (u.name, t)
        order = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0") if u.row % 256 == 0 else ("Q4_0", "Q5_0", "Q8_0")
        assert all(e["err"][a] > e["err"][b] > 0 for a, b in zip(order, order[1:])), (u.name, e["err"])
        assert e["sq"] == pytest.approx(float((w.astype(np.float64) ** 2).sum()), rel=1e-5)
    few = weight_errors(f32_gguf, units, rows=8)  # sampled rows, scaled to the tensor
    big = max(units, key=lambda u: u.n_elements // u.row)
    assert few[big.name]["sampled"] == 8 and few[big.name]["err"]["Q8_0"] == pytest.approx(
        errors[big.name]["err"]["Q8_0"], rel=0.5)


def test_quantize_with_the_proxy_writes_a_file_within_the_budget(f32_gguf, tmp_path):
    """`--sensitivity proxy`: no calibration run, the types from the weight error, the budget met, the file says
    which sensitivity chose its types and states no predicted KLD."""
    from gguf import GGUFReader

    from quantgate.formats import inspect_gguf
    out = tmp_path / "proxy.gguf"
    r = run_cli("quantize", f32_gguf, "--target-bpw", "6", "--sensitivity", "proxy", "--decode-floor", "none", "--out",
                out, "--json", env={"QUANTGATE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert s["sensitivity_kind"] == "proxy" and s["predicted_kld"] is None and s["predicted_proxy_error"] > 0
    assert set(s["seconds"]) >= {"sensitivity", "allocation", "llama.cpp quantizer", "metadata copy"}
    assert all(v >= 0 for v in s["seconds"].values())
    assert inspect_gguf(out).bits_per_weight <= 6.0 and len(set(s["types"].values())) >= 2
    fields = GGUFReader(out).fields
    assert fields["quantgate.allocation.sensitivity"].contents() == "proxy"
    assert "quantgate.allocation.predicted_kld" not in fields
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("sens-*"))  # nothing measured


def test_the_proxy_gives_the_same_errors_on_any_number_of_threads(f32_gguf):
    """Tensors run in parallel in the worker; the rows sampled are drawn before, so threads change nothing."""
    from quantgate.quant.allocate import units_of
    from quantgate.quant.proxy import weight_errors
    units = units_of(f32_gguf)

    def errors(threads: int) -> dict:  # the quantizers' CPU seconds are timings, not results
        return {n: {k: v for k, v in e.items() if k != "quantize_s"}
                for n, e in weight_errors(f32_gguf, units, rows=16, threads=threads).items()}
    assert errors(1) == errors(3)


def test_types_restrict_the_allocation_and_bad_ones_are_one_line(f32_gguf, tmp_path):
    """`--types`: only those types (and Q8_0, every measurement's base) are chosen, the budget still met, and the
    file says what was allowed; a type that is no candidate, or --types without a budget, is one line."""
    from gguf import GGUFReader

    from quantgate.formats import inspect_gguf
    out = tmp_path / "k.gguf"
    r = run_cli("quantize", f32_gguf, "--target-bpw", "6", "--sensitivity", "proxy", "--types", "q4_0,Q4_K",
                "--decode-floor", "none", "--out", out, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert set(s["types"].values()) <= {"Q4_0", "Q4_K", "Q8_0"} and s["types_allowed"] == ["Q4_0", "Q4_K"]
    assert "Q4_0" in s["types"].values()
    assert inspect_gguf(out).bits_per_weight <= 6.0
    assert GGUFReader(out).fields["quantgate.allocation.types_allowed"].contents() == "Q4_0,Q4_K"
    for args, needle in ((["--target-bpw", "6", "--types", "Q4_K,F16"], "F16 is not a candidate type"),
                         (["--types", "Q4_K"], "--types applies to an allocation")):
        bad = run_cli("quantize", f32_gguf, *args, "--out", tmp_path / "bad.gguf")
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and needle in lines[0], bad.stderr
        assert not (tmp_path / "bad.gguf").exists()


@pytest.fixture(scope="module")
def gated_f32_gguf(tmp_path_factory):
    """A gated model's GGUF: it carries tensors llama.cpp's quantizer keeps in float whatever it is asked."""
    from quantgate.export.gguf import export_checkpoint
    from quantgate.formats import save_checkpoint
    from quantgate.model import build_model, preset
    from quantgate.tokenizer import byte_tokenizer
    d = tmp_path_factory.mktemp("alloc-gated")
    save_checkpoint(build_model(preset("tiny", vocab_size=300, n_layers=1, gate="elementwise"), seed=0), d / "m",
                    byte_tokenizer())
    export_checkpoint(d / "m", d / "m.gguf", "f32")
    return d / "m.gguf"


@pytest.mark.parametrize("sensitivity", ["proxy", pytest.param("measured", marks=pytest.mark.slow)])
def test_tensors_llama_cpp_keeps_in_float_count_against_the_budget(gated_f32_gguf, tmp_path, sensitivity):
    """Tensors llama.cpp leaves in float are no units: the proxy learns them from the file it writes (and writes
    again), the measured path from its base file; either way their float bytes count, so the file meets the target
    (it overshot by 0.002 bpw on the medium gated twin before)."""
    from quantgate.formats import inspect_gguf
    from quantgate.formats.gguf import open_reader
    from quantgate.quant.llama_cpp import run_quantizer
    probe = tmp_path / "q8.gguf"
    kept = run_quantizer(gated_f32_gguf, probe, "Q8_0", []).tensor_types
    floats = {n for n, t in kept.items() if t in ("F32", "F16", "BF16")
              and len(next(x for x in open_reader(gated_f32_gguf).tensors if x.name == n).shape) >= 2}
    assert floats, "the gated export should carry 2-D tensors llama.cpp keeps in float"
    probe.unlink()
    out = tmp_path / "auto.gguf"
    r = run_cli("quantize", gated_f32_gguf, "--target-bpw", "5.5", "--sensitivity", sensitivity, "--calib-windows",
                "2", "--ctx", "32", "--decode-floor", "none", "--out", out, "--json",
                env={"QUANTGATE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert not floats & set(s["types"]) and inspect_gguf(out).bits_per_weight <= 5.5
    assert s["bits_per_weight"] == pytest.approx(inspect_gguf(out).bits_per_weight, abs=1e-3)
