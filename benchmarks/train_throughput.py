"""Forward+backward training throughput: our model against transformers' Qwen3 on the same config.

Both models get the identical config (the `small` preset, baseline, no gate, since stock Qwen3 has
none), the same threads, the same batches and the same AdamW step. Reports medians of repeats and
their ratio (eager, and ours under torch.compile as `quantgate train --compile` runs it), measured in one run (these machines are noisy, so only same-run ratios mean much). Also
times one lockstep step of the gated/baseline twin pair and projects what a full `small` twin run
(the demo recipe) costs in minutes.

    python benchmarks/train_throughput.py [--threads 2] [--repeats 7] [--out benchmarks/results/train_throughput.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def step_time(model, opt, batch, hf: bool) -> float:
    t = time.perf_counter()
    inp, tgt = batch[:, :-1], batch[:, 1:]
    logits = model(inp, use_cache=False).logits if hf else model(inp).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return time.perf_counter() - t


def hf_twin_of(cfg):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    hc = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                     num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
                     rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
                     max_position_embeddings=cfg.max_seq_len, attn_implementation="sdpa")
    return Qwen3ForCausalLM(hc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_throughput.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from quantgate.demo import DEMO_RECIPES
    from quantgate.model import build_model, make_twins, preset
    from quantgate.train import make_optimizer, TrainConfig

    cfg = preset("small")
    tc = TrainConfig()
    ours = build_model(cfg, seed=0).train()
    theirs = hf_twin_of(cfg).train()
    theirs.load_state_dict({("lm_head.weight" if k == "lm_head.weight" else "model." + k): v
                            for k, v in ours.state_dict().items()}, strict=False)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.ctx), generator=g) for _ in range(args.repeats + 2)]
    runs = {"ours": ours, "transformers": theirs}
    compile_s = None
    if not args.no_compile:
        ours_c = build_model(cfg, seed=0).train()
        runs["ours_compiled"] = torch.compile(ours_c)
    opts = {k: make_optimizer(m, tc) for k, m in runs.items()}
    if "ours_compiled" in runs:
        t0 = time.perf_counter()
        step_time(runs["ours_compiled"], opts["ours_compiled"], batches[0], hf=False)
        compile_s = time.perf_counter() - t0
    times = {k: [] for k in runs}
    for i, b in enumerate(batches):  # interleaved so drifts in machine load hit every variant equally
        for name, model in runs.items():
            t = step_time(model, opts[name], b, hf=name == "transformers")
            if i >= 2:  # two warm-up steps
                times[name].append(t)
    tokens = args.batch * (args.ctx - 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens / v for k, v in med.items()}

    baseline, gated = make_twins(cfg, "elementwise", 0)
    twin_opts = [make_optimizer(baseline.train(), tc), make_optimizer(gated.train(), tc)]
    pair = []
    for i, b in enumerate(batches):
        t = sum(step_time(m, o, b, hf=False) for m, o in zip((baseline, gated), twin_opts))
        if i >= 2:
            pair.append(t)
    recipe = DEMO_RECIPES["full"]
    pair_med = statistics.median(pair)
    result = {
        "what": "forward+backward+AdamW step, small preset (6L d128, 4x32 heads, 2 KV, ffn 512, vocab 4096)",
        "batch": args.batch, "ctx": args.ctx, "threads": args.threads, "repeats": args.repeats,
        "median_step_s": {k: round(v, 4) for k, v in med.items()},
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "ratio_ours_over_transformers": round(tps["ours"] / tps["transformers"], 3),
        "ratio_ours_compiled_over_transformers": (round(tps["ours_compiled"] / tps["transformers"], 3)
                                                  if "ours_compiled" in tps else None),
        "ratio_ours_compiled_over_ours": (round(tps["ours_compiled"] / tps["ours"], 3)
                                          if "ours_compiled" in tps else None),
        "compile_seconds": None if compile_s is None else round(compile_s, 1),
        "goal_ratio": 1.2,
        "twin_pair_step_s": round(pair_med, 4),
        "small_twin_run": {"recipe": recipe,
                           "projected_minutes": round(pair_med * recipe["steps"] / 60, 1)},
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(),
                    "torch": torch.__version__},
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
