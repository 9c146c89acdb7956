"""Static checks of the code's structure (issue 12): decisions that must live in one place."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("quantgate", "export", "calib_data") for p in (ROOT / d).rglob("*.py")] + [ROOT / "cli.py"]


def test_one_place_decides_what_kind_of_path_it_is():
    """Only quantgate/formats tests a path's suffix for .gguf/.onnx; everything else asks artifact_kind."""
    suffix_test = re.compile(r'''["']\.(gguf|onnx)["']''')
    where = [str(p.relative_to(ROOT)) for p in SOURCES if suffix_test.search(p.read_text())]
    assert where == ["quantgate/formats/kind.py"], where


def test_llama_cpp_enums_are_not_retyped():
    """llama.cpp's type ids come from gguf-py (LlamaFileType, GGMLQuantizationType), never a literal table."""
    # the ids a hand copy would carry: llama_ftype Q4_K_M 15, Q8_0 7, BF16 32; ggml_type q8_0 8, q4_0 2
    table = re.compile(r'"(Q4_K_M"\s*:\s*15|Q8_0"\s*:\s*7|[bB][fF]16"\s*:\s*32|q8_0"\s*:\s*8|q4_0"\s*:\s*2)\b')
    where = [str(p.relative_to(ROOT)) for p in SOURCES if table.search(p.read_text())]
    assert where == [], where


# --- the import graph ------------------------------------------------------------------------------------------

def _module_name(path: Path) -> str:
    """The installed name of a source file (export/ and calib_data/ install under quantgate, cli.py as quantgate.cli)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("export", "calib_data"):
        parts.insert(0, "quantgate")
    elif parts == ["cli"]:
        parts = ["quantgate", "cli"]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SOURCES}


def _resolve(name: str) -> str | None:
    """The project module an imported name lives in (`quantgate.formats.load_checkpoint` -> `quantgate.formats`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, bool, list[str]]]:
    """(imported project module, at the top of the file?, names taken from it) for every import statement."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [a.name for a in node.names]
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            targets = [(f"{base}.{n}", []) for n in names if f"{base}.{n}" in MODULES] + [(base, names)]
        else:
            continue
        for name, taken in targets:
            target = _resolve(name) if name.startswith("quantgate") else None
            if target and target != module:
                out.append((target, node in tree.body, taken))
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the project modules importing it runs: what it imports (anywhere in the file) and, since Python
    runs a package's __init__ before any of its submodules, the packages above each of them."""
    graph = {}
    for m in MODULES:
        edges = set()
        for target, _top, _names in _imports(m):
            parts = target.split(".")
            edges |= {".".join(parts[:k]) for k in range(1, len(parts) + 1)} & MODULES.keys()
        graph[m] = edges - {m} - {p for p in _ancestors(m)}  # a module's own packages are already running
    return graph


def _ancestors(m: str) -> set[str]:
    parts = m.split(".")
    return {".".join(parts[:k]) for k in range(1, len(parts))}


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every edge a depth-first walk finds closing a cycle, as the path around it."""
    state: dict[str, str] = {}
    cycles: list[str] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(" -> ".join(stack[stack.index(n):] + [m, n]) if n in stack else f"{m} -> {n}")
            elif n not in state:
                visit(n, stack + [m])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return cycles


def late_imports() -> list[str]:
    """Imports of project modules inside functions, outside cli.py."""
    return sorted({f"{m} imports {t}" for m in MODULES if m != "quantgate.cli"
                   for t, top, _names in _imports(m) if not top})


def test_no_import_cycles():
    """The project's modules form layers: no module imports (directly or through others) one that imports it.
    Function-level imports count too, so a cycle cannot hide inside a function."""
    cycles = find_cycles(_graph())
    assert cycles == [], cycles[:5]


def test_project_imports_at_the_top():
    """Every file imports the project's modules at its top, where a reader sees what it depends on; only the CLI
    imports its commands' modules when they run (its start-up time, see cli.py's docstring)."""
    late = late_imports()
    assert late == [], late[:10]


# quant/ is the one room for quantization: no quantizer at the top of the package, and no old path kept (none ever
# shipped in a release)
GONE = ("quantgate.quantize", "quantgate.gguf_quantize", "quantgate.onnx_quantize", "quantgate.onnx_weight_only",
        "quantgate.smoothquant", "quantgate.gptq", "quantgate.qlinear", "quantgate.torchao_backend",
        "quantgate.checkpoint", "quantgate.gguf_file", "quantgate.llama_runner", "quantgate.onnx_weights",
        "quantgate.ort_runner", "quantgate.schemes")


def test_quantizers_live_in_quant_and_old_paths_are_gone():
    import importlib
    for old in GONE:
        assert old not in MODULES, f"{old} is still a module"
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    for backend in ("torch_backend", "llama_cpp", "ort", "ort_weight_only", "torchao_backend", "smoothquant", "gptq",
                    "qlinear"):
        assert f"quantgate.quant.{backend}" in MODULES


def test_the_quant_registry_imports_nothing_above_it():
    """quant.schemes (the registry every layer reads) depends on errors and two leaf modules of plain values (the
    llama.cpp type names, the parsers of sizes and decode floors) that depend on errors alone, so reading a scheme
    never loads a quantizer, a runner or a format; quant/'s modules import quantgate's lower layers, never a verb
    module."""
    verbs = {"quantgate.cli", "quantgate.evaluate", "quantgate.generate", "quantgate.analyze", "quantgate.report",
             "quantgate.demo", "quantgate.train", "quantgate.info", "quantgate.attribution"}
    leaves = {"quantgate.quant.gguf_types", "quantgate.quant.targets"}
    assert {t for t, _top, _n in _imports("quantgate.quant.schemes") if t.startswith("quantgate")} <= {
        "quantgate.errors", *leaves}
    for leaf in leaves:
        assert {t for t, _top, _n in _imports(leaf) if t.startswith("quantgate")} <= {"quantgate.errors", *leaves}
    up = sorted(f"{m} imports {t}" for m in MODULES if m.startswith("quantgate.quant")
                for t, _top, _n in _imports(m) if t in verbs or t.startswith("quantgate.report"))
    assert up == [], up


# --- the report only reads results ---------------------------------------------------------------------------

# what the report package may take from outside itself: the functions the CLI's verbs call, the registry, the
# runners' public interface, and the plumbing (errors, files, identity, progress, text sources)
REPORT_MAY_USE = {
    "quantgate": {"__version__"},
    "quantgate.quant": {"SCHEMES", "SCOPES", "get", "plain_of", "scope_words"},
    "quantgate.quant.build": {"CalibSettings", "quantize"},                   # quantgate quantize
    "quantgate.export.gguf": {"export_checkpoint"},                          # quantgate export gguf
    "quantgate.export.onnx": {"export_checkpoint"},                          # quantgate export onnx
    "quantgate.evaluate": {"evaluate_model"},                                # quantgate eval
    "quantgate.analyze": {"analyze", "plot_reports", "save_figure"},         # quantgate analyze
    "quantgate.gate_survival": {"check_gate_survival"},                      # quantgate analyze --reference
    "quantgate.info": {"model_info", "cache_bytes"},                         # quantgate info
    "quantgate.formats": {"inspect_gguf", "load_checkpoint"},
    "quantgate.formats.onnx_io": {"onnx_bytes"},                             # an export's size on disk
    "quantgate.runners": {"TorchRunner"},                                  # the float model in memory
    "quantgate.runners.open": {"fixed_ctx", "open_runner"},                  # any model path, as eval opens it
    "quantgate.runners.bench": {"bench"},
}


def test_one_function_opens_a_model_path_as_a_runner():
    """eval, generate and the report open GGUF files, ONNX exports and model directories through
    quantgate.runners.open alone: no other module constructs a LlamaRunner or OrtRunner from a path."""
    constructs = sorted(f"{m}: {name}" for m in MODULES if m not in ("quantgate.runners.open",) and
                        not m.startswith("quantgate.runners.") and m != "quantgate.runners"
                        for name in ("LlamaRunner(", "OrtRunner(") if name in MODULES[m].read_text())
    allowed = {"quantgate.quant.ort: OrtRunner("}  # static calibration runs the fp32 export it is quantizing
    assert set(constructs) <= allowed, constructs
REPORT_PLUMBING = {"quantgate.calib_data", "quantgate.errors", "quantgate.executor", "quantgate.fsio",
                   "quantgate.identity", "quantgate.progress", "quantgate.stats"}  # stats: the intervals comparisons carry


def test_the_report_imports_no_exporter_or_quantizer_internals():
    """The report builds its artifacts with the functions `quantgate quantize` / `export` call and reads results;
    it reaches into no quantizer's or exporter's module beyond them, and into nothing private."""
    bad = []
    for m in (m for m in MODULES if m == "quantgate.report" or m.startswith("quantgate.report.")):
        for target, _top, names in _imports(m):
            if target.startswith("quantgate.report") or target in REPORT_PLUMBING:
                continue
            allowed = REPORT_MAY_USE.get(target)
            extra = sorted(set(names) - allowed) if allowed is not None else [target]
            bad += [f"{m}: {target}.{n}" for n in extra]
    assert bad == [], bad


# --- the public API ------------------------------------------------------------------------------------------

def test_public_api_resolves_and_shadows_no_submodule():
    import quantgate
    submodules = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    assert not set(quantgate.API) & submodules, set(quantgate.API) & submodules
    for name, (module, attr) in quantgate.API.items():
        import importlib
        assert getattr(quantgate, name) is getattr(importlib.import_module(module), attr), name
    assert set(quantgate.__all__) == {"__version__", *quantgate.API}


# --- formats as rows -----------------------------------------------------------------------------------------

def test_every_gguf_tensor_quantgate_writes_is_one_gguf_py_lists_for_its_arch():
    """The writer's and reader's names come from gguf-py's tables: each name a file of either architecture holds
    is among the tensors gguf-py's MODEL_TENSORS gives that architecture (what llama.cpp's loader looks up)."""
    from quantgate.formats.gguf_layout import GGUF_ARCHS, arch_tensors, expected_tensor_names
    for name in GGUF_ARCHS:
        known = arch_tensors(name)
        identity = 1 if GGUF_ARCHS[name].identity_layers else 0
        written = {n.split(".", 2)[-1] if n.startswith("blk.") else n for n in
                   expected_tensor_names(name, n_layers=2, tied=False, identity=identity)}
        assert {n.rsplit(".", 1)[0] if n.endswith((".weight", ".bias")) else n for n in written} <= known, name


def test_layouts_recognise_the_config_they_write():
    """Each layout row reads back as itself from the config.json keys it writes (no name tests in between)."""
    from quantgate.formats.hf import config_to_hf
    from quantgate.layouts import DEFAULT_LAYOUT_FOR_GATE, LAYOUTS, detect_layout
    from quantgate.model import preset
    for gate, name in DEFAULT_LAYOUT_FOR_GATE.items():
        cfg = preset("tiny", gate=gate)
        assert detect_layout(config_to_hf(cfg, LAYOUTS[name])) == name
    assert detect_layout(config_to_hf(preset("tiny", gate="elementwise"), LAYOUTS["official"])) == "official"


def test_one_capture_helper_attaches_hooks():
    """Every "run windows through the model with hooks" loop goes through quantgate.capture."""
    where = [str(p.relative_to(ROOT)) for p in SOURCES if "register_forward" in p.read_text()]
    assert where == ["quantgate/capture.py"], where


def test_nothing_outside_the_model_sets_its_attention_state():
    """KV-cache bits are an option of the run (runners pass Model.forward's kv_bits), not an attribute that
    quantizers set on the model's attention modules from outside."""
    poke = re.compile(r"\.self_attn\.\w+\s*=[^=]")
    where = [str(p.relative_to(ROOT)) for p in SOURCES if poke.search(p.read_text())]
    assert where == [], where


def test_the_registry_and_the_cli_help_import_no_torch():
    """The registry sits below everything (quant/__init__ holds only it), so `quantgate --help` and
    `quantgate quantize --list` answer without importing torch, onnx or llama.cpp."""
    import subprocess
    import sys
    probe = ("import sys\nfrom quantgate.cli import main\nfor argv in (['--help'], ['quantize', '--list', '--json']):\n"
             "    try:\n        main(argv, prog_name='quantgate')\n    except SystemExit:\n        pass\n"
             "print('HEAVY', sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'llama_cpp') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "HEAVY []", r.stdout[-500:]


def test_each_layout_refuses_the_models_it_cannot_hold():
    """Gate-free models in qwen3 (and qwen3_5, as zero gate rows), gated ones in official/qwen3_next/qwen3_5;
    partial rotary only in qwen3_next/qwen3_5; a model without QK-norm only in official; hybrids only in qwen3_5
    (and qwen3_5_moe); mixture-of-experts models only in qwen3_5_moe: the rows' flags, checked on every combination."""
    import dataclasses

    from quantgate.layouts import LAYOUTS
    from quantgate.model import hybrid, preset
    for gate in ("none", "headwise", "elementwise"):
        for rotary in (1.0, 0.5):
            for qk in (True, False):
                for is_hybrid, moe, lab in ((False, False, False), (True, False, False), (False, True, False),
                                            (True, True, False), (False, False, True), (True, False, True)):
                    cfg = preset("tiny", gate=gate)
                    cfg = dataclasses.replace(hybrid(cfg) if is_hybrid else cfg, partial_rotary=rotary, qk_norm=qk,
                                              positions="learned" if lab else "rope")
                    if moe:  # mixture-of-experts models in qwen3_5_moe only, and only those there
                        cfg = dataclasses.replace(cfg, n_experts=4, n_experts_used=2, expert_ffn_dim=32,
                                                  shared_expert_ffn_dim=32)
                    for name, lay in LAYOUTS.items():
                        if name == "quantgate_lab":  # sink-lab models (learned positions) only, of any gate
                            fits = lab and not is_hybrid and not moe and rotary == 1.0
                            assert (lay.cannot_hold(cfg) is None) == fits, (name, gate, rotary, qk, is_hybrid, lab)
                            continue
                        q35 = name in ("qwen3_5", "qwen3_5_moe")
                        gate_ok = q35 or (gate == "none") == (name == "qwen3")
                        fits = (gate_ok and (rotary == 1.0 or name in ("qwen3_next", "qwen3_5", "qwen3_5_moe"))
                                and (qk or name == "official") and (not is_hybrid or q35)
                                and moe == (name == "qwen3_5_moe") and not lab)
                        assert (lay.cannot_hold(cfg) is None) == fits, (name, gate, rotary, qk, is_hybrid, moe)
