"""The sizes people run: peak memory and wall time of every verb on Qwen3.5 checkpoints of 0.8B, 2B, 4B and 9B shape.

Each checkpoint is written in the released layout (`Qwen3_5ForConditionalGeneration`: text weights under
`model.language_model.*`, a vision tensor, the `mtp.*` head; bf16; sharded at 2 GB with an index), with random
weights at the real configs of QWEN35.md section 1.2 (memory and time do not depend on the values). It is written
tensor by tensor, so this script itself never holds a model.

Every verb runs in a child process of its own (`python -m quantgate.cli ...`), under a wrapper that reports the
child's wall time and its peak RSS (getrusage of the largest descendant: the CLI, or the llama.cpp worker it
spawns); the CLI's own "peak memory" line is kept beside it. Beside quantgate's `export gguf`, llama.cpp's own
convert_hf_to_gguf.py (from the llama-cpp-python sdist) converts the same checkpoint to the same out type.

Verbs: `info` (directory and GGUF), `export gguf --outtype bf16` (MTP kept), `quantize --type Q4_K_M`
(llama.cpp's quantizer), `generate` (32 tokens), `eval` on the Q4_K_M file (perplexity, 4 windows of 128);
`eval` of the Q4_K_M file against the checkpoint (KL divergence; the reference's fp32 logits); the PyTorch verbs
`analyze` and `eval` of the directory (in memory where the fp32 model fits, else block by block); `export onnx`
(fp32, streamed from the directory), `quantize --scheme int4` on it (ORT's MatMulNBits quantizer, one MatMul at a
time) and `generate` from the int4 export. A verb that exits non-zero is recorded with its one line.
`--verbs onnx` runs only the ONNX verbs and keeps each shape's other results beside them (each verb names the
commit it ran at).

Goals (issue 25): export and quantize peak RSS <= 1.5 x the largest single tensor + 1.5 GB; analyze and eval
(run layer by layer where the fp32 model does not fit) <= the largest block in fp32 + 3 GB; time linear in
parameters.

    python benchmarks/scale.py [--shapes qwen35-0.8b,qwen35-2b,qwen35-4b,qwen35-9b] [--work DIR]
        [--llama-cpp-src DIR]   # the vendored llama.cpp tree of the llama-cpp-python sdist (else pip-downloaded)

Writes benchmarks/results/scale.json after every verb (a long run keeps what it measured) and scale.md from it
(`--markdown-only` rewrites the .md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantgate.formats.hf import config_to_hf, tensor_plan
from quantgate.layouts import LAYOUTS
from quantgate.model import Model, ModelConfig, hybrid
from quantgate.tokenizer import train_bpe

HERE = Path(__file__).parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from laptop_speed import llama_cpp_tree  # noqa: E402  (the sdist's converter tree, fetched the same way)

CONVERT = HERE.parent / "tests" / "llama_convert.py"
SHARD_BYTES = 2 << 30
GB = 1e9


def qwen35(dim: int, layers: int, heads: int, kv: int, value_heads: int, ffn: int, tied: bool) -> ModelConfig:
    """A Qwen3.5 dense text model of QWEN35.md's table: head_dim 256, GDN key heads 16 x 128, value heads x 128."""
    base = ModelConfig(vocab_size=248320, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, head_dim=256,
                       ffn_dim=ffn, rope_theta=1e7, tie_embeddings=tied, max_seq_len=4096, gate="elementwise")
    return replace(hybrid(base), linear_key_heads=16, linear_value_heads=value_heads, linear_key_dim=128,
                   linear_value_dim=128)


def qwen35_moe(layers: int) -> ModelConfig:
    """Qwen3.5-35B-A3B / Qwen3.6-35B-A3B (QWEN35.md section 1.3: d 2048, heads 16/2 x 256, GDN 16/32 x 128, 256
    experts of 512, top 8, a shared expert of 512, untied) with `layers` of its 40 layers: every tensor has the
    released shape, the model is scaled to fit this machine's disk by depth alone."""
    base = replace(qwen35(2048, layers, 16, 2, 32, 512, False), n_experts=256, n_experts_used=8, expert_ffn_dim=512,
                   shared_expert_ffn_dim=512)
    return base


SHAPES = {
    "qwen35-0.8b": lambda: qwen35(1024, 24, 8, 2, 16, 3584, True),
    "qwen35-2b": lambda: qwen35(2048, 24, 8, 2, 16, 6144, True),
    "qwen35-4b": lambda: qwen35(2560, 32, 16, 4, 32, 9216, True),
    "qwen35-9b": lambda: qwen35(4096, 32, 16, 4, 32, 12288, False),
    "qwen35-35b-a3b-8l": lambda: qwen35_moe(8),  # 8 of the 40 layers: 7.7 B parameters (text model), 1.5 B active
    "smoke": lambda: replace(hybrid(ModelConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=2, n_kv_heads=1,
                                                head_dim=128, ffn_dim=512, max_seq_len=4096, gate="elementwise")),
                             linear_key_heads=2, linear_value_heads=4, linear_key_dim=64, linear_value_dim=64),
    "smoke-moe": lambda: replace(SHAPES["smoke"](), n_experts=16, n_experts_used=4, expert_ffn_dim=256,
                                 shared_expert_ffn_dim=256),
}

WRAPPER = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"rc": r.returncode, "seconds": time.perf_counter() - t,
                  "peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "stdout": r.stdout[-3000:], "stderr": r.stderr[-3000:]}))
"""


def measured(cmd: list[str]) -> dict:
    """Run `cmd` under the wrapper: rc, seconds, peak RSS of its largest process, the tails of its output, and the
    CLI's own peak line when it printed one."""
    r = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True, cwd=tempfile.gettempdir(),
                       env={**os.environ, "QUANTGATE_PROGRESS": "0"})
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["own_peak_line"] = next((ln for ln in out["stderr"].splitlines() if ln.startswith("peak memory:")), None)
    out["error_line"] = next((ln for ln in out["stderr"].splitlines() if ln.startswith("error:")), None)
    return out


def qg(*args: str) -> list[str]:
    return [sys.executable, "-m", "quantgate.cli", *args]


# --- the checkpoint, written tensor by tensor --------------------------------------------------------------------

def layout_of(cfg: ModelConfig):
    return LAYOUTS["qwen3_5_moe" if cfg.is_moe else "qwen3_5"]


def released_config(cfg: ModelConfig) -> dict:
    """config.json as Qwen3.5's released multimodal checkpoints nest it (Qwen3.5-MoE's the same way)."""
    lay = layout_of(cfg)
    text = config_to_hf(cfg, lay)
    text.pop("quantgate")
    text.update(torch_dtype="bfloat16", mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    arch = "Qwen3_5MoeForConditionalGeneration" if cfg.is_moe else "Qwen3_5ForConditionalGeneration"
    return {"architectures": [arch], "model_type": lay.multimodal_type,
            "tie_word_embeddings": cfg.tie_embeddings, "text_config": text,
            "vision_config": {"depth": 1, "hidden_size": 64, "out_hidden_size": cfg.dim}}


def tensor_shapes(cfg: ModelConfig, hf: dict) -> dict[str, tuple]:
    """Every tensor of the released layout with its shape: the text model (quantgate's own plan for this layout),
    the MTP head (one full-attention block and its projection and norms) and one vision tensor."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Model(cfg).state_dict().items()}
    out = {theirs: shape for theirs, (_ours, shape) in tensor_plan(cfg, layout_of(cfg), shapes, hf).items()}
    D, H, KV, hd, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    out.update({"mtp.fc.weight": (D, 2 * D), "mtp.pre_fc_norm_embedding.weight": (D,),
                "mtp.pre_fc_norm_hidden.weight": (D,), "mtp.norm.weight": (D,),
                "mtp.layers.0.input_layernorm.weight": (D,), "mtp.layers.0.post_attention_layernorm.weight": (D,),
                "mtp.layers.0.self_attn.q_proj.weight": (2 * H * hd, D),
                "mtp.layers.0.self_attn.k_proj.weight": (KV * hd, D), "mtp.layers.0.self_attn.v_proj.weight": (KV * hd, D),
                "mtp.layers.0.self_attn.o_proj.weight": (D, H * hd), "mtp.layers.0.self_attn.q_norm.weight": (hd,),
                "mtp.layers.0.self_attn.k_norm.weight": (hd,), "mtp.layers.0.mlp.gate_proj.weight": (F, D),
                "mtp.layers.0.mlp.up_proj.weight": (F, D), "mtp.layers.0.mlp.down_proj.weight": (D, F),
                "model.visual.patch_embed.proj.weight": (64, 3 * 2 * 16 * 16)})
    if cfg.is_moe:  # the MTP block's MLP is the routed one, experts stored one tensor each (as transformers saves)
        p, E, Fe, Fs = "mtp.layers.0.mlp.", cfg.n_experts, cfg.expert_ffn_dim, cfg.shared_expert_ffn_dim
        out = {k: v for k, v in out.items() if not k.startswith(p)}
        out.update({p + "gate.weight": (E, D), p + "shared_expert.gate_proj.weight": (Fs, D),
                    p + "shared_expert.up_proj.weight": (Fs, D), p + "shared_expert.down_proj.weight": (D, Fs),
                    p + "shared_expert_gate.weight": (1, D)})
        out.update({f"{p}experts.{k}.{n}.weight": sh for k in range(E)
                    for n, sh in (("gate_proj", (Fe, D)), ("up_proj", (Fe, D)), ("down_proj", (D, Fe)))})
    return out


def write_checkpoint(cfg: ModelConfig, d: Path, seed: int = 0) -> dict:
    """Random bf16 weights (std 0.02; norms and A_log near 0, as zero-centred norms are) in 2 GB shards."""
    d.mkdir()
    hf = released_config(cfg)
    (d / "config.json").write_text(json.dumps(hf, indent=2))
    tok = train_bpe([open(json.__file__).read() * 4], 512)
    tok.save(d)
    g = torch.Generator().manual_seed(seed)
    shard, size, index, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(d / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    total = 0
    for name, shape in tensor_shapes(cfg, hf).items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.normal_(0.0, 0.02, generator=g)
        if size + t.numel() * 2 > SHARD_BYTES:
            flush()
        shard[name], size, total = t, size + t.numel() * 2, total + t.numel() * 2
    flush()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": index}, indent=2))
    with torch.device("meta"):
        meta = Model(cfg)
        n_params = meta.num_params()
        block = max(sum(p.numel() for p in blk.parameters()) for blk in meta.layers) * 4  # fp32, as run
    largest = max(int(torch.Size(s).numel()) for s in tensor_shapes(cfg, hf).values()) * 2
    facts = {"params": n_params, "stored_bytes": total, "largest_tensor_bytes": largest, "shards": n,
             "largest_block_fp32_bytes": block}
    if cfg.is_moe:  # what one token runs, and the largest tensor the GGUF holds (one projection's experts stacked)
        per_expert = 3 * cfg.dim * cfg.expert_ffn_dim
        facts |= {"moe": True, "active_params": n_params - cfg.n_layers * (cfg.n_experts - cfg.n_experts_used) * per_expert,
                  "largest_gguf_tensor_bytes": cfg.n_experts * cfg.expert_ffn_dim * cfg.dim * 2}
    return facts


# --- one shape -------------------------------------------------------------------------------------------------

def run_shape(name: str, work: Path, tree: Path, results: dict, save, verbs: str = "all") -> None:
    """Every verb on one shape; `verbs="onnx"` only the ONNX ones, recorded beside the shape's earlier results."""
    cfg = SHAPES[name]()
    d = claim(work / name)
    t = time.perf_counter()
    facts = write_checkpoint(cfg, d / "ckpt")
    facts["write_seconds"] = time.perf_counter() - t
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    old = results["shapes"].get(name)
    if verbs == "onnx" and old:  # keep the other verbs, each ONNX one records the commit it ran at
        r = old
        r["verbs"] = {k: v for k, v in r["verbs"].items() if "onnx" not in k}
    else:
        r = results["shapes"][name] = {"checkpoint": facts, "verbs": {}, "commit": commit}
    save()
    ckpt, ours, q4 = d / "ckpt", d / "ours-BF16.gguf", d / "ours-Q4_K_M.gguf"
    os.environ["QUANTGATE_CACHE"] = str(d / "cache")  # the reference logits' cache, removed with the folder

    def step(label: str, cmd: list[str]) -> dict:
        out = measured(cmd)
        r["verbs"][label] = {k: v for k, v in out.items() if k not in ("stdout", "stderr")} | {
            "stderr_tail": out["stderr"][-600:] if out["rc"] else "", "commit": commit}
        print(f"{name} {label}: rc {out['rc']} {out['seconds']:.1f} s peak {out['peak_rss'] / GB:.2f} GB "
              f"{out['error_line'] or ''}", flush=True)
        save()
        return out

    if verbs == "all":
        gguf_verbs(ckpt, ours, q4, step, r)
    if verbs in ("all", "onnx"):
        onnx_verbs(ckpt, d, step, r, facts)
    if verbs == "all":
        converter(ckpt, ours, d, tree, step, r, save)
    remove_own(d)


def gguf_verbs(ckpt: Path, ours: Path, q4: Path, step, r: dict) -> None:
    step("info (directory)", qg("info", str(ckpt)))
    step("export gguf bf16", qg("export", "gguf", str(ckpt), "--out", str(ours), "--outtype", "bf16"))
    if ours.exists():
        r["ours_gguf_bytes"] = ours.stat().st_size
        step("info (gguf)", qg("info", str(ours)))
        step("quantize Q4_K_M (llama.cpp)", qg("quantize", str(ours), "--type", "Q4_K_M", "--out", str(q4)))
    if q4.exists():
        r["q4_bytes"] = q4.stat().st_size
        step("generate 32 tokens (Q4_K_M)", qg("generate", str(q4), "--prompt", "def main():", "--max-tokens", "32",
                                               "--threads", "2"))
        step("eval ppl (Q4_K_M, 4 x 128)", qg("eval", str(q4), "--max-windows", "4", "--ctx", "128", "--threads", "2"))
        # KL divergence against the checkpoint itself: its fp32 reference logits, layer by layer where it cannot fit
        step("eval KLD (Q4_K_M vs the checkpoint, 2 x 64)", qg("eval", str(q4), "--reference", str(ckpt),
                                                             "--max-windows", "2", "--ctx", "64", "--threads", "2"))
        q4.unlink()
    # the PyTorch verbs: in memory where the fp32 model fits, else one block at a time (quantgate.layerwise)
    step("analyze (torch)", qg("analyze", str(ckpt), "--windows", "2", "--ctx", "64"))
    step("eval (torch, directory)", qg("eval", str(ckpt), "--max-windows", "2", "--ctx", "64"))


def onnx_verbs(ckpt: Path, d: Path, step, r: dict, facts: dict) -> None:
    """The fp32 ONNX export, streamed from the directory; then int4 (ORT's MatMulNBits quantizer, one MatMul at a
    time) and a generate on it."""
    onnx_dir, q = d / "onnx", d / "onnx-int4"
    step("export onnx (fp32)", qg("export", "onnx", str(ckpt), "--out", str(onnx_dir)))
    if not (onnx_dir / "model.onnx").is_file():
        return
    r["onnx_bytes"] = sum(f.stat().st_size for f in onnx_dir.iterdir() if f.name.startswith("model.onnx"))
    step("quantize onnx int4 (ONNX Runtime)", qg("quantize", str(onnx_dir), "--scheme", "int4", "--out", str(q)))
    shutil.rmtree(onnx_dir, ignore_errors=True)  # written by the step above, in this script's own folder
    if (q / "model.onnx").is_file():
        r["onnx_int4_bytes"] = sum(f.stat().st_size for f in q.iterdir() if f.name.startswith("model.onnx"))
        step("generate 32 tokens (onnx int4)", qg("generate", str(q), "--prompt", "def main():", "--max-tokens", "32",
                                                  "--threads", "2"))
        shutil.rmtree(q, ignore_errors=True)


def converter(ckpt: Path, ours: Path, d: Path, tree: Path, step, r: dict, save) -> None:
    """llama.cpp's own converter on the same checkpoint, to the same out type, MTP kept as ours keeps it."""
    ref = d / "ref-BF16.gguf"
    jobs = d / "jobs.json"
    jobs.write_text(json.dumps([[str(ckpt), "--outfile", str(ref), "--outtype", "bf16"]]))
    out = step("llama.cpp convert_hf_to_gguf.py bf16", [sys.executable, str(CONVERT), str(tree), str(jobs)])
    if out["rc"] == 0:
        r["ref_gguf_bytes"] = ref.stat().st_size
        if ours.exists():
            r["equal_to_converter"] = same_tensors(ours, ref)
        save()


MARKER = ".quantgate-scale"  # in every folder this script creates; only such folders are ever removed


def claim(d: Path) -> Path:
    """A fresh work folder for one shape: one this script made before is cleared, anything else is refused."""
    if d.exists():
        if not (d / MARKER).is_file():
            sys.exit(f"{d} exists and was not made by benchmarks/scale.py: choose another --work")
        remove_own(d)
    d.mkdir(parents=True)
    (d / MARKER).write_text("made by benchmarks/scale.py\n")
    return d


def remove_own(d: Path) -> None:
    if (d / MARKER).is_file():
        shutil.rmtree(d)


def same_tensors(a: Path, b: Path) -> dict:
    """Whether two GGUFs hold the same tensors: names, types and shapes from the tables, then the data compared
    tensor by tensor (memory-mapped, 64 MB at a time), and which tensors differ if any."""
    import numpy as np
    from gguf import GGUFReader
    ta, tb = ({t.name: t for t in GGUFReader(p).tensors} for p in (a, b))
    differ = sorted(set(ta) ^ set(tb))
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            differ.append(name)
            continue
        u, v = np.asarray(x.data).reshape(-1).view(np.uint8), np.asarray(y.data).reshape(-1).view(np.uint8)
        step = 64 << 20
        if any(not np.array_equal(u[i:i + step], v[i:i + step]) for i in range(0, u.size, step)):
            differ.append(name)
    return {"tensors": len(ta), "differ": differ[:20], "n_differ": len(differ)}


# --- report ----------------------------------------------------------------------------------------------------

def write_markdown(res: dict, path: Path) -> None:
    lines = ["# Scale: every verb on Qwen3.5 shapes (random bf16 weights, released layout)", "",
             f"Runs started {res['started']}, {res['machine']}; each shape's heading names the quantgate commit it "
             "ran at. Peak RSS: the largest process of each verb's child (the CLI, or llama.cpp's worker/quantizer), "
             "getrusage; it includes pages of files the process mapped. Goals (issue 25): export and quantize "
             "peak <= 1.5 x largest tensor + 1.5 GB; the PyTorch verbs (analyze, eval of the directory, the KLD "
             "reference) <= the largest block in fp32 + 3 GB; ONNX quantize, whose input is the fp32 export, <= 1.5 x "
             "that export's largest tensor (twice the stored one) + 1.5 GB.", ""]
    res = {**res, "shapes": dict(sorted(res["shapes"].items(), key=lambda kv: kv[1]["checkpoint"]["params"]))}
    for name, s in res["shapes"].items():
        c = s["checkpoint"]
        goal = 1.5 * c["largest_tensor_bytes"] + 1.5e9
        lines += [f"## {name}: {c['params'] / 1e9:.2f} B parameters (text model), {c['stored_bytes'] / GB:.1f} GB "
                  f"stored, largest tensor {c['largest_tensor_bytes'] / GB:.2f} GB"
                  + (f" (quantgate {s['commit']})" if s.get("commit") else ""), "",
                  "| verb | result | wall s | peak RSS GB | goal GB | verdict |", "|---|---|---|---|---|---|"]
        for label, v in s["verbs"].items():
            torch_verb = label.startswith(("analyze (torch)", "eval (torch", "eval KLD"))
            bounded = label.startswith(("export gguf", "export onnx", "quantize", "llama.cpp convert")) or \
                (torch_verb and "largest_block_fp32_bytes" in c)
            g = c["largest_block_fp32_bytes"] + 3e9 if torch_verb and bounded else goal
            if label.startswith("quantize onnx"):  # its input is the fp32 export: its largest tensor is twice as large
                g = 1.5 * 2 * c["largest_tensor_bytes"] + 1.5e9
            ok = "" if not bounded or v["rc"] else ("met" if v["peak_rss"] <= g else
                                                    f"missed by {(v['peak_rss'] - g) / GB:.2f} GB")
            ok = f"(the converter, for comparison: {ok})" if ok and label.startswith("llama.cpp") else ok
            what = "ok" if v["rc"] == 0 else f"exit {v['rc']}: {(v['error_line'] or '').removeprefix('error: ')[:110]}"
            label = label + (f" ({v['commit']})" if v.get("commit") and v["commit"] != s.get("commit") else "")
            lines.append(f"| {label} | {what} | {v['seconds']:.1f} | {v['peak_rss'] / GB:.2f} | "
                         f"{g / GB:.2f} | {ok} |" if bounded else
                         f"| {label} | {what} | {v['seconds']:.1f} | {v['peak_rss'] / GB:.2f} | | |")
        sizes = [f"{k.replace('_bytes', '')} {s[k] / GB:.2f} GB" for k in ("ours_gguf_bytes", "ref_gguf_bytes", "q4_bytes", "onnx_bytes", "onnx_int4_bytes")
                 if k in s]
        lines += ["", "Files: " + ", ".join(sizes) + "." if sizes else "", ""]
        eq = s.get("equal_to_converter")
        if eq:
            lines += [f"quantgate's BF16 GGUF against llama.cpp's converter: {eq['tensors']} tensors, "
                      + ("every one the same name, type, shape and bytes." if not eq["n_differ"] else
                         f"{eq['n_differ']} differ ({', '.join(eq['differ'][:5])})."), ""]
    lines += time_lines(res)
    path.write_text("\n".join(lines) + "\n")


def time_lines(res: dict) -> list[str]:
    """Wall time against parameters for the verbs that touch every weight: a least-squares line (seconds =
    fixed + per-B x B parameters) and its largest residual, which says whether time is linear in parameters."""
    import numpy as np
    out = ["## Time against parameters (dense shapes; a MoE's many small expert tensors are not on the same line)", "",
           "| verb | s per B parameters (slope) | fixed s (intercept) | largest residual s | shapes |", "|---|---|---|---|---|"]
    for label in ("export gguf bf16", "llama.cpp convert_hf_to_gguf.py bf16", "quantize Q4_K_M (llama.cpp)"):
        pts = [(s["checkpoint"]["params"] / 1e9, s["verbs"][label]["seconds"]) for s in res["shapes"].values()
               if label in s["verbs"] and s["verbs"][label]["rc"] == 0 and not s["checkpoint"].get("moe")]
        if len(pts) < 3:
            continue
        x, y = np.array(pts).T
        slope, icpt = np.polyfit(x, y, 1)
        resid = np.abs(y - (slope * x + icpt)).max()
        out.append(f"| {label} | {slope:.1f} | {icpt:.1f} | {resid:.1f} | {len(pts)} |")
    return out + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen35-0.8b,qwen35-2b,qwen35-4b,qwen35-9b")
    ap.add_argument("--work", default=None, help="folder for the checkpoints and files (needs ~45 GB for 9B)")
    ap.add_argument("--llama-cpp-src", default=None)
    ap.add_argument("--out", default=str(RESULTS / "scale.json"))
    ap.add_argument("--markdown-only", action="store_true")
    ap.add_argument("--verbs", choices=("all", "onnx"), default="all",
                    help="onnx: only the ONNX verbs, kept beside each shape's other results (implies --merge)")
    ap.add_argument("--merge", action="store_true", help="keep the other shapes of an existing --out; rerun these")
    args = ap.parse_args()
    out = Path(args.out)
    if args.markdown_only:
        write_markdown(json.loads(out.read_text()), out.with_suffix(".md"))
        return
    if out.exists() and not args.merge:  # replace only a result of this script
        try:
            ours = "shapes" in json.loads(out.read_text()) and out.suffix == ".json"
        except (OSError, ValueError):
            ours = False
        if not ours:
            sys.exit(f"{out} exists and is not a result of benchmarks/scale.py: choose another --out")
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"unknown shape {unknown[0]}; choose from {', '.join(SHAPES)}")
    work = Path(args.work or tempfile.mkdtemp(prefix="quantgate-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    tree = llama_cpp_tree(work, args.llama_cpp_src)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    mem = next((int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal:")), 0)
    res = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
           "machine": f"{os.cpu_count()} cores, {mem / 2**30:.0f} GiB, {platform.machine()}", "shapes": {}}
    if args.verbs == "onnx":
        args.merge = True
    if args.merge and out.is_file():  # each shape records the commit it ran at
        old = json.loads(out.read_text())
        res["shapes"] = {k: v for k, v in old["shapes"].items() if k not in shapes or args.verbs == "onnx"}
        res["started"] = f"{old['started']}; {res['started']}"

    def save():
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(res, indent=2) + "\n")
        tmp.replace(out)
        write_markdown(res, out.with_suffix(".md"))

    for name in shapes:
        run_shape(name, work, tree, res, save, args.verbs)
    if not args.work:  # the temporary folder made above, with the sdist tree fetched into it
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
