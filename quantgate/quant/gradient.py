"""The allocator's gradient sensitivity (`quantize --sensitivity gradient`): each tensor's KLD at each llama.cpp type,
predicted from the diagonal Fisher information of the model's own output distribution (issue 50).

For a small change dW of the weights, KL(p_W || p_W+dW) ~ 1/2 dW' F dW, with F the Fisher information of the model's
next-token distribution (the KL's Hessian at dW = 0). Keeping F's diagonal, per position:

    delta(u, t) = 1/(2P) * sum over u's elements of F * (w - dequant_t(quant_t(w)))^2   (minus the same at Q8_0)

P the calibration positions, dW ggml's own quantization error (the proxy's worker, quant.proxy.weight_errors, with F
in place of the importance matrix). The deltas are in KLD units: they add to a base KLD, and the calibrated setting
(quant.allocate.calibrated_sensitivity) scales each tensor's curve to one measured KLD.

F's diagonal is estimated as the squared gradient, window by window, of sum_t log p(y_t), y_t drawn from the model's
own distribution at every position (the true Fisher, not the empirical one of the text's tokens; the draws are
independent, so cross terms vanish in expectation and the squared per-window gradient estimates the diagonal of the
window's Fisher, cross-position terms included). One backward per window.

Computed block by block, streamed from the GGUF: a forward pass keeps each block's input for every window (N x T x D
fp32 per block); the output head, a vocabulary slice at a time, draws the labels and gives the last block's output
gradient; then each block is read again, newest first, its GGUF tensors as leaves (formats.gguf.layer_state maps
them into our layout by differentiable operations, so the gradient is the GGUF tensor's own, in its own layout), run
again from its saved inputs and differentiated window by window. Memory: one block's weights, their gradient and
their Fisher in fp32, plus the saved inputs. The embedding's Fisher is kept for the tokens the windows hold (the
only rows with a gradient besides a tied head's); the head's rows are scored in a second pass over the saved final
hidden states once their Fisher mass has chosen which.

Rows: a tensor of at most ALL_ELEMENTS keeps every row; a larger one is represented by ROWS rows drawn with
probability proportional to their Fisher mass (each weighted by 1/(ROWS p)): an unbiased estimate of the whole
tensor's weighted error that spends its rows where F is (a uniform draw of 256 of 248,320 embedding rows would
mostly see rows no window uses, whose F is zero).

Follows HAWQ (Dong et al. 2019: a second-order sensitivity per layer, the Hessian times the squared quantization
perturbation) and NVIDIA ModelOpt's AutoQuantize gradient score (sum over a module's outputs of the squared loss
gradient times the squared output change from quantizing it). Differs from both: the Fisher of the model's own
distribution (the KL's Hessian), not the loss Hessian's trace (HAWQ) nor the text labels' gradient (ModelOpt); the
weights' diagonal, which keeps cross-position terms, where ModelOpt's output-space score keeps the input
correlations instead; per tensor and llama.cpp type with ggml's own quantizers giving dW; and in KLD units, so it can
be calibrated against measured KLD. Written by hand: neither exists for llama.cpp's types (ModelOpt scores its own
formats on PyTorch modules).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.func import functional_call

from ..formats.gguf import gguf_config, inspect_gguf, layer_state, open_reader, read_tensor, tokenizer_from_gguf
from ..llama_worker import float_rows
from ..memory import release_freed
from ..model import Model, rope_cache
from ..progress import track

ROWS = 256  # rows drawn per tensor larger than ALL_ELEMENTS (as many as the proxy samples)
ALL_ELEMENTS = 1 << 22  # a tensor up to this many elements keeps every row
VOCAB_SLICE = 1 << 14  # output-head rows at a time


@dataclass
class FisherRows:
    """Per unit name: (ggml row indices [k], the Fisher diagonal on those rows [k, row], each row's factor to the
    whole tensor [k]); `positions` the calibration positions the Fisher was summed over; `seconds` what it took."""
    by_unit: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    positions: int
    seconds: float


def pick_rows(mass: np.ndarray, rng: np.random.Generator, rows: int = ROWS,
              keep_all: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(row indices, factors): every row with Fisher mass (factor 1) where `keep_all`, else `rows` rows drawn with
    replacement in proportion to their mass, each weighted 1/(rows p): a row without mass has no weighted error, so
    leaving it out loses nothing."""
    nz = np.flatnonzero(mass > 0)
    if keep_all or len(nz) <= rows:
        return nz, np.ones(len(nz), dtype=np.float32)
    p = mass / mass.sum()
    idx = np.sort(rng.choice(len(mass), size=rows, replace=True, p=p))
    return idx, (1.0 / (rows * p[idx])).astype(np.float32)


class _Source:
    """The GGUF's tensors as fp32 torch tensors: whole ones for a block, row slices of the embedding and head."""

    def __init__(self, src: Path):
        self.reader = open_reader(src)
        self.info = inspect_gguf(src)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.names = set(self.tensors)
        self.cfg = gguf_config(self.info, self.names, tokenizer_from_gguf(self.reader))

    def read(self, name: str) -> torch.Tensor:
        return torch.from_numpy(read_tensor(self.reader, name))

    def rows(self, name: str, idx) -> torch.Tensor:
        """Rows `idx` (an index array or a slice) of a 2-D float tensor, widened to fp32 only where read."""
        t = self.tensors[name]
        return torch.from_numpy(np.array(float_rows(t, int(t.shape[0]))[idx], dtype=np.float32))


def fisher_rows(src: str | Path, units, windows: np.ndarray, seed: int = 0, rows: int = ROWS,
                threads: int | None = None, batch: int = 4, labels: np.ndarray | None = None) -> FisherRows:
    """The Fisher diagonal of every unit on `windows` [N, T] (BOS first), block by block (module docstring), as the
    rows the weight-error pass will weigh. `labels` [N, T]: the tokens whose log-likelihood is differentiated, in
    place of draws from the model (the tests' independent check of the streaming)."""
    t0 = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    s = _Source(Path(src))
    cfg, arch = s.cfg, s.info.arch
    wanted = {u.name: u for u in units}
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Model(cfg)
    ids = torch.as_tensor(windows, dtype=torch.long)
    N, T = ids.shape
    cos, sin = rope_cache(cfg, torch.arange(T))
    emb_name, head_name = "token_embd.weight", ("token_embd.weight" if cfg.tie_embeddings else "output.weight")
    vocab = np.unique(windows)  # the embedding rows the windows read
    emb = s.rows(emb_name, vocab)
    where = {int(v): j for j, v in enumerate(vocab)}
    pos = torch.as_tensor(np.vectorize(where.__getitem__)(windows), dtype=torch.long)  # [N, T] into `vocab`
    saved = [emb[pos]]  # each block's input, every window
    del emb
    out: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    with torch.no_grad():
        for i in track(range(cfg.n_layers), "Fisher: forward, block by block", total=cfg.n_layers, memory=True):
            block, sd = model.layers[i], _local(layer_state(cfg, arch, s.names, s.read, i), i)
            saved.append(torch.cat([functional_call(block, sd, (saved[-1][b:b + batch], cos, sin))[0]
                                    for b in range(0, N, batch)]))
            del sd
            release_freed()
    xd, lse, labels, mass, dh = _head_pass(s, model, saved.pop(), head_name, gen, labels)

    for i in track(reversed(range(cfg.n_layers)), "Fisher: backward, block by block", total=cfg.n_layers,
                   memory=True):
        leaves: dict[str, torch.Tensor] = {}

        def leaf(name: str) -> torch.Tensor:
            if name not in leaves:
                leaves[name] = s.read(name).requires_grad_(name in wanted)
            return leaves[name]
        h_in = saved.pop()
        fisher: dict[str, torch.Tensor] = {}
        for w in range(N):  # one window at a time: the square of each window's own gradient
            sd = _local(layer_state(cfg, arch, s.names, leaf, i), i)
            h = h_in[w:w + 1].clone().requires_grad_()
            y = functional_call(model.layers[i], sd, (h, cos, sin))[0]
            grads = [n for n, t in leaves.items() if t.requires_grad]
            g = torch.autograd.grad(y, [h, *(leaves[n] for n in grads)], dh[w:w + 1], allow_unused=True)
            dh[w:w + 1] = g[0]
            for n, gn in zip(grads, g[1:]):
                if gn is not None:
                    fisher[n] = fisher[n].add_(gn.square()) if n in fisher else gn.square()
            del sd, y, g, h
        for n, f in fisher.items():
            out[n] = _chosen(f.reshape(-1, wanted[n].row).numpy(), rng, rows)
        del leaves, fisher, h_in
        release_freed()

    # the embedding: each window's gradient lands on the rows of its own tokens
    emb_grads = [torch.zeros(len(vocab), cfg.dim).index_add_(0, pos[w], dh[w]) for w in range(N)]
    if not cfg.tie_embeddings and emb_name in wanted:
        f = torch.stack(emb_grads).square().sum(0).numpy()
        r, f_rows, scale = _chosen(f, rng, rows)
        out[emb_name] = (vocab[r].astype(np.int64), f_rows, scale)
    if head_name in wanted:
        tied = (where, emb_grads) if cfg.tie_embeddings else None
        out[head_name] = _head_rows(s, head_name, xd, lse, labels, mass, tied, rng, rows)
    return FisherRows(out, N * T, round(time.perf_counter() - t0, 2))


def _head_pass(s: _Source, model: Model, h_last: torch.Tensor, head: str, gen: torch.Generator,
               given: np.ndarray | None = None):
    """The output head over every window, a vocabulary slice at a time (each slice read once): labels drawn from the
    model's own distribution (Gumbel-max, so the draw needs no full softmax), the gradient of sum_t log p(y_t) at
    the last block's output, and each head row's Fisher mass (its squared per-window gradient, summed). Returns the
    final normed hidden states, the log-normalisers, the labels, the head rows' mass and that gradient."""
    V = int(s.tensors[head].shape[1])
    h = h_last.clone().requires_grad_()
    x = functional_call(model.norm, {"weight": s.read("output_norm.weight")}, (h,))
    xd = x.detach()
    N, T, _D = xd.shape
    lse = torch.full((N, T), -torch.inf)
    best, labels = torch.full((N, T), -torch.inf), torch.zeros((N, T), dtype=torch.long)
    with torch.no_grad():
        for v0 in range(0, V, VOCAB_SLICE):
            z = xd @ s.rows(head, slice(v0, v0 + VOCAB_SLICE)).T
            lse = torch.logaddexp(lse, torch.logsumexp(z, -1))
            noisy = z - torch.log(-torch.log(torch.rand(z.shape, generator=gen).clamp_(1e-30, 1 - 1e-7)))
            top, at = noisy.max(-1)
            labels = torch.where(top > best, at + v0, labels)
            best = torch.maximum(top, best)
        if given is not None:
            labels = torch.as_tensor(given, dtype=torch.long)
        dx, mass = torch.zeros_like(xd), np.zeros(V)
        for v0 in range(0, V, VOCAB_SLICE):
            w = s.rows(head, slice(v0, v0 + VOCAB_SLICE))
            gz = _score_grad(xd @ w.T, lse, labels, torch.arange(v0, v0 + len(w)))
            dx += gz @ w
            mass[v0:v0 + len(w)] = torch.einsum("ntv,ntd->nvd", gz, xd).square().sum((0, 2)).numpy()
    dh = torch.autograd.grad(x, h, dx)[0]
    return xd, lse, labels, mass, dh


def _score_grad(z: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """d log p(y) / d z for the logits `z` [N, T, k] of head rows `rows` [k]: 1[y = row] - p(row)."""
    return (labels[..., None] == rows).float() - torch.exp(z - lse[..., None])


def _head_rows(s: _Source, head: str, xd, lse, labels, mass: np.ndarray, tied, rng: np.random.Generator,
               rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The head's Fisher on the rows its mass picks (every row of a small head): each window's gradient of those
    rows, plus, where the embedding is tied, what the window's tokens add to the same rows, squared and summed."""
    idx, scale = pick_rows(mass, rng, rows, keep_all=mass.size * xd.shape[-1] <= ALL_ELEMENTS)
    uniq, back = np.unique(idx, return_inverse=True)
    f = torch.zeros(len(uniq), xd.shape[-1])
    r = torch.as_tensor(uniq)
    with torch.no_grad():
        w = s.rows(head, uniq)
        for n in range(xd.shape[0]):
            g = _score_grad(xd[n:n + 1] @ w.T, lse[n:n + 1], labels[n:n + 1], r)[0].T @ xd[n]
            if tied is not None:
                where, emb_grads = tied
                hit = [(j, where[int(v)]) for j, v in enumerate(uniq) if int(v) in where]
                if hit:
                    a, b = map(list, zip(*hit))
                    g[a] += emb_grads[n][b]
            f += g.square()
    return idx.astype(np.int64), np.ascontiguousarray(f.numpy()[back], dtype=np.float32), scale


def _local(sd: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer i's parameters under the block's own names (functional_call on model.layers[i])."""
    prefix = f"layers.{i}."
    return {k[len(prefix):]: v for k, v in sd.items()}


def _chosen(f: np.ndarray, rng: np.random.Generator, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tensor's Fisher [n_rows, row] as (row indices, their Fisher rows, factors): pick_rows by the rows' mass."""
    idx, scale = pick_rows(f.sum(1), rng, rows, keep_all=f.size <= ALL_ELEMENTS)
    return idx.astype(np.int64), np.ascontiguousarray(f[idx], dtype=np.float32), scale


def pilot(src: str | Path, T: int, threads: int | None = None) -> dict:
    """What one block costs here, for `--sensitivity auto` to predict a whole pass from: seconds to read block 0's
    tensors into fp32 and to run it forward over one window of T tokens; the model's layers, width and vocabulary."""
    if threads:
        torch.set_num_threads(threads)
    s = _Source(Path(src))
    cfg, arch = s.cfg, s.info.arch
    with torch.device("meta"):
        model = Model(cfg)
    t0 = time.perf_counter()
    sd = _local(layer_state(cfg, arch, s.names, s.read, 0), 0)
    t1 = time.perf_counter()
    cos, sin = rope_cache(cfg, torch.arange(T))
    h = torch.randn(1, T, cfg.dim) * 0.02
    with torch.no_grad():
        functional_call(model.layers[0], sd, (h, cos, sin))
    t2 = time.perf_counter()
    return {"read_s": t1 - t0, "forward_s": t2 - t1, "layers": cfg.n_layers, "dim": cfg.dim,
            "vocab": int(s.tensors["token_embd.weight"].shape[1])}


def predict_seconds(p: dict, n_windows: int) -> float:
    """A gradient pass over `n_windows` predicted from pilot(): each block read twice (forward, backward) and run
    about four times per window (the forward, its recomputation and the backward's two products); the head's four
    vocabulary-wide products per window, against a block's ~24 dim^2 per token, cost vocab / (3 dim) block-forwards."""
    per_block = 2 * p["read_s"] + 4 * n_windows * p["forward_s"]
    head = n_windows * p["forward_s"] * p["vocab"] / (3 * p["dim"])
    return p["layers"] * per_block + head
