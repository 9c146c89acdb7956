"""Every quantization scheme quantgate offers, on every backend, as small config objects in one registry.

torchao's shape (`quantize_(model, Config())`): one frozen dataclass per workflow, and one `quantize(source,
scheme)` (quantgate.quant.build) that dispatches on the config's type. The registry key is
`backend:name` (`torch:w4a16-g32`, `onnx:int4+gate8`, `gguf:Q4_K_M+gate8`, `torchao:int8-dynamic`); the CLI
help, `quantgate quantize --list`, the report's validation and its cells all read it.

What a scheme keeps at more bits than the rest is an explicit `KeepAt(bits, scope)`, and a scope names the
same tensors on every backend:

| scope        | kept at `bits`                                   | torch             | onnxruntime           | llama.cpp |
|--------------|--------------------------------------------------|-------------------|-----------------------|-----------|
| `gate`       | the gate rows W_g only                           | `g_proj`          | not expressible (*)   | not expressible (*) |
| `q_and_gate` | the whole q|gate projection (q rows and W_g rows) | `q_proj`+`g_proj` | the fused `qg_proj` MatMul | `attn_q` |

In a hybrid, `q_and_gate` also keeps every Gated DeltaNet's output gate (`in_proj_z`; llama.cpp `attn_gate`), on
every backend. A MoE's router and shared-expert gate (its third gate) stay float under every scheme: llama.cpp
keeps `ffn_gate_inp` and `ffn_gate_inp_shexp` F32 whatever the type, and torch skips both (simulate.FLOAT_LINEARS).

(*) the exports fuse q and gate rows into one tensor (one MatMul; qwen35's `attn_q`), so a backend quantizing
that tensor can keep both rows or neither. The names are the ones each backend had before this registry
(kept for the CLI and saved checkpoints): torch `-gate8` is the gate rows only, torch `-qgate8`, ONNX
`+gate8` and GGUF `+gate8` are the whole q|gate projection; `quantize --list` prints the scope of each.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import ClassVar

from ..errors import QuantgateError

SCOPES = {  # scope -> the tensors it keeps, in words (the same on every backend that can express it)
    "gate": "the gate rows W_g only",
    "q_and_gate": "the whole q|gate projection (q rows and gate rows)",
}
HYBRID_SCOPES = {"q_and_gate": "every Gated DeltaNet's output-gate projection (in_proj_z)"}  # a hybrid's too


def scope_words(scope: str, hybrid: bool | None = None) -> str:
    """What a keep scope keeps, in words, for a hybrid (True), a model without Gated DeltaNet layers (False), or no
    model in view (None: the general rule, hybrids named)."""
    words, extra = SCOPES[scope], HYBRID_SCOPES.get(scope)
    if extra is None or hybrid is False:
        return words
    return f"{words}, and {extra}" if hybrid else f"{words}; in a hybrid also {extra}"


@dataclass(frozen=True)
class KeepAt:
    """Tensors kept at `bits` while the rest take the scheme's bits; `scope` is a key of SCOPES."""
    bits: int
    scope: str

    def describe(self, hybrid: bool | None = None) -> dict:
        return {"bits": self.bits, "scope": self.scope, "tensors": scope_words(self.scope, hybrid)}


# --- PyTorch simulation (fake-quantized weights and activations, evaluated by our runner) ---------------

@dataclass(frozen=True)
class TorchScheme:
    """A PyTorch scheme: what happens to the weights (bits, group size), to the activations entering each
    block Linear (none, a static per-tensor range from calibration, or dynamic per-token), to the KV cache,
    and which tensors keep more bits. Only the Linears inside the decoder blocks are quantized; embeddings,
    norms and lm_head stay in float (llama.cpp likewise keeps its output tensor at higher precision).

    The field names are what checkpoints store in config.json's `quant_scheme` (`gate_bits`/`gate_scope`
    are the KeepAt override in that stored form)."""
    backend: ClassVar[str] = "torch"
    name: str
    weight_bits: int | None = 8          # None keeps float weights
    group_size: int | None = None        # None: one scale per output row
    act: str | None = None               # None (weight-only) | "static" | "dynamic"
    act_bits: int = 8
    calib: str = "minmax"                # static ranges: "minmax" | "percentile"
    percentile: float = 99.99
    symmetric: bool = False              # static activations: symmetric int8 or asymmetric uint8
    sink_aware: bool = False             # PrefixQuant-style: BOS kept in float and left out of calibration
    gate_bits: int | None = None         # KeepAt.bits
    gate_scope: str = "gate"             # KeepAt.scope
    method: str = "rtn"                  # weight rounding: "rtn" (round to nearest) | "gptq"
    smooth_alpha: float | None = None    # SmoothQuant migration strength before quantizing (None: off)
    kv_bits: int | None = None           # KV cache rounded per token and head to this many bits
    allocated: bool = False              # bits and group size per Linear (quant_state), chosen under a budget

    @property
    def keep(self) -> KeepAt | None:
        return None if self.gate_bits is None else KeepAt(self.gate_bits, self.gate_scope)

    @property
    def needs_calibration(self) -> bool:
        return self.act == "static" or self.method == "gptq" or self.smooth_alpha is not None

    @property
    def kv_only(self) -> bool:
        """A KV-cache-only scheme leaves the Linears alone."""
        return self.weight_bits is None and self.act is None and self.gate_bits is None and not self.allocated

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> dict:
        if self.allocated:
            return {"weights": "allocated int bits and group size per Linear (quant.allocate_torch)",
                    "weight_bits": None, "group_size": None, "activations": "float", "kv_cache": None,
                    "artifact": "model directory"}
        w = "float" if self.weight_bits is None else f"int{self.weight_bits}" + (
            f" g{self.group_size}" if self.group_size else " per row") + (" GPTQ" if self.method == "gptq" else "")
        a = "float" if self.act is None else f"int{self.act_bits} {self.act}" + (
            f" {self.calib}" if self.act == "static" else "") + (" symmetric" if self.symmetric else "") + (
            " sink-aware" if self.sink_aware else "") + (
            f" SmoothQuant {self.smooth_alpha}" if self.smooth_alpha is not None else "")
        return {"weights": w, "weight_bits": self.weight_bits, "group_size": self.group_size, "activations": a,
                "kv_cache": None if self.kv_bits is None else f"int{self.kv_bits}", "artifact": "model directory"}

    @classmethod
    def from_saved(cls, d, where: str) -> "TorchScheme":
        """A scheme read back from a checkpoint's config.json: every field checked (the file may have been
        edited by hand), one error line naming the field otherwise."""
        if not isinstance(d, dict):
            raise QuantgateError(f"{where}: quant_scheme must be a JSON object")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown or not isinstance(d.get("name"), str):
            raise QuantgateError(f"{where}: quant_scheme has unknown fields {unknown[:3]} or no name")
        for k, (ok, want) in _SAVED_FIELDS.items():
            if k in d and not ok(d[k]):
                raise QuantgateError(f"{where}: quant_scheme.{k} must be {want}, got {str(d[k])[:40]}")
        return cls(**d)


def _bits(lo: int, hi: int):
    return lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi)


def _flag(v) -> bool:
    return isinstance(v, bool)


def _number(lo: float, hi: float, none: bool = False):
    return lambda v: (none and v is None) or (isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi)


_SAVED_FIELDS = {  # field -> (check, what it must be)
    "weight_bits": (_bits(2, 8), "2..8 or null"), "group_size": (_bits(1, 1 << 16), "a positive integer or null"),
    "act": (lambda v: v in (None, "static", "dynamic"), "null, static or dynamic"),
    "act_bits": (lambda v: v is not None and _bits(2, 16)(v), "2..16"),
    "calib": (lambda v: v in ("minmax", "percentile"), "minmax or percentile"),
    "percentile": (_number(50, 100), "a number in [50, 100]"), "symmetric": (_flag, "true or false"),
    "sink_aware": (_flag, "true or false"), "gate_bits": (_bits(2, 16), "2..16 or null"),
    "gate_scope": (lambda v: v in SCOPES, " or ".join(SCOPES)),
    "method": (lambda v: v in ("rtn", "gptq"), "rtn or gptq"),
    "smooth_alpha": (_number(0, 1, none=True), "a number in [0, 1] or null"),
    "kv_bits": (_bits(2, 16), "2..16 or null"), "allocated": (_flag, "true or false"),
}


@dataclass(frozen=True)
class TorchBudget:
    """Int bits and group size per block Linear chosen by quantgate's torch allocator (quant.allocate_torch) under a
    budget in bits per weight of the block Linears: `auto@5`; `+held` holds the gates at the allocation's base
    option. What it writes is a checkpoint whose scheme is a TorchScheme with `allocated` set. Not listed in the
    registry: `get` reads the name."""
    backend: ClassVar[str] = "torch"
    name: str
    target_bpw: float
    hold_gates: bool = False
    keep: ClassVar[None] = None
    needs_calibration: ClassVar[bool] = True  # sensitivity is measured on calibration windows

    def describe(self) -> dict:
        return _budget_row(f"allocated int bits and group size per Linear, <= {self.target_bpw:g} bpw"
                           + (", gates held" if self.hold_gates else ""), self.target_bpw, "model directory")


def _budget_row(weights: str, bpw: float | None, artifact: str) -> dict:
    """`quantize --list`'s row of an allocation config (any backend's budget)."""
    return {"weights": weights, "weight_bits": bpw, "group_size": None, "activations": "float", "kv_cache": None,
            "artifact": artifact}


TORCH_BUDGET_NAME = re.compile(r"auto@([0-9]+(?:\.[0-9]+)?)(\+held)?")


def torch_budget(name: str) -> TorchBudget | None:
    """`auto@BPW` with `+held` as a torch allocation's config; None for any other name. A size (`auto@40MB`) is
    refused: a torch checkpoint stores its rounded weights in float, so only bits per weight mean anything."""
    if re.fullmatch(r"auto@[0-9.]+[KMGT]i?B.*", name):
        raise QuantgateError(f"torch:{name}: a torch allocation takes bits per weight (auto@5): its checkpoint "
                             f"stores the rounded weights in float, so a size target means nothing")
    m = TORCH_BUDGET_NAME.fullmatch(name)
    if m is None:
        return None
    bpw = float(m.group(1))
    if not 1.0 <= bpw <= 32.0:
        raise QuantgateError(f"torch:{name}: the budget must be between 1 and 32 bits per weight")
    return TorchBudget(name, bpw, bool(m.group(2)))


# --- ONNX Runtime (onnxruntime.quantization on an fp32 export) ------------------------------------------

@dataclass(frozen=True)
class OnnxScheme:
    """An onnxruntime.quantization recipe (DESIGN section 4): `tool` is quantize_dynamic, quantize_static
    (QDQ, MinMax calibration) or MatMulNBitsQuantizer ("nbits", `block_size` per block); "export" is the
    fp32 export itself, the report's float reference on this backend."""
    backend: ClassVar[str] = "onnx"
    name: str
    tool: str                     # "export" | "dynamic" | "static" | "nbits"
    weight_bits: int
    block_size: int | None = None
    keep: KeepAt | None = None

    @property
    def needs_calibration(self) -> bool:
        return self.tool == "static"

    @property
    def base(self) -> str:
        """The onnx_quantize scheme name without the override."""
        return self.name.partition("+")[0]

    def describe(self) -> dict:
        w = {"export": "fp32", "dynamic": "int8 per tensor", "static": "int8 per channel",
             "nbits": f"int{self.weight_bits} blocks of {self.block_size}"}[self.tool]
        a = {"dynamic": "uint8 per call", "static": "uint8 calibrated"}.get(self.tool, "float")
        return {"weights": w, "weight_bits": self.weight_bits, "group_size": self.block_size, "activations": a,
                "kv_cache": None, "artifact": "ONNX directory"}


# --- llama.cpp (its own quantizer on an F32/F16 GGUF; KV-cache types are chosen at run time) -------------

from .gguf_types import GGUF_FILE_TYPES, GGUF_KV_TYPES, NEEDS_IMATRIX, NO_GATE_OVERRIDE  # noqa: F401  (re-exported)
from .targets import parse_floor, parse_size


# gguf-py is imported where its enums are read, not with the registry: the CLI reads the registry for its
# help text, and a command that never touches a GGUF should not pay for gguf-py's import.

def llama_file_type(name: str) -> int:
    """llama_ftype of a file type name (`Q4_K_M` -> 15), from gguf-py's LlamaFileType."""
    from gguf import LlamaFileType
    return int(LlamaFileType[f"MOSTLY_{name}"])


def ggml_type(name: str) -> int:
    """ggml_type of a tensor/KV type name (`q8_0` -> 8), from gguf-py's GGMLQuantizationType."""
    from gguf import GGMLQuantizationType
    return int(GGMLQuantizationType[name.upper()])


def llama_file_type_name(value: int) -> str | None:
    """The name llama.cpp prints for a general.file_type value (`15` -> `Q4_K_M`); None if unknown."""
    from gguf import LlamaFileType
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return None


@dataclass(frozen=True)
class GgufScheme:
    """A llama.cpp file type (llama.cpp picks its usual per-tensor mixture), optionally with an importance
    matrix and a KeepAt override; or, with `kv_type`, an F16 file run with a quantized KV cache (a run-time
    choice, `eval/generate --kv-type`: the report scores it as a cell, `quantize` has nothing to write)."""
    backend: ClassVar[str] = "gguf"
    name: str
    file_type: str                # a GGUF_FILE_TYPES name
    keep: KeepAt | None = None
    imatrix: bool = False
    kv_type: str | None = None

    @property
    def needs_calibration(self) -> bool:
        return self.imatrix

    @property
    def llama_ftype(self) -> int:
        return llama_file_type(self.file_type)

    def describe(self) -> dict:
        bits = {"F16": 16, "BF16": 16, "Q8_0": 8, "Q6_K": 6}.get(self.file_type)
        if bits is None:
            bits = int(self.file_type.lstrip("IQ")[0])
        return {"weights": f"llama.cpp {self.file_type} mixture" + (" + imatrix" if self.imatrix else ""),
                "weight_bits": bits, "group_size": None, "activations": "float",
                "kv_cache": self.kv_type,
                "artifact": "nothing: a run-time option (eval/generate --kv-type)" if self.kv_type else ".gguf file"}


@dataclass(frozen=True)
class GgufBudget:
    """Per-tensor llama.cpp types chosen by quantgate's allocator (quant.allocate) under a budget: `auto@4.5` (bits
    per weight) or `auto@2.6GB` (the file's size); `+imatrix` gives every quantization an importance matrix, `+held`
    holds the gates at the allocation's base type (the gate A/B's other arm), `+floor=Q4_K_M` (or `=0.95xQ4_K_M`,
    `=40` tok/s) keeps the predicted decode speed above a floor. Not listed in the registry (any budget is one):
    `get` reads the name."""
    backend: ClassVar[str] = "gguf"
    name: str
    target_bpw: float | None
    imatrix: bool = False
    hold_gates: bool = False
    target_bytes: int | None = None
    decode_floor: str | None = None
    keep: ClassVar[None] = None
    kv_type: ClassVar[None] = None
    needs_calibration: ClassVar[bool] = True  # sensitivity is measured on calibration windows

    def describe(self) -> dict:
        size = f"<= {self.target_bpw:g} bpw" if self.target_bpw is not None else f"<= {self.target_bytes:,} bytes"
        return _budget_row(f"allocated llama.cpp types per tensor, {size}"
                           + (" + imatrix" if self.imatrix else "") + (", gates held" if self.hold_gates else "")
                           + (f", decode >= {_floor_words(self.decode_floor)}" if self.decode_floor else ""),
                           self.target_bpw, ".gguf file")


def _floor_words(text: str) -> str:
    return str(parse_floor(text))


BUDGET_NAME = re.compile(r"auto@([0-9]+(?:\.[0-9]+)?)([KMGT]i?B)?((?:\+imatrix|\+held|\+floor=[0-9A-Za-z_.]+)*)")


def gguf_budget(name: str) -> GgufBudget | None:
    """`auto@BPW` or `auto@SIZE` (2.6GB, 900MB) with `+imatrix`, `+held`, `+floor=SPEED` as its config; None for any
    other name; one line for a budget or floor out of range."""
    m = BUDGET_NAME.fullmatch(name)
    if m is None:
        return None
    flags = re.findall(r"\+(imatrix|held|floor=[0-9A-Za-z_.]+)", m.group(3))
    floors = [f.partition("=")[2] for f in flags if f.startswith("floor=")]
    if len(floors) > 1 or len(flags) != len(set(flags)):
        raise QuantgateError(f"gguf:{name}: each of +imatrix, +held, +floor=... at most once")
    floor = floors[0] if floors else None
    if floor:
        parse_floor(floor, f"gguf:{name}: the floor")  # refused here, before any cell runs
    if m.group(2):
        return GgufBudget(name, None, "imatrix" in flags, "held" in flags,
                          parse_size(m.group(1) + m.group(2), f"gguf:{name}: the size"), floor)
    bpw = float(m.group(1))
    if not 1.0 <= bpw <= 32.0:
        raise QuantgateError(f"gguf:{name}: the budget must be between 1 and 32 bits per weight")
    return GgufBudget(name, bpw, "imatrix" in flags, "held" in flags, None, floor)


@dataclass(frozen=True)
class OnnxBudget:
    """MatMulNBits bits and block size per node chosen by quantgate's ONNX allocator (quant.allocate_onnx) under a
    budget: `auto@5` (bits per weight) or `auto@40MB` (the folder's size); `+held` holds the gates at the
    allocation's base option. Not listed in the registry: `get` reads the name."""
    backend: ClassVar[str] = "onnx"
    name: str
    target_bpw: float | None
    hold_gates: bool = False
    target_bytes: int | None = None
    tool: ClassVar[str] = "budget"
    keep: ClassVar[None] = None
    needs_calibration: ClassVar[bool] = True  # sensitivity is measured on calibration windows

    def describe(self) -> dict:
        size = f"<= {self.target_bpw:g} bpw" if self.target_bpw is not None else f"<= {self.target_bytes:,} bytes"
        return _budget_row(f"allocated MatMulNBits bits and blocks per node, {size}"
                           + (", gates held" if self.hold_gates else ""), self.target_bpw, "ONNX directory")


ONNX_BUDGET_NAME = re.compile(r"auto@([0-9]+(?:\.[0-9]+)?)([KMGT]i?B)?(\+held)?")


def onnx_budget(name: str) -> OnnxBudget | None:
    """`auto@BPW` or `auto@SIZE`, with `+held`, as an ONNX allocation's config; None for any other name."""
    m = ONNX_BUDGET_NAME.fullmatch(name)
    if m is None:
        return None
    if m.group(2):
        return OnnxBudget(name, None, bool(m.group(3)), parse_size(m.group(1) + m.group(2), f"onnx:{name}: the size"))
    bpw = float(m.group(1))
    if not 1.0 <= bpw <= 32.0:
        raise QuantgateError(f"onnx:{name}: the budget must be between 1 and 32 bits per weight")
    return OnnxBudget(name, bpw, bool(m.group(3)))


# --- torchao (real integer kernels, applied when the model is loaded: `eval --torchao`) -----------------

@dataclass(frozen=True)
class TorchaoScheme:
    """torchao's own configs on the block Linears at load time (quantgate.quant.torchao_backend)."""
    backend: ClassVar[str] = "torchao"
    name: str
    group_size: int | None = None
    cuda_only: bool = False
    keep: KeepAt | None = None

    needs_calibration: ClassVar[bool] = False

    def describe(self) -> dict:
        w = "int8 per row" if self.name == "int8-dynamic" else f"int4 g{self.group_size} (tinygemm)"
        return {"weights": w, "weight_bits": 8 if self.name == "int8-dynamic" else 4, "group_size": self.group_size,
                "activations": "int8 dynamic" if self.name == "int8-dynamic" else "bf16", "kv_cache": None,
                "artifact":
                    "nothing: applied at load time (eval --torchao" + (", CUDA only)" if self.cuda_only else ")")}


# --- the registry -----------------------------------------------------------------------------------------

GATE8 = KeepAt(8, "q_and_gate")
TORCH_SCHEMES = (
    TorchScheme("w8a8-static", act="static"),
    TorchScheme("w8a8-static-sym", act="static", symmetric=True),
    TorchScheme("w8a8-static-pct", act="static", calib="percentile"),
    TorchScheme("w8a8-static-sink", act="static", sink_aware=True),
    TorchScheme("w8a8-smoothquant", act="static", smooth_alpha=0.5),
    TorchScheme("w8a8-dynamic", act="dynamic"),
    TorchScheme("w8a16"),
    TorchScheme("kv-int8", weight_bits=None, kv_bits=8),
    TorchScheme("kv-int4", weight_bits=None, kv_bits=4),
    TorchScheme("w4a16-g32", weight_bits=4, group_size=32),
    TorchScheme("w4a16-g64", weight_bits=4, group_size=64),
    TorchScheme("w4a16-g128", weight_bits=4, group_size=128),
    TorchScheme("w4a16-g32-gate8", weight_bits=4, group_size=32, gate_bits=8, gate_scope="gate"),
    TorchScheme("w4a16-g32-qgate8", weight_bits=4, group_size=32, gate_bits=8, gate_scope="q_and_gate"),
    TorchScheme("gptq-w4a16-g32", weight_bits=4, group_size=32, method="gptq"),
    TorchScheme("gptq-w4a16-g128", weight_bits=4, group_size=128, method="gptq"),
)
ONNX_SCHEMES = (
    OnnxScheme("fp32", "export", 32),
    OnnxScheme("int8-dynamic", "dynamic", 8),
    OnnxScheme("int8-static", "static", 8),
    OnnxScheme("int8-weight", "nbits", 8, block_size=32),
    OnnxScheme("int4", "nbits", 4, block_size=32),
    OnnxScheme("int4+gate8", "nbits", 4, block_size=32, keep=GATE8),
)
GGUF_SCHEMES = (
    *(GgufScheme(t, t) for t in GGUF_FILE_TYPES),
    *(GgufScheme(f"{t}+gate8", t, keep=GATE8) for t in GGUF_FILE_TYPES if t not in NO_GATE_OVERRIDE),
    *(GgufScheme(f"kv-{k}", "F16", kv_type=k) for k in GGUF_KV_TYPES if k != "f32"),
)
TORCHAO_SCHEMES = (
    TorchaoScheme("int8-dynamic"),
    TorchaoScheme("int4-weight", group_size=128, cuda_only=True),
)
SCHEMES: dict[str, object] = {f"{s.backend}:{s.name}": s
                              for s in (*TORCH_SCHEMES, *ONNX_SCHEMES, *GGUF_SCHEMES, *TORCHAO_SCHEMES)}


def names(backend: str) -> list[str]:
    """The scheme names of one backend, in registry order."""
    return [k.partition(":")[2] for k in SCHEMES if k.startswith(f"{backend}:")]


def get(backend: str, name: str, what: str | None = None, **overrides):
    """The registry's config for `backend:name` (with dataclass overrides, e.g. block_size=64); an unknown
    name is one error line listing the choices (`what` names them, e.g. "GGUF type")."""
    budget = {"gguf": gguf_budget, "onnx": onnx_budget, "torch": torch_budget}.get(backend) if what is None else None
    s = SCHEMES.get(f"{backend}:{name}") or (budget(name) if budget else None)
    if s is None:
        listed = names(backend)
        tail = ""
        if backend == "gguf":  # the +gate8 and kv- variants are spelled out as a rule, not listed
            listed = [n for n in listed if "+" not in n and not n.startswith("kv-")]
            if what is None:  # a report cell: the kv- run-time variants are cells too
                tail = ("; any type below 8 bits takes +gate8, kv-q8_0 or kv-q4_0 run an F16 file with that KV cache, "
                        "and auto@BPW[+imatrix][+held] allocates types per tensor under BPW bits per weight")
        elif backend == "onnx" and what is None:
            tail = "; auto@BPW[+held] allocates MatMulNBits bits and blocks per node under BPW bits per weight"
        elif backend == "torch" and what is None:
            tail = "; auto@BPW[+held] allocates int bits and group size per Linear under BPW bits per weight"
        raise QuantgateError(f"unknown {what or backend + ' scheme'} {name!r}; choose from {', '.join(listed)}{tail}")
    return replace(s, **overrides) if overrides else s


def with_gate_bits(backend: str, name: str, gate_bits: int | None):
    """The CLI's `--gate-bits 8` on an ONNX or GGUF base scheme: its registry `+gate8` variant, or one line
    saying why there is none."""
    base = get(backend, name, "ONNX scheme" if backend == "onnx" else "GGUF type")
    if gate_bits is None:
        return base
    if gate_bits != 8:
        raise QuantgateError(f"--gate-bits must be 8, got {gate_bits}")
    aware = SCHEMES.get(f"{backend}:{name}+gate8")
    if aware is None:
        what = "int4" if backend == "onnx" else "types below 8 bits"
        raise QuantgateError(f"--gate-bits 8 applies to {what} (the {name} gate rows are 8-bit already)")
    return aware


def plain_of(scheme) -> str | None:
    """The same scheme without its KeepAt override (the report's comparison partner), if registered."""
    if scheme.keep is None:
        return None
    if scheme.backend == "torch":
        name = scheme.name.removesuffix("-qgate8").removesuffix("-gate8")
    else:
        name = scheme.name.partition("+")[0]
    return name if f"{scheme.backend}:{name}" in SCHEMES else None


def describe(key: str, hybrid: bool | None = None) -> dict:
    """One row of `quantgate quantize --list`: the scheme's settings in words and numbers (`hybrid`: of the model in
    view, which decides the keep scope's words; None: no model)."""
    s = SCHEMES[key]
    return {"key": key, "backend": s.backend, "name": s.name, **s.describe(),
            "calibration": bool(s.needs_calibration), "keep": None if s.keep is None else s.keep.describe(hybrid),
            "gated_models_only": s.keep is not None}


def listing(backend: str | None = None, hybrid: bool | None = None) -> list[dict]:
    return [describe(k, hybrid) for k in SCHEMES if backend is None or k.startswith(f"{backend}:")]
