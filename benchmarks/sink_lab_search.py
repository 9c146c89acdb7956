"""The search for a sink-lab recipe (issue 26): which part of quantgate's model keeps its baseline from sinking on
Guo et al.'s Bigram-Backcopy task, measured one switch at a time, three seeds each.

Baseline (and gated) twins of quantgate's Model, or of the same model with lab switches (`LabModel`: no QK-norm,
rope off with learned absolute positions, LayerNorm, GELU MLP; "GPT" is all of them: a GPT-2-style block), trained
here on fresh Bigram-Backcopy sequences (BOS, then the chain; triggers the 3 most frequent symbols), one layer and one
head of 64, batch 32, ctx 64, AdamW 3e-3 betas (0.9, 0.99), wd 1e-4, 1000 steps unless a run overrides it. Measured on
64 held-out sequences: the BOS share of the head's attention over non-trigger queries (`bos_nontrig`, Guo et al.'s
reading) and over all queries, the copy accuracy at triggers, the largest residual |h| and where it sits.

    OMP_NUM_THREADS=1 python benchmarks/sink_lab_search.py --name X --seeds 0,1,2 [key=value ...]

Every run appends one JSON line per seed to results/sink_lab_search.jsonl (the committed lines: RUNS below, run on
this project's 2-core machine on 2026-12-04, one thread per process). `quantgate demo --lab sinks` trains the
outcome: quantgate's model with learned positions (ModelConfig.positions), lab training settings, 4000 steps.

The search ran with the task's 64-token vocabulary. The demo first trained with quantgate's 259-token byte
tokenizer and its baseline did not sink (that run was not kept); the runs named vocab259 (and vocab66, the symbol tokenizer's size) isolate that one difference: `vocab` is the number of
embedding rows (tied to the output head), the data is unchanged. The demo now tokenizes one token per symbol.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import json
import math
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)

from quantgate.model import Model, ModelConfig, rope_cache  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))
N_SYM = 62          # quantgate's SYMBOLS (ascii letters + digits)
BOS = 62            # ids 0..61 symbols, 62 BOS, 63 spare (eos/pad)
VOCAB = 64

DEFAULTS = dict(
    # model (quantgate's Model; lab switches below)
    dim=128, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=64, ffn_dim=512, qk_norm=True,
    rope=True, pos=False, norm="rms", mlp="swiglu", tie=True, init="qg", partial_rotary=1.0, rope_theta=10000.0,
    vocab=VOCAB,  # embedding rows: the task's 64, or 259 as quantgate's byte tokenizer has (ids >= 64 never occur)
    # training
    lr=3e-3, sched="const", beta2=0.99, wd=1e-4, wd_all=True, clip=0.0, warmup=0, batch=32, ctx=64, steps=1000,
    # data
    triggers="top3", chain="qg",
)


# ----------------------------------------------------------------------------------------------- data
def stationary(P: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eig(P.T)
    pi = np.real(v[:, np.argmin(np.abs(w - 1))])
    return pi / pi.sum()


class BigramBackcopy:
    """Guo et al.'s `bbm` generator (BBM/data.py class bbm) on quantgate's Dirichlet bigram chain:
    BOS, a first symbol from the non-trigger marginal, then bigram steps, except after a trigger the next token
    is the token before the trigger."""

    def __init__(self, triggers: str = "top3", n_triggers: int = 3, chain: str = "qg"):
        if chain == "qg":  # quantgate's chain before issue 26: each row Dirichlet(0.1) over the 62 symbols
            P = np.random.default_rng(20241017).dirichlet(np.full(N_SYM, 0.1), size=N_SYM)
        elif chain.startswith("zipf:"):  # rows Dirichlet(6.2 * w), w Zipf(s) over symbol rank (calib_data.synthetic's)
            s = float(chain.split(":")[1])
            w = 1 / np.arange(1, N_SYM + 1) ** s
            P = np.random.default_rng(20241017).dirichlet(6.2 * w / w.sum(), size=N_SYM)
        else:
            raise ValueError(chain)
        self.P = P
        self.cum = np.cumsum(P, axis=1)
        self.cum[:, -1] = 1.0
        self.pi = stationary(P)
        if triggers == "top3":
            trig = np.argsort(self.pi)[::-1][:n_triggers]
        elif triggers == "first3":
            trig = np.arange(n_triggers)
        else:
            raise ValueError(triggers)
        self.triggers = sorted(int(t) for t in trig)
        self.is_trig = np.zeros(VOCAB, dtype=bool)
        self.is_trig[self.triggers] = True
        first = self.pi.copy()
        first[self.triggers] = 0
        self.first = first / first.sum()
        self.row_entropy = -(P * np.log(np.clip(P, 1e-300, None))).sum(1)

    def batch(self, rng: np.random.Generator, B: int, T: int) -> np.ndarray:
        """[B, T+1] int64: column 0 BOS."""
        out = np.empty((B, T + 1), dtype=np.int64)
        out[:, 0] = BOS
        out[:, 1] = rng.choice(N_SYM, size=B, p=self.first)
        u = rng.random((B, T + 1))
        for t in range(2, T + 1):
            prev = out[:, t - 1]
            nxt = np.minimum((u[:, t, None] > self.cum[prev]).sum(axis=1), N_SYM - 1)
            out[:, t] = np.where(self.is_trig[prev], out[:, t - 2], nxt)
        return out


# ----------------------------------------------------------------------------------------------- model
class GeluMLP(nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class LabModel(Model):
    """quantgate's Model with lab-only switches: rope off (identity rotation), learned absolute positions,
    LayerNorm instead of RMSNorm (block and final norms; QK-norm stays RMSNorm), GELU MLP instead of SwiGLU."""

    def __init__(self, cfg: ModelConfig, rope=True, pos=False, norm="rms", mlp="swiglu", max_len=256):
        super().__init__(cfg)
        self.use_rope = rope
        self.pos_embed = nn.Embedding(max_len, cfg.dim) if pos else None
        for b in self.layers:
            if norm == "ln":
                b.input_layernorm = nn.LayerNorm(cfg.dim, eps=1e-5)
                b.post_attention_layernorm = nn.LayerNorm(cfg.dim, eps=1e-5)
            if mlp == "gelu":
                b.mlp = GeluMLP(cfg.dim, cfg.ffn_dim)
        if norm == "ln":
            self.norm = nn.LayerNorm(cfg.dim, eps=1e-5)

    def forward(self, idx, past=None, start_pos=0, probe=False, return_hidden=False, on_layer=None,
                position_ids=None, key_mask=None, kv_bits=None):
        assert past is None and position_ids is None and key_mask is None
        B, T = idx.shape
        positions = torch.arange(start_pos, start_pos + T, device=idx.device)
        cos, sin = rope_cache(self.cfg, positions)
        if not self.use_rope:
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        h = self.embed_tokens(idx)
        if self.pos_embed is not None:
            h = h + self.pos_embed(positions)[None]
        probs, hidden = [], []
        for i, layer in enumerate(self.layers):
            h, _, p = layer(h, cos, sin, None, probe, None, kv_bits)
            if on_layer is not None:
                on_layer(i, h, p)
                continue
            if probe:
                probs.append(p)
            if return_hidden:
                hidden.append(h)
        logits = self.lm_head(self.norm(h)).float()
        return type("Out", (), {"logits": logits, "attn_probs": probs, "hidden": hidden})()


def lab_init(model: LabModel, seed: int, how: str) -> None:
    if how == "qg":  # quantgate's init (N(0, 0.02), residual projections scaled), LayerNorm biases zero
        model.init_weights(seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.zero_()
    elif how == "torch":  # PyTorch defaults, as Guo's code leaves them (Embedding N(0,1), Linear U(+-1/sqrt(in)))
        torch.manual_seed(seed)
        for m in model.modules():
            if hasattr(m, "reset_parameters") and m is not model:
                m.reset_parameters()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.fill_(1.0)
    else:
        raise ValueError(how)


def build_twins(c: dict, seed: int) -> dict[str, LabModel]:
    cfg = ModelConfig(vocab_size=c["vocab"], dim=c["dim"], n_layers=c["n_layers"], n_heads=c["n_heads"],
                      n_kv_heads=c["n_kv_heads"], head_dim=c["head_dim"], ffn_dim=c["ffn_dim"],
                      qk_norm=c["qk_norm"], tie_embeddings=c["tie"], partial_rotary=c["partial_rotary"],
                      rope_theta=c["rope_theta"], max_seq_len=256, bos_id=BOS, eos_id=63,
                      pad_id=63)
    kw = dict(rope=c["rope"], pos=c["pos"], norm=c["norm"], mlp=c["mlp"])
    base = LabModel(cfg.with_gate("none"), **kw)
    lab_init(base, seed, c["init"])
    gated = LabModel(cfg.with_gate("elementwise"), **kw)
    lab_init(gated, seed + 1, c["init"])
    missing, unexpected = gated.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(".g_proj." in m for m in missing), (missing, unexpected)
    return {"baseline": base, "gated": gated}


def make_opt(m: nn.Module, c: dict):
    if c["wd_all"]:
        groups = [{"params": list(m.parameters()), "weight_decay": c["wd"]}]
    else:
        groups = [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": c["wd"]},
                  {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=c["lr"], betas=(0.9, c["beta2"]), eps=1e-8)


# ----------------------------------------------------------------------------------------------- measure
@torch.no_grad()
def measure(model: LabModel, data: BigramBackcopy, x: np.ndarray, quick: bool = False) -> dict:
    model.eval()
    xt = torch.as_tensor(x[:, :-1])
    y = torch.as_tensor(x[:, 1:])
    vals = {}
    hooks = [b.self_attn.v_proj.register_forward_hook(
        lambda m, a, o, i=i: vals.__setitem__(i, o.detach())) for i, b in enumerate(model.layers)]
    out = model(xt, probe=True, return_hidden=True)
    for h in hooks:
        h.remove()
    N, T = xt.shape
    trig = torch.as_tensor(data.is_trig[x[:, :-1]])
    qmask = torch.ones(N, T, dtype=torch.bool)
    qmask[:, 0] = False
    nontrig, trigq = qmask & ~trig, qmask & trig
    layers = []
    for li, p in enumerate(out.attn_probs):  # [N, H, T, T]
        bos = p[..., 0]  # [N, H, T]
        H = p.shape[1]
        prev = torch.diagonal(p, offset=-1, dim1=-2, dim2=-1)  # [N, H, T-1]: query t -> key t-1, t >= 1
        prev = F.pad(prev, (1, 0))
        row = {"bos_nontrig": [float(bos[:, h][nontrig].mean()) for h in range(H)],
               "bos_all": [float(bos[:, h][qmask].mean()) for h in range(H)],
               "bos_trig": [float(bos[:, h][trigq].mean()) for h in range(H)],
               "prev_at_trig": [float(prev[:, h][trigq].mean()) for h in range(H)],
               "prev_at_nontrig": [float(prev[:, h][nontrig].mean()) for h in range(H)],
               "self_at_nontrig": [float(torch.diagonal(p, dim1=-2, dim2=-1)[:, h][nontrig].mean()) for h in range(H)]}
        v = vals[li].float().view(N, T, model.cfg.n_kv_heads, model.cfg.head_dim).norm(dim=-1)  # [N, T, KV]
        row["value_norm_bos_over_rest"] = [float(v[:, 0, k].mean() / v[:, 1:, k].mean())
                                           for k in range(model.cfg.n_kv_heads)]
        layers.append(row)
    heads = [(s, li, h) for li, r in enumerate(layers) for h, s in enumerate(r["bos_nontrig"])]
    s, li, h = max(heads)
    res = {"sink_head": [li, h], "bos_nontrig": round(s, 4),
           "bos_all": round(layers[li]["bos_all"][h], 4), "bos_trig": round(layers[li]["bos_trig"][h], 4),
           "copy_head_prev_at_trig": round(max(v for r in layers for v in r["prev_at_trig"]), 4),
           "uniform_bos_share": round(float((1.0 / torch.arange(2, T + 1).float()).mean()), 4)}
    logp = F.log_softmax(out.logits, dim=-1)
    nll = -logp.gather(-1, y[..., None])[..., 0]
    res["loss_all"] = round(float(nll.mean()), 4)
    res["loss_trig"] = round(float(nll[trigq].mean()), 4)
    res["copy_acc"] = round(float((out.logits.argmax(-1) == y)[trigq].float().mean()), 4)
    ent = torch.as_tensor(data.row_entropy[np.minimum(x[:, :-1], N_SYM - 1)]).float()
    res["loss_nontrig_excess"] = round(float((nll - ent)[nontrig].mean()), 4)  # over the chain's entropy
    if quick:
        return res
    res["layers"] = [{k: [round(v, 4) for v in vv] for k, vv in r.items()} for r in layers]
    hs = torch.stack(out.hidden)  # [L, N, T, D]
    a = hs.abs()
    flat = int(a.argmax())
    L_, N_, T_, D_ = a.shape
    l_at, n_at, t_at, d_at = np.unravel_index(flat, (L_, N_, T_, D_))
    res["max_abs_h"] = round(float(a.max()), 3)
    res["max_abs_h_at"] = {"layer": int(l_at), "position": int(t_at), "channel": int(d_at)}
    res["max_abs_h_nonbos"] = round(float(a[:, :, 1:].max()), 3)
    res["max_abs_h_bos"] = round(float(a[:, :, 0].max()), 3)
    res["median_abs_h"] = round(float(a.median()), 4)
    norms = hs[-1].norm(dim=-1)  # [N, T]
    res["resid_norm_bos_over_median"] = round(float(norms[:, 0].mean() / norms[:, 1:].median()), 3)
    return res


@torch.no_grad()
def kl_vs(model_f, model_q, x: np.ndarray, kv_bits=None) -> float:
    xt = torch.as_tensor(x[:, :-1])
    lp = F.log_softmax(model_f(xt).logits, -1)
    lq = F.log_softmax(model_q(xt, kv_bits=kv_bits).logits, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def quant_metrics(model: LabModel, calib: np.ndarray, x: np.ndarray) -> dict:
    from quantgate.quant import get
    from quantgate.quant.simulate import quantize_
    os.environ.setdefault("QUANTGATE_PROGRESS", "0")
    model.eval()
    out = {}
    for name in ("w8a8-static", "w8a8-static-sink"):
        q = quantize_(copy.deepcopy(model), get("torch", name), calib[:, :-1])
        q.eval()
        out[f"kl_{name}"] = round(kl_vs(model, q, x), 5)
    out["kl_kv-int4"] = round(kl_vs(model, model, x, kv_bits=4), 5)
    return out


# ----------------------------------------------------------------------------------------------- train
def lr_at(step, c):
    lr = c["lr"] * min(1.0, (step + 1) / c["warmup"]) if c["warmup"] else c["lr"]
    if c["sched"] == "cos":  # cosine to 0.1 x lr after warmup
        p = max(0.0, (step - c["warmup"]) / max(1, c["steps"] - c["warmup"]))
        lr = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
    return lr


def run(c: dict, seed: int, name: str, do_quant: bool, probe_every: int, only: str | None = None) -> dict:
    torch.manual_seed(seed)
    data = BigramBackcopy(c["triggers"], chain=c["chain"])
    models = build_twins(c, seed)
    if only:
        models = {only: models[only]}
    opts = {k: make_opt(m, c) for k, m in models.items()}
    x_eval = data.batch(np.random.default_rng(10_000_019), 64, c["ctx"])
    x_probe = x_eval[:16]
    times = {k: 0.0 for k in models}
    traj = []
    for step in range(c["steps"]):
        b = torch.as_tensor(data.batch(np.random.default_rng([seed, step]), c["batch"], c["ctx"]))
        lr = lr_at(step, c)
        for k, m in models.items():
            t0 = time.perf_counter()
            m.train()
            for g in opts[k].param_groups:
                g["lr"] = lr
            logits = m(b[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            if c["clip"]:
                torch.nn.utils.clip_grad_norm_(m.parameters(), c["clip"])
            opts[k].step()
            times[k] += time.perf_counter() - t0
        if probe_every and ((step + 1) % probe_every == 0):
            row = {"step": step + 1}
            for k, m in models.items():
                q = measure(m, data, x_probe, quick=True)
                row[k] = {kk: q[kk] for kk in ("bos_nontrig", "bos_trig", "copy_acc", "loss_all")}
            traj.append(row)
            print(f"  [{name} s{seed}] step {step+1}: " + " | ".join(
                f"{k} bos {row[k]['bos_nontrig']:.3f} trigbos {row[k]['bos_trig']:.3f} copy {row[k]['copy_acc']:.2f} "
                f"loss {row[k]['loss_all']:.3f}" for k in models), flush=True)
    res = {"name": name, "seed": seed, "config": c, "triggers": data.triggers,
           "trigger_freq": round(float(data.is_trig[x_eval[:, 1:]].mean()), 4),
           "train_s": {k: round(v, 1) for k, v in times.items()}, "trajectory": traj}
    for k, m in models.items():
        res[k] = measure(m, data, x_eval)
        if do_quant:
            calib = data.batch(np.random.default_rng(20_000_003), 16, c["ctx"])
            res[k].update(quant_metrics(m, calib, x_eval))
    return res


def parse_val(v: str):
    if v in ("True", "true"):
        return True
    if v in ("False", "false"):
        return False
    for f in (int, float):
        try:
            return f(v)
        except ValueError:
            pass
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--quant", action="store_true")
    ap.add_argument("--only", choices=["baseline", "gated"], default=None)
    ap.add_argument("--probe-every", type=int, default=250)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "sink_lab_search.jsonl"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    c = dict(DEFAULTS)
    for kv in a.overrides:
        k, v = kv.split("=", 1)
        if k not in c:
            sys.exit(f"unknown key {k}")
        c[k] = parse_val(v)
    for s in [int(s) for s in a.seeds.split(",")]:
        t = time.time()
        r = run(c, s, a.name, a.quant, a.probe_every, a.only)
        r["wall_s"] = round(time.time() - t, 1)
        with open(a.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        if a.only:
            b = r[a.only]
            print(f"{a.name} seed {s}: {a.only} bos_nontrig {b['bos_nontrig']:.3f} (all {b['bos_all']:.3f}, trig "
                  f"{b['bos_trig']:.3f}) copy_acc {b['copy_acc']:.2f} max|h| {b['max_abs_h']:.1f} @pos "
                  f"{b['max_abs_h_at']['position']} train {r['train_s']} wall {r['wall_s']} s", flush=True)
            continue
        b, g = r["baseline"], r["gated"]
        print(f"{a.name} seed {s}: baseline bos_nontrig {b['bos_nontrig']:.3f} (all {b['bos_all']:.3f}, trig "
              f"{b['bos_trig']:.3f}) copy_acc {b['copy_acc']:.2f} max|h| {b['max_abs_h']:.1f} @pos "
              f"{b['max_abs_h_at']['position']} | gated bos_nontrig {g['bos_nontrig']:.3f} (all {g['bos_all']:.3f}) "
              f"copy_acc {g['copy_acc']:.2f} max|h| {g['max_abs_h']:.1f} @pos {g['max_abs_h_at']['position']} | "
              f"train {r['train_s']} wall {r['wall_s']} s", flush=True)


# The committed runs ($C, $G, $R, $L as below), in the order they ran
C, G = "chain=zipf:0.9", "qk_norm=False rope=False pos=True norm=ln mlp=gelu"  # the data; the GPT-style switches
R = "qk_norm=False rope=False pos=True mlp=gelu"  # R1: the first recipe that sank in 3 of 3 seeds
L = "batch=8 beta2=0.95 clip=1.0 wd=0.1 wd_all=False warmup=30"  # the lab's training settings (L4k: steps=4000)
RUNS = """
--only baseline --name Q            $C
--only baseline --name GPT          $C qk_norm=False rope=False pos=True norm=ln mlp=gelu
--only baseline --name Q-noqknorm   $C qk_norm=False
--only baseline --name Q-learnedpos $C rope=False pos=True
--only baseline --name Q-ln         $C norm=ln
--only baseline --name Q-gelu       $C mlp=gelu
--only baseline --name GPT+qknorm  $C $G qk_norm=True
--only baseline --name GPT+rope    $C $G rope=True pos=False
--only baseline --name GPT+rms     $C $G norm=rms
--only baseline --name GPT+swiglu  $C $G mlp=swiglu
--only baseline --name Q-noqknorm-gelu $C qk_norm=False mlp=gelu
--only baseline --name Q-noqknorm-nope $C qk_norm=False rope=False
--only baseline --name Q-noqknorm-learnedpos     $C qk_norm=False rope=False pos=True
--only baseline --name Q-learnedpos-gelu         $C rope=False pos=True mlp=gelu
--only baseline --name Q-noqknorm-2000           $C qk_norm=False steps=2000 --probe-every 500
--only baseline --name Q-noqknorm-cos            $C qk_norm=False sched=cos
--quant --name R1 $C $R
--only baseline --name R1-qgchain-top3   chain=qg triggers=top3 $R
--only baseline --name R1-qgchain-first3 chain=qg triggers=first3 $R
--only baseline --name Q-noqknorm-gelu-prope025 $C qk_norm=False mlp=gelu partial_rotary=0.25
--only baseline --name R1-labtrain $C $R batch=8 beta2=0.95 clip=1.0 wd=0.1 wd_all=False warmup=30
--only baseline --name R1-2L2H $C $R n_layers=2 n_heads=2 n_kv_heads=1 head_dim=32
--only baseline --name R1-2000 $C $R steps=2000 --probe-every 500
--only baseline --name L:Q                 $C $L
--only baseline --name L:Q-noqknorm        $C $L qk_norm=False
--only baseline --name L:Q-learnedpos      $C $L rope=False pos=True
--only baseline --name L:Q-gelu            $C $L mlp=gelu
--only baseline --name L:Q-learnedpos-gelu $C $L rope=False pos=True mlp=gelu
--only baseline --name L:Q-noqknorm-learnedpos $C $L qk_norm=False rope=False pos=True
--only baseline --name L:Q-noqknorm-gelu   $C $L qk_norm=False mlp=gelu
--only baseline --name L:R1-qgchain-top3   chain=qg $L $R
--only baseline --name L:R1-qgchain-first3 chain=qg triggers=first3 $L $R
--only baseline --probe-every 500 --name L4k:Q            $C $L
--only baseline --probe-every 500 --name L4k:Q-noqknorm   $C $L qk_norm=False
--only baseline --probe-every 500 --name L4k:Q-learnedpos $C $L rope=False pos=True
--only baseline --probe-every 500 --name L4k:Q-gelu       $C $L mlp=gelu
--only baseline --name L:R1-wd1e-4   $C $R batch=8 beta2=0.95 clip=1.0 wd=1e-4 wd_all=False warmup=30
--only baseline --name R1-wd0.1      $C $R wd=0.1 wd_all=False
--only baseline --name R1-batch8     $C $R batch=8
--only baseline --name L:Q-learnedpos-vocab259              $C $L rope=False pos=True vocab=259
--only baseline --probe-every 500 --name L4k:Q-learnedpos-vocab259 $C $L rope=False pos=True vocab=259
--only baseline --name L:Q-learnedpos-vocab66               $C $L rope=False pos=True vocab=66
"""


if __name__ == "__main__":
    main()
