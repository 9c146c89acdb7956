"""Shared fixtures: tiny random HF checkpoints, a byte tokenizer, and paths to ../shared data."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
SHARED_DATA = SHARED / "data"


def shared_file(*parts: str) -> Path:
    p = SHARED_DATA.joinpath(*parts)
    if not p.is_file():
        pytest.skip(f"{p} is absent (../shared/data ships with the project's workspace, not with user clones)")
    return p


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> None:
    """Give every parameter (norm weights too) random values so conversions are really exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g) if "norm" in name and p.mean() > 0.5
                        else 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


TINY_HF = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
               max_position_embeddings=256, rope_theta=10000.0, bos_token_id=0, eos_token_id=1)


def make_hf_qwen3(tie: bool = False, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(**TINY_HF, tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(seed)
    m = Qwen3ForCausalLM(cfg).eval()
    randomize_(m, seed)
    return m


def make_hf_qwen3_next(partial_rotary: float = 1.0, tie: bool = False, seed: int = 0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    L = TINY_HF["num_hidden_layers"]
    cfg = Qwen3NextConfig(**TINY_HF, tie_word_embeddings=tie, partial_rotary_factor=partial_rotary,
                          layer_types=["full_attention"] * L, mlp_only_layers=list(range(L)),
                          attn_implementation="eager")
    torch.manual_seed(seed)
    m = Qwen3NextForCausalLM(cfg).eval()
    randomize_(m, seed)
    return m


def transformers5_python() -> str | None:
    """This interpreter, when it holds transformers >= 5.2 (Qwen3.5; the test venv does): the reference scripts
    that take a transformers-5 interpreter (QUANTGATE_TF5_PYTHON) then run in it."""
    try:
        from importlib.metadata import version
        major, minor = (int(x) for x in version("transformers").split(".")[:2])
    except Exception:  # not installed, or an unparsable version
        return None
    return sys.executable if (major, minor) >= (5, 2) else None


def rel_err(a, b) -> float:
    a, b = (torch.as_tensor(x).detach().double() for x in (a, b))
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture
def byte_tok():
    from quantgate.tokenizer import byte_tokenizer
    return byte_tokenizer()


_SERVER = None  # this pytest process's CLI server (tests/cli_server.py), started by the first run_cli


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600, env: dict | None = None, fresh: bool = False):
    """Run the installed `quantgate` command; returns CompletedProcess (returncode -N when signal N killed it).

    By default the command runs in a child forked from the CLI server, which imported quantgate.cli once: the same
    `main` on the same argv, its own process, exit code and output, without ~2 s of interpreter start-up and
    imports per command (the default test step runs several hundred). `fresh=True` starts a new interpreter, for
    what a fork would not show: signals sent to a process group, environment read when a library is imported
    (huggingface_hub, OpenMP), a process's own peak memory."""
    e = {**os.environ, "QUANTGATE_PROGRESS": "0", **(env or {})}
    where = str(cwd or tempfile.gettempdir())  # away from the repository: `python -m` would import the source tree
    argv = [str(a) for a in args]
    if fresh:
        return subprocess.run([sys.executable, "-m", "quantgate.cli", *argv], capture_output=True, text=True,
                              cwd=where, timeout=timeout, env=e)
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        from cli_server import CliServer
        _SERVER = CliServer()
    r = _SERVER.run(*argv, timeout=timeout, cwd=where, env=e)
    if r.timeout:
        raise subprocess.TimeoutExpired([sys.executable, "-m", "quantgate.cli", *argv], timeout, r.stdout, r.stderr)
    code = r.code if r.code is not None else -(r.signal or 1)
    return subprocess.CompletedProcess(["quantgate", *argv], code, r.stdout, r.stderr)


@pytest.fixture(scope="session", autouse=True)
def _close_cli_server():
    yield
    if _SERVER is not None:
        _SERVER.close()


def save_tiny_twins(d: Path, text_name: str = "text.txt") -> Path:
    """Tiny baseline/gated twins (head_dim 32, so llama.cpp's quantized KV cache takes them) with a byte
    tokenizer, saved under d/baseline and d/gated beside a short code text: the bad-input tests' inputs."""
    from quantgate.formats import save_checkpoint
    from quantgate.model import make_twins, preset
    from quantgate.tokenizer import byte_tokenizer
    b, g = make_twins(preset("tiny", vocab_size=300, head_dim=32), "elementwise", seed=0)
    save_checkpoint(b, d / "baseline", byte_tokenizer())
    save_checkpoint(g, d / "gated", byte_tokenizer())
    (d / text_name).write_text("def f(x):\n    return x * 2\n" * 400)
    return d


def save_k_quant_model(d: Path):
    """A gated model whose rows are multiples of 256 (llama.cpp's k-quants take every tensor, no fallback
    types), saved under d/m with a byte tokenizer and exported as the F32 d/m.gguf. Returns the model."""
    from quantgate.formats import save_checkpoint
    from quantgate.export.gguf import export_checkpoint
    from quantgate.model import build_model, preset
    from quantgate.tokenizer import byte_tokenizer
    cfg = preset("tiny", vocab_size=300, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                 gate="elementwise")
    m = build_model(cfg, seed=1).eval()
    randomize_(m, 1, std=0.06)
    save_checkpoint(m, d / "m", byte_tokenizer())
    export_checkpoint(d / "m", d / "m.gguf")
    return m


def export_gated_twin(d: Path) -> Path:
    """The gated twin under d/gated exported through the CLI as d/g.gguf and d/onnx (the sweeps' GGUF and ONNX
    inputs)."""
    for verb in (["gguf", "--out", str(d / "g.gguf")], ["onnx", "--out", str(d / "onnx")]):
        r = run_cli("export", verb[0], str(d / "gated"), *verb[1:])
        assert r.returncode == 0, r.stderr[-2000:]
    return d


def dir_snapshot(path: Path) -> dict:
    """{relative path: (size, mtime_ns)} for every file below path: to show nothing was written or changed."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


BOS_CH, CONST_CH = 63, 62  # embedding channels used by planted models: BOS marker, constant in every token


def plant_bos_spike(model, spike_layer: int, spike_channel: int, marker: int = BOS_CH, strength: float = 50.0):
    """Hand-set weights: channel `marker` of the embedding is 1 on BOS and 0 elsewhere, nothing writes to it,
    and one MLP unit of `spike_layer` reads it and writes a massive value into `spike_channel`, on BOS only."""
    bos = model.cfg.bos_id
    with torch.no_grad():
        E = model.embed_tokens.weight
        E[:, marker] = 0.0
        E[bos, marker] = 1.0
        for layer in model.layers:
            layer.self_attn.o_proj.weight[marker] = 0.0
            layer.mlp.down_proj.weight[marker] = 0.0
        mlp = model.layers[spike_layer].mlp
        mlp.gate_proj.weight[0].zero_(); mlp.gate_proj.weight[0, marker] = strength
        mlp.up_proj.weight[0].zero_(); mlp.up_proj.weight[0, marker] = strength
        mlp.down_proj.weight[:, 0] = 0.0; mlp.down_proj.weight[spike_channel, 0] = 1.0
    return model


@pytest.fixture(scope="session")
def cli_server(tmp_path_factory):
    """A CLI server (tests/cli_server.py): the real `quantgate` entry point, forked per command from one process
    that imported it once; for sweeps of hundreds of commands."""
    from cli_server import CliServer
    server = CliServer(env={"QUANTGATE_CACHE": str(tmp_path_factory.mktemp("cli-cache"))})
    yield server
    server.close()


def assert_refused(r, needle: str | None = None) -> str:
    """The bad-input contract: exit 2, one `error:` line (naming `needle`), no traceback, no crash, no hang."""
    assert not r.timeout and r.signal is None, (r.args, r.signal, r.stderr[-2000:])
    assert r.code == 2 and len(r.lines) == 1, (r.args, r.code, r.stderr[-2000:])
    assert r.lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr[-2000:]
    if needle is not None:
        assert needle in r.lines[0], (needle, r.lines[0])
    return r.lines[0]


def tree_snapshot(path: Path) -> dict:
    """{relative path: bytes digest} of every file and folder below `path` (folders as None): equal snapshots
    mean nothing was created, removed or changed."""
    import hashlib
    out = {}
    for p in sorted(path.rglob("*")):
        out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
    return out


def save_random_models(d: Path, models: dict) -> Path:
    """Each make() of `models` randomized (seed 5) and saved under d/name with a byte tokenizer, beside a short code
    text d/t.txt: the layer-by-layer tests' inputs."""
    from quantgate.formats import save_checkpoint
    from quantgate.tokenizer import byte_tokenizer
    (d / "t.txt").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(300)))
    for name, make in models.items():
        m = make().eval()
        randomize_(m, 5)
        save_checkpoint(m, d / name, byte_tokenizer())
    return d


@contextlib.contextmanager
def small_filesystem(where, size: str):
    """A real tmpfs of `size` mounted at `where` (root only): a disk that really fills."""
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]}): needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
