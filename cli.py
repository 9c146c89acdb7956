"""The `quantgate` command line: a thin layer over functions a user can import.

Installed as `quantgate.cli`. Every bad input ends in one `error: ...` line on stderr and exit code 2;
Ctrl-C ends with exit code 130, SIGTERM with 143. Nothing half-written is left behind (see quantgate.fsio).

Each command imports the module it runs when it runs (as mlx-lm's command dispatch does), so `quantgate --help`
starts in a fraction of a second instead of the seconds torch, onnx and llama.cpp take to import. This file is
the one place where the project's own modules are imported inside functions (tests/test_structure.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading

import click

from quantgate import __version__
from quantgate.errors import QuantgateError
from quantgate.fsio import interrupts


class Terminated(BaseException):
    """SIGTERM, raised where the process is so that every atomic write below removes its temporary file."""


# Set by the handlers: some libraries turn an interrupt into their own error (torch.export) or swallow it;
# the atomic writers read the same list and refuse to commit (quantgate.fsio.interrupts).
_signalled: list[int] = interrupts


_state = {"raised": False, "deferred": 0}


def _in_import(frame) -> bool:
    """Is Python importing a module right now? An exception raised inside a native extension's initialisation
    (onnx's nanobind, for one) escapes through C++ and aborts the whole process."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _redeliver(signum: int) -> None:
    _state["deferred"] += 1
    os.kill(os.getpid(), signum)


def _on_signal(signum, frame):
    """The first signal interrupts the work (once no import is running: it is handed back 50 ms later); later
    ones (a second Ctrl-C while temporary files are being removed) are only recorded, so the cleanup finishes.
    Every signal is recorded at once, so the atomic writers refuse to commit from then on."""
    if _state["deferred"]:
        _state["deferred"] -= 1  # our own redelivery: recorded already
    else:
        _signalled.append(signum)
    if _state["raised"]:
        return
    if _in_import(frame):
        t = threading.Timer(0.05, _redeliver, (signum,))
        t.daemon = True
        t.start()
        return
    _state["raised"] = True
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _exit(code: int, line: str):
    """Print the one error line and leave at once. Every temporary path is gone by now (the exception has
    unwound every writer); skipping the interpreter's shutdown keeps native libraries' exit handlers, which can
    abort a process interrupted mid-call, from turning a clean error into a crash."""
    for s in (signal.SIGINT, signal.SIGTERM):  # nothing may interrupt the last line
        signal.signal(s, signal.SIG_IGN)
    click.echo(line, err=True)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _stop(signum: int):
    if signum == signal.SIGTERM:
        _exit(143, "error: terminated (SIGTERM); nothing half-written was kept")
    _exit(130, "error: interrupted (Ctrl-C); nothing half-written was kept")


def _one_line(e) -> str:
    """An error message as one line, whatever a library put into it."""
    return " ".join(str(e).split())


class QuantgateGroup(click.Group):
    def parse_args(self, ctx, args):
        ctx.meta["quantgate.argv"] = list(args)  # what this invocation was given (not sys.argv: main(args=...))
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:  # an unknown top-level option: one line too
            _exit(2, f"error: {_one_line(e.format_message())} (see 'quantgate --help')")

    def invoke(self, ctx):
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        try:
            result = super().invoke(ctx)
            if ctx.invoked_subcommand in LONG_VERBS and not _listing(ctx):
                from quantgate.memory import peak_line
                from quantgate.progress import console
                console.print(peak_line(), markup=False, highlight=False)  # stderr: JSON on stdout stays clean
            return result
        except QuantgateError as e:
            if _signalled:
                _stop(_signalled[0])
            _exit(2, f"error: {_one_line(e)}")
        except click.UsageError as e:  # click's three-line usage message, as one line
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
            _exit(2, f"error: {_one_line(e.format_message())}{where}")
        except OSError as e:  # the file system said no (a file where a folder must be, permissions, ...)
            if _signalled:
                _stop(_signalled[0])
            _exit(2, f"error: {e.filename}: {e.strerror}" if e.filename else f"error: {_one_line(e)}")
        except KeyboardInterrupt:
            _stop(signal.SIGINT)
        except Terminated:
            _stop(signal.SIGTERM)
        except Exception:
            if _signalled:  # the signal surfaced as another library's error: still an interruption
                _stop(_signalled[0])
            raise


# the verbs that end by printing their peak memory (to stderr): what a user sizing a machine for a model needs
LONG_VERBS = {"train", "eval", "quantize", "export", "generate", "analyze", "attribute", "report", "demo"}


def _heartbeat(ctx):
    """In a log, a long verb prints a line at least every 20 s while it runs (quantgate.progress.verb); `generate`
    streams its text instead."""
    verb = ctx.invoked_subcommand
    if verb not in LONG_VERBS or verb == "generate" or _listing(ctx):
        return contextlib.nullcontext()
    from quantgate.progress import verb as heartbeat
    return heartbeat(verb)


def _listing(ctx) -> bool:
    """`quantgate quantize --list` prints a table; no work, no memory line."""
    return ctx.invoked_subcommand == "quantize" and "--list" in ctx.meta.get("quantgate.argv", ())


@click.group(cls=QuantgateGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quantgate")
def main():
    """Quantize and deploy LLMs with gated attention, and measure what the gate does to outliers.

    Start with `quantgate demo`: it trains a baseline and a gated twin on text that ships with
    Python itself and evaluates both.
    """
    ctx = click.get_current_context()
    ctx.with_resource(_heartbeat(ctx))  # held until the verb returns or fails


def _emit(obj: dict, as_json: bool) -> None:
    if as_json:
        from quantgate.fsio import strict_json
        click.echo(json.dumps(strict_json(obj), indent=2, allow_nan=False))
    else:
        for k, v in obj.items():
            if k == "per_window":  # the bootstrap's units: too long for a terminal line
                v = f"{len(v['kld'])} windows (--json prints them)"
            click.echo(f"{k:>20}: {v}")


COUNT = click.IntRange(1, 1 << 30)          # steps, windows, tokens
CTX = click.IntRange(2, 1 << 20)             # window length: BOS plus at least one scored token
SEED = click.IntRange(0, 2 ** 32 - 1)
THREADS = click.IntRange(1, 1024)


class Finite(click.FloatRange):
    """click's FloatRange, which lets nan through (every comparison with nan is false): a finite number in range."""

    def convert(self, value, param, ctx):
        import math
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


class Device(click.ParamType):
    """cpu, cuda or cuda:N (and auto where the command can choose): checked here, before any work."""
    name = "device"

    def __init__(self, auto: bool = False):
        self.auto = auto

    def convert(self, value, param, ctx):
        import re
        v = str(value).strip().lower()
        if v in ("cpu", "cuda") or re.fullmatch(r"cuda:\d{1,2}", v) or (self.auto and v == "auto"):
            return v
        self.fail(f"{value!r} is not {'auto, ' if self.auto else ''}cpu, cuda or cuda:N", param, ctx)


class ModelRef(click.ParamType):
    """A model argument: a local path (directory, .gguf, ONNX export), or a Hugging Face repo id such as
    Qwen/Qwen3.5-0.8B, resolved here to its cached snapshot (downloaded when not cached, unless HF_HUB_OFFLINE)."""
    name = "model"

    def convert(self, value, param, ctx):
        from quantgate.formats.hub import resolve
        return str(resolve(value))


MODEL = ModelRef()


DATA_HELP = ("text source: 'embedded' (the Python standard library's sources, always available), a text "
             "file, a folder, a glob, a WikiText-style file, or a local HF datasets folder (save_to_disk)")


@main.command()
@click.option("--preset", type=click.Choice(["tiny", "small", "medium", "large", "base"]), default="small", show_default=True,
              help="model size: tiny (tests), small (CPU demo), medium (~9M, CPU; rows llama.cpp's k-quants take), "
                   "base (~100M, GPU)")
@click.option("--arch", type=click.Choice(["attention", "hybrid"]), default="attention", show_default=True,
              help="attention: every layer full attention; hybrid: Qwen3.5-style, three of every four layers Gated "
                   "DeltaNet (linear attention with its own output gate), the fourth gated full attention (with "
                   "--twins the baseline's full-attention layers have no gate); saved in the qwen3_5 layout")
@click.option("--gate", type=click.Choice(["none", "headwise", "elementwise"]), default="elementwise",
              show_default=True, help="attention output gate (with --twins: the gated twin's)")
@click.option("--twins", is_flag=True, help="train a baseline and a gated model side by side: same init, same batches")
@click.option("--data", default="embedded", show_default=True, help=DATA_HELP)
@click.option("--out", required=True, type=click.Path(), help="run directory (state/, baseline/, gated/)")
@click.option("--steps", type=COUNT, default=1800, show_default=True)
@click.option("--batch-size", type=click.IntRange(1, 1 << 16), default=8, show_default=True,
              help="global batch (split over torchrun ranks)")
@click.option("--ctx", type=CTX, default=256, show_default=True, help="window length in tokens, BOS included")
@click.option("--lr", type=Finite(0, 10, min_open=True), default=3e-3, show_default=True)
@click.option("--warmup", type=click.IntRange(0, 1 << 30), default=100, show_default=True)
@click.option("--weight-decay", type=Finite(0, 10), default=0.1, show_default=True)
@click.option("--grad-clip", type=Finite(0, 1e6, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--seeds", type=click.IntRange(1, 100), default=1, show_default=True,
              help="with --twins: train this many twin pairs, seeds SEED..SEED+N-1, into OUT/seed-K/ (for `report` "
                   "to say whether a difference survives another training run)")
@click.option("--vocab-size", type=click.IntRange(259, 1 << 20), default=None,
              help="BPE vocabulary (default: the preset's)")
@click.option("--byte-tokenizer", is_flag=True, help="256 bytes + specials instead of BPE")
@click.option("--symbol-tokenizer", is_flag=True,
              help="with a synthetic --data: one token per symbol of its alphabet (the sink lab's tokenizer)")
@click.option("--max-chars", type=COUNT, default=None, help="use only the first N characters of the corpus")
@click.option("--ckpt-every", type=COUNT, default=200, show_default=True,
              help="write a resumable checkpoint every N steps")
@click.option("--threads", type=THREADS, default=None, help="CPU threads (default: torch's)")
@click.option("--device", type=Device(auto=True), default="auto", show_default=True,
              help="auto, cpu, cuda or cuda:N (bf16 autocast on CUDA)")
@click.option("--compile", "compile_", is_flag=True,
              help="torch.compile the model: faster steps after about a minute of compiling per model")
@click.option("--resume", is_flag=True, help="continue the run in --out from its last checkpoint")
def train(out, resume, compile_, seeds, **kw):
    """Train a model (or twins) from scratch. Multi-GPU/multi-process: run under torchrun."""
    from quantgate.train import TrainConfig, train_seeds
    from quantgate.train import train as run_train
    tc = TrainConfig(compile=compile_, **kw)
    if seeds == 1:
        for role, p in run_train(tc, out, resume=resume).items():
            click.echo(f"{role}: {p}")
        return
    runs = train_seeds(tc, out, seeds, resume=resume)
    for paths in runs:
        click.echo(" ".join(f"{role}: {p}" for role, p in paths.items()))
    pairs = " ".join(f"--models {r['baseline']} {r['gated']}" for r in runs)
    click.echo(f"report across seeds: quantgate report {pairs} --out REPORT_DIR")


@main.command("eval")
@click.argument("model", type=MODEL)
@click.option("--data", default="embedded", show_default=True, help=DATA_HELP)
@click.option("--ctx", type=CTX, default=256, show_default=True, help="window length, BOS included")
@click.option("--split", type=click.Choice(["auto", "all", "train", "valid", "test"]), default="auto",
              show_default=True, help="auto: test split of the embedded corpus, whole text otherwise")
@click.option("--max-windows", type=COUNT, default=None,
              help="evaluate N windows spread evenly over the text (default: every window; with --reference, 64)")
@click.option("--reference", type=MODEL, default=None,
              help="float model to compare against: adds KL divergence, top-1 agreement and the perplexity delta")
@click.option("--torchao", type=click.Choice(["int8-dynamic", "int4-weight"]), default=None,
              help="run with torchao's real integer kernels (int4-weight needs CUDA)")
@click.option("--device", type=Device(), default="cpu", show_default=True,
              help="cpu, cuda or cuda:N (torch and ONNX Runtime; a GGUF offloads its layers where llama.cpp has a GPU "
                   "backend, and is refused otherwise)")
@click.option("--kv-type", type=click.Choice(["f32", "f16", "q8_0", "q4_0", "int8", "int4"]), default="f32",
              show_default=True, help="KV-cache type. GGUF: llama.cpp's f32 (parity), f16, q8_0, q4_0. Model "
              "directories and ONNX exports: int8/int4 round k and v per token and head (a kv- quantized checkpoint "
              "uses its own bits unless one is given); f32/f16 keep the cache float")
@click.option("--threads", type=THREADS, default=None, help="CPU threads (llama.cpp, ONNX Runtime)")
@click.option("--layerwise", is_flag=True, default=None,
              help="run a model directory one decoder block at a time over all windows (automatic when its fp32 "
                   "weights do not fit in memory); the same numbers, one block resident")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def eval_cmd(model, data, ctx, split, max_windows, reference, torchao, device, kv_type, threads, layerwise, as_json):
    """Perplexity of MODEL (a model directory, a .gguf run by llama.cpp, or an ONNX export run by ONNX
    Runtime): consecutive windows of ctx-1 tokens, BOS first, every token scored. With --reference: KL
    divergence and top-1 agreement too."""
    from quantgate.evaluate import evaluate_model
    _emit(evaluate_model(model, data, ctx, split, max_windows, device=device, reference=reference,
                         torchao=torchao, kv_type=kv_type, threads=threads, layerwise=layerwise or None), as_json)


CLI_BACKENDS = {"torch": "torch", "onnxruntime": "onnx", "llama.cpp": "gguf"}  # --backend -> registry prefix


def _base_names(backend: str) -> str:
    """The registry's names a user types for --scheme/--type (ONNX and GGUF +gate8 variants come from
    --gate-bits; GGUF kv- entries are run-time options, onnx fp32 is the export itself)."""
    from quantgate.quant import SCHEMES, names
    if backend == "torch":
        return ", ".join(names("torch"))
    return ", ".join(n for n in names(backend) if SCHEMES[f"{backend}:{n}"].keep is None
                     and not n.startswith("kv-") and n != "fp32")


def _print_schemes(backend: str | None, as_json: bool, model: str | None = None) -> None:
    """`quantize --list`: the registry, one line per scheme under its backend (JSON rows with --json); with a MODEL,
    what each keep scope holds in that model (a Gated DeltaNet clause only for a hybrid)."""
    from quantgate.quant import listing
    hybrid = None
    if model is not None:
        from quantgate.info import header_config
        hybrid = header_config(model).is_hybrid
    rows = listing(backend, hybrid)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    width = max(len(r["name"]) for r in rows)
    for i, r in enumerate(rows):
        if i == 0 or rows[i - 1]["backend"] != r["backend"]:
            click.echo(f"{r['backend']}:")
        parts = [f"weights {r['weights']}", f"activations {r['activations']}"]
        if r["kv_cache"]:
            parts.append(f"KV cache {r['kv_cache']}")
        if r["keep"]:
            parts.append(f"keeps {r['keep']['tensors']} at {r['keep']['bits']} bits (gated models)")
        if r["calibration"]:
            parts.append("calibrates on --calib-data")
        click.echo(f"  {r['name']:<{width}}  {'; '.join(parts)}; writes {r['artifact']}")


@main.command()
@click.argument("model", type=MODEL, required=False)
@click.option("--list", "list_schemes", is_flag=True,
              help="list every scheme of every backend (or of --backend): bits, activations, what it keeps at more "
                   "bits and what it writes; then exit")
@click.option("--json", "as_json", is_flag=True, help="print JSON (the --list table, or the summary of what was written)")
@click.option("--backend", type=click.Choice(["auto", *CLI_BACKENDS]), default="auto",
              show_default=True, help="auto: llama.cpp for a .gguf, onnxruntime for an ONNX export, torch for a model "
              "directory (fake-quantized weights and activations, evaluated by our PyTorch runner)")
@click.option("--scheme", default=None, help=f"torch: {_base_names('torch')}; onnxruntime: {_base_names('onnx')} "
              "(see --list)")
@click.option("--block-size", type=click.IntRange(16, 256), default=32, show_default=True,
              help="onnxruntime int4/int8-weight: block size (16, 32, 64, 128 or 256)")
@click.option("--type", "qtype", default=None, help=f"llama.cpp: {_base_names('gguf')}")
@click.option("--imatrix", type=click.Choice(["auto"]), default=None,
              help="llama.cpp: importance matrix computed in PyTorch from --calib-data (with --target-bpw: every "
                   "quantization the allocator measures and writes takes it)")
@click.option("--gate-bits", type=click.Choice(["8"]), default=None,
              help="llama.cpp: keep attn_q (q and gate rows) at Q8_0 while the rest takes --type; onnxruntime int4: "
                   "keep the fused q|gate MatMul at 8 bits (the registry's +gate8 schemes; torch spells them "
                   "w4a16-g32-qgate8, and w4a16-g32-gate8 keeps the gate rows only)")
@click.option("--target-bpw", type=click.FloatRange(1.0, 32.0), default=None,
              help="llama.cpp: choose each tensor's type (Q2_K ... Q8_0) to minimise the KLD measured per tensor "
                   "on --calib-windows windows of --ctx tokens (one llama.cpp quantization and run per tensor and "
                   "type: fewer windows are quicker), the file at most this many bits per weight (instead of --type); "
                   "onnxruntime: the same for each MatMul's MatMulNBits bits (4, 8) and block size (32, 64, 128), "
                   "4.25 to 9 bits per weight; a model directory (torch): each block Linear's bits (3-8) and group "
                   "size (32, 64, 128), 3.125 to 8.5 bits per weight of the block Linears")
@click.option("--target-size", default=None, metavar="SIZE",
              help="as --target-bpw, with the tensors (GGUF) or the ONNX folder at most SIZE (e.g. 2.6GB, 900MB, "
                   "123456789)")
@click.option("--hold-gates", is_flag=True,
              help="with --target-bpw/--target-size: the gate tensors (attn_q, a hybrid's attn_gate, ssm_alpha, "
                   "ssm_beta, ssm_out; ONNX: the fused q|gate MatMul and in_proj_z; torch: g_proj and a Gated "
                   "DeltaNet's in_proj_z, in_proj_a, in_proj_b, out_proj) take the allocation's base type instead of "
                   "what their measured KLD earns (the A/B that shows whether protecting the gates pays)")
@click.option("--sensitivity", type=click.Choice(["auto", "measured", "calibrated", "gradient", "proxy"]),
              default="auto", show_default=True,
              help="with --target-bpw/--target-size: measured (each tensor's KLD at each type: one quantization and "
                   "run per tensor and type); gradient (GGUF: each tensor's KLD at each type predicted from the "
                   "diagonal Fisher of the model's own outputs on the calibration windows, times ggml's own weight "
                   "error: one forward and backward pass, streamed block by block); calibrated (GGUF: the gradient's "
                   "curve scaled to each tensor's KLD measured at one type, the one nearest the budget); proxy (each "
                   "tensor's importance-weighted weight error from ggml's own quantizers on sampled rows; for ONNX, "
                   "each node's weight error from ORT's block quantizer; for torch, each Linear's squared rounding "
                   "error: minutes at 9B, but a weak stand-in); auto (the best one whose predicted time fits "
                   "--sensitivity-time)")
@click.option("--sensitivity-time", default=None, metavar="TIME",
              help="with --sensitivity auto on a GGUF: the time its sensitivity may take, seconds (300) or a factor "
                   "of a plain Q4_K quantize's time predicted here (0.5x); default 0.5x, at least 120 s. auto takes "
                   "measured, calibrated or gradient, the first predicted to fit, else the gradient on fewer "
                   "windows, else the proxy; the file's metadata says which and why")
@click.option("--decode-floor", default=None, metavar="SPEED",
              help="with --target-bpw/--target-size: the file must decode at least this fast, predicted from each "
                   "type's decode time measured here with --threads: tok/s (40), a llama.cpp type (Q4_K_M: as fast "
                   "as that file of this model), a fraction of one (0.95xQ4_K_M), auto (GGUF default: as fast as the "
                   "largest standard type, Q3_K_M to Q8_0, whose file fits the budget, where its files and timings "
                   "are predicted within --sensitivity-time; else none, and the file says so) or none. Types such as "
                   "IQ4_XS, Q3_K and Q5_K decode slower on a CPU than their size suggests. One file per type is "
                   "written and timed, then the written file is timed against the floor in alternated rounds (128 "
                   "tokens of prefill, 128 of decode, 9 rounds) and written again (three files at most) where its "
                   "median is under 0.98x the floor's or it is measurably slower (a sign test over the rounds). A "
                   "floor of at most 1x a type whose file fits the budget takes that type's own per-tensor types "
                   "where they are predicted to lose less KLD, or where nothing else is fast enough")
@click.option("--types", "alloc_types", default=None, metavar="LIST",
              help="with --target-bpw/--target-size on a GGUF: the llama.cpp types the allocation may use, comma-"
                   "separated (default: Q2_K,Q3_K,IQ4_XS,Q4_K,Q5_K,Q6_K,Q8_0, and Q4_0,Q5_0,Q5_1,IQ4_NL for rows not a "
                   "multiple of 256; Q8_0 is always allowed). E.g. leave out IQ4_XS: llama.cpp quantizes it about 3x "
                   "slower than Q4_K (most of a 9B allocation's time when it is chosen) and some runtimes lack fast "
                   "kernels for it")
@click.option("--quantize-time", "quantize_factor", type=float, default=None, metavar="FACTOR",
              help="with --target-bpw/--target-size and the proxy sensitivity on a GGUF: llama.cpp's quantizer may take "
                   "at most FACTOR times its time with every tensor at Q4_K (a plain Q4_K_M quantize's bulk), or a "
                   "minute more, predicted from each type's quantizer timed on the proxy's sampled rows (default 1.5; "
                   "0: no limit). IQ4_XS quantizes about 3x slower than Q4_K: unlimited, a 9B allocation took 2.1x a "
                   "plain quantize. The allocation's JSON says what the limit cost in predicted error")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="with --target-bpw/--target-size on a GGUF: where the measured and calibrated sensitivities' probes "
                   "run: here, or as tasks on the Ray cluster at RAY_ADDRESS (every node seeing the same files)")
@click.option("--out", default=None, type=click.Path(), help="output model directory (torch, ONNX) or .gguf file")
@click.option("--calib-data", default="embedded", show_default=True,
              help="calibration text (the embedded corpus's valid split; never its test split)")
@click.option("--calib-windows", type=COUNT, default=32, show_default=True)
@click.option("--ctx", type=CTX, default=256, show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--threads", type=THREADS, default=None,
              help="llama.cpp quantizer threads (with --decode-floor: also the threads its decode is timed with; "
                   "one by default, which a busy machine does not upset)")
@click.option("--layerwise", is_flag=True, default=None,
              help="torch: run the model one decoder block at a time and write the output as it goes (what a model "
                   "too large for memory gets anyway); the same file, one block's weights resident")
def quantize(model, list_schemes, as_json, backend, scheme, block_size, qtype, imatrix, gate_bits, target_bpw,
             target_size, hold_gates, sensitivity, sensitivity_time, decode_floor, alloc_types, quantize_factor,
             executor, out, calib_data, calib_windows, ctx, seed, threads, layerwise):
    """Quantize MODEL: a model directory under a named PyTorch scheme (writes a loadable checkpoint that
    records the scheme), a .gguf with llama.cpp's own quantizer (--type), or an ONNX export with
    onnxruntime.quantization (--scheme int8-dynamic|int8-static|int8-weight|int4). Every scheme is a row of
    one registry (quantgate.quant): --list prints it."""
    from dataclasses import replace

    from quantgate import quant
    if list_schemes:  # the registry alone: no torch, onnx or llama.cpp to import
        _print_schemes(None if backend == "auto" else CLI_BACKENDS[backend], as_json, model)
        return
    from quantgate.quant.build import CalibSettings, quantize
    if model is None or out is None:
        raise QuantgateError(f"missing {'MODEL' if model is None else '--out'}: quantgate quantize MODEL --out PATH "
                             f"(a model directory, a .gguf or an ONNX export), or --list to see the schemes")
    from quantgate.formats import artifact_kind
    if backend == "auto":
        backend = {"gguf": "llama.cpp", "onnx": "onnxruntime", "hf": "torch"}[artifact_kind(model)]
    for flag, given in (("--hold-gates", hold_gates), ("--decode-floor", decode_floor),
                        ("--sensitivity", sensitivity != "auto"), ("--types", alloc_types),
                        ("--sensitivity-time", sensitivity_time), ("--executor", executor != "local"),
                        ("--quantize-time", quantize_factor is not None)):
        if given and target_bpw is None and target_size is None:
            raise QuantgateError(f"{flag} applies to an allocation: add --target-bpw or --target-size")
    if target_bpw is not None or target_size is not None:
        if qtype or scheme or gate_bits:
            raise QuantgateError("--target-bpw/--target-size choose llama.cpp types per tensor for a .gguf, "
                                 "MatMulNBits bits and block size per node for an ONNX export, or int bits and group "
                                 "size per Linear for a model directory; they replace --type, --scheme and --gate-bits")
        from quantgate.quant.targets import parse_floor, parse_size
        if backend == "torch":
            for flag, given in (("--target-size", target_size), ("--imatrix", imatrix), ("--types", alloc_types),
                                ("--decode-floor", decode_floor), ("--layerwise", layerwise),
                                ("--quantize-time", quantize_factor is not None),
                                ("--sensitivity-time", sensitivity_time), ("--executor", executor != "local")):
                if given:
                    raise QuantgateError(f"{flag} does not apply to a torch allocation (--target-bpw on a model "
                                         f"directory: its checkpoint stores rounded weights in float, with no integer "
                                         f"kernel whose size or speed could be targeted)")
            from quantgate.quant.allocate_torch import allocate_torch
            summary = allocate_torch(model, out, target_bpw, calib_data, calib_windows, ctx, seed, hold_gates,
                                     sensitivity)
            _emit(summary if as_json else {k: v for k, v in summary.items() if k != "sensitivity"}, as_json)
            return
        if backend == "onnxruntime":
            for flag, given in (("--imatrix", imatrix), ("--types", alloc_types),
                                ("--quantize-time", quantize_factor is not None),
                                ("--sensitivity-time", sensitivity_time), ("--executor", executor != "local")):
                if given:
                    raise QuantgateError(f"{flag} applies to a GGUF allocation (an ONNX allocation chooses MatMulNBits "
                                         f"bits and block sizes)")
            from quantgate.quant.allocate_onnx import OPTIONS, allocate_onnx
            if decode_floor and decode_floor.strip().lower() == "auto":
                raise QuantgateError("--decode-floor auto is a GGUF allocation's (the standard llama.cpp type the "
                                     "budget names); an ONNX allocation takes tok/s, a uniform option or none")
            floor = (parse_floor(decode_floor, references=OPTIONS, kind="a uniform option")
                     if decode_floor and decode_floor.strip().lower() != "none" else None)
            summary = allocate_onnx(model, out, target_bpw, parse_size(target_size) if target_size else None,
                                    calib_data, calib_windows, ctx, seed, threads, hold_gates, sensitivity, floor)
            _emit(summary if as_json else {k: v for k, v in summary.items() if k not in ("sensitivity", "decode_cost")},
                  as_json)
            return
        from quantgate.quant.allocate import allocate_gguf, parse_types
        floor = ("auto" if decode_floor is None or decode_floor.strip().lower() == "auto" else
                 None if decode_floor.strip().lower() == "none" else parse_floor(decode_floor))
        summary = allocate_gguf(model, out, target_bpw, parse_size(target_size) if target_size else None, calib_data,
                                calib_windows, ctx, seed, threads, hold_gates, imatrix == "auto", floor, sensitivity,
                                parse_types(alloc_types), quantize_factor, sensitivity_time, executor)
        _emit(summary if as_json else {k: v for k, v in summary.items() if k not in ("sensitivity", "decode_cost")},
              as_json)
        return
    bits = int(gate_bits) if gate_bits else None
    if backend == "onnxruntime":
        if not scheme:
            raise QuantgateError(f"--scheme is required for an ONNX export ({_base_names('onnx')})")
        if qtype or imatrix:
            raise QuantgateError("--type and --imatrix apply to GGUF files (llama.cpp)")
        sch = replace(quant.with_gate_bits("onnx", scheme, bits), block_size=block_size)
    elif backend == "llama.cpp":
        if not qtype:
            raise QuantgateError(f"--type is required for a GGUF ({_base_names('gguf')})")
        if scheme:
            raise QuantgateError("--scheme is for the torch backend; use --type for a GGUF")
        sch = quant.with_gate_bits("gguf", qtype.upper(), bits)
        sch = replace(sch, imatrix=True) if imatrix else sch
    else:
        if not scheme:
            raise QuantgateError("--scheme is required for a model directory (see --list)")
        if qtype or imatrix or gate_bits:
            raise QuantgateError("--type, --imatrix and --gate-bits apply to GGUF files (llama.cpp)")
        sch = quant.get("torch", scheme, "scheme")
    _emit(quantize(model, sch, out, CalibSettings(calib_data, calib_windows, ctx, seed), threads, layerwise or None),
          as_json)


@main.group()
def export():
    """Export a model directory to a deployable format: GGUF (llama.cpp) or ONNX (ONNX Runtime)."""


@export.command("gguf")
@click.argument("model", type=MODEL)
@click.option("--out", required=True, type=click.Path(), help="output .gguf file")
@click.option("--outtype", type=click.Choice(["f32", "f16", "bf16"]), default="f32", show_default=True,
              help="type of the matrices (norms stay f32); quantize afterwards with `quantgate quantize`")
@click.option("--no-mtp", is_flag=True, help="leave out the checkpoint's multi-token-prediction head (kept by default, "
              "as llama.cpp's converter keeps it: llama.cpp uses it for speculative decoding)")
def export_gguf_cmd(model, out, outtype, no_mtp):
    """Write MODEL as a GGUF that stock llama.cpp runs: baseline -> qwen3; gated -> qwen35 with q and gate
    interleaved in attn_q, so llama.cpp's own attention graph applies the gate.

    A model directory is streamed from its safetensors one tensor at a time (bf16 stays bf16), so the memory it
    needs is set by its largest tensor, not by the model: a 9B checkpoint exports on a 24 GB machine."""
    from quantgate.export.gguf import export_checkpoint
    _emit(export_checkpoint(model, out, outtype, mtp=not no_mtp), False)


@export.command("onnx")
@click.argument("model", type=MODEL)
@click.option("--out", required=True, type=click.Path(), help="output directory (model.onnx, config, tokenizer)")
@click.option("--opset", type=click.Choice(["23", "18"]), default="23", show_default=True,
              help="23: ONNX Attention op with native GQA; 18: attention decomposed, for older runtimes")
@click.option("--graph", type=click.Choice(["standard", "gqa"]), default="standard", show_default=True,
              help="standard: traced from PyTorch (q and gate in one MatMul, ONNX Attention, gate as Sigmoid*Mul "
                   "after it; a hybrid's Gated DeltaNet rule as an ONNX Scan): the portable form, optimum opens it; "
                   "gqa: built on ONNX Runtime's fused CPU ops (GroupQueryAttention with rotary inside, gate after "
                   "it; for hybrids CausalConvWithState, LinearAttention or GatedDeltaNet, GatedRMSNorm), with the "
                   "logits of the last position only unless its logits_to_keep input asks for more: the fast form")
@click.option("--gdn-op", type=click.Choice(["linear_attention", "gated_delta_net"]), default=None,
              help="--graph gqa on a hybrid: the ORT op that runs the Gated DeltaNet rule (default linear_attention, "
                   "ORT 1.31+: measured faster at prefill than gated_delta_net, ORT 1.32+)")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True)
def export_onnx_cmd(model, out, opset, graph, gdn_op, dtype):
    """Write MODEL as an ONNX decoder with past/present key-value tensors (optimum's names, dynamic batch,
    sequence and past lengths) that ONNX Runtime runs; optimum's ORTModelForCausalLM opens the standard graph. The
    fp32 graphs of a model directory are streamed (each weight written from the safetensors into model.onnx.data as
    it is reached): the memory is set by the largest tensor, not the model."""
    import warnings

    from quantgate.export.onnx import export_checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _emit(export_checkpoint(model, out, int(opset), graph, dtype, gdn_op=gdn_op), False)


@main.command()
@click.argument("model", type=MODEL)
@click.option("--prompt", required=True, help="text to continue (BOS is put in front)")
@click.option("--max-tokens", type=COUNT, default=64, show_default=True,
              help="at most this many new tokens (fewer when the model's context fills up)")
@click.option("--temperature", type=Finite(0, 100), default=0.0, show_default=True, help="0: greedy")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--kv-type", type=click.Choice(["f32", "f16", "q8_0", "q4_0", "int8", "int4"]), default="f16",
              show_default=True, help="KV-cache type: llama.cpp's f32, f16, q8_0, q4_0 for a GGUF; int8/int4 (k and v "
              "rounded per token and head) for a model directory or an ONNX export, whose cache is float otherwise")
@click.option("--threads", type=THREADS, default=None)
def generate(model, prompt, max_tokens, temperature, seed, kv_type, threads):
    """Stream a continuation of --prompt from MODEL (a .gguf run by llama.cpp, an ONNX export run by ONNX Runtime,
    or a model directory run by PyTorch), then print prefill and decode speeds, and decode as a fraction of the
    memory-bandwidth bound (bytes one decode step reads over this machine's read bandwidth, measured afterwards).

    The prompt and the new tokens share the model's context: a prompt that fills it is refused, and generation
    stops early (and says so) when the context is full."""
    from quantgate.generate import generate as run
    from quantgate.progress import console

    def show(piece: str) -> None:
        click.echo(piece, nl=False)
        sys.stdout.flush()

    click.echo(prompt, nl=False)
    res = run(model, prompt, max_tokens, temperature, seed, kv_type, threads, on_text=show)
    click.echo("")
    if res.stopped_at_context:
        console.print(f"stopped after {res.new_tokens} new tokens: the model's context of {res.context} tokens is full",
                      markup=False, highlight=False)
    bound = (f" ({res.fraction_of_bound:.0%} of the memory-bandwidth bound: {res.bytes_per_token / 1e6:.0f} MB read "
             f"per token at {res.bandwidth_gbs:.1f} GB/s)" if res.bandwidth_gbs else "")
    console.print(f"[{res.backend}] prompt {res.prompt_tokens} tokens: prefill {res.prefill_tps:.1f} tok/s; "
                  f"{res.new_tokens} new tokens: decode {res.decode_tps:.1f} tok/s{bound}; threads {res.threads}", markup=False,
                  highlight=False)


@main.command()
@click.argument("model", type=MODEL)
@click.option("--json", "as_json", is_flag=True)
def info(model, as_json):
    """Layout, gate mode, parameter count and dimensions of a model directory or a .gguf file."""
    from quantgate.info import model_info
    _emit(model_info(model), as_json)


@main.command()
@click.argument("model", type=MODEL)
@click.option("--data", default="embedded", show_default=True, help=DATA_HELP)
@click.option("--windows", "n_windows", type=COUNT, default=32, show_default=True, help="windows to run")
@click.option("--ctx", type=CTX, default=256, show_default=True, help="window length, BOS included")
@click.option("--split", type=click.Choice(["auto", "all", "train", "valid", "test"]), default="auto",
              show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True, help="window sampler seed")
@click.option("--compare", type=MODEL, default=None, help="a second model (the twin) on the same windows")
@click.option("--json", "json_out", type=click.Path(), default=None, help="write the full report here")
@click.option("--plots", type=click.Path(), default=None, help="write PNG plots into this folder")
@click.option("--reference", type=MODEL, default=None,
              help="the float model MODEL was exported/quantized from: adds the gate-survival check")
@click.option("--layerwise", is_flag=True, default=None,
              help="run a model directory one decoder block at a time over all windows (automatic when its fp32 "
                   "weights do not fit in memory); the same numbers, one block resident")
def analyze(model, data, n_windows, ctx, split, seed, compare, json_out, plots, reference, layerwise):
    """Massive activations, attention sinks, linear-input outliers and gate sparsity, per layer.

    MODEL is a model directory or a .gguf (dequantized). With --reference, also checks that the gate
    survived: the artifact's gate rows against the float model's, on the same inputs."""
    from rich.console import Console
    from rich.table import Table

    from quantgate.analyze import run_analyze
    from quantgate.progress import console
    result = run_analyze(model, data, ctx, n_windows, split, seed, compare, json_out, plots, reference,
                         layerwise=layerwise or None)
    out = Console()
    for name, rep in result["reports"].items():
        t = Table(title=f"{name} ({rep['gate']}, {rep['windows']} windows x {rep['ctx']}; "
                        f"uniform BOS share {rep['uniform_bos_share']:.3f})")
        hybrid = any(l.get("kind") == "linear_attention" for l in rep["layers"])
        cols = ("layer", *(("kind",) if hybrid else ()), "max|h|", "pos", "chan", "max/med", "BOS mean", "BOS max",
                "gate", "g<0.1")
        for col in cols:
            t.add_column(col, justify="right")
        if hybrid:
            t.caption = "gate: sigmoid(X W_g) on attention layers, the GDN's silu(z) on linear ones (g<0.1: |value|)"
        for l in rep["layers"]:
            g = next((k for k in ("gate", "gdn_gate") if f"{k}_mean" in l), None)
            gate = ("-", "-") if g is None else (
                f"{sum(l[f'{g}_mean']) / len(l[f'{g}_mean']):.3f}",
                f"{sum(l[f'{g}_frac_below_0.1']) / len(l[f'{g}_frac_below_0.1']):.1%}")
            bos = ("-", "-") if l["bos_attention"] is None else (f"{l['bos_attention_mean']:.3f}",
                                                                f"{max(l['bos_attention']):.3f}")
            kind = (("GDN" if l["kind"] == "linear_attention" else "attn"),) if hybrid else ()
            t.add_row(str(l["layer"]), *kind, f"{l['max_abs']:.1f}", str(l["max_position"]), str(l["max_channel"]),
                      f"{l['max_over_median']:.1f}", *bos, *gate)
        out.print(t)
        routed = [l for l in rep["layers"] if "routing" in l]
        if routed:  # a MoE: how the router spreads tokens, and the shared expert's gate
            t = Table(title=f"{name}: expert routing ({routed[0]['routing']['experts']} experts, "
                            f"{routed[0]['routing']['tokens']} tokens per layer)")
            for col in ("layer", "dead", "max/uniform", "load entropy", "top-1 w", "shared gate", "s<0.1"):
                t.add_column(col, justify="right")
            for l in routed:
                r = l["routing"]
                t.add_row(str(l["layer"]), str(r["dead_experts"]), f"{r['max_share_over_uniform']:.2f}",
                          f"{r['load_entropy']:.3f}", f"{r['top1_weight_mean']:.3f}", f"{r['shared_gate_mean']:.3f}",
                          f"{r['shared_gate_frac_below_0.1']:.1%}")
            t.caption = ("load entropy: of each expert's share of routed slots, over log E (1 = even); shared gate: "
                         "sigmoid(x W_s) on the shared expert")
            out.print(t)
        worst = max(rep["linear_inputs"].items(), key=lambda kv: kv[1]["kurtosis"])
        out.print(f"highest linear-input kurtosis: {worst[0]} = {worst[1]['kurtosis']:.1f} "
                  f"(max |x| {worst[1]['max_abs']:.1f})")
    if "gate_survival" in result:
        gs = result["gate_survival"]
        t = Table(title=f"gate survival: {model} vs {reference} ({gs['tokens']} tokens)")
        for col in ("layer", "mean |dg|", "max |dg|", "crossed 0.5", "gate mean ref", "artifact", "W rel err"):
            t.add_column(col, justify="right")
        for l in gs["layers"]:
            t.add_row(str(l["layer"]), f"{l['mean_abs_diff']:.2e}", f"{l['max_abs_diff']:.2e}",
                      f"{l['frac_crossed_0.5']:.2%}", f"{l['gate_mean_ref']:.3f}", f"{l['gate_mean_artifact']:.3f}",
                      f"{l['weight_rel_err']:.2e}")
        out.print(t)
    for p in result.get("plots", []):
        console.print(f"plot: {p}")
    if json_out:
        console.print(f"report: {json_out}")


@main.command()
@click.argument("model", type=MODEL)
@click.option("--scheme", required=True, help="a scheme name, as for `quantgate quantize`")
@click.option("--data", default="embedded", show_default=True, help=DATA_HELP)
@click.option("--windows", "n_windows", type=COUNT, default=16, show_default=True,
              help="held-out windows scored per run")
@click.option("--calib-windows", type=COUNT, default=16, show_default=True)
@click.option("--ctx", type=CTX, default=256, show_default=True)
@click.option("--json", "json_out", type=click.Path(), default=None, help="write the full attribution here")
def attribute(model, scheme, data, n_windows, calib_windows, ctx, json_out):
    """Which Linear inputs carry the quantization error: one group, one layer, one cell at a time."""
    from rich.console import Console
    from rich.table import Table

    from quantgate.attribution import attribute_model
    rep = attribute_model(model, scheme, data, n_windows, calib_windows, ctx, json_out)
    t = Table(title=f"{scheme}: KL divergence with only this part quantized (all: {rep['kld_all']:.5f})")
    for col in ("part", "KLD", "share"):
        t.add_column(col, justify="right")
    for kind in ("groups", "layers"):
        for k, v in rep[kind].items():
            t.add_row(f"{kind[:-1]} {k}", f"{v:.5f}", f"{rep[kind + '_share'][k]:.1%}")
    top = sorted(rep["cells_share"].items(), key=lambda kv: -kv[1])[:5]
    for k, share in top:
        t.add_row(f"layer.group {k}", f"{rep['cells'][k]:.5f}", f"{share:.1%}")
    Console().print(t)


@main.command()
@click.option("--models", nargs=2, required=True, type=MODEL, metavar="BASELINE GATED", multiple=True,
              help="the twins: a model without gate, then the gated one (same tokenizer). Repeat it once per seed "
                   "(`train --twins --seeds N` writes OUT/seed-K/baseline and gated): each pair gets its own report in "
                   "OUT/seed-K/ and OUT/report.* gives the numbers across seeds")
@click.option("--data", default="embedded", show_default=True, help=DATA_HELP)
@click.option("--backends", default="torch,onnx,gguf", show_default=True, help="comma list of torch, onnx, gguf")
@click.option("--schemes", default=None,
              help="comma list of backend:scheme (e.g. torch:w8a8-static,onnx:int4,gguf:Q4_K_M,gguf:kv-q4_0); "
                   "an allocation under a budget is a scheme too: gguf:auto@4.5 (+imatrix, +held, +floor=Q4_K_M, or "
                   "auto@2.6GB), onnx:auto@5 (+held, auto@40MB), torch:auto@5 (+held); "
                   "default: a set per backend (see quantgate.report.DEFAULT_SCHEMES)")
@click.option("--windows", type=COUNT, default=64, show_default=True,
              help="held-out windows scored per cell: the bootstrap's units (at least 16 for an interval; "
                   "benchmarks/results/interval_width.json shows how intervals narrow with more)")
@click.option("--ctx", type=CTX, default=256, show_default=True)
@click.option("--calib-windows", type=COUNT, default=16, show_default=True)
@click.option("--threads", type=THREADS, default=None)
@click.option("--unpaired", is_flag=True,
              help="the two models are not twins (other layers or another tokenizer, e.g. Qwen/Qwen3-0.6B beside "
                   "Qwen/Qwen3.5-0.8B): each is still scored against its own float model, and the comparisons resample "
                   "each model's windows on their own instead of pairing them")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="where the cells run: here, or as tasks on the Ray cluster at RAY_ADDRESS (every node seeing the "
                   "same files; the speed columns are then timed on this process's node, one artifact at a time)")
@click.option("--out", required=True, type=click.Path(), help="report directory (cells/, artifacts/, plots/, report.*)")
def report(models, data, backends, schemes, windows, ctx, calib_windows, threads, unpaired, executor, out):
    """Accuracy against bits for the twins side by side, per backend and scheme, with their outliers, the
    per-layer link between activation size and quantization error, gate survival and a conclusion written
    from the numbers. Re-running reuses every finished cell."""
    from quantgate.progress import console
    from quantgate.report import DEFAULT_SCHEMES, ReportSettings, run_report, run_seeds_report
    bks = tuple(b.strip() for b in backends.split(",") if b.strip())
    sch = {b: list(DEFAULT_SCHEMES.get(b, [])) for b in bks}
    if schemes:
        sch = {b: [] for b in bks}
        for item in schemes.split(","):
            b, _, name = item.strip().partition(":")
            if b not in sch or not name:
                raise QuantgateError(f"--schemes item {item!r} is not backend:scheme for one of {', '.join(bks)}")
            sch[b].append(name)
    settings = ReportSettings(models[0][0], models[0][1], out, data, bks, sch, windows, ctx, calib_windows,
                              threads=threads, unpaired=unpaired, executor=executor)
    rep = run_report(settings) if len(models) == 1 else run_seeds_report(list(models), settings)
    for line in rep["conclusion"]:
        click.echo(f"- {line}")
    console.print(f"report: {out}/report.html, {out}/report.md, {out}/report.json", markup=False, highlight=False)


@main.command()
@click.option("--out", default="quantgate-demo", show_default=True, type=click.Path(), help="output directory")
@click.option("--fast", is_flag=True, help="tiny twins, a few minutes (CI)")
@click.option("--gate", type=click.Choice(["headwise", "elementwise"]), default="elementwise", show_default=True)
@click.option("--threads", type=THREADS, default=None)
@click.option("--lab", type=click.Choice(["sinks"]), default=None,
              help="sinks: twins on a synthetic Bigram-Backcopy corpus (Guo et al. 2024) on which small models grow "
                   "attention sinks, several seeds, then the same analysis and report across seeds (torch schemes)")
@click.option("--seeds", type=click.IntRange(1, 20), default=None,
              help="twin pairs to train, seeds 0..N-1 (default: 1 for the demo, 3 for the lab); with more than one, "
                   "the report's verdicts are stated across the pairs, so they carry the variation between training "
                   "runs (a one-pair verdict says it is about that pair)")
def demo(out, fast, gate, threads, lab, seeds):
    """Train baseline and gated twins on the embedded corpus, evaluate them on held-out text, analyse their
    outliers side by side (analysis.json, plots/), export and quantize both on every backend and write the
    report (report/report.html), then stream a short generation from the 4-bit GGUF. Re-running reuses
    finished stages."""
    from quantgate.demo import run_demo, run_lab
    if lab:
        if fast:
            raise QuantgateError("--fast and --lab are separate demos; choose one")
        run_lab(out, lab, gate=gate, threads=threads, seeds=seeds or 3)
        return
    run_demo(out, fast=fast, gate=gate, threads=threads, seeds=seeds or 1)


if __name__ == "__main__":
    main()
