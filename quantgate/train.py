"""Train one model or a baseline/gated twin pair on a text corpus.

Twins are trained in lockstep in one process: they start from identical values for every parameter
they share (`make_twins`) and each step feeds both the same batch, so they differ only by the gate.
Batches are a pure function of (seed, step), and the learning rate of step, so `--resume` from the
last checkpoint continues the exact loss trajectory of an uninterrupted run. Under `torchrun` each
rank takes its slice of every global batch and DDP averages the gradients (gloo on CPU, nccl on CUDA).

A run directory holds `state/` (train_state.pt, tokenizer.json, train_log.json) and the finished
models, `baseline/` and/or `gated/`, in stock-loadable layouts.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from rich.progress import TextColumn

from .calib_data import data_paths, load_corpus, sample_windows, tokenize_corpus
from .calib_data.synthetic import SYMBOLS, SYNTHETIC_NAMES
from .errors import QuantgateError
from .formats import save_checkpoint
from .fsio import atomic_file, check_output, claim_folder, read_marker, write_json
from .model import GATE_MODES, Model, build_model, hybrid, make_twins, preset
from .progress import make_progress, stage
from .runners import torch_device
from .tokenizer import Tokenizer, byte_tokenizer, load_tokenizer, symbol_tokenizer, train_bpe


ARCHS = ("attention", "hybrid")


@dataclass
class TrainConfig:
    preset: str = "small"
    arch: str = "attention"            # "hybrid": Qwen3.5-style, 3 of every 4 layers Gated DeltaNet (model.hybrid)
    gate: str = "elementwise"          # the gated model's gate (twins) or the single model's gate
    twins: bool = False
    data: str = "embedded"
    steps: int = 1800
    batch_size: int = 8
    ctx: int = 256
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    betas: tuple = (0.9, 0.95)
    seed: int = 0
    vocab_size: int | None = None       # BPE size; None: the preset's
    byte_tokenizer: bool = False
    symbol_tokenizer: bool = False      # a synthetic corpus's own alphabet, one token per symbol (the sink lab's)
    max_chars: int | None = None        # cap on corpus size (first documents kept)
    ckpt_every: int = 200
    log_every: int = 10
    threads: int | None = None
    device: str = "auto"
    compile: bool = False               # torch.compile the training forward (costs ~1 min per model up front)
    model_overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.gate not in GATE_MODES:
            raise QuantgateError(f"gate must be one of {GATE_MODES}, got {self.gate!r}")
        if self.arch not in ARCHS:
            raise QuantgateError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.twins and self.gate == "none":
            raise QuantgateError("--twins needs a gated variant: --gate headwise or --gate elementwise")
        if self.symbol_tokenizer and (self.byte_tokenizer or self.vocab_size is not None):
            raise QuantgateError("--symbol-tokenizer replaces --byte-tokenizer and --vocab-size; give one of them")
        if self.symbol_tokenizer and str(self.data) not in SYNTHETIC_NAMES:
            raise QuantgateError(f"--symbol-tokenizer takes a synthetic corpus ({', '.join(SYNTHETIC_NAMES)}), "
                                 f"whose alphabet it is; got --data {str(self.data)[:80]}")
        for name in ("steps", "batch_size", "ctx"):
            if getattr(self, name) <= 0:
                raise QuantgateError(f"{name} must be positive")
        for name, lo, hi in (("lr", 0, 10), ("weight_decay", 0, 10), ("grad_clip", 0, 1e6), ("min_lr_frac", 0, 1)):
            v = getattr(self, name)
            ok = lo < v <= hi if name in ("lr", "grad_clip") else lo <= v <= hi
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok:
                raise QuantgateError(f"{name} must be a finite number in {'(' if name in ('lr', 'grad_clip') else '['}"
                                     f"{lo}, {hi}], got {v!r}")


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_frac * lr at the last step."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights are left undecayed)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=tc.lr, betas=tc.betas, eps=1e-8)


def batch_for_step(stream, tc: TrainConfig, step: int) -> np.ndarray:
    return sample_windows(stream, tc.batch_size, tc.ctx, seed=tc.seed * 1_000_003 + step)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch_device(name)


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> DistInfo:
    """Join the process group torchrun set up (WORLD_SIZE > 1); a plain run is a world of one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistInfo()
    if not dist.is_initialized():
        if device.startswith("cuda"):  # bind this rank's GPU before NCCL starts (it would guess rank % n_gpus)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size())


def prepare_tokenizer(tc: TrainConfig, state_dir: Path, train_texts) -> Tokenizer:
    """Reuse state/tokenizer.json when resuming; else train one on the training split and save it."""
    if (state_dir / "tokenizer.json").is_file():
        return load_tokenizer(state_dir)
    if tc.byte_tokenizer:
        tok = byte_tokenizer()
    elif tc.symbol_tokenizer:
        tok = symbol_tokenizer(SYMBOLS)
    else:
        tok = train_bpe(train_texts(), tc.vocab_size or preset(tc.preset).vocab_size)
    with atomic_file(state_dir / "tokenizer.json", "w") as f:  # recorded as quantgate's (fsio: content hashes)
        f.write(tok.tok.to_str(pretty=True))
    return tok


def build_models(tc: TrainConfig, tok: Tokenizer) -> dict[str, Model]:
    cfg = preset(tc.preset, vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id,
                 pad_id=tok.pad_id, max_seq_len=max(tc.ctx, preset(tc.preset).max_seq_len))
    if tc.arch == "hybrid":
        cfg = hybrid(cfg)
    cfg = replace(cfg, **tc.model_overrides)
    if tc.twins:
        baseline, gated = make_twins(cfg, tc.gate, tc.seed)
        return {"baseline": baseline, "gated": gated}
    model = build_model(cfg.with_gate(tc.gate), tc.seed)
    return {"baseline" if tc.gate == "none" else "gated": model}


def save_state(path: Path, step: int, models: dict, optims: dict, log: list, tc: TrainConfig) -> None:
    state = {"step": step, "log_json": json.dumps(log), "train_config_json": json.dumps(asdict(tc)),
             "models": {k: m.state_dict() for k, m in models.items()},
             "optims": {k: o.state_dict() for k, o in optims.items()}}
    with atomic_file(path) as f:
        torch.save(state, f)


# Settings that shape the trajectory: a resumed run must keep them (steps may grow, threads may change).
TRAJECTORY_FIELDS = ("preset", "arch", "gate", "twins", "data", "batch_size", "ctx", "lr", "min_lr_frac", "warmup",
                     "weight_decay", "grad_clip", "betas", "seed", "vocab_size", "byte_tokenizer", "max_chars",
                     "model_overrides", "symbol_tokenizer")


# Fields added after runs were recorded: a record without one was made at its default.
RECORDED_DEFAULTS = {"arch": "attention", "symbol_tokenizer": False}


def recorded(settings: dict | None) -> dict:
    """Training settings as recorded by a model or a state, with fields it predates at their defaults."""
    return {**RECORDED_DEFAULTS, **settings} if settings else {}


def trajectory(tc: TrainConfig) -> dict:
    """The settings that decide what a run trains (its steps included), as JSON holds them: recorded in the
    models it writes, so a later run (the demo's stage reuse) can tell whether they came from these settings."""
    return json.loads(json.dumps({f: getattr(tc, f) for f in (*TRAJECTORY_FIELDS, "steps")}))


def load_state(path: Path, models: dict, optims: dict, tc: TrainConfig) -> tuple[int, list]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a torn or foreign file
        raise QuantgateError(f"{path}: cannot resume from this training state ({type(e).__name__})") from None
    saved = recorded(json.loads(state["train_config_json"]))
    now = json.loads(json.dumps(asdict(tc)))  # tuples become lists, as in the saved copy
    for name in TRAJECTORY_FIELDS:
        if saved.get(name) != now.get(name):
            raise QuantgateError(f"--resume with --{name.replace('_', '-')} {now.get(name)} but the run was "
                                 f"started with {saved.get(name)}; use the same settings")
    if set(state["models"]) != set(models):
        raise QuantgateError(f"{path}: holds models {sorted(state['models'])}, this run trains {sorted(models)}")
    for k in models:
        models[k].load_state_dict(state["models"][k])
        optims[k].load_state_dict(state["optims"][k])
    return int(state["step"]), json.loads(state["log_json"])


def train(tc: TrainConfig, out: str | Path, resume: bool = False) -> dict[str, Path]:
    """Run training; returns {role: model directory}. See the module docstring for the layout."""
    out = Path(out)
    device = resolve_device(tc.device)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    di = init_distributed(device)
    if di.world > 1 and device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', di.rank))}"
    if tc.batch_size % di.world:
        raise QuantgateError(f"batch size {tc.batch_size} must divide evenly over {di.world} processes")
    state_dir, state_file = out / "state", out / "state" / "train_state.pt"
    if resume and not state_file.is_file():
        raise QuantgateError(f"--resume: no training state in {state_dir}")
    if not resume and state_file.is_file():
        raise QuantgateError(f"{out} already holds a training run; pass --resume to continue it or pick another --out")
    inputs = data_paths(tc.data)
    check_output(out, "run", inputs, accept=("demo",))
    for role in ("baseline", "gated"):
        check_output(out / role, "checkpoint", inputs, flag="--out (its model folder)")
    torch.manual_seed(tc.seed)

    with stage("train: corpus, tokenizer and models"):  # in a log, a line while this runs (BPE training: minutes)
        corpus = load_corpus(tc.data, tc.max_chars)
        train_split = corpus.split("train")
        if not train_split.documents:
            raise QuantgateError(f"{tc.data}: the training split is empty (corpus too small)")
        if di.main:
            claim_folder(out, (read_marker(out) or {}).get("artifact", "run"))  # a demo folder stays a demo folder
            tok = prepare_tokenizer(tc, state_dir, lambda: (d.text for d in train_split.documents))
        if di.world > 1:
            dist.barrier()
            if not di.main:
                tok = load_tokenizer(state_dir)
        stream = tokenize_corpus(train_split, tok)

        models = build_models(tc, tok)
    optims = {k: make_optimizer(m, tc) for k, m in models.items()}
    step, log = 0, []
    if resume:
        step, log = load_state(state_file, models, optims, tc)
    for m in models.values():
        m.to(device).train()
    for o in optims.values():  # optimizer state follows its parameters' device
        for st in o.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    st[k] = v.to(device)
    wrapped = models
    if di.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [torch.device(device).index] if device.startswith("cuda") else None
        wrapped = {k: DDP(m, device_ids=ids) for k, m in models.items()}
    if tc.compile:
        wrapped = {k: torch.compile(m) for k, m in wrapped.items()}
    if di.main:
        write_json(state_dir / "run.json", {"train_config": asdict(tc), "corpus": corpus.source,
                                            "corpus_fingerprint": corpus.fingerprint,
                                            "train_tokens": len(stream), "world_size": di.world,
                                            "models": {k: m.cfg.to_dict() for k, m in models.items()},
                                            "params": {k: m.num_params() for k, m in models.items()}})

    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext()
    rows = slice(di.rank, None, di.world)
    loss_cols = [TextColumn(f"{k} {{task.fields[{k}]}}") for k in models]
    progress = make_progress(*loss_cols, TextColumn("{task.fields[tps]} tok/s"))
    t0, tokens_since, t_since = time.time(), 0, time.time()
    running = {k: float("nan") for k in models}
    with progress:
        task = progress.add_task("train", total=tc.steps, completed=step, tps="-",
                                 **{k: "-" for k in models})
        while step < tc.steps:
            batch = torch.as_tensor(batch_for_step(stream, tc, step)[rows], device=device)
            lr = lr_at(step, tc)
            losses = {}
            for k, m in wrapped.items():
                for g in optims[k].param_groups:
                    g["lr"] = lr
                with amp:
                    logits = m(batch[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                         batch[:, 1:].reshape(-1))
                optims[k].zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(models[k].parameters(), tc.grad_clip)
                optims[k].step()
                losses[k] = loss.detach()
            if di.world > 1:
                for k in losses:
                    dist.all_reduce(losses[k])
                    losses[k] /= di.world
            step += 1
            tokens_since += tc.batch_size * (tc.ctx - 1)
            if step % tc.log_every == 0 or step == tc.steps:
                running = {k: float(v) for k, v in losses.items()}
                tps = tokens_since / max(1e-9, time.time() - t_since)
                tokens_since, t_since = 0, time.time()
                log.append({"step": step, "lr": lr, "loss": running, "tokens_per_s": round(tps, 1),
                            "elapsed_s": round(time.time() - t0, 2)})
                progress.update(task, tps=f"{tps:,.0f}", **{k: f"{v:.3f}" for k, v in running.items()})
                if di.main:
                    write_json(state_dir / "train_log.json", log)
            progress.update(task, completed=step)
            if di.main and (step % tc.ckpt_every == 0 or step == tc.steps):
                save_state(state_file, step, models, optims, log, tc)
    outputs = {}
    if di.main:
        for k, m in models.items():
            recipe = {f: getattr(tc, f) for f in ("batch_size", "ctx", "lr", "warmup", "weight_decay", "seed")}
            m.cfg.extra = {**m.cfg.extra, "trained_by": "quantgate train", "role": k, "steps": tc.steps,
                           "recipe": {**recipe, "tokens": tc.steps * tc.batch_size * (tc.ctx - 1)},
                           "train_config": trajectory(tc), "corpus": corpus.source,
                           "corpus_fingerprint": corpus.fingerprint}
            outputs[k] = save_checkpoint(m.cpu().eval(), out / k, tok)
    if di.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return outputs


def train_seeds(tc: TrainConfig, out: str | Path, seeds: int, resume: bool = False) -> list[dict[str, Path]]:
    """`seeds` twin pairs, seeds tc.seed .. tc.seed+seeds-1, each a run of its own in OUT/seed-K/ (K counts from 0).
    With resume, finished pairs are kept and the first unfinished one continues from its checkpoint."""
    if not tc.twins:
        raise QuantgateError("--seeds trains twin pairs: add --twins")
    out = Path(out)
    check_output(out, "seeds", data_paths(tc.data))
    claim_folder(out, "seeds")
    runs = []
    for k in range(seeds):
        run = out / f"seed-{k}"
        done = all((run / role / "config.json").is_file() for role in ("baseline", "gated"))
        if resume and done:
            runs.append({role: run / role for role in ("baseline", "gated")})
            continue
        started = (run / "state" / "train_state.pt").is_file()
        runs.append(train(replace(tc, seed=tc.seed + k), run, resume=resume and started))
    return runs
