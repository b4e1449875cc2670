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
