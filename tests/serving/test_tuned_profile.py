"""``louver-tune`` output used by a server: a tiny real CPU tuning run (fp32 KV, one 2K case, one
layer, two trials) exports a profile into a directory, and an ``sglang.Engine`` on SmolLM2 with
``LOUVER_PROFILE_DIR`` pointing there finds it by itself (this device's key, the served dtype):
its startup log says it loaded that file and the statistics file records the same line."""

from __future__ import annotations

import json

from louver_eval.data.capture import ensure_traces
from louver_eval.data.fetch_model import ensure_model
from louver_sgl.profiles import Profile
from louver_tuning.cli import main as cli_main


def test_tuned_profile_is_loaded_by_an_engine(tmp_path, capfd, monkeypatch):
    ensure_traces([2048], text="bible")
    ensure_traces([2048], text="paul_graham")
    out = tmp_path / "profiles"
    args = ["tune", "--target", "cpu", "--storage", f"sqlite:///{tmp_path}/tune.db", "--study-name", "tiny",
            "--cases", "2048x1", "--layers", "21", "--validation", "2048x1", "--kv-dtype", "float32",
            "--trials", "2", "--repeats", "1", "--warmup", "0", "--export", str(out), "--confirm-top", "0"]
    assert cli_main(args) == 0
    (path,) = out.glob("cpu_*.float32.json")
    profile = Profile.load(path)
    assert profile.shapes.kv_dtype == "float32"
    capfd.readouterr()  # the tuning run's output
    stats = tmp_path / "stats.json"
    monkeypatch.setenv("LOUVER_PROFILE_DIR", str(out))
    monkeypatch.setenv("LOUVER_STATS_FILE", str(stats))
    monkeypatch.delenv("LOUVER_PROFILE", raising=False)
    import sglang as sgl

    engine = sgl.Engine(model_path=str(ensure_model()), device="cpu", attention_backend="louver", dtype="float32",
                        max_total_tokens=4096, disable_overlap_schedule=True, log_level="info")
    try:
        result = engine.generate("The tuned profile is", {"temperature": 0, "max_new_tokens": 4})
    finally:
        engine.shutdown()
    assert result["meta_info"]["completion_tokens"] == 4
    line = f"louver: using tuned profile {path}"
    captured = capfd.readouterr()
    assert line in captured.out + captured.err, "the Engine did not log loading the profile"
    assert json.loads(stats.read_text())["profile"].startswith(line)
