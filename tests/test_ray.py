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
def _cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    yield c
    c.shutdown()


@pytest.fixture
def cluster(_cluster):
    """The module's cluster with a live second node: a test that killed the last one does not hand the next a
    handle to a node that is gone."""
    workers = list(_cluster.worker_nodes)
    worker = workers[0] if workers else _cluster.add_node(num_cpus=1)
    _cluster.wait_for_nodes()
    return _cluster, worker


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


@pytest.mark.slow  # a real two-node cluster: minutes
def test_probes_on_two_nodes_with_one_killed_mid_run_give_the_local_numbers(cluster, small_gguf, tmp_path):
    """The measured probes as Ray tasks on a head and a second node, the second node killed while they run: the run
    ends on the head with every probe, each the local run's number, the same types and no scratch left behind."""
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
    assert got["base_kld"] == pytest.approx(local["base_kld"], rel=1e-6)
    for n, d in local["delta"].items():
        for t, v in d.items():
            assert got["delta"][n][t] == pytest.approx(v, rel=1e-6, abs=1e-12), (n, t)
    assert json.loads((tmp_path / "k.gguf.allocation.json").read_text())["types"] == \
        json.loads((tmp_path / "l.gguf.allocation.json").read_text())["types"]
    assert not list(tmp_path.glob(".quantgate-*"))


@pytest.mark.parametrize("env, needle", [({"RAY_ADDRESS": ""}, "needs RAY_ADDRESS"),
                                         ({"RAY_ADDRESS": "127.0.0.1:1"}, "no Ray cluster answers")])
def test_no_cluster_to_join_is_one_line_and_writes_nothing(small_gguf, tmp_path, env, needle):
    r = run_cli("quantize", small_gguf, *ARGS, "--executor", "ray", "--out", tmp_path / "x.gguf", env=env)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    assert not list(tmp_path.iterdir())


REPORT = ("--backends", "torch,gguf", "--schemes", "torch:w4a16-g32,gguf:Q4_0,gguf:Q8_0", "--windows", "4", "--ctx",
          "64", "--calib-windows", "2")


def _report(d, out, env, *extra):
    r = run_cli("report", "--models", d / "baseline", d / "gated", "--data", d / "text.txt", *REPORT, *extra,
                "--out", out, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


ACCURACY = ("kld_mean", "top1_agreement", "delta_ppl_pct", "ppl", "bits_per_weight")


@pytest.mark.slow  # a real two-node cluster: minutes
def test_a_report_on_two_nodes_gives_the_local_numbers_and_survives_a_node_killed_mid_run(cluster, tmp_path):
    """2 twins x 4 cells (torch fp32 and w4a16-g32, GGUF Q4_0 and Q8_0) locally, then on the two-node cluster with
    the worker node killed while its cells run: every cell still there, every accuracy number within 1e-6 of the
    local one, the speed columns timed on one node, named, and no partial artifact."""
    from conftest import save_tiny_twins
    c, worker = cluster
    d = save_tiny_twins(tmp_path / "w")
    local = _report(d, tmp_path / "local", {"QUANTGATE_CACHE": str(tmp_path / "c1")})
    assert len(local["cells"]) == 8 and local["executor"]["name"] == "local"
    env = {**os.environ, "QUANTGATE_CACHE": str(tmp_path / "c3"), "RAY_ADDRESS": c.address, "QUANTGATE_PROGRESS": "0"}
    args = [sys.executable, "-m", "quantgate.cli", "report", "--models", str(d / "baseline"), str(d / "gated"),
            "--data", str(d / "text.txt"), *REPORT, "--executor", "ray", "--out", str(tmp_path / "killed")]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline and not list((tmp_path / "killed" / "artifacts").glob("gguf/*F32.gguf")):
        time.sleep(1)  # the cells' tasks start once the exports exist
    time.sleep(3)
    assert proc.poll() is None, "the report ended before the node could be killed"
    c.remove_node(worker)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    killed = json.loads((tmp_path / "killed" / "report.json").read_text())
    assert set(killed["cells"]) == set(local["cells"])
    for name, cell in local["cells"].items():
        for k in ACCURACY:
            if k in cell:
                assert killed["cells"][name][k] == pytest.approx(cell[k], rel=1e-6, abs=1e-12), (name, k)
        assert ("decode_tps" in cell) == ("decode_tps" in killed["cells"][name]), name
    ex = killed["executor"]  # two nodes when the cells started; the speed columns timed on the head, still alive
    assert ex["name"] == "ray" and len(ex["nodes"]) == 2, ex
    assert [n for n in ex["nodes_at_end"] if n.endswith(ex["speed_node"][:8])], ex
    keys = json.loads((tmp_path / "killed" / "artifacts" / "keys.json").read_text())
    assert set(keys) == set(killed["artifacts"]) and all((tmp_path / "killed" / "artifacts" / k).exists() for k in keys)
