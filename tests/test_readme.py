"""The README's set-up commands are the ones CI runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("python3 -m venv")]
    assert len(ci_lines) == 1
    assert ci_lines[0] in readme.splitlines()
    assert any("quantgate demo" in ln and ln.startswith("python3 -m venv") for ln in readme.splitlines())


def test_the_readme_states_the_demos_window_counts():
    """The set-up paragraph's window counts are the ones `quantgate demo` uses (issue 26)."""
    from quantgate.demo import DEMO_EVAL_WINDOWS, DEMO_WINDOWS, FAST_WINDOWS
    setup = (ROOT / "README.md").read_text().split("## Set up", 1)[1].split("```", 1)[0]
    assert f"{DEMO_EVAL_WINDOWS} held-out windows per twin" in " ".join(setup.split())
    assert f"{DEMO_WINDOWS} held-out windows per cell; `--fast`: {FAST_WINDOWS} for both" in " ".join(setup.split())
