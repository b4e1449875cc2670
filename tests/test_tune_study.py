"""The tuner on a small synthetic trace with a deterministic fake timer: optimum, constraints,
resume from storage, profile export."""

from __future__ import annotations

import json

import optuna
import pytest
import torch

from louver_sgl import LouverConfig, PageIndexStore
from louver_eval.data.paged import paged_batch
from louver_sgl.decode import louver_decode
from louver_sgl.profiles import Profile
from louver_tuning.cli import main as cli_main
from louver_tuning.confirm import confirm_best
from louver_tuning.cpu import CpuTarget
from louver_tuning.space import build_space
from louver_tuning.study import RunOptions, TuneSettings, run_tune, study_profile
from louver_tuning.validate import ConstraintViolation, check_step

LENGTH, H_Q, H_KV, D = 1024, 4, 2, 32
SETTINGS = TuneSettings(cases=(f"{LENGTH}x1", f"{LENGTH}x2"), text="synthetic", layers=(0,),
                        validation=(f"{LENGTH}x2",), validation_text="synthetic", space="small", repeats=1, warmup=0)
# Fake latency factors; the optimum of the small space is page 64, 8-bit, 16-page chunks, 1 thread.
PAGE_MS = {32: 1.5, 64: 1.0, 128: 1.2}
BITS_MS = {4: 1.1, 8: 1.0}
CHUNK_MS = {16: 1.0, 64: 1.05, 256: 1.3}


def synthetic_trace(text: str, length: int) -> dict:
    """A trace dict shaped like captured ones: keys/values ``[N, H_kv, D]`` fp16, queries ``[4, H_q, D]``."""
    gen = torch.Generator().manual_seed(length)
    keys = torch.randn(length, H_KV, D, generator=gen)
    keys[..., :4] += 4 * torch.randn(length, H_KV, 1, generator=gen)  # a few strong directions
    queries = torch.randn(4, H_Q, D, generator=gen)
    queries[..., :4] *= 3
    meta = {"length": length, "head_dim": D, "num_heads": H_Q, "num_kv_heads": H_KV, "softmax_scale": D ** -0.5}
    return {"keys": {0: keys.half()}, "values": {0: torch.randn(length, H_KV, D, generator=gen).half()},
            "queries": {0: queries}, "query_positions": torch.arange(length - 4, length), "meta": meta}


def fake_timer(step, point) -> float:
    """Deterministic latency of the point; also runs the step once (so broken steps still break)."""
    step()
    batch = int(point.case.split("x")[1].split("/")[0])
    threads = 1.0 if point.launch["num_threads"] == 1 else 1.4
    return (batch * PAGE_MS[point.config.page_size] * BITS_MS[point.config.grid_bits]
            * CHUNK_MS[point.launch["chunk_pages"]] * threads)


class BrokenTarget(CpuTarget):
    """Breaks a constraint for some points: page 32 reports a certified bound of eps; page 128
    returns a wrong output."""

    def make_step(self, batch, store, config, launch):
        step = super().make_step(batch, store, config, launch)

        def broken():
            out, stats = step()
            if config.page_size == 32:
                stats.mass_bound.fill_(config.eps)
            if config.page_size == 128:
                out = out + 1.0
            return out, stats
        return broken


def tune(tmp_path, target=None, sampler="grid", trials=50, name="s", settings=SETTINGS, threads=(1,)):
    target = target or CpuTarget(repeats=1, warmup=0)
    space = build_space(target.launch_space(), LENGTH, "small").restrict({"num_threads": list(threads)})
    return run_tune(target, settings, RunOptions(trials=trials, sampler=sampler, progress=False),
                    f"sqlite:///{tmp_path}/t.db", name, synthetic_trace, fake_timer, space)


def test_grid_finds_known_optimum(tmp_path):
    study = tune(tmp_path, threads=(1, 2))
    assert len(study.trials) == 3 * 2 * 3 * 2  # the whole grid, each point once
    best = study.best_trial.params
    assert (best["page_size"], best["grid_bits"], best["chunk_pages"], best["num_threads"]) == (64, 8, 16, 1)
    assert study.best_value == pytest.approx(2 ** 0.5)  # geometric mean of batch 1 and 2 at factor 1


def test_tpe_starts_with_defaults_and_finds_optimum(tmp_path):
    study = tune(tmp_path, sampler="tpe", trials=16)
    first = study.trials[0]
    assert first.user_attrs["role"] == "defaults"
    assert (first.params["page_size"], first.params["grid_bits"], first.params["chunk_pages"]) == (64, 8, 64)
    assert study.best_value == pytest.approx(2 ** 0.5)


def test_violating_trials_are_rejected(tmp_path):
    study = tune(tmp_path, target=BrokenTarget(repeats=1, warmup=0))
    failed = study.get_trials(states=(optuna.trial.TrialState.FAIL,))
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert {t.params["page_size"] for t in failed} == {32, 128}
    assert {t.params["page_size"] for t in complete} == {64}
    assert all("certified bound" in t.user_attrs["rejected"] for t in failed if t.params["page_size"] == 32)
    assert all("output error" in t.user_attrs["rejected"] for t in failed if t.params["page_size"] == 128)


def test_hopeless_trials_are_pruned(tmp_path):
    slow = lambda step, point: 10.0 if point.config.page_size == 32 else fake_timer(step, point)
    target = CpuTarget(repeats=1, warmup=0)
    space = build_space(target.launch_space(), LENGTH, "small").restrict({"num_threads": [1]})
    study = run_tune(target, SETTINGS, RunOptions(trials=50, sampler="grid", progress=False, prune_ratio=3.0),
                     f"sqlite:///{tmp_path}/t.db", "p", synthetic_trace, slow, space)
    pruned = study.get_trials(states=(optuna.trial.TrialState.PRUNED,))
    # page 32 runs 10 ms at batch 1 (> 3 x 1.0): pruned at the first case once a fast trial completed
    assert pruned and all(t.params["page_size"] == 32 and t.last_step == 0 for t in pruned)


def test_resume_continues_the_same_study(tmp_path):
    tune(tmp_path, sampler="tpe", trials=3, name="r")
    study = tune(tmp_path, sampler="tpe", trials=2, name="r")
    assert len(study.trials) == 5
    assert sum(t.user_attrs.get("role") == "defaults" for t in study.trials) == 1
    with pytest.raises(ValueError, match="other settings"):
        tune(tmp_path, sampler="tpe", trials=1, name="r", settings=TuneSettings(**{**SETTINGS.__dict__, "eps": 1e-2}))


def test_a_budget_study_holds_the_certified_only_knobs():
    from louver_tuning.space import policy_space

    target = CpuTarget()
    space = build_space(target.launch_space(), 1 << 15, "full")
    held = policy_space(space, "budget", target.default_launch())
    for name in ("certified_passes", "certified_rule", "one_scan"):
        assert len(held.distributions[name].choices) == 1 < len(space.distributions[name].choices)
    assert held.held({"certified_passes": 1, "one_scan": False, "page_size": 32}) == {
        "certified_passes": LouverConfig().certified_passes, "one_scan": True, "page_size": 32}
    assert policy_space(space, "certified", target.default_launch()) is space


def test_journal_storage(tmp_path):
    target = CpuTarget(repeats=1, warmup=0)
    space = build_space(target.launch_space(), LENGTH, "small").restrict({"num_threads": [1], "page_size": [64]})
    for _ in range(2):
        study = run_tune(target, SETTINGS, RunOptions(trials=2, sampler="tpe", progress=False),
                         f"journal:{tmp_path}/j.log", "j", synthetic_trace, fake_timer, space)
    assert len(study.trials) == 4


def test_export_writes_a_valid_profile(tmp_path, capsys):
    study = tune(tmp_path, sampler="grid", name="e")
    profile = study_profile(study, set(CpuTarget().launch_space()))
    assert profile.config["page_size"] == 64
    assert profile.launch == {"chunk_pages": 16, "num_threads": 1, "one_scan": True, "residual_weights": False}
    assert (profile.shapes.head_dim, profile.shapes.num_q_heads, profile.shapes.num_kv_heads) == (D, H_Q, H_KV)
    assert profile.shapes.context_lengths == (LENGTH,) and profile.shapes.batch_sizes == (1, 2)
    out = tmp_path / "p.json"
    assert cli_main(["export", "--storage", f"sqlite:///{tmp_path}/t.db", "--study-name", "e", "--out", str(out),
                    "--confirm-top", "0"]) == 0
    loaded = Profile.load(out)
    assert loaded.to_dict()["config"] == dict(profile.config)
    assert (tmp_path / "p.history.png").stat().st_size > 0
    assert cli_main(["show", "--storage", f"sqlite:///{tmp_path}/t.db", "--study-name", "e"]) == 0
    assert "importance" in capsys.readouterr().out
    # --report-dir: the plots and the results table go there, none beside the profile
    reports, shipped = tmp_path / "reports", tmp_path / "shipped"
    assert cli_main(["export", "--storage", f"sqlite:///{tmp_path}/t.db", "--study-name", "e", "--out-dir",
                     str(shipped), "--report-dir", str(reports), "--confirm-top", "0"]) == 0
    (written,) = shipped.iterdir()
    assert written.suffix == ".json"
    assert (reports / f"{written.stem}.history.png").stat().st_size > 0
    assert (reports / f"{written.stem}.results.txt").read_text().strip()
    assert json.loads(out.read_text())["measured"]["trials"]["complete"] == 18


def test_export_under_another_policy_adds_a_section(tmp_path, capsys):
    """A budget study exported where the device's certified profile lies becomes its budget
    section; ``--replace`` writes the budget profile whole instead."""
    tune(tmp_path, sampler="grid", name="c")
    tune(tmp_path, sampler="grid", name="b",
         settings=TuneSettings(**{**SETTINGS.__dict__, "policy": "budget", "budget": 0.05}))
    out, db = tmp_path / "p.json", f"sqlite:///{tmp_path}/t.db"
    export = ["export", "--storage", db, "--out", str(out), "--confirm-top", "0"]
    assert cli_main([*export, "--study-name", "c"]) == 0
    assert cli_main([*export, "--study-name", "b"]) == 0
    assert "'budget' section" in capsys.readouterr().out
    assert (tmp_path / "p.budget.results.txt").read_text().strip()  # beside the certified study's reports
    assert (tmp_path / "p.results.txt").is_file()
    merged = Profile.load(out)
    assert merged.shapes.policy == "certified" and set(merged.policies) == {"budget"}
    assert not {"certified_passes", "certified_rule", "one_scan"} & {*merged.policies["budget"]["config"],
                                                                    *merged.policies["budget"]["launch"]}
    assert merged.policies["budget"]["measured"]["study_name"] == "b"
    assert merged.policies["budget"]["measured"]["settings"]["budget"] == 0.05  # the fraction it was tuned at
    assert "budget" not in merged.measured["settings"]  # a certified study's objective has none
    assert cli_main([*export, "--study-name", "b", "--replace"]) == 0
    replaced = Profile.load(out)
    assert replaced.shapes.policy == "budget" and not replaced.policies


def test_check_step_catches_false_negatives(monkeypatch):
    """A broken index (token bounds of -inf) misses keys above T: the validator must say so."""
    config = LouverConfig(eps=1e-3)
    pb = paged_batch(synthetic_trace("synthetic", LENGTH), 0, 2, config.page_size)
    store = PageIndexStore(config, len(pb.k) // config.page_size, H_KV, D, pb.k.dtype)
    store.build_pages(pb.k, torch.arange(store.num_pages))
    out, stats = louver_decode(pb.q, pb.k, pb.v, pb.page_table, pb.seq_lens, store, pb.sigma)
    check_step(pb, store, config, out, stats)  # the real index passes
    broken = lambda pages: torch.full((len(pages), config.page_size, H_KV, H_Q // H_KV), float("-inf"))
    monkeypatch.setattr(store, "token_bounds", lambda bounds, pages: broken(pages))  # the fp32 bounds
    monkeypatch.setattr("louver_tuning.validate.int8_token_bounds_reference",  # the compiled kernels' int8 ones
                        lambda weights, offset, codes, bits, residual=False, weight_rule=None: broken(codes))
    stats.dense_fallback.zero_()
    with pytest.raises(ConstraintViolation, match="false negatives"):
        check_step(pb, store, config, out, stats)


def test_confirmation_re_times_candidates_and_picks_the_fastest(tmp_path):
    study = tune(tmp_path, sampler="tpe", trials=4, name="c")
    target = CpuTarget(repeats=1, warmup=0)
    result = confirm_best(study, target, set(target.launch_space()), top=2, rounds=2, loader=synthetic_trace)
    assert result["defaults"] == 0 and len(result["timed"]) in (2, 3)
    timed = result["timed"]
    assert result["winner"] == int(min(timed, key=lambda n: timed[n]["geomean_ms"]))
    profile = study_profile(study, set(target.launch_space()), result)
    assert profile.measured["tuned"]["trial"] == result["winner"]
    assert profile.measured["speedup_vs_defaults"] == pytest.approx(
        timed["0"]["geomean_ms"] / timed[str(result["winner"])]["geomean_ms"])


def test_quick_space_is_narrowed_around_its_seed_and_holds_it():
    """The quick study's space: grid family, the seed's page size and neighbours, chunk sizes
    within 4x, sink/recent within one, the dtype-dependent knobs fixed to the seed's."""
    from optuna.distributions import CategoricalDistribution

    from louver_tuning.quick import quick_space
    from louver_tuning.space import contains

    launch = {"chunk_pages": CategoricalDistribution([8, 16, 32, 64, 128, 256]),
              "num_threads": CategoricalDistribution([1, 2, 3, 4])}
    seed = {"page_size": 128, "family": "grid", "grid_bits": 4, "sink_pages": 0, "recent_pages": 4,
            "min_sparse_tokens": 1024, "dense_fallback_fraction": 1.0, "chunk_pages": 64, "num_threads": 2}
    space = quick_space(launch, seed)
    choices = {k: list(d.choices) for k, d in space.distributions.items() if isinstance(d, CategoricalDistribution)}
    assert all(contains(space.distributions[k], v) for k, v in seed.items())
    assert choices["family"] == ["grid"] and choices["page_size"] == [64, 128]
    assert choices["sink_pages"] == [0, 1] and choices["recent_pages"] == [3, 4]
    assert choices["chunk_pages"] == [16, 32, 64, 128, 256] and choices["num_threads"] == [2, 4]
    assert choices["min_sparse_tokens"] == [1024] and choices["dense_fallback_fraction"] == [1.0]


def test_the_estimate_share_is_searched_under_the_a_posteriori_rule_only():
    from louver_sgl.profiles.format import CERTIFIED_ONLY, policy_values

    space = build_space(CpuTarget().launch_space(), 1 << 15, "small")
    assert LouverConfig().certified_rule == "histogram" and "estimate_share" not in space.grid()
    grid = space.restrict({"certified_rule": ["a_posteriori"]}).grid()
    assert grid["estimate_share"] == [1.0, 2.0, 3.0, 4.0, 6.0, 8.0]
    assert LouverConfig().estimate_share in grid["estimate_share"]
    assert "estimate_share" in CERTIFIED_ONLY
    assert policy_values({"estimate_share": 4.0, "page_size": 64}, "budget") == {"page_size": 64}
