"""Outlier metrics, layer by layer (DESIGN section 5).

- massive activations: per layer, max |h| of the residual stream after the block, where it occurs
  (window, token position, channel), the median |h| and their ratio, and the top channels;
- attention sinks: per layer and head, the attention mass on position 0 (BOS), averaged over query
  positions >= 1, overall and per window (and each window's largest |h|: the units the report's bootstrap
  resamples);
- linear-input outliers: max |x| and kurtosis of the input of every linear layer;
- gate: per layer and head, the mean of sigmoid(X W_g) and the fraction of values below 0.1;
- hybrids: attention sinks on the full-attention layers only (a Gated DeltaNet layer has no attention
  probabilities), and the GDN's own output gate silu(z) per value head: its mean and the fraction |silu(z)| < 0.1;
- mixture of experts: per layer, how the router spreads tokens (each expert's share of the routed slots, the
  experts no token reached, the load's max over uniform and its normalised entropy, the mean top-1 weight) and
  the shared expert's gate sigmoid(x W_s), the model's third gate: its mean and fraction below 0.1.

Everything is accumulated batch by batch with forward hooks and the model's probe path, so the only
per-layer state kept is a bounded sample of |h| for the median.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .capture import capture
from .layerwise import capture_layerwise
from .model import Model, route

MEDIAN_SAMPLE = 1 << 20  # |h| values kept per layer for the median (exact below this count)


@dataclass
class Moments:
    """Running max |x| and raw moments of a tensor stream, for Pearson kurtosis E[(x-mu)^4] / var^2."""
    n: int = 0
    s1: float = 0.0
    s2: float = 0.0
    s3: float = 0.0
    s4: float = 0.0
    max_abs: float = 0.0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().double().reshape(-1)
        self.n += x.numel()
        self.s1 += float(x.sum())
        x2 = x * x
        self.s2 += float(x2.sum())
        self.s3 += float((x2 * x).sum())
        self.s4 += float((x2 * x2).sum())
        self.max_abs = max(self.max_abs, float(x.abs().max()))

    def kurtosis(self) -> float:
        m = self.s1 / self.n
        e2, e3, e4 = self.s2 / self.n, self.s3 / self.n, self.s4 / self.n
        var = e2 - m * m
        c4 = e4 - 4 * m * e3 + 6 * m * m * e2 - 3 * m ** 4
        return float(c4 / (var * var)) if var > 0 else float("nan")


@dataclass
class LayerAccumulator:
    max_abs: float = -1.0
    where: tuple = (0, 0, 0)  # window, position, channel
    channel_max: torch.Tensor | None = None
    samples: list = field(default_factory=list)
    n_sampled: int = 0
    bos_sum: torch.Tensor | None = None  # per head
    bos_count: int = 0
    bos_windows: list = field(default_factory=list)  # per window: [H] mean share on BOS (the bootstrap's units)
    bos_sel_sum: torch.Tensor | None = None  # the same over the selected queries only (query_mask: non-triggers)
    bos_sel_count: int = 0
    bos_sel_windows: list = field(default_factory=list)
    max_windows: list = field(default_factory=list)  # per window: its largest |h|
    gate_sum: torch.Tensor | None = None
    gate_low: torch.Tensor | None = None
    gate_count: int = 0
    gate_hist: np.ndarray | None = None
    gdn_sum: torch.Tensor | None = None  # per value head: mean silu(z), fraction |silu(z)| < 0.1
    gdn_low: torch.Tensor | None = None
    gdn_count: int = 0
    expert_load: torch.Tensor | None = None  # MoE: routed token slots per expert
    top1_sum: float = 0.0
    route_count: int = 0
    shared_sum: float = 0.0  # MoE: sigmoid of the shared expert's gate, summed, and how often it is < 0.1
    shared_low: float = 0.0
    shared_count: int = 0


GATE_BINS = np.linspace(0.0, 1.0, 51)


def _sample(values: torch.Tensor, budget: int, generator: torch.Generator) -> torch.Tensor:
    flat = values.reshape(-1)
    if flat.numel() <= budget:
        return flat.clone()
    idx = torch.randint(0, flat.numel(), (budget,), generator=generator)
    return flat[idx]


class OutlierCollector:
    """What the analysis records while windows run through a model (quantgate.capture attaches its hooks and
    calls `layer` after each block), read back as a report dict."""

    def __init__(self, model: Model, top_k: int = 8, seed: int = 0, query_mask: np.ndarray | None = None):
        """query_mask [N, T] (the analysed windows): the queries a second BOS share is averaged over, beside the
        one over all queries; on Bigram-Backcopy the non-trigger positions, where Guo et al. read the sink (a copy
        head is active on triggers and dormant, parked on BOS, elsewhere)."""
        self.model, self.top_k = model, top_k
        self.query_mask = None if query_mask is None else torch.as_tensor(query_mask, dtype=torch.bool)
        self.layers = [LayerAccumulator() for _ in model.layers]
        self.linear: dict[str, Moments] = {}
        # one sampler per layer: the |h| sample a layer keeps for its median does not depend on the order in which
        # layers and batches run (the in-memory model runs batch-major, the layer-by-layer one layer-major)
        self.gens = [torch.Generator().manual_seed(seed * 100003 + i) for i in range(len(model.layers))]
        self._windows_seen = 0
        self._ctx = 0

    def pre_hooks(self) -> list:
        """Every Linear's input: max |x| and kurtosis."""
        return [(mod, self._linear_hook(name)) for name, mod in self.model.named_modules()
                if isinstance(mod, torch.nn.Linear)]

    def post_hooks(self) -> list:
        """Every gate's output; and the model's own output, which ends a batch (window count, context)."""
        gates = [(layer.self_attn.g_proj, self._gate_hook(i)) for i, layer in enumerate(self.model.layers)
                 if not layer.is_linear and layer.self_attn.g_proj is not None]
        gdn = [(layer.linear_attn.in_proj_z, self._gdn_gate_hook(i)) for i, layer in enumerate(self.model.layers)
               if layer.is_linear]
        moe = [h for i, layer in enumerate(self.model.layers) if self.model.cfg.is_moe
               for h in ((layer.mlp.gate, self._router_hook(i)), (layer.mlp.shared_expert_gate, self._shared_hook(i)))]
        return gates + gdn + moe + [(self.model, self._batch_done)]

    def _router_hook(self, i: int):
        E, k = self.model.cfg.n_experts, self.model.cfg.n_experts_used

        def hook(_mod, _args, out):
            w, idx = route(out.detach(), k)  # the model's own routing rule, on the logits it computed
            acc = self.layers[i]
            load = torch.bincount(idx.reshape(-1), minlength=E).double()
            acc.expert_load = load if acc.expert_load is None else acc.expert_load + load
            acc.top1_sum += float(w[:, 0].sum())
            acc.route_count += w.shape[0]
        return hook

    def _shared_hook(self, i: int):
        def hook(_mod, _args, out):
            g = torch.sigmoid(out.detach().double())
            acc = self.layers[i]
            acc.shared_sum += float(g.sum())
            acc.shared_low += float((g < 0.1).sum())
            acc.shared_count += g.numel()
        return hook

    def _gdn_gate_hook(self, i: int):
        Hv = self.model.cfg.linear_value_heads

        def hook(_mod, _args, out):
            z = torch.nn.functional.silu(out.detach().float())
            B, T, _ = z.shape
            z = z.view(B, T, Hv, -1)
            acc = self.layers[i]
            mean = z.mean(dim=(0, 1, 3)) * (B * T)
            low = (z.abs() < 0.1).float().mean(dim=(0, 1, 3)) * (B * T)
            acc.gdn_sum = mean if acc.gdn_sum is None else acc.gdn_sum + mean
            acc.gdn_low = low if acc.gdn_low is None else acc.gdn_low + low
            acc.gdn_count += B * T
        return hook

    def _batch_done(self, _mod, args, _out) -> None:
        self._windows_seen += args[0].shape[0]
        self._ctx = args[0].shape[1]

    def _linear_hook(self, name: str):
        def hook(_mod, args):
            self.linear.setdefault(name, Moments()).add(args[0])
        return hook

    def _gate_hook(self, i: int):
        H = self.model.cfg.n_heads

        def hook(_mod, _args, out):
            g = torch.sigmoid(out.detach().float())
            B, T, _ = g.shape
            g = g.view(B, T, H, -1)
            acc = self.layers[i]
            per_head = g.mean(dim=(0, 1, 3)) * (B * T)
            low = (g < 0.1).float().mean(dim=(0, 1, 3)) * (B * T)
            acc.gate_sum = per_head if acc.gate_sum is None else acc.gate_sum + per_head
            acc.gate_low = low if acc.gate_low is None else acc.gate_low + low
            acc.gate_count += B * T
            hist = np.histogram(g.numpy().reshape(-1), bins=GATE_BINS)[0]
            acc.gate_hist = hist if acc.gate_hist is None else acc.gate_hist + hist
        return hook

    def layer(self, i: int, h: torch.Tensor, probs: torch.Tensor) -> None:
        """Called after block i with its output h and attention probabilities (Model.forward's on_layer)."""
        B = h.shape[0]
        budget = max(1, MEDIAN_SAMPLE // 64)
        acc = self.layers[i]
        a = h.detach().float().abs()
        m = float(a.max())
        if m > acc.max_abs:
            flat = int(a.argmax())
            w, rest = divmod(flat, a.shape[1] * a.shape[2])
            acc.max_abs, acc.where = m, (self._windows_seen + w, *divmod(rest, a.shape[2]))
        acc.max_windows += a.amax(dim=(1, 2)).tolist()
        cmax = a.amax(dim=(0, 1))
        acc.channel_max = cmax if acc.channel_max is None else torch.maximum(acc.channel_max, cmax)
        if acc.n_sampled < MEDIAN_SAMPLE:
            s = _sample(a, min(budget * B, MEDIAN_SAMPLE - acc.n_sampled), self.gens[i])
            acc.samples.append(s)
            acc.n_sampled += s.numel()
        if probs is None:  # a Gated DeltaNet layer: no attention probabilities
            return
        bos = probs[:, :, 1:, 0].float()  # [B, H, T-1]: attention of queries >= 1 on BOS
        acc.bos_sum = bos.sum(dim=(0, 2)) if acc.bos_sum is None else acc.bos_sum + bos.sum(dim=(0, 2))
        acc.bos_count += bos.shape[0] * bos.shape[2]
        acc.bos_windows += bos.mean(dim=2).tolist()
        if self.query_mask is not None:
            sel = self.query_mask[self._windows_seen:self._windows_seen + B, 1:].float()[:, None, :]  # [B, 1, T-1]
            n = sel.sum(dim=2).clamp(min=1)  # [B, 1]: a window with no such query counts as share 0 over 1
            acc.bos_sel_sum = ((bos * sel).sum(dim=(0, 2)) if acc.bos_sel_sum is None
                               else acc.bos_sel_sum + (bos * sel).sum(dim=(0, 2)))
            acc.bos_sel_count += int(sel.sum())
            acc.bos_sel_windows += ((bos * sel).sum(dim=2) / n).tolist()

    def report(self) -> dict:
        layers = []
        for i, acc in enumerate(self.layers):
            median = float(torch.cat(acc.samples).median())
            top = torch.topk(acc.channel_max, min(self.top_k, acc.channel_max.numel()))
            bos = None if acc.bos_sum is None else (acc.bos_sum / acc.bos_count).tolist()
            entry = {
                "layer": i, "kind": self.model.cfg.layer_type(i), "max_abs": acc.max_abs, "max_window": acc.where[0], "max_position": acc.where[1],
                "max_channel": acc.where[2], "median_abs": median,
                "max_over_median": acc.max_abs / median if median > 0 else float("inf"),
                "top_channels": [{"channel": int(c), "max_abs": float(v)} for v, c in zip(top.values, top.indices)],
                "bos_attention": bos, "bos_attention_mean": None if bos is None else float(np.mean(bos)),
                "max_abs_windows": acc.max_windows, "bos_attention_windows": acc.bos_windows or None,
            }
            if acc.bos_sel_count:
                entry["bos_attention_nontrigger"] = (acc.bos_sel_sum / acc.bos_sel_count).tolist()
                entry["bos_attention_nontrigger_windows"] = acc.bos_sel_windows
            if acc.gate_count:
                entry["gate_mean"] = (acc.gate_sum / acc.gate_count).tolist()
                entry["gate_frac_below_0.1"] = (acc.gate_low / acc.gate_count).tolist()
                entry["gate_histogram"] = {"bins": GATE_BINS.tolist(), "counts": acc.gate_hist.tolist()}
            if acc.gdn_count:
                entry["gdn_gate_mean"] = (acc.gdn_sum / acc.gdn_count).tolist()
                entry["gdn_gate_frac_below_0.1"] = (acc.gdn_low / acc.gdn_count).tolist()
            if acc.route_count:
                entry["routing"] = routing_stats(acc)
            layers.append(entry)
        linear = {name: {"max_abs": m.max_abs, "kurtosis": m.kurtosis(), "n": m.n}
                  for name, m in sorted(self.linear.items())}
        return {"windows": self._windows_seen, "layers": layers, "linear_inputs": linear,
                # a head spreading attention evenly gives BOS mean(1/(q+1)) over queries q = 1..T-1
                "uniform_bos_share": float(np.mean(1.0 / np.arange(2, self._ctx + 1))), "ctx": self._ctx}


def routing_stats(acc: LayerAccumulator) -> dict:
    """One MoE layer's routing over every token analysed: each expert's share of the routed slots (uniform is
    1/E), the experts no token reached, max share over uniform, the load's entropy over log E (1 = even), the
    mean top-1 weight, and the shared expert's gate."""
    share = acc.expert_load / acc.expert_load.sum()
    E = share.numel()
    nz = share[share > 0]
    return {"experts": E, "tokens": acc.route_count, "expert_share": share.tolist(),
            "dead_experts": int((acc.expert_load == 0).sum()), "max_share_over_uniform": float(share.max() * E),
            "load_entropy": float(-(nz * nz.log()).sum() / np.log(E)) if E > 1 else 1.0,
            "top1_weight_mean": acc.top1_sum / acc.route_count,
            "shared_gate_mean": acc.shared_sum / acc.shared_count,
            "shared_gate_frac_below_0.1": acc.shared_low / acc.shared_count}


def analyze_model(model: Model, windows: np.ndarray, batch: int = 4, top_k: int = 8,
                  query_mask: np.ndarray | None = None) -> dict:
    """Outlier report of `model` over `windows` ([N, T] int64, BOS first); query_mask: see OutlierCollector."""
    col = OutlierCollector(model, top_k=top_k, query_mask=query_mask)
    capture(model, windows, pre=col.pre_hooks(), post=col.post_hooks(), batch=batch, label="analyze", probe=True,
            on_layer=col.layer)
    return col.report()


def analyze_layerwise(lw, windows: np.ndarray, batch: int = 4, top_k: int = 8,
                      query_mask: np.ndarray | None = None) -> dict:
    """analyze_model for a checkpoint run block by block (quantgate.layerwise.LayerwiseModel): the same hooks on its
    modules, the same report; the output head's input is measured from the final hidden states."""
    col = OutlierCollector(lw.model, top_k=top_k, query_mask=query_mask)

    def on_layer(i: int, first: int, h: torch.Tensor, probs) -> None:
        col._windows_seen = first  # where this batch's windows start (the in-memory path counts them as it goes)
        col.layer(i, h, probs)

    hooks = [(m, f) for m, f in col.post_hooks() if m is not lw.model]
    pre = [(m, f) for m, f in col.pre_hooks() if m is not lw.model.lm_head]
    hs: list = []
    with torch.inference_mode():
        capture_layerwise(lw, windows, pre=pre, post=hooks, batch=batch, probe=True, on_layer=on_layer,
                          label="analyze (layer by layer)", keep=hs)
        lw._load(lw.model.norm, "norm.")
        for h in hs:
            col.linear.setdefault("lm_head", Moments()).add(lw.model.norm(h))
        lw._drop(lw.model.norm)
    col._windows_seen, col._ctx = len(windows), windows.shape[1]
    return col.report()
