"""Bits and block size per MatMulNBits node under a size budget, for an fp32 ONNX export (issue 36's ONNX side).

    from quantgate.quant.allocate_onnx import allocate_onnx
    allocate_onnx("m-onnx/", "m-auto/", target_bpw=5.0)

The GGUF allocator's method (quant.allocate) on ONNX Runtime's weight-only format:

1. Units: every MatMul with a constant 2-D fp32 weight that the int4/int8-weight recipes quantize (a Gated
   DeltaNet's in_proj_a/in_proj_b stay float, as there), and the embedding table (a tied head reads it: one unit).
   The gates are units of their own: the fused q|gate projection of each gated attention layer and a GDN's
   in_proj_z. Options: OPTIONS, MatMulNBits' 4 or 8 bits in blocks of 32, 64 or 128 along K (each block's fp32
   scale costs 32 bits: int4 in blocks of 32 is 5 bits per weight, int8 in blocks of 128 8.25).
2. Sensitivity, measured: a base graph with every unit at BASE, then one graph per (unit, option) with that unit
   alone at the option, each written by ORT's own block quantizer (quant.ort_weight_only) and run by ONNX Runtime
   on calibration windows against the fp32 export's logits: delta(u, o) = KLD(graph) - KLD(base). Cached by
   content, as the GGUF sensitivity is. Above MEASURE_ABOVE weights (hours to measure) `--sensitivity auto` takes
   the weight-error proxy instead (proxy_sensitivity: ORT's block quantizer on sampled columns, no calibration).
3. Allocation: quant.allocate's multiple-choice knapsack on the predicted KLD (base + summed deltas); with a
   decode floor, the same Lagrangian price on decode time as the GGUF floor, from one graph per option timed here
   (measure_decode_cost); the written graph is then timed against the floor (floor_check) and, where it is measurably
   slower (quant.decode_cost's sign test), planned for that much more speed and written again (FLOOR_TRIES graphs at
   most). A floor of at most 1x a uniform option takes that option's own graph where it is predicted to lose less, or
   where nothing else is fast enough (quant.allocate.floor_plan).
4. The graph is written by ort_weight_only with each node's (bits, block size); quantgate.json's quantization
   names the target and every node's option, and `allocation.json` in the folder holds the sensitivity.

Written by hand: onnxruntime.quantization takes one bits and block size for a whole graph, and no library chooses
them per node from measured KLD.
"""
from __future__ import annotations

import hashlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..calib_data import calibration_windows, check_ctx, data_paths
from ..errors import QuantgateError
from ..formats.onnx import onnx_context
from ..formats.onnx_io import check_graph, check_written, onnx_bytes, read_meta, resolve_onnx
from ..fsio import atomic_dir, check_output, write_json
from ..identity import code_id, content_id, key
from ..metrics import window_scores
from ..progress import track
from ..reference import cache_dir
from ..runners.open import fixed_ctx, open_runner
from ..tokenizer import load_tokenizer
from .allocate import Allocation, Sensitivity, allocate, floor_plan, floor_words, held_gates, recipe_plan
from .decode_cost import SPEED, DecodeCost, FloorCheck, check_against, decode_seconds, floor_missed
from .ort import GATE_MATMULS, KEPT_FLOAT, side_files
from .ort_weight_only import Spec, block_quantizer, quantize_weight_only, tied_head, weight_array
from .targets import DecodeFloor

OPTIONS = ("int4/128", "int4/64", "int4/32", "int8/128", "int8/64", "int8/32")  # bits/block of MatMulNBits
BASE = "int8/32"  # every unit's option while another one is measured
SCALE_BITS = 32  # an fp32 scale per block (the export is fp32; ORT writes the scales in the weight's dtype)
MEASURE_ABOVE = 100_000_000  # weights: --sensitivity auto measures below, takes the proxy above (hours to measure)
NODE_BYTES = 512  # what a MatMulNBits node and its initializers' names add to model.onnx, at most
PROXY_ROWS = 256  # output columns sampled per weight, as the GGUF proxy samples rows


def spec(option: str) -> Spec:
    """"int4/32" -> (4, 32)."""
    bits, block = option.removeprefix("int").split("/")
    return int(bits), int(block)


@dataclass(frozen=True)
class OnnxUnit:
    """One weight the allocator chooses an option for: a MatMul node (named by the node) or the embedding table
    (named by its initializer, with the tied head that reads it). k: the input dimension blocks run along."""
    name: str
    k: int
    n: int
    gate: bool = False
    weight: str = ""  # its initializer ([K, N]; the embedding table is [N, K])

    @property
    def n_elements(self) -> int:
        return self.k * self.n

    @property
    def is_gate(self) -> bool:
        return self.gate

    def candidates(self) -> tuple[str, ...]:
        """The options whose blocks divide K (MatMulNBits would pad the last block; a whole one keeps bytes exact)."""
        return tuple(o for o in OPTIONS if self.k % spec(o)[1] == 0)

    def bytes(self, option: str) -> int:
        bits, block = spec(option)
        blocks = self.n * math.ceil(self.k / block)
        return blocks * (block * bits // 8 + SCALE_BITS // 8)

    def bits(self, option: str) -> float:
        return 8 * self.bytes(option) / self.n_elements


@dataclass(frozen=True)
class Graph:
    """What the allocation needs of an export: its units, the tied head's node (it reads the embedding unit's
    option), every initializer's element count and the float bytes the units replace."""
    units: list[OnnxUnit]
    embed: str | None  # the embedding table's unit (its Gather becomes GatherBlockQuantized)
    head_of: dict[str, str]  # tied head MatMul node -> the embedding unit
    total_elements: int
    unit_float_bytes: int


def units_of(path: Path) -> Graph:
    """The units of the fp32 export at `path` (its model.onnx, read without its weights)."""
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    untie = tied_head(g, inits)
    units: list[OnnxUnit] = []
    head_of: dict[str, str] = {}
    embed = None
    for node in g.node:
        if node.op_type == "Gather" and node.input[0] in inits and len(inits[node.input[0]].dims) == 2:
            v, d = (int(x) for x in inits[node.input[0]].dims)
            embed = node.input[0]
            units.append(OnnxUnit(embed, d, v, weight=embed))
        elif node.op_type == "MatMul" and len(node.input) == 2 and not any(k in node.name for k in KEPT_FLOAT):
            if untie is not None and node.input[1] == untie[1]:
                head_of[node.name] = untie[0]
                continue
            b = inits.get(node.input[1])
            if b is None or len(b.dims) != 2 or b.data_type != onnx.TensorProto.FLOAT:
                continue
            k, n = (int(x) for x in b.dims)
            units.append(OnnxUnit(node.name, k, n, any(m in node.name for m in GATE_MATMULS), node.input[1]))
    if not units:
        raise QuantgateError(f"{path} has no MatMul with a constant fp32 weight: nothing to allocate")
    total = sum(int(np.prod([int(d) for d in t.dims])) for t in g.initializer if t.data_type == onnx.TensorProto.FLOAT)
    return Graph(units, embed, head_of, total, 4 * sum(u.n_elements for u in units))


def spec_function(graph: Graph, options: dict[str, str]):
    """(spec_of(node name), the embedding's spec) for ort_weight_only, from an option per unit."""
    def spec_of(node: str) -> Spec | None:
        unit = graph.head_of.get(node, node)
        return spec(options[unit]) if unit in options else None
    return spec_of, (spec(options[graph.embed]) if graph.embed in options else None)


def write_graph(path: Path, model_dir: Path, folder: Path, graph: Graph, options: dict[str, str],
                meta: dict) -> None:
    """The export at `path` with each unit at its option, written into `folder` (model.onnx and its side files)."""
    spec_of, embed = spec_function(graph, options)
    quantize_weight_only(path, folder / "model.onnx", spec_of, embed)
    side_files(model_dir, folder, meta)


def measure_sensitivity(path: Path, model_dir: Path, graph: Graph, calib_data: str = "embedded", n_windows: int = 8,
                        ctx: int = 128, seed: int = 0, threads: int | None = None) -> Sensitivity:
    """Each unit's KLD increase over the base graph when it alone takes each option (module docstring), measured
    by ONNX Runtime and cached by content."""
    meta = read_meta(model_dir)
    tok = load_tokenizer(model_dir, meta.get("bos_id"), meta.get("eos_id"))
    check_ctx(ctx, onnx_context(model_dir), path)
    windows = calibration_windows(tok, calib_data, n_windows, ctx, seed)
    k = key("sensitivity-onnx", content_id(model_dir), code_id(), BASE, [(u.name, u.candidates()) for u in graph.units],
            hashlib.sha256(windows.tobytes()).hexdigest())
    cached = cache_dir() / f"sens-onnx-{k}.json"
    if cached.is_file():
        d = json.loads(cached.read_text())
        return Sensitivity(d["base_kld"], d["delta"], d["windows"], d["ctx"], d["data"], base=BASE)
    ref = _logits(model_dir, windows, threads)
    base = {u.name: BASE for u in graph.units}

    def kld(options: dict[str, str]) -> float:
        with tempfile.TemporaryDirectory(prefix="quantgate-sens-onnx-") as work:
            write_graph(path, model_dir, Path(work), graph, options, {**meta, "quantization": {"scheme": "probe"}})
            lg = _logits(Path(work), windows, threads)
        return float(np.mean([window_scores(ref[i], lg[i], windows[i])["kld"].mean() for i in range(len(windows))]))

    base_kld = kld(base)
    runs = [(u, o) for u in graph.units for o in u.candidates() if o != BASE]
    delta: dict[str, dict[str, float]] = {u.name: {BASE: 0.0} for u in graph.units}
    for u, o in track(runs, "sensitivity: one node at a time", total=len(runs)):
        delta[u.name][o] = kld({**base, u.name: o}) - base_kld
    sens = Sensitivity(base_kld, delta, len(windows), ctx, calib_data, base=BASE)
    write_json(cached, sens.to_dict())
    return sens


def _logits(folder: Path, windows: np.ndarray, threads: int | None) -> np.ndarray:
    with open_runner(str(folder), fixed_ctx(windows.shape[1], folder), threads=threads).runner as r:
        return r.logits(windows)


def proxy_sensitivity(path: Path, graph: Graph, rows: int = PROXY_ROWS, seed: int = 0) -> Sensitivity:
    """Each unit's squared weight error at each option over its error at BASE, on `rows` sampled output columns
    (scaled to all of them): ORT's own block quantizer, dequantized here (dequantize_blocks). The ONNX twin of the
    GGUF proxy (quant.proxy), for exports too large to measure; no calibration run, no importance weights, and as
    weak a stand-in as that one (its files carried 2-3x the KLD of measured ones on the GGUF benchmark pair)."""
    import onnx
    inits = {t.name: t for t in onnx.load(str(path), load_external_data=False).graph.initializer}
    rng = np.random.default_rng(seed)
    quantizers: dict = {}
    delta = {}
    for u in track(graph.units, "weight error: one node at a time", total=len(graph.units)):
        a = weight_array(inits[u.weight], path.parent)
        pick = np.sort(rng.choice(u.n, size=min(rows, u.n), replace=False))
        w = np.ascontiguousarray((a[pick].T if u.name == graph.embed else a[:, pick]), dtype=np.float32)  # [K, rows]
        del a
        err = {}
        for o in u.candidates():
            bits, block = spec(o)
            if (bits, block) not in quantizers:
                quantizers[bits, block] = block_quantizer(bits, block)
            packed, scales, _zp = quantizers[bits, block].qbits_block_quant(w)
            err[o] = float(((w - dequantize_blocks(packed, scales, bits, block, u.k)) ** 2).sum()) * u.n / len(pick)
        delta[u.name] = {o: e - err[BASE] for o, e in err.items()}
    return Sensitivity(0.0, delta, rows, 0, "weights", "proxy", base=BASE)


def dequantize_blocks(packed: np.ndarray, scales: np.ndarray, bits: int, block: int, k: int) -> np.ndarray:
    """[K, N] float32 from ORT's symmetric MatMulNBits blocks: packed [N, blocks, block * bits / 8] (two 4-bit values a
    byte, the low nibble first), scales [N, blocks], the zero point implicit (2^(bits-1)), as the kernel reads them.
    Written by hand: onnxruntime.quantization has no dequantizer for its blocks."""
    n, nb, _ = packed.shape
    if bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, nb, block)
    else:
        q = packed.reshape(n, nb, block)
    w = (q.astype(np.float32) - 2 ** (bits - 1)) * scales.reshape(n, nb, 1)
    return np.ascontiguousarray(w.reshape(n, nb * block)[:, :k].T)


def measure_decode_cost(path: Path, model_dir: Path, graph: Graph, threads: int | None) -> DecodeCost:
    """Decode seconds per token of one graph per option (every unit that takes it at it, the rest at BASE), timed
    in alternated rounds by ONNX Runtime with `threads` (quant.decode_cost's protocol), as extra seconds per unit
    element over BASE; a uniform option is its own reference, so `--decode-floor int4/32` means as fast as ORT's
    int4 recipe in blocks of 32. Cached by the export's content, the threads and this machine."""
    import os
    import platform
    k = key("decode-cost-onnx", content_id(model_dir), code_id(), BASE, threads, SPEED,
            [(u.name, u.candidates()) for u in graph.units], platform.node(), os.cpu_count())
    cached = cache_dir() / f"decode-onnx-{k}.json"
    if cached.is_file():
        d = json.loads(cached.read_text())
        return DecodeCost(d["base_s"], d["extra_s_per_element"], d["reference_s"], d["threads"], d["measured_s"],
                          kv="f32")
    meta = read_meta(model_dir)
    with tempfile.TemporaryDirectory(prefix="quantgate-speed-onnx-") as work:
        folders = {}
        for o in OPTIONS:
            folders[o] = Path(work) / o.replace("/", "-")
            folders[o].mkdir()
            write_graph(path, model_dir, folders[o], graph, {u.name: o if o in u.candidates() else BASE
                                                              for u in graph.units},
                        {**meta, "quantization": {"scheme": "probe"}})
        seconds = decode_seconds(folders, threads, kv="f32")
    extra = {}
    for o in OPTIONS:
        n = sum(u.n_elements for u in graph.units if o in u.candidates())
        if n:
            extra[o] = (seconds[o] - seconds[BASE]) / n if o != BASE else 0.0
    cost = DecodeCost(seconds[BASE], extra, dict(seconds), threads, seconds, kv="f32")
    write_json(cached, cost.to_dict())
    return cost


def floor_check(folder: Path, path: Path, model_dir: Path, graph: Graph, floor: DecodeFloor, threads: int | None,
                meta: dict) -> FloorCheck:
    """The written graph in `folder` against the floor, timed now in alternated rounds (met unless measurably
    slower): a floor named by a uniform option has that graph written again beside it (removed afterwards). The ONNX
    twin of quant.decode_cost.floor_check: the per-option speed model is only roughly right for a mixture."""
    if floor.reference is None:
        return check_against({"written": folder}, floor, threads, kv="f32")
    with tempfile.TemporaryDirectory(prefix="quantgate-floor-onnx-") as work:
        ref = Path(work)
        write_graph(path, model_dir, ref, graph, uniform_types(graph, floor.reference),
                    {**meta, "quantization": {"scheme": "probe"}})
        return check_against({"written": folder, "reference": ref}, floor, threads, kv="f32")


def uniform_types(graph: Graph, option: str) -> dict[str, str]:
    """A uniform recipe's option per node: `option` where the node takes it, the base elsewhere."""
    return {u.name: option if option in u.candidates() else BASE for u in graph.units}


FLOOR_TRIES = 3  # graphs written and timed against a decode floor before a shortfall is an error


def budget_bytes(graph: Graph, other_bytes: int, target_bpw: float | None, target_bytes: int | None) -> int:
    """The units' byte budget for a target in bits per weight (over every fp32 initializer) or in folder bytes
    (model.onnx and its data); one line naming the reachable range when the target is outside it."""
    lo = sum(min(u.bytes(o) for o in u.candidates()) for u in graph.units) + other_bytes
    hi = sum(max(u.bytes(o) for o in u.candidates()) for u in graph.units) + other_bytes
    if target_bytes is not None:
        want = target_bytes

        def say(b: int) -> str:
            return f"{b / 1e9:.3g} GB" if b >= 1e8 else f"{b:,} bytes"
    else:
        want = int(target_bpw * graph.total_elements / 8)

        def say(b: int) -> str:
            return f"{8 * b / graph.total_elements:.2f} bpw"
    if want < lo:
        raise QuantgateError(f"target {say(want)} is below the smallest graph the options give ({say(lo)}); "
                             f"nothing was written")
    if want >= graph.unit_float_bytes + other_bytes:
        raise QuantgateError(f"target {say(want)} is not below the fp32 export ({say(graph.unit_float_bytes + other_bytes)})"
                             f": nothing to allocate; nothing was written")
    return min(want, hi) - other_bytes


def allocate_onnx(src: str | Path, out: str | Path, target_bpw: float | None = None, target_bytes: int | None = None,
                  calib_data: str = "embedded", calib_windows: int = 8, ctx: int = 128, seed: int = 0,
                  threads: int | None = None, hold_gates: bool = False, sensitivity: str = "auto",
                  decode_floor: DecodeFloor | None = None) -> dict:
    """Write the ONNX folder `out` from the fp32 export `src` with each MatMulNBits node's bits and block size
    chosen under the target (bits per weight over every weight, or folder bytes) to minimise the measured KLD;
    `hold_gates`: the gate units at the allocation's base option (the A/B's held arm); `sensitivity`: "measured"
    (each node's KLD), "proxy" (its weight error: for exports too large to measure) or "auto" (measured up to
    MEASURE_ABOVE weights); `decode_floor`: the graph's decode speed, predicted from per-option timings taken here
    with `threads` (measure_decode_cost), must not fall below it. Returns the summary, also written to
    `out`/allocation.json."""
    if (target_bpw is None) == (target_bytes is None):
        raise QuantgateError("give one target: --target-bpw or --target-size")
    if target_bpw is not None and not 1.0 <= target_bpw <= 32.0:
        raise QuantgateError(f"--target-bpw must be between 1 and 32, got {target_bpw}")
    path, model_dir = resolve_onnx(src)
    check_graph(path)
    meta = read_meta(model_dir)
    if meta.get("quantization"):
        raise QuantgateError(f"{path} is already quantized ({meta['quantization']['scheme']}); start from the fp32 export")
    if meta.get("dtype") == "fp16":
        raise QuantgateError(f"{path} is an fp16 export; allocate from the fp32 export")
    out = Path(out)
    check_output(out, "onnx", (model_dir, *data_paths(calib_data)))
    graph = units_of(path)
    weights = sum(u.n_elements for u in graph.units)
    other_weights = 4 * (graph.total_elements - weights)  # norms, float MatMuls: fp32 as exported
    # in bytes, the rest of the folder counts too: the export's nodes and names, and what each MatMulNBits node adds
    # to them (its name, attributes and two initializers' names: NODE_BYTES, an upper bound)
    other = other_weights if target_bytes is None else (onnx_bytes(model_dir) - graph.unit_float_bytes
                                                        + NODE_BYTES * len(graph.units))
    budget = budget_bytes(graph, other, target_bpw, target_bytes)
    if sensitivity not in ("auto", "measured", "proxy"):
        more = " (gradient and calibrated score llama.cpp types: a GGUF allocation)" if sensitivity in (
            "gradient", "calibrated") else ""
        raise QuantgateError(f"--sensitivity for an ONNX allocation must be auto, measured or proxy, got {sensitivity!r}{more}")
    if sensitivity == "auto":
        sensitivity = "proxy" if weights > MEASURE_ABOVE else "measured"
    if sensitivity == "proxy":
        sens = proxy_sensitivity(path, graph, seed=seed)
    else:
        sens = measure_sensitivity(path, model_dir, graph, calib_data, calib_windows, ctx, seed, threads)
    cost = limit = None
    if decode_floor is not None:
        cost = measure_decode_cost(path, model_dir, graph, threads)
        if decode_floor.reference is not None:  # the floor's own recipe (quant.allocate.recipe_plan)
            cost.reference_types = uniform_types(graph, decode_floor.reference)
        limit = cost.plan_limit_s(decode_floor, graph.units)  # a uniform option: its own file's time, as measured

    def plan_for() -> Allocation:  # under the current limit (a floor check may tighten it)
        if cost is not None and not hold_gates:  # the held arm holds the gates, which the floor's recipe does not
            return floor_plan(graph.units, sens, budget, cost, limit, decode_floor)
        free = allocate(graph.units, sens, budget, None, cost, limit)
        return allocate(graph.units, sens, budget, held_gates(graph.units, free), cost, limit) if hold_gates else free

    plan = plan_for()
    target = f"{target_bpw:g} bpw" if target_bpw is not None else f"{target_bytes} bytes"
    measured = sens.kind == "measured"
    def quantization(checks: list[dict]) -> dict:
        return {"scheme": f"auto@{target}", "target": target, "hold_gates": hold_gates, "sensitivity": sens.kind,
                "predicted_kld": plan.predicted_kld if measured else None,
                "calibration": (f"{calib_data}: {sens.windows} windows of {sens.ctx} tokens" if measured
                                else f"weights: {sens.windows} sampled columns per node"), "source": str(path),
                "options": plan.types,
                **({"decode_floor": floor_words(decode_floor, plan, checks, "graph"),
                    "predicted_decode_tps": 1 / plan.predicted_decode_s} if checks or plan.recipe else {})}

    tries: list[dict] = []
    with atomic_dir(out, "onnx") as tmp:
        write_graph(path, model_dir, tmp, graph, plan.types, {**meta, "quantization": quantization([])})
        # the written graph against the floor; one measurably slower asks the model for more speed (the floor's own
        # recipe is not timed: it is the floor's graph)
        while cost is not None and plan.recipe is None:
            check = floor_check(tmp, path, model_dir, graph, decode_floor, threads, meta)
            tries.append({**check.to_dict(), "predicted_tps": 1 / plan.predicted_decode_s})
            if check.met:
                break
            recipe = None if hold_gates else recipe_plan(graph.units, sens, cost, decode_floor, budget)
            if len(tries) == FLOOR_TRIES and recipe is None:
                raise floor_missed("graph", check.written_tps, check.floor_tps, len(tries))
            limit *= check.ratio
            try:
                plan = plan_for() if len(tries) < FLOOR_TRIES else recipe
            except QuantgateError as e:
                if "decode floor out of reach" not in str(e):
                    raise
                raise floor_missed("graph", check.written_tps, check.floor_tps) from None
            write_graph(path, model_dir, tmp, graph, plan.types, {**meta, "quantization": quantization([])})
        if cost is not None:
            side_files(model_dir, tmp, {**meta, "quantization": quantization(tries)})
        check_written(tmp, out)
        size = onnx_bytes(tmp)
        if target_bytes is not None and size > target_bytes:  # the margin is an estimate: the file is the truth
            raise QuantgateError(f"the allocated graph is {size:,} bytes, over the target {target_bytes:,}; "
                                 f"nothing was written (lower the target by {size - target_bytes:,} bytes)")
        summary = {"src": str(path), "out": str(out), "target_bpw": target_bpw, "target_bytes": target_bytes,
                   "bytes": size, "bits_per_weight": round(8 * (plan.unit_bytes + other_weights) / graph.total_elements, 4),
                   "sensitivity_kind": sens.kind, "predicted_kld": plan.predicted_kld if measured else None,
                   **({} if measured else {"predicted_proxy_error": plan.predicted_kld}),
                   "hold_gates": hold_gates, "types": plan.types,
                   "gate_types": {u.name: plan.types[u.name] for u in graph.units if u.is_gate},
                   "sensitivity": sens.to_dict()}
        if cost is not None:
            summary.update(decode_floor=str(decode_floor), floor_tps=1 / cost.limit_s(decode_floor),
                           predicted_decode_tps=1 / plan.predicted_decode_s, decode_cost=cost.to_dict(),
                           floor_checks=tries, floor_recipe=plan.recipe)
        write_json(tmp / "allocation.json", summary, kind="allocation")
    return summary
