"""`quantgate demo` reuses its trained twins only when they were trained by the same recipe and gate."""
from __future__ import annotations

import pytest

from quantgate.demo import _retire, _trained_by
from quantgate.errors import QuantgateError
from quantgate.fsio import claim_folder
from quantgate.train import TrainConfig, train


def _tc(**kw) -> TrainConfig:
    base = dict(preset="tiny", twins=True, gate="elementwise", byte_tokenizer=True, max_chars=200_000, batch_size=2,
                ctx=32, warmup=1, steps=3, threads=1, ckpt_every=3, log_every=1)
    return TrainConfig(**{**base, **kw})


def test_stage_reuse_follows_the_recorded_recipe_and_gate(tmp_path):
    out = claim_folder(tmp_path / "demo", "demo")
    assert _trained_by(out, _tc()) == "none"
    train(_tc(), out)
    assert _trained_by(out, _tc()) == "models"  # same recipe, same gate: reused
    assert _trained_by(out, _tc(gate="headwise")) == "other"  # another gate: trained again
    assert _trained_by(out, _tc(lr=1e-3)) == "other"  # another recipe: trained again
    assert _trained_by(out, _tc(steps=4)) == "other"
    (out / "notes.txt").write_text("the user's")
    _retire(out)  # removes the train stage's own outputs, nothing else
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "quantgate.json"]
    assert _trained_by(out, _tc()) == "none"


def test_an_interrupted_run_of_the_same_recipe_resumes_and_a_foreign_folder_is_never_removed(tmp_path):
    out = claim_folder(tmp_path / "demo", "demo")
    train(_tc(), out)
    import shutil
    shutil.rmtree(out / "gated")  # as if training had been interrupted before the models were written
    shutil.rmtree(out / "baseline")
    assert _trained_by(out, _tc()) == "state"
    (out / "gated").mkdir()
    (out / "gated" / "thesis.tex").write_text("mine")
    assert _trained_by(out, _tc()) == "other"
    with pytest.raises(QuantgateError, match="was not written by quantgate"):
        _retire(out)
    assert (out / "gated" / "thesis.tex").read_text() == "mine" and (out / "state" / "run.json").is_file()
