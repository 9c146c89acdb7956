"""CUDA paths that CI's CPU machines cannot run: they skip without a GPU and must pass with one."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli, save_tiny_twins

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    d = save_tiny_twins(tmp_path_factory.mktemp("gpu"))
    r = run_cli("quantize", str(d / "gated"), "--scheme", "w8a8-static", "--calib-data", str(d / "text.txt"),
                "--calib-windows", "2", "--ctx", "64", "--out", str(d / "q"))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("export", "gguf", str(d / "gated"), "--out", str(d / "g.gguf"))
    assert r.returncode == 0, r.stderr[-2000:]
    return d


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_eval_of_a_torch_quantized_checkpoint_on_cuda_with_its_reference(twins, tmp_path, device):
    """The per-layer SQNR runs the float reference beside the CUDA model: both on the same device."""
    args = ["eval", str(twins / "q"), "--data", str(twins / "text.txt"), "--ctx", "64", "--max-windows", "4",
            "--reference", str(twins / "gated"), "--json"]
    env = {"QUANTGATE_CACHE": str(tmp_path / "cache")}
    cuda, cpu = run_cli(*args, "--device", device, env=env), run_cli(*args, env=env)
    assert cuda.returncode == 0 and cpu.returncode == 0, cuda.stderr[-2000:]
    a, b = json.loads(cuda.stdout), json.loads(cpu.stdout)
    assert a["device"] == device and a["layer_sqnr_db"] and abs(a["ppl"] - b["ppl"]) / b["ppl"] < 1e-3


def test_gguf_on_cuda_offloads_or_refuses_and_never_records_a_device_that_did_not_run(twins):
    import llama_cpp
    args = ["eval", str(twins / "g.gguf"), "--data", str(twins / "text.txt"), "--ctx", "64", "--max-windows", "2",
            "--json"]
    r = run_cli(*args, "--device", "cuda")
    if llama_cpp.llama_supports_gpu_offload():
        cpu = json.loads(run_cli(*args).stdout)
        assert r.returncode == 0 and json.loads(r.stdout)["device"] == "cuda", r.stderr[-2000:]
        assert abs(json.loads(r.stdout)["ppl"] - cpu["ppl"]) / cpu["ppl"] < 1e-2
    else:
        assert r.returncode == 2 and "no GPU backend" in r.stderr


def test_a_cuda_index_that_does_not_exist_is_refused(twins):
    r = run_cli("eval", str(twins / "gated"), "--data", str(twins / "text.txt"), "--ctx", "64", "--device",
                f"cuda:{torch.cuda.device_count()}")
    assert r.returncode == 2 and "CUDA device(s)" in r.stderr
