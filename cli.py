"""The `quantgate` command line: a thin layer over functions a user can import.

Installed as `quantgate.cli`. Every bad input ends in one `error: ...` line on stderr and exit code 2;
Ctrl-C ends with exit code 130. Nothing half-written is left behind (see quantgate.fsio).
"""
from __future__ import annotations

import json
import sys

import click

from quantgate import __version__
from quantgate.errors import QuantgateError


class QuantgateGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except QuantgateError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=QuantgateGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quantgate")
def main():
    """Quantize and deploy LLMs with gated attention, and measure what the gate does to outliers.

    Start with `quantgate demo`: it trains a baseline and a gated twin on text that ships with
    Python itself and evaluates both.
    """


def _emit(obj: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(obj, indent=2))
    else:
        for k, v in obj.items():
            click.echo(f"{k:>20}: {v}")


DATA_HELP = ("text source: 'embedded' (the Python standard library's sources, always available), a text "
             "file, a folder, a glob, a WikiText-style file, or a local HF datasets folder (save_to_disk)")


@main.command()
@click.option("--preset", type=click.Choice(["tiny", "small", "base"]), default="small", show_default=True,
              help="model size: tiny (tests), small (CPU demo), base (~100M, GPU)")
@click.option("--gate", type=click.Choice(["none", "headwise", "elementwise"]), default="elementwise",
              show_default=True, help="attention output gate (with --twins: the gated twin's)")
@click.option("--twins", is_flag=True, help="train a baseline and a gated model side by side: same init, same batches")
@click.option("--data", default="embedded", show_default=True, help=DATA_HELP)
@click.option("--out", required=True, type=click.Path(), help="run directory (state/, baseline/, gated/)")
@click.option("--steps", default=1800, show_default=True)
@click.option("--batch-size", default=8, show_default=True, help="global batch (split over torchrun ranks)")
@click.option("--ctx", default=256, show_default=True, help="window length in tokens, BOS included")
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--warmup", default=100, show_default=True)
@click.option("--weight-decay", default=0.1, show_default=True)
@click.option("--grad-clip", default=1.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--vocab-size", type=int, default=None, help="BPE vocabulary (default: the preset's)")
@click.option("--byte-tokenizer", is_flag=True, help="256 bytes + specials instead of BPE")
@click.option("--max-chars", type=int, default=None, help="use only the first N characters of the corpus")
@click.option("--ckpt-every", default=200, show_default=True, help="write a resumable checkpoint every N steps")
@click.option("--threads", type=int, default=None, help="CPU threads (default: torch's)")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda (bf16 autocast)")
@click.option("--compile", "compile_", is_flag=True,
              help="torch.compile the model: faster steps after about a minute of compiling per model")
@click.option("--resume", is_flag=True, help="continue the run in --out from its last checkpoint")
def train(out, resume, compile_, **kw):
    """Train a model (or twins) from scratch. Multi-GPU/multi-process: run under torchrun."""
    from quantgate.train import TrainConfig
    from quantgate.train import train as run_train
    paths = run_train(TrainConfig(compile=compile_, **kw), out, resume=resume)
    for role, p in paths.items():
        click.echo(f"{role}: {p}")


@main.command("eval")
@click.argument("model", type=click.Path())
@click.option("--data", default="embedded", show_default=True, help=DATA_HELP)
@click.option("--ctx", default=256, show_default=True, help="window length, BOS included")
@click.option("--split", type=click.Choice(["auto", "all", "train", "valid", "test"]), default="auto",
              show_default=True, help="auto: test split of the embedded corpus, whole text otherwise")
@click.option("--max-windows", type=int, default=None, help="evaluate at most N windows")
@click.option("--reference", type=click.Path(), default=None,
              help="float model to compare against: adds KL divergence, top-1 agreement and the perplexity delta")
@click.option("--torchao", type=click.Choice(["int8-dynamic", "int4-weight"]), default=None,
              help="run with torchao's real integer kernels (int4-weight needs CUDA)")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def eval_cmd(model, data, ctx, split, max_windows, reference, torchao, device, as_json):
    """Perplexity of MODEL: consecutive windows of ctx-1 tokens, BOS first, every token scored."""
    from quantgate.evaluate import evaluate_model
    _emit(evaluate_model(model, data, ctx, split, max_windows, device=device, reference=reference,
                         torchao=torchao), as_json)


@main.command()
@click.argument("model", type=click.Path())
@click.option("--backend", type=click.Choice(["torch"]), default="torch", show_default=True,
              help="torch: fake-quantized weights and activations, evaluated by our PyTorch runner")
@click.option("--scheme", required=True, help="w8a8-static[-sym|-pct|-sink], w8a8-smoothquant, w8a8-dynamic, "
              "w8a16, kv-int8, kv-int4, w4a16-g32|g64|g128, w4a16-g32-gate8, w4a16-g32-qgate8, gptq-w4a16-g32|g128")
@click.option("--out", required=True, type=click.Path(), help="output model directory")
@click.option("--calib-data", default="embedded", show_default=True,
              help="calibration text (the embedded corpus's valid split; never its test split)")
@click.option("--calib-windows", default=32, show_default=True)
@click.option("--ctx", default=256, show_default=True)
@click.option("--seed", default=0, show_default=True)
def quantize(model, backend, scheme, out, calib_data, calib_windows, ctx, seed):
    """Quantize MODEL under a named scheme and write a loadable checkpoint that records the scheme."""
    from quantgate.quantize import quantize_checkpoint
    _emit(quantize_checkpoint(model, scheme, out, calib_data, calib_windows, ctx, seed), False)


@main.command()
@click.argument("model", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def info(model, as_json):
    """Layout, gate mode, parameter count and dimensions of a model directory."""
    from quantgate.info import model_info
    _emit(model_info(model), as_json)


@main.command()
@click.argument("model", type=click.Path())
@click.option("--data", default="embedded", show_default=True, help=DATA_HELP)
@click.option("--windows", "n_windows", default=32, show_default=True, help="calibration windows to run")
@click.option("--ctx", default=256, show_default=True, help="window length, BOS included")
@click.option("--split", type=click.Choice(["auto", "all", "train", "valid", "test"]), default="auto",
              show_default=True)
@click.option("--seed", default=0, show_default=True, help="window sampler seed")
@click.option("--compare", type=click.Path(), default=None, help="a second model (the twin) on the same windows")
@click.option("--json", "json_out", type=click.Path(), default=None, help="write the full report here")
@click.option("--plots", type=click.Path(), default=None, help="write PNG plots into this folder")
def analyze(model, data, n_windows, ctx, split, seed, compare, json_out, plots):
    """Massive activations, attention sinks, linear-input outliers and gate sparsity, per layer."""
    from rich.console import Console
    from rich.table import Table

    from quantgate.analyze import run_analyze
    from quantgate.progress import console
    result = run_analyze(model, data, ctx, n_windows, split, seed, compare, json_out, plots)
    out = Console()
    for name, rep in result["reports"].items():
        t = Table(title=f"{name} ({rep['gate']}, {rep['windows']} windows x {rep['ctx']}; "
                        f"uniform BOS share {rep['uniform_bos_share']:.3f})")
        for col in ("layer", "max|h|", "pos", "chan", "max/med", "BOS mean", "BOS max", "gate", "g<0.1"):
            t.add_column(col, justify="right")
        for l in rep["layers"]:
            gate = ("-", "-") if "gate_mean" not in l else (
                f"{sum(l['gate_mean']) / len(l['gate_mean']):.3f}",
                f"{sum(l['gate_frac_below_0.1']) / len(l['gate_frac_below_0.1']):.1%}")
            t.add_row(str(l["layer"]), f"{l['max_abs']:.1f}", str(l["max_position"]), str(l["max_channel"]),
                      f"{l['max_over_median']:.1f}", f"{l['bos_attention_mean']:.3f}", f"{max(l['bos_attention']):.3f}",
                      *gate)
        out.print(t)
        worst = max(rep["linear_inputs"].items(), key=lambda kv: kv[1]["kurtosis"])
        out.print(f"highest linear-input kurtosis: {worst[0]} = {worst[1]['kurtosis']:.1f} "
                  f"(max |x| {worst[1]['max_abs']:.1f})")
    for p in result.get("plots", []):
        console.print(f"plot: {p}")
    if json_out:
        console.print(f"report: {json_out}")


@main.command()
@click.argument("model", type=click.Path())
@click.option("--scheme", required=True, help="a scheme name, as for `quantgate quantize`")
@click.option("--data", default="embedded", show_default=True, help=DATA_HELP)
@click.option("--windows", "n_windows", default=16, show_default=True, help="held-out windows scored per run")
@click.option("--calib-windows", default=16, show_default=True)
@click.option("--ctx", default=256, show_default=True)
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
@click.option("--out", default="quantgate-demo", show_default=True, type=click.Path(), help="output directory")
@click.option("--fast", is_flag=True, help="tiny twins, a few minutes (CI)")
@click.option("--gate", type=click.Choice(["headwise", "elementwise"]), default="elementwise", show_default=True)
@click.option("--threads", type=int, default=None)
def demo(out, fast, gate, threads):
    """Train baseline and gated twins on the embedded corpus, evaluate them on held-out text, and
    analyse their outliers side by side (analysis.json, plots/)."""
    from quantgate.demo import run_demo
    run_demo(out, fast=fast, gate=gate, threads=threads)


if __name__ == "__main__":
    main()
