"""What a report run is: its settings, the schemes it scores unless told otherwise, and the identity every cached
result is keyed by."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..calib_data import data_paths
from ..errors import QuantgateError
from ..fsio import check_output
from ..identity import key as ident_key
from ..quant import SCHEMES
from ..quant import get as registry_get

TWINS = ("baseline", "gated")
DEFAULT_SCHEMES = {
    "torch": ["w8a8-static", "w8a8-static-sink", "w8a8-dynamic", "w4a16-g32", "w4a16-g32-qgate8"],
    "onnx": ["fp32", "int8-dynamic", "int8-static", "int4", "int4+gate8"],
    "gguf": ["F16", "Q8_0", "Q4_K_M", "Q4_K_M+gate8", "Q2_K", "kv-q8_0", "kv-q4_0"],
}  # names from the registry (quantgate.quant); the gate-aware ones all keep the whole q|gate projection at 8 bits
BENCH_TOKENS = 192  # the speed runs prefill 128 tokens, then decode 64
GATE_SURVIVAL_WINDOWS = 4  # calibration windows the gate-survival check of each gated artifact runs


def gated_only(backend: str, scheme: str) -> bool:
    """Gate-aware schemes (a KeepAt override on gate rows) have nothing to keep in the baseline. The float
    reference cells (torch fp32 speed) are not registry schemes."""
    sch = SCHEMES.get(f"{backend}:{scheme}")
    return sch is not None and sch.keep is not None


@dataclass
class ReportSettings:
    baseline: str
    gated: str
    out: str
    data: str = "embedded"
    backends: tuple = ("torch", "onnx", "gguf")
    schemes: dict = field(default_factory=lambda: {k: list(v) for k, v in DEFAULT_SCHEMES.items()})
    windows: int = 64            # benchmarks/results/interval_width.json: the half-width of the twins' KLD-ratio
    ctx: int = 256               # interval is 0.05-0.12 at 32 windows, 0.04-0.08 at 64, 0.03-0.04 at 128; 64 fits the demo
    calib_windows: int = 16
    analysis_windows: int = 32
    threads: int | None = None
    recipe_note: str | None = None      # why the twins were trained as they were (the demo says so here)
    unpaired: bool = False              # two models that are not twins (other layers or tokenizer): unpaired intervals
    executor: str = "local"             # where the cells run (quantgate.executor); not part of any key


@dataclass
class Identity:
    """What every cached result of one report run is keyed by: the twins' contents, the data's contents,
    the measurement settings and the code (never paths, modification times or the version string)."""
    models: dict          # twin -> content id
    data: str             # corpus fingerprint
    code: str

    def cell_key(self, s: ReportSettings, *cell) -> str:
        return ident_key("cell", self.code, self.models, self.data, s.windows, s.ctx, s.calib_windows,
                         s.analysis_windows, *cell)

    def calibration(self, s: ReportSettings) -> list:
        return [self.data, s.calib_windows, s.ctx, 0]  # data content, windows, window length, sampler seed


def check_settings(s: ReportSettings) -> None:
    """Checked before any work, so a typo is one error line and not a report whose cells were all skipped."""
    unknown = [b for b in s.backends if b not in DEFAULT_SCHEMES]
    if unknown:
        raise QuantgateError(f"unknown backend {unknown[0]!r}; choose from {', '.join(DEFAULT_SCHEMES)}")
    for backend in s.backends:
        for scheme in s.schemes.get(backend, DEFAULT_SCHEMES[backend]):
            registry_get(backend, scheme)  # an unknown name: one line listing the choices
    check_output(s.out, "report", (s.baseline, s.gated, *data_paths(s.data)))
