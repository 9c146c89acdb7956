"""A seeded mutation sweep over real files made from tiny twins, through the real CLI.

Safetensors (header length, JSON header fields, offsets, truncation, data bytes), GGUF (counts, key types and
values, string lengths, tensor dims, types and offsets, truncation), ONNX (bytes, graph inputs, initializers,
external data) and the JSON beside them (config.json, tokenizer.json, quantgate.json, saved scheme metadata),
each fed to info, eval, export, quantize or generate. Every case must end in a correct result (exit 0) or in
exit 2 with one `error:` line: never a traceback, a hang, or a native abort; nothing written on failure; the
mutated inputs byte-identical afterwards. The test prints how many cases ran and how each class ended.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import struct
import threading
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from conftest import save_tiny_twins, tree_snapshot

SEED = int(os.environ.get("QUANTGATE_FUZZ_SEED", "20261201"))
PER_CASE_TIMEOUT = 120  # seconds: a case that takes longer counts as a hang
PLAN = {  # mutation family -> number of cases (>= 300 in all)
    "safetensors": 80, "config.json": 45, "tokenizer.json": 25, "scheme metadata": 30,
    "gguf": 90, "onnx bytes": 20, "onnx graph": 20, "onnx json": 20,
}
WRONG = [None, True, False, -1, 0, 1, 3, 2 ** 40, 2 ** 70, 1.5, -1e30, float("nan"), float("inf"), "x", "",
         [], [1, 2], {}, {"a": 1}]


# --- base artifacts -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from quantgate.export.gguf import export_checkpoint as export_gguf
    from quantgate.export.onnx import export_checkpoint as export_onnx
    from quantgate.quant.llama_cpp import quantize_gguf
    from quantgate.quant.torch_backend import quantize_checkpoint
    d = save_tiny_twins(tmp_path_factory.mktemp("fuzz-base"), "t.txt")
    quantize_checkpoint(str(d / "gated"), "w8a8-static", str(d / "gated-w8a8"), str(d / "t.txt"), 2, 32)
    export_gguf(d / "gated", d / "gated-F32.gguf", "f32")
    export_gguf(d / "baseline", d / "baseline-F16.gguf", "f16")
    quantize_gguf(d / "gated-F32.gguf", d / "gated-Q8_0.gguf", "Q8_0")
    quantize_gguf(d / "gated-F32.gguf", d / "gated-Q4_K_M.gguf", "Q4_K_M")
    export_onnx(d / "gated", d / "onnx")
    return d


# --- mutators: each takes the case folder and a seeded Random, edits the copy in place, returns a description --

def _walk(obj, rng: random.Random, depth: int = 0):
    """A random (container, key) inside a JSON value, or None for the root."""
    if not isinstance(obj, (dict, list)) or not obj or (depth and rng.random() < 0.35):
        return None
    key = rng.choice(list(obj)) if isinstance(obj, dict) else rng.randrange(len(obj))
    deeper = _walk(obj[key], rng, depth + 1)
    return deeper if deeper is not None else (obj, key)


def mutate_json_file(path: Path, rng: random.Random, prefer: str | None = None) -> str:
    obj = json.loads(path.read_text())
    if rng.random() < 0.08:
        raw = path.read_bytes()
        path.write_bytes(raw[: rng.randrange(len(raw))])
        return "truncated JSON"
    root = obj[prefer] if prefer and isinstance(obj, dict) and prefer in obj and rng.random() < 0.8 else obj
    spot = _walk(root, rng) or (None, None)
    holder, key = spot
    if holder is None:
        obj = rng.choice(WRONG)
        desc = f"root -> {obj!r}"
    elif isinstance(holder, dict) and rng.random() < 0.25:
        del holder[key]
        desc = f"del {key}"
    else:
        holder[key] = copy.deepcopy(rng.choice(WRONG))
        desc = f"{key} -> {holder[key]!r}"
    path.write_text(json.dumps(obj))
    return desc[:60]


def mutate_safetensors(path: Path, rng: random.Random) -> str:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    kind = rng.randrange(8)
    if kind == 0:
        new_n = rng.choice([0, 1, n - 1, n + 1, 2 * n, len(raw), 2 ** 63 - 1, 2 ** 64 - 1])
        path.write_bytes(struct.pack("<Q", new_n) + raw[8:])
        return f"header length {n} -> {new_n}"
    if kind == 1:
        path.write_bytes(raw[: rng.randrange(8, len(raw))])
        return "truncated"
    if kind == 2:
        buf = bytearray(raw)
        for _ in range(rng.randint(1, 16)):
            buf[rng.randrange(8 + n, len(buf))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(buf))
        return "data bits flipped"
    t = header[name]
    if kind == 3:
        t["dtype"] = rng.choice(["F16", "BF16", "F64", "I64", "I8", "BOOL", "U8", "F8_E4M3", "XYZ", 7, None])
        desc = f"{name} dtype -> {t['dtype']}"
    elif kind == 4:
        shape = list(t["shape"])
        how = rng.randrange(5)
        if how == 0:
            shape.append(1)
        elif how == 1 and shape:
            shape.pop()
        elif shape:
            i = rng.randrange(len(shape))
            shape[i] = rng.choice([shape[i] * 2, 0, -1, 2 ** 40, "8"])
        t["shape"] = shape
        desc = f"{name} shape -> {shape}"
    elif kind == 5:
        a, b = t["data_offsets"]
        t["data_offsets"] = rng.choice([[b, a], [a, len(data) + 64], [a, a], [a - 4, b - 4], [str(a), b], [a],
                                        [a + 2 ** 40, b + 2 ** 40]])
        desc = f"{name} offsets -> {t['data_offsets']}"
    elif kind == 6:
        if rng.random() < 0.5:
            del header[name]
            desc = f"{name} removed"
        else:
            header[f"{name}.copy"] = dict(t)
            desc = f"{name} duplicated"
    else:
        header["__metadata__"] = rng.choice([{"format": 5}, [1], "x", {"format": "pt", "a": {"b": 1}}])
        desc = "metadata -> wrong type"
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return desc[:60]


def _gguf_layout(path: Path):
    from gguf import GGUFReader
    r = GGUFReader(str(path))
    fields = [f for f in r.fields.values() if not f.name.startswith("GGUF.")]
    return r, fields


def mutate_gguf(path: Path, rng: random.Random) -> str:
    raw = bytearray(path.read_bytes())
    r, fields = _gguf_layout(path)
    kind = rng.randrange(9)
    if kind == 0:  # tensor count or kv count in the header
        off = rng.choice([8, 16])
        old = struct.unpack_from("<Q", raw, off)[0]
        new = rng.choice([0, old - 1, old + 1, old * 2, 2 ** 32, 2 ** 63])
        struct.pack_into("<Q", raw, off, new)
        desc = f"{'tensor' if off == 8 else 'kv'} count {old} -> {new}"
    elif kind == 1:  # a key's value type
        f = rng.choice(fields)
        klen = struct.unpack_from("<Q", raw, f.offset)[0]
        new = rng.choice([0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 99])
        struct.pack_into("<I", raw, f.offset + 8 + klen, new)
        desc = f"{f.name} type -> {new}"
    elif kind == 2:  # a scalar key's value bytes
        f = rng.choice([f for f in fields if len(f.parts) == 4])
        klen = struct.unpack_from("<Q", raw, f.offset)[0]
        at = f.offset + 12 + klen
        width = f.parts[3].nbytes
        raw[at:at + width] = bytes(rng.randrange(256) for _ in range(width))
        desc = f"{f.name} value bytes randomised"
    elif kind == 3:  # a string length
        f = rng.choice(fields)
        struct.pack_into("<Q", raw, f.offset, rng.choice([0, 1, 2 ** 20, 2 ** 62]))
        desc = f"{f.name} key length"
    else:
        t = rng.choice(r.tensors)
        o = t.field.offset
        nlen = struct.unpack_from("<Q", raw, o)[0]
        nd = struct.unpack_from("<I", raw, o + 8 + nlen)[0]
        dims_at, type_at = o + 12 + nlen, o + 12 + nlen + 8 * nd
        if kind == 4:
            struct.pack_into("<I", raw, o + 8 + nlen, rng.choice([0, 1, 3, 4, 5, 2 ** 31]))
            desc = f"{t.name} n_dims"
        elif kind == 5:
            i = rng.randrange(nd)
            old = struct.unpack_from("<Q", raw, dims_at + 8 * i)[0]
            struct.pack_into("<Q", raw, dims_at + 8 * i, rng.choice([0, 1, old * 2, old + 1, 2 ** 40]))
            desc = f"{t.name} dim {i}"
        elif kind == 6:
            struct.pack_into("<I", raw, type_at, rng.choice([0, 1, 2, 8, 10, 12, 14, 30, 31, 99]))
            desc = f"{t.name} type"
        elif kind == 7:
            old = struct.unpack_from("<Q", raw, type_at + 4)[0]
            struct.pack_into("<Q", raw, type_at + 4, rng.choice([old + 1, old + r.alignment, old + 2 ** 30, 0]))
            desc = f"{t.name} offset"
        else:
            raw = raw[: rng.randrange(24, len(raw))]
            desc = "truncated"
    path.write_bytes(bytes(raw))
    return desc[:60]


def mutate_onnx_bytes(path: Path, rng: random.Random) -> str:
    raw = bytearray(path.read_bytes())
    if rng.random() < 0.3:
        path.write_bytes(bytes(raw[: rng.randrange(len(raw))]))
        return "truncated"
    k = rng.randint(1, 24)
    for _ in range(k):
        raw[rng.randrange(len(raw))] = rng.randrange(256)
    path.write_bytes(bytes(raw))
    return f"{k} bytes randomised"


def mutate_onnx_graph(path: Path, rng: random.Random) -> str:
    import onnx
    from onnx import TensorProto
    m = onnx.load(str(path))
    kind = rng.randrange(6)
    if kind == 0:
        v = rng.choice(list(m.graph.input))
        v.type.tensor_type.elem_type = rng.choice([TensorProto.FLOAT, TensorProto.INT32, TensorProto.STRING])
        desc = f"{v.name} dtype"
    elif kind == 1:
        v = rng.choice(list(m.graph.input))
        v.name = v.name + "_x"
        desc = "input renamed"
    elif kind == 2:
        inits = list(m.graph.initializer)
        t = rng.choice(inits)
        m.graph.initializer.remove(t)
        desc = f"initializer {t.name} dropped"
    elif kind == 3:
        v = next(i for i in m.graph.input if i.name == "past_key_values.0.key")
        dim = v.type.tensor_type.shape.dim[rng.choice([1, 3])]
        dim.ClearField("dim_value")
        dim.dim_param = "weird"
        desc = "past dims made symbolic"
    else:  # move one weight to external data that is missing, outside, or too short
        t = max(m.graph.initializer, key=lambda i: len(i.raw_data))
        loc = rng.choice(["missing.bin", "../outside.bin", "short.bin"])
        if loc == "short.bin":
            (path.parent / loc).write_bytes(t.raw_data[: len(t.raw_data) // 2])
        t.data_location = TensorProto.EXTERNAL
        del t.external_data[:]
        for k, v in (("location", loc), ("offset", "0"), ("length", str(len(t.raw_data)))):
            e = t.external_data.add()
            e.key, e.value = k, v
        t.ClearField("raw_data")
        desc = f"external data {loc}"
    onnx.save(m, str(path))
    return desc


# --- the sweep -------------------------------------------------------------------------------------------------

def _case(base: Path, family: str, rng: random.Random, work: Path):
    """Make one mutated input under `work`; returns (argv, model path, description)."""
    text = base / "t.txt"
    out = work / "out"
    if family in ("safetensors", "config.json", "tokenizer.json"):
        src = rng.choice(["gated", "baseline"])
        model = work / src
        shutil.copytree(base / src, model)
        desc = (mutate_safetensors(model / "model.safetensors", rng) if family == "safetensors"
                else mutate_json_file(model / family, rng))
        verb = rng.choice(["info", "eval", "export", "quantize", "generate"])
    elif family == "scheme metadata":
        model = work / "q"
        shutil.copytree(base / "gated-w8a8", model)
        desc = mutate_json_file(model / "config.json", rng, prefer="quantgate")
        verb = rng.choice(["info", "eval", "generate"])
    elif family == "gguf":
        src = rng.choice(["gated-F32.gguf", "baseline-F16.gguf", "gated-Q8_0.gguf", "gated-Q4_K_M.gguf"])
        model = work / src
        shutil.copy2(base / src, model)
        desc = f"{src}: {mutate_gguf(model, rng)}"
        verb = rng.choice(["info", "eval", "quantize", "generate"])
    else:
        model = work / "onnx"
        shutil.copytree(base / "onnx", model)
        if family == "onnx bytes":
            desc = mutate_onnx_bytes(model / "model.onnx", rng)
        elif family == "onnx graph":
            desc = mutate_onnx_graph(model / "model.onnx", rng)
        else:
            desc = mutate_json_file(model / rng.choice(["quantgate.json", "config.json"]), rng)
        verb = rng.choice(["info", "eval", "quantize", "generate"])
    if verb == "quantize" and family == "gguf":
        if "Q" in model.name:  # already quantized: llama.cpp's quantizer takes the float files
            verb = "eval"
    argv = {"info": ["info", model, "--json"],
            "eval": ["eval", model, "--data", text, "--ctx", "32", "--max-windows", "2", "--json"],
            "export": ["export", "gguf", model, "--out", out / "x.gguf"],
            "generate": ["generate", model, "--prompt", "def f(", "--max-tokens", "3"],
            "quantize": (["quantize", model, "--type", "Q8_0", "--out", out / "q.gguf"] if family == "gguf" else
                         ["quantize", model, "--scheme", "int8-dynamic", "--out", out / "q"] if family.startswith("onnx")
                         else ["quantize", model, "--scheme", "w8a16", "--out", out / "q"])}[verb]
    return argv, verb, desc


def _check(r, verb: str, work: Path, before: dict) -> str | None:
    """None when the case ended as the contract says, else what went wrong."""
    if r.timeout:
        return "hang"
    if r.signal is not None:
        return f"killed by signal {r.signal} (a native abort reached the CLI)"
    if "Traceback" in r.stderr:
        return "traceback:\n" + r.stderr[-1500:]
    if r.code == 0:
        if verb == "eval":
            try:
                ppl = json.loads(r.stdout)["ppl"]
            except (ValueError, KeyError):
                return "exit 0 without a JSON result"
            if not (isinstance(ppl, float) and math.isfinite(ppl) and ppl > 0):
                return f"exit 0 with ppl {ppl}"
        after = {k: v for k, v in tree_snapshot(work).items() if not k.startswith("out")}
        return None if after == before else "an input changed"
    if r.code != 2 or len(r.lines) != 1 or not r.lines[0].startswith("error: "):
        return f"exit {r.code} with {len(r.lines)} stderr lines:\n" + r.stderr[-1500:]
    if (work / "out").exists():
        return "output written although the command failed"
    return None if tree_snapshot(work) == before else "an input changed or something was written"


def _bucket(r) -> str:
    if r.code == 0:
        return "exit 0"
    words = r.lines[0].split(": ", 1)[-1] if r.lines else "?"
    for key in ("shape", "missing", "truncated", "corrupt", "not valid JSON", "must be", "NaN or Inf", "dtype",
                "unexpected tensor", "llama.cpp", "ONNX Runtime", "tokenizer", "not supported", "is not"):
        if key in words:
            return f"exit 2: {key}"
    return "exit 2: other"


@pytest.mark.slow  # about 4 minutes, the longest test: it runs in CI's second step (pytest -m slow)
def test_fuzz_sweep(base, tmp_path, capsys):
    from cli_server import CliServer
    rng = random.Random(SEED)
    jobs = [(family, rng.random()) for family, n in PLAN.items() for _ in range(n)]
    assert len(jobs) >= 300
    results: list = []
    lock = threading.Lock()
    servers = [CliServer(env={"QUANTGATE_CACHE": str(tmp_path / "cache")}) for _ in range(2)]

    def worker(k: int):
        for i in range(k, len(jobs), len(servers)):
            family, case_seed = jobs[i]
            case_rng = random.Random(f"{SEED}-{i}-{case_seed}")
            work = tmp_path / f"case{i}"
            work.mkdir()
            argv, verb, desc = _case(base, family, case_rng, work)
            before = tree_snapshot(work)
            r = servers[k].run(*argv, timeout=PER_CASE_TIMEOUT)
            problem = _check(r, verb, work, before)
            with lock:
                results.append((family, verb, desc, r, problem))
            shutil.rmtree(work, ignore_errors=True)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(servers))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in servers:
            s.close()
    endings: dict = defaultdict(Counter)
    for family, verb, _desc, r, _problem in results:
        endings[family][_bucket(r)] += 1
    with capsys.disabled():
        print(f"\nfuzz sweep (seed {SEED}): {len(results)} mutated inputs across "
              f"{', '.join(sorted({v for _, v, _, _, _ in results}))}")
        for family in PLAN:
            print(f"  {family:16s} {sum(endings[family].values()):3d}: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(endings[family].items())))
    bad = [(f, v, d, r.args, p) for f, v, d, r, p in results if p]
    assert len(results) == len(jobs)
    assert not bad, "\n\n".join(f"[{f} / {v}] {d}\n{' '.join(map(str, a))}\n{p}" for f, v, d, a, p in bad[:6]) \
        + f"\n\n{len(bad)} of {len(results)} cases broke the contract"
