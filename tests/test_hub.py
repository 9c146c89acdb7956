"""Hugging Face repo ids as model arguments: resolved from a local cache built here (the network is never
touched: HF_HUB_OFFLINE=1), refused in one line when offline and not cached; a local folder of that name wins."""
from __future__ import annotations

import shutil

import pytest

from conftest import dir_snapshot, run_cli
from quantgate.errors import QuantgateError
from quantgate.formats import load_checkpoint, save_checkpoint
from quantgate.formats.hub import is_hub_id
from quantgate.model import build_model, hybrid, preset
from quantgate.tokenizer import byte_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding acme/tiny-hybrid (our saved hybrid, as snapshot COMMIT of main)."""
    save_checkpoint(build_model(hybrid(preset("tiny", vocab_size=300, n_layers=4, gate="elementwise"))),
                    tmp_path / "src", byte_tokenizer())
    repo = tmp_path / "hub" / "models--acme--tiny-hybrid"
    shutil.copytree(tmp_path / "src", repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def test_a_cached_repo_id_loads_offline(cache, tmp_path):
    loaded = load_checkpoint("acme/tiny-hybrid")
    assert loaded.layout == "qwen3_5" and COMMIT in str(loaded.path)
    r = run_cli("info", "acme/tiny-hybrid", env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}, fresh=True)
    assert r.returncode == 0 and "qwen3_5" in r.stdout, r.stderr[-1500:]


def test_an_uncached_repo_id_offline_is_one_line_and_writes_nothing(cache, tmp_path):
    with pytest.raises(QuantgateError, match="HF_HUB_OFFLINE"):
        load_checkpoint("acme/absent")
    before = dir_snapshot(tmp_path)
    r = run_cli("export", "gguf", "acme/absent", "--out", str(tmp_path / "x.gguf"),
                env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}, fresh=True)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "not in" in lines[0] and "HF_HUB_OFFLINE" in lines[0], r.stderr
    assert dir_snapshot(tmp_path) == before


def test_a_local_folder_of_that_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("acme/tiny") and not is_hub_id("acme/tiny.gguf") and not is_hub_id("./acme/tiny")
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    assert not is_hub_id("acme/tiny")


@pytest.mark.parametrize("name", ["acme/bad--name", "acme/name.", "acme/x-", "acme/a..b"])
def test_a_repo_id_the_hub_rejects_is_one_line(cache, tmp_path, name):
    with pytest.raises(QuantgateError, match="not a repo id the Hugging Face Hub accepts"):
        load_checkpoint(name)
    r = run_cli("info", name, env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}, cwd=tmp_path, fresh=True)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Hub accepts" in lines[0], r.stderr
