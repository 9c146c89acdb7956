"""--executor ray (quantgate.executor) on a real local Ray cluster: a head and a second node, each its own raylet
process on this machine. The allocator's probes give the local run's numbers; a worker node killed mid-run leaves the
run to end on the head with the same numbers and nothing behind; no cluster to join is one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import randomize_, run_cli

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'quantgate[ray]')")


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker = c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c, worker
    c.shutdown()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    from quantgate.export.gguf import export_checkpoint
    from quantgate.formats import save_checkpoint
    from quantgate.model import build_model, preset
    from quantgate.tokenizer import byte_tokenizer
    d = tmp_path_factory.mktemp("ray")
    m = build_model(preset("tiny", vocab_size=300, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                           n_layers=1, tie_embeddings=False), seed=2).eval()
    randomize_(m, 2, std=0.08)
    save_checkpoint(m, d / "m", byte_tokenizer())
    export_checkpoint(d / "m", d / "m.gguf", "f32")
    return d / "m.gguf"


ARGS = ("--target-bpw", "5", "--sensitivity", "measured", "--types", "Q4_K,Q6_K", "--decode-floor", "none",
        "--calib-windows", "2", "--ctx", "32", "--json")


def _sens(r) -> dict:
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)["sensitivity"]


def test_measured_probes_on_two_nodes_give_the_local_numbers(cluster, small_gguf, tmp_path):
    c, _worker = cluster
    local = _sens(run_cli("quantize", small_gguf, *ARGS, "--out", tmp_path / "l.gguf",
                          env={"QUANTGATE_CACHE": str(tmp_path / "c1")}))
    on_ray = _sens(run_cli("quantize", small_gguf, *ARGS, "--executor", "ray", "--out", tmp_path / "r.gguf",
                           env={"QUANTGATE_CACHE": str(tmp_path / "c2"), "RAY_ADDRESS": c.address}))
    assert on_ray["base_kld"] == pytest.approx(local["base_kld"], rel=1e-6)
    for n, d in local["delta"].items():
        for t, v in d.items():
            assert on_ray["delta"][n][t] == pytest.approx(v, rel=1e-6, abs=1e-12), (n, t)
    assert json.loads((tmp_path / "r.gguf.allocation.json").read_text())["types"] == \
        json.loads((tmp_path / "l.gguf.allocation.json").read_text())["types"]
    assert not list(tmp_path.glob(".quantgate-*"))


def test_a_worker_node_killed_mid_run_still_ends_with_every_probe(cluster, small_gguf, tmp_path):
    c, worker = cluster
    env = {**os.environ, "QUANTGATE_CACHE": str(tmp_path / "c"), "RAY_ADDRESS": c.address, "QUANTGATE_PROGRESS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "quantgate.cli", "quantize", str(small_gguf), *ARGS, "--executor",
                             "ray", "--out", str(tmp_path / "k.gguf")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    time.sleep(12)  # the probes under way on both nodes
    assert proc.poll() is None, "the run ended before the node could be killed"
    c.remove_node(worker)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    got = json.loads(out)["sensitivity"]
    local = _sens(run_cli("quantize", small_gguf, *ARGS, "--out", tmp_path / "l.gguf",
                          env={"QUANTGATE_CACHE": str(tmp_path / "c1")}))
    for n, d in local["delta"].items():
        for t, v in d.items():
            assert got["delta"][n][t] == pytest.approx(v, rel=1e-6, abs=1e-12), (n, t)
    assert not list(tmp_path.glob(".quantgate-*"))
    c.add_node(num_cpus=1)  # the module's other tests get their second node back


@pytest.mark.parametrize("env, needle", [({"RAY_ADDRESS": ""}, "needs RAY_ADDRESS"),
                                         ({"RAY_ADDRESS": "127.0.0.1:1"}, "no Ray cluster answers")])
def test_no_cluster_to_join_is_one_line_and_writes_nothing(small_gguf, tmp_path, env, needle):
    r = run_cli("quantize", small_gguf, *ARGS, "--executor", "ray", "--out", tmp_path / "x.gguf", env=env)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    assert not list(tmp_path.iterdir())
