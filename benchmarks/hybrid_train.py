"""CPU training throughput of hybrid twins (Qwen3.5-style: Gated DeltaNet + gated attention) beside the
all-attention twins, at the `small` preset, with `quantgate train`'s own step (AdamW, clip, cross-entropy).

Four models, one step each per round, rounds alternated so drifts in machine load hit every model alike:
attention baseline / gated, hybrid baseline / gated (`quantgate train --arch hybrid --twins`). Reports per-model
median step seconds, their spread (min-max), tokens/s (batch x (ctx-1) / median), and the ratios measured in this
run. Eager PyTorch, fp32.

    python benchmarks/hybrid_train.py [--threads 2] [--rounds 7] [--out benchmarks/results/hybrid_train.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from quantgate.model import hybrid, make_twins, preset
from quantgate.train import TrainConfig, make_optimizer


def step_seconds(model, opt, batch) -> float:
    t = time.perf_counter()
    logits = model(batch[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hybrid_train.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tc = TrainConfig()
    cfg = preset("small")
    models = {}
    for arch, c in (("attention", cfg), ("hybrid", hybrid(cfg))):
        base, gated = make_twins(c, "elementwise", seed=0)
        models[f"{arch}/baseline"], models[f"{arch}/gated"] = base.train(), gated.train()
    opts = {k: make_optimizer(m, tc) for k, m in models.items()}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, cfg.vocab_size, (args.batch, args.ctx), generator=g) for _ in range(args.rounds + 1)]
    times = {k: [] for k in models}
    t0 = time.perf_counter()
    for r, b in enumerate(batches):
        for k in models:
            dt = step_seconds(models[k], opts[k], b)
            if r > 0:  # round 0 warms up allocators and kernels
                times[k].append(dt)
    tokens = args.batch * (args.ctx - 1)
    per = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
               "tokens_per_s": tokens / statistics.median(v)} for k, v in times.items()}
    med = {k: v["median_s"] for k, v in per.items()}
    result = {
        "command": f"python benchmarks/hybrid_train.py --threads {args.threads} --rounds {args.rounds} "
                   f"--batch {args.batch} --ctx {args.ctx}",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                    "torch": torch.__version__},
        "config": {"preset": "small", "hybrid_layer_types": list(hybrid(cfg).layer_types),
                   "params": {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}},
        "rounds": args.rounds, "tokens_per_step": tokens, "models": per,
        "ratios": {"hybrid_gated_over_hybrid_baseline_tokens_per_s": med["hybrid/baseline"] / med["hybrid/gated"],
                   "hybrid_gated_over_attention_gated_tokens_per_s": med["attention/gated"] / med["hybrid/gated"],
                   "attention_gated_over_attention_baseline_tokens_per_s":
                       med["attention/baseline"] / med["attention/gated"]},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for k, v in per.items():
        print(f"{k:20s} {v['tokens_per_s']:8.0f} tokens/s  (median {v['median_s']:.3f} s, "
              f"{v['min_s']:.3f}-{v['max_s']:.3f})")
    print(json.dumps(result["ratios"], indent=2))


if __name__ == "__main__":
    main()
