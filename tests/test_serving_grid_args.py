"""The serving grid's and one_batch runner's argument handling (no server is started)."""

import json

import pytest

from benchmarks.serving import one_batch_cpu
from benchmarks.serving.serving_grid_cpu import CONFIGS, DEFAULT_CONFIGS, prompt_count, workload_args
from louver_sgl.serving.options import load_options


def test_prompt_count_default_and_override():
    assert prompt_count(1, None) == 2
    assert prompt_count(4, None) == 4
    assert prompt_count(1, 1) == 1


def test_workload_args_pass_the_prompt_count():
    random = workload_args("random", 32768, 1, 64, 1)
    assert random[random.index("--num-prompts") + 1] == "1"
    assert random[random.index("--random-input-len") + 1] == "32768"
    shared = workload_args("shared-prefix", 8192, 4, 64, 4)
    assert shared[shared.index("--gsp-prompts-per-group") + 1] == "4"
    assert shared[shared.index("--gsp-system-prompt-len") + 1] == str(8192 - 100)


def test_workload_args_refuse_fewer_prompts_than_concurrency():
    with pytest.raises(ValueError, match="cannot keep 4 requests"):
        workload_args("random", 8192, 4, 64, 2)
    with pytest.raises(ValueError, match="unknown workload"):
        workload_args("sharegpt", 8192, 1, 64, 2)


def test_one_batch_rows_from_its_result_file(tmp_path, monkeypatch):
    """one_batch's jsonl results become rows; a failed run is an error, not an empty result."""
    calls = []

    def fake_run(cmd, stdout, stderr, timeout, env):
        calls.append(cmd)
        out = cmd[cmd.index("--result-filename") + 1]
        with open(out, "a") as f:
            for n in (1024, 4096):
                f.write(json.dumps({"batch_size": 1, "input_len": n, "output_len": 32, "prefill_latency": 1.5,
                                    "prefill_throughput": n / 1.5, "median_decode_latency": 0.2,
                                    "median_decode_throughput": 5.0, "total_latency": 8.0}) + "\n")

        class Done:
            returncode = 0
        return Done()

    monkeypatch.setattr(one_batch_cpu.subprocess, "run", fake_run)
    rows = one_batch_cpu.one_batch(tmp_path / "model", "budget-0.05", [1024, 4096], 32, tmp_path / "log")
    assert [r["input_len"] for r in rows] == [1024, 4096]
    assert rows[1]["decode_median_s"] == 0.2 and rows[1]["policy"] == "budget-0.05"
    assert rows[1]["warmup_input_len"] == 1024
    cmd = calls[0]
    assert cmd[cmd.index("--attention-backend") + 1] == "louver" and "--json-model-override-args" not in cmd

    class Failed:
        returncode = 3
    monkeypatch.setattr(one_batch_cpu.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(RuntimeError, match="exited 3"):
        one_batch_cpu.one_batch(tmp_path / "model", "torch_native", [1024, 16384], 32, tmp_path / "log")


def test_a_refused_request_fails_the_row():
    """A prompt past the context comes back at once, counted as completed with TTFT 0."""
    from benchmarks.serving.serving_grid_cpu import check_requests

    good = {"completed": 2, "ttfts": [50.0, 2.0], "output_lens": [64, 64], "errors": ["", ""]}
    check_requests(good, 2, 64)
    refused = {"completed": 1, "ttfts": [0.0], "output_lens": [64], "errors": [""]}
    with pytest.raises(RuntimeError, match="bench_serving row failed"):
        check_requests(refused, 1, 64)
    with pytest.raises(RuntimeError, match="want 64"):
        check_requests({**good, "output_lens": [64, 1]}, 2, 64)
    with pytest.raises(RuntimeError):
        check_requests({**good, "errors": ["", "HTTP 400"]}, 2, 64)


def test_every_configuration_environment_is_a_valid_louver_option_set():
    """A misspelt LOUVER_* variable would fail the server at startup, an hour into a grid."""
    assert set(DEFAULT_CONFIGS) <= set(CONFIGS)
    assert "budget-0.05-native-extend" not in DEFAULT_CONFIGS  # a TTFT control, run on request
    for name, (backend, policy, env) in CONFIGS.items():
        assert (backend == "louver") == (policy is not None), name
        load_options(env)  # parses and validates every value
    config, serving = load_options(CONFIGS["budget-0.05-native-extend"][2])
    assert serving.extend_backend == "torch_native" and config.budget == 0.05


@pytest.mark.parametrize("module", ["benchmarks.serving.serving_grid_cpu", "benchmarks.serving.one_batch_cpu"])
def test_lengths_past_the_context_are_refused_before_any_run(module, monkeypatch, capsys):
    """32,768 input tokens plus 64 output do not fit the 32K context: an error at once, not an
    hour later from the server."""
    import importlib
    import sys

    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, "ensure_model", lambda: pytest.fail("the model was fetched before the check"))
    monkeypatch.setattr(sys, "argv", [module, "--input-lens", "8192", "32768", "--output-len", "64"])
    with pytest.raises(SystemExit):
        mod.main()
    assert "YaRN context" in capsys.readouterr().err


def test_long_context_args_only_past_the_native_context():
    """Within SmolLM2's 8K no override; past it the YaRN stretch and the raised watchdog; past
    32K an error (the server would refuse the request)."""
    from louver_eval.server import LONG_PREFILL_ARGS, YARN_32K_ARGS, long_context_args

    assert long_context_args(8192) == []
    assert long_context_args(8193) == YARN_32K_ARGS + LONG_PREFILL_ARGS
    assert long_context_args(32768) == YARN_32K_ARGS + LONG_PREFILL_ARGS
    with pytest.raises(ValueError, match="YaRN context"):
        long_context_args(32769)


@pytest.mark.parametrize("rerun", [False, True])
def test_rerun_replaces_a_row_instead_of_skipping_it(rerun, tmp_path, monkeypatch):
    """Without --rerun a row the file holds is skipped; with it the new measurement replaces the
    old row (one row per key, never two)."""
    import sys

    from benchmarks.serving import serving_grid_cpu as grid

    out = tmp_path / "rows.json"
    old = {"config": "torch_native", "workload": "random", "input_len": 8192, "concurrency": 1, "mean_itl_ms": 1.0}
    out.write_text(json.dumps({"rows": [old]}))
    calls = []

    def fake_run_config(name, cells, model, output_len, num_prompts, done, save, log_dir):
        calls.append(done)
        if (name, *cells[0]) not in done:
            save({**old, "mean_itl_ms": 2.0})

    monkeypatch.setattr(grid, "run_config", fake_run_config)
    monkeypatch.setattr(grid, "ensure_model", lambda: tmp_path)
    argv = ["grid", "--configs", "torch_native", "--input-lens", "8192", "--concurrency", "1",
            "--workloads", "random", "--out", str(out)] + (["--rerun"] if rerun else [])
    monkeypatch.setattr(sys, "argv", argv)
    grid.main()
    rows = json.loads(out.read_text())["rows"]
    assert len(calls) == 1 and len(rows) == 1
    assert rows[0]["mean_itl_ms"] == (2.0 if rerun else 1.0)
