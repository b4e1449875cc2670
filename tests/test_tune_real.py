"""A short real CPU tuning run (wall-clock timer) on a captured 2K-token trace, through the CLI."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from louver_eval.data.capture import ensure_traces
from louver_sgl.profiles import Profile
from louver_tuning.cli import main as cli_main


def test_short_cpu_tuning_run(tmp_path, capsys):
    ensure_traces([2048], text="bible")
    ensure_traces([2048], text="paul_graham")
    storage = f"sqlite:///{tmp_path}/tune.db"
    args = ["tune", "--target", "cpu", "--storage", storage, "--study-name", "ci", "--cases", "2048x1", "2048x2",
            "--layers", "21", "--validation", "2048x1", "--trials", "4", "--repeats", "2", "--export", str(tmp_path),
            "--confirm-top", "2", "--confirm-rounds", "1"]
    assert cli_main(args) == 0
    study = optuna.load_study(storage=storage, study_name="ci")
    assert len(study.trials) == 4 and study.trials[0].user_attrs["role"] == "defaults"
    # the real index and kernel never break a hard constraint: no trial is rejected
    assert not study.get_trials(states=(TrialState.FAIL,))
    (path,) = tmp_path.glob("cpu_*.json")
    profile = Profile.load(path)
    assert profile.target == "cpu" and profile.shapes.num_q_heads == 9 and profile.shapes.head_dim == 64
    assert profile.measured["defaults"]["case_ms"].keys() == {"2048x1", "2048x2"}
    assert profile.measured["confirmation"]["winner"] == profile.measured["tuned"]["trial"]
    assert (tmp_path / f"{path.stem}.history.png").is_file()
    assert cli_main(["list"]) == 0


def test_quick_run_seeds_from_the_nearest_profile_and_lands_where_the_backend_looks(tmp_path, capsys, monkeypatch):
    """``tune --quick`` on a 2K trace (its own cases are 16K): the first trial is the profile the
    backend would run here now, every trial stays in the narrowed space, and the profile goes to
    the user profile directory, where the backend's selection then finds it as this device's."""
    import louver_sgl
    from louver_sgl.profiles import Shapes, select_profile

    ensure_traces([2048], text="bible")
    ensure_traces([2048], text="paul_graham")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LOUVER_PROFILE_DIR", raising=False)
    monkeypatch.delenv("LOUVER_PROFILE", raising=False)
    storage = f"sqlite:///{tmp_path}/quick.db"
    args = ["tune", "--quick", "--target", "cpu", "--storage", storage, "--study-name", "q", "--cases", "2048x1",
            "--layers", "21", "--validation", "2048x1", "--kv-dtype", "bfloat16", "--trials", "3", "--repeats", "1",
            "--confirm-rounds", "1"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "quick: seeded from" in out
    study = optuna.load_study(storage=storage, study_name="q")
    seed = study.trials[0]
    assert seed.user_attrs["role"] == "nearest" and seed.params["family"] == "grid"
    assert all(t.params["family"] == "grid" for t in study.trials)
    (path,) = (tmp_path / "home" / "louver_sgl" / "profiles").glob("cpu_*.bfloat16.json")
    profile = Profile.load(path)
    assert "nearest" in profile.measured and "speedup_vs_nearest" in profile.measured
    selection = select_profile("cpu", Shapes(64, 9, 3, "bfloat16"), louver_sgl.__version__)
    assert selection.kind == "exact" and str(path) in selection.message
