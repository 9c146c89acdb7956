"""Training: seeded runs are bit-identical, --resume after kill -9 continues the same trajectory,
two gloo processes under torchrun match one process, and the log/outputs are what the CLI promises."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli
from quantgate.formats import load_checkpoint
from quantgate.train import TrainConfig, lr_at, train

TINY = ["--preset", "tiny", "--byte-tokenizer", "--max-chars", "300000", "--batch-size", "4", "--ctx", "64",
        "--warmup", "3", "--threads", "1"]


def tiny_config(**kw) -> TrainConfig:
    base = dict(preset="tiny", byte_tokenizer=True, max_chars=300_000, batch_size=4, ctx=64, warmup=3,
                steps=8, threads=1, ckpt_every=4, log_every=2)
    return TrainConfig(**{**base, **kw})


def tensors(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


def assert_same_weights(a: Path, b: Path, exact: bool = True, atol: float = 0.0):
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        if exact:
            assert torch.equal(ta[k], tb[k]), k
        else:
            assert torch.allclose(ta[k], tb[k], atol=atol, rtol=0), (k, (ta[k] - tb[k]).abs().max())


def test_seeded_twin_runs_are_bit_identical(tmp_path):
    a = train(tiny_config(twins=True), tmp_path / "a")
    b = train(tiny_config(twins=True), tmp_path / "b")
    assert set(a) == {"baseline", "gated"}
    for role in a:
        assert_same_weights(a[role], b[role])
    c = train(tiny_config(twins=True, seed=1), tmp_path / "c")
    assert not torch.equal(tensors(a["gated"])["model.embed_tokens.weight"],
                           tensors(c["gated"])["model.embed_tokens.weight"])
    log = json.loads((tmp_path / "a" / "state" / "train_log.json").read_text())
    assert [e["step"] for e in log] == [2, 4, 6, 8]
    assert set(log[-1]["loss"]) == {"baseline", "gated"} and log[-1]["tokens_per_s"] > 0
    assert load_checkpoint(a["gated"]).layout == "qwen3_next" and load_checkpoint(a["baseline"]).layout == "qwen3"


def test_twins_learn_and_start_from_the_same_loss(tmp_path):
    out = train(tiny_config(twins=True, steps=30, log_every=1, lr=3e-3), tmp_path / "r")
    log = json.loads((tmp_path / "r" / "state" / "train_log.json").read_text())
    first, last = log[0]["loss"], log[-1]["loss"]
    # same init, same batch: the sigmoid(.)~0.5 gate is the only difference at step 1
    assert abs(first["baseline"] - first["gated"]) < 0.05
    assert last["baseline"] < first["baseline"] - 0.5 and last["gated"] < first["gated"] - 0.5
    assert set(out) == {"baseline", "gated"}


def test_lr_schedule():
    tc = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_frac=0.1)
    assert lr_at(0, tc) == pytest.approx(0.1) and lr_at(9, tc) == pytest.approx(1.0)
    assert lr_at(10, tc) == pytest.approx(1.0) and lr_at(100, tc) == pytest.approx(0.1)
    assert lr_at(55, tc) == pytest.approx(0.55)


@pytest.mark.slow
def test_resume_after_kill_9_continues_the_same_trajectory(tmp_path):
    args = ["train", *TINY, "--twins", "--steps", "120", "--ckpt-every", "10"]
    ref = run_cli(*args, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    run = tmp_path / "run"
    env = {**os.environ, "QUANTGATE_PROGRESS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "quantgate.cli", *args, "--out", str(run)],
                            cwd=tempfile.gettempdir(), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state = run / "state" / "train_state.pt"
    deadline = time.time() + 300
    while not state.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "training finished before it could be killed"
    assert not (run / "gated").exists()
    killed_at = torch.load(state, weights_only=True)["step"]
    assert 10 <= killed_at < 120
    again = run_cli(*args, "--out", str(run))
    assert again.returncode != 0 and "--resume" in again.stderr
    res = run_cli(*args, "--out", str(run), "--resume")
    assert res.returncode == 0, res.stderr
    for role in ("baseline", "gated"):
        assert_same_weights(tmp_path / "ref" / role, run / role)
    log_ref = json.loads((tmp_path / "ref" / "state" / "train_log.json").read_text())
    log_run = json.loads((run / "state" / "train_log.json").read_text())
    assert [e["loss"] for e in log_ref] == [e["loss"] for e in log_run]


def test_resume_without_state_is_an_error(tmp_path):
    r = run_cli("train", *TINY, "--steps", "2", "--out", str(tmp_path / "none"), "--resume")
    assert r.returncode == 2 and "no training state" in r.stderr


@pytest.mark.slow
def test_two_gloo_processes_match_one(tmp_path):
    common = [*TINY, "--gate", "headwise", "--steps", "6", "--ckpt-every", "6"]
    single = run_cli("train", *common, "--out", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr
    env = {**os.environ, "QUANTGATE_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "quantgate.cli", "train", *common, "--out", str(tmp_path / "two")],
                         cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True, timeout=600)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    run = json.loads((tmp_path / "two" / "state" / "run.json").read_text())
    assert run["world_size"] == 2
    # same global batch, gradients averaged over ranks: equal up to float reduction order
    assert_same_weights(tmp_path / "one" / "gated", tmp_path / "two" / "gated", exact=False, atol=1e-4)
    log1 = json.loads((tmp_path / "one" / "state" / "train_log.json").read_text())
    log2 = json.loads((tmp_path / "two" / "state" / "train_log.json").read_text())
    assert log1[-1]["loss"]["gated"] == pytest.approx(log2[-1]["loss"]["gated"], abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_training_learns(tmp_path):
    out = train(tiny_config(twins=True, steps=30, device="cuda", threads=None, log_every=1), tmp_path / "g")
    log = json.loads((tmp_path / "g" / "state" / "train_log.json").read_text())
    assert log[-1]["loss"]["gated"] < log[0]["loss"]["gated"] - 0.5
    assert load_checkpoint(out["gated"]).model.embed_tokens.weight.dtype == torch.float32


def test_resume_refuses_changed_settings(tmp_path):
    from quantgate.errors import QuantgateError
    train(tiny_config(steps=4), tmp_path / "r")
    with pytest.raises(QuantgateError, match="--lr"):
        train(tiny_config(steps=6, lr=1e-2), tmp_path / "r", resume=True)
    longer = train(tiny_config(steps=6, threads=2), tmp_path / "r", resume=True)  # more steps, other threads: fine
    log = json.loads((tmp_path / "r" / "state" / "train_log.json").read_text())
    assert log[-1]["step"] == 6 and (longer["gated"] / "config.json").is_file()


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path):
    eager = train(tiny_config(twins=True, steps=10), tmp_path / "e")
    compiled = train(tiny_config(twins=True, steps=10, compile=True), tmp_path / "c")
    for role in eager:
        assert_same_weights(eager[role], compiled[role], exact=False, atol=1e-5)


@pytest.mark.slow  # ~30 s: training, saving and re-running hybrid twins end to end
def test_hybrid_twins_train_save_as_qwen3_5_and_run(tmp_path):
    """`train --arch hybrid --twins`: both twins learn, are written in the qwen3_5 layout (the baseline as zero
    gate rows, read back gate-free), eval and generate run on them, and an export option hybrids cannot take
    (the hand-built GroupQueryAttention graph) is refused in one line."""
    r = run_cli("train", *TINY, "--arch", "hybrid", "--twins", "--steps", "30", "--lr", "3e-3",
                "--out", str(tmp_path / "h"))
    assert r.returncode == 0, r.stderr[-2000:]
    log = json.loads((tmp_path / "h" / "state" / "train_log.json").read_text())
    first, last = log[0]["loss"], log[-1]["loss"]
    assert last["baseline"] < first["baseline"] - 0.5 and last["gated"] < first["gated"] - 0.5
    base, gated = load_checkpoint(tmp_path / "h" / "baseline"), load_checkpoint(tmp_path / "h" / "gated")
    assert (base.layout, gated.layout) == ("qwen3_5", "qwen3_5")
    assert (base.model.cfg.gate, gated.model.cfg.gate) == ("none", "elementwise")
    assert base.model.cfg.layer_types == ("linear_attention", "full_attention")  # tiny: 2 layers, the last full
    assert base.model.cfg.extra["train_config"]["arch"] == "hybrid"
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 100)
    r = run_cli("eval", str(tmp_path / "h" / "gated"), "--data", str(text), "--ctx", "32", "--max-windows", "2",
                "--reference", str(tmp_path / "h" / "baseline"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ppl"] > 1, r.stderr[-1500:]
    r = run_cli("generate", str(tmp_path / "h" / "gated"), "--prompt", "def", "--max-tokens", "5")
    assert r.returncode == 0, r.stderr[-1500:]
    r = run_cli("export", "onnx", str(tmp_path / "h" / "gated"), "--dtype", "fp16", "--out", str(tmp_path / "g-onnx"))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "hybrid" in r.stderr
    assert not (tmp_path / "g-onnx").exists()
