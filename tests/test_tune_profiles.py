"""Profiles: file format, validation, selection at startup, and how options resolve over them."""

from __future__ import annotations

import json

import pytest
import torch

import louver_sgl
from louver_sgl import LouverConfig
from louver_sgl.profiles import (DTYPE_DEPENDENT, SHIPPED_DIR, Profile, ProfileError, Shapes, cpu_isa_level,
                                 derive_generic, load_generic, normalize_device_name, profile_key, select_profile)
from louver_sgl.profiles.launch import cpu_threads
from louver_sgl.profiles.select import profile_file_names
from louver_sgl.serving.options import resolve_options

SHAPES = Shapes(64, 9, 3, "float16", (8192,), (1,))
DEVICE = "Test CPU 9000 avx512"


def profile_dict(**changes):
    data = {"target": "cpu", "device_name": DEVICE, "louver_version": louver_sgl.__version__,
            "config": {"page_size": 32, "grid_bits": 4, "sink_pages": 2},
            "launch": {"chunk_pages": 16, "num_threads": 1},
            "shapes": {"head_dim": 64, "num_q_heads": 9, "num_kv_heads": 3, "kv_dtype": "float16",
                       "context_lengths": [8192], "batch_sizes": [1]},
            "measured": {"speedup_vs_defaults": 1.2}}
    data.update(changes)
    return data


def write(tmp_path, data, name=None) -> str:
    path = tmp_path / (name or f"{profile_key('cpu', DEVICE)}.json")
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_device_keys():
    assert normalize_device_name("NVIDIA H200") == "nvidia_h200"
    assert normalize_device_name("NVIDIA GeForce RTX 4090 (24GB)") == "nvidia_geforce_rtx_4090_24gb"
    assert profile_key("cpu", "AMD EPYC avx512") == "cpu_amd_epyc_avx512"
    assert cpu_isa_level({"avx", "avx2", "avx512f"}) == "avx512"
    assert cpu_isa_level({"avx", "avx2"}) == "avx2"
    with pytest.raises(ValueError, match="no letters"):
        normalize_device_name("  --  ")


def test_round_trip(tmp_path):
    profile = Profile.from_dict(profile_dict())
    loaded = Profile.load(profile.write(tmp_path / "p.json"))
    assert loaded.to_dict() == profile.to_dict()
    assert loaded.shapes == SHAPES


@pytest.mark.parametrize("data, message", [
    (profile_dict(config={"eps": 1e-2}), "accuracy knobs"),
    (profile_dict(config={"policy": "dense"}), "accuracy knobs"),
    (profile_dict(config={"page_size": 48}), "invalid config.*page_size"),
    (profile_dict(config={"pagesize": 32}), "unknown config keys"),
    (profile_dict(launch={"chunk_pages": "64"}), "launch.chunk_pages"),
    (profile_dict(target="tpu"), "target must be"),
    (profile_dict(extra=1), "unknown keys"),
    ({"target": "cpu"}, "missing keys"),
    (profile_dict(shapes={"head_dim": 64, "num_q_heads": 9, "num_kv_heads": 2, "kv_dtype": "float16"}), "multiple"),
    (profile_dict(shapes={"head_dim": 64, "num_q_heads": 9, "num_kv_heads": 3, "kv_dtype": "fp8"}), "kv_dtype"),
])
def test_malformed_profiles_are_rejected(tmp_path, data, message):
    with pytest.raises(ProfileError, match=message):
        Profile.load(write(tmp_path, data))


BUDGET_SECTION = {"config": {"grid_bits": 8, "page_size": 64}, "launch": {"chunk_pages": 64},
                  "measured": {"eps": None, "speedup_vs_defaults": 1.1}}


@pytest.mark.parametrize("policies, message", [
    ({"sparse": BUDGET_SECTION}, "section for 'sparse'"),
    ({"budget": {"config": {"eps": 1e-2}}}, "accuracy knobs"),
    ({"budget": {"config": {"page_size": 48}}}, r"policies.budget.*invalid config"),
    ({"budget": {"launch": {"chunk_pages": "64"}}}, "launch.chunk_pages"),
    ({"budget": {"config": {}, "extra": {}}}, "keys among"),
    ({"budget": {"config": [1]}}, "must be JSON objects"),
    ([BUDGET_SECTION], "policies must be a JSON object"),
])
def test_malformed_policy_sections_are_rejected(tmp_path, policies, message):
    with pytest.raises(ProfileError, match=message):
        Profile.load(write(tmp_path, profile_dict(policies=policies)))


def test_the_served_policys_section_applies_over_the_main_values(tmp_path):
    """A profile tuned under certified with a budget section: a budget server takes the section's
    values (over the main ones it does not set), a certified one the main values; the user's
    options still win over both, and the log line names the section."""
    path = write(tmp_path, profile_dict(policies={"budget": BUDGET_SECTION}))
    assert Profile.load(path).to_dict()["policies"] == {"budget": BUDGET_SECTION}
    config, serving, selection = resolve_options("cpu", SHAPES, {"LOUVER_PROFILE": path}, DEVICE)
    assert (config.policy, config.page_size, config.grid_bits, serving.chunk_pages) == ("certified", 32, 4, 16)
    assert "section" not in selection.message
    env = {"LOUVER_PROFILE": path, "LOUVER_POLICY": "budget"}
    config, serving, selection = resolve_options("cpu", SHAPES, env, DEVICE)
    assert (config.page_size, config.grid_bits, config.sink_pages) == (64, 8, 2)
    assert (serving.chunk_pages, serving.num_threads) == (64, 1)
    assert "'budget' section" in selection.message
    cfg = tmp_path / "louver.json"
    cfg.write_text(json.dumps({"policy": "budget", "page_size": 128}))
    config, _, _ = resolve_options("cpu", SHAPES, {"LOUVER_PROFILE": path, "LOUVER_CONFIG": str(cfg)}, DEVICE)
    assert (config.policy, config.page_size, config.grid_bits) == ("budget", 128, 8)


def test_a_study_under_another_policy_becomes_a_section_of_the_device_profile():
    from louver_sgl.profiles.format import merge_tuned

    certified = Profile.from_dict(profile_dict())
    budget_shapes = {**profile_dict()["shapes"], "policy": "budget", "eps": 1e-3}
    budget = Profile.from_dict(profile_dict(config={"grid_bits": 8}, launch={"chunk_pages": 64}, shapes=budget_shapes))
    merged, done = merge_tuned(certified, budget)
    assert "'budget' section" in done and merged.config == certified.config
    assert merged.policies["budget"]["config"] == {"grid_bits": 8}
    assert merged.policies["budget"]["measured"]["eps"] == 1e-3
    # tuned under certified again: the main values are replaced, the budget section stays
    again = Profile.from_dict(profile_dict(config={"page_size": 64}))
    merged2, done = merge_tuned(merged, again)
    assert merged2.config == {"page_size": 64} and "budget" in merged2.policies and "kept" in done
    # another device's or shapes' profile at the path is replaced whole
    other = Profile.from_dict(profile_dict(device_name="Other CPU avx2"))
    assert merge_tuned(other, budget)[0] is budget
    assert merge_tuned(None, budget)[0] is budget


def test_a_re_tune_keeps_the_hand_set_main_values():
    """A value set by hand (recorded in measured.hand_set) survives a re-tune of the main values
    that did not search it; one the study searched takes the study's value and leaves the record."""
    from louver_sgl.profiles.format import merge_tuned

    record = {"estimate_share_max": 8.0, "chunk_pages": 32, "why": "measured by hand", "date": "2026-12-07"}
    existing = Profile.from_dict(profile_dict(config={"page_size": 32, "estimate_share_max": 8.0},
                                              launch={"chunk_pages": 32, "num_threads": 1},
                                              measured={"hand_set": record}))
    params = {"page_size": 64, "chunk_pages": 16}
    tuned = Profile.from_dict(profile_dict(config={"page_size": 64}, launch={"chunk_pages": 16, "num_threads": 2},
                                           measured={"tuned": {"params": params}}))
    merged, done = merge_tuned(existing, tuned)
    assert merged.config == {"page_size": 64, "estimate_share_max": 8.0}
    assert merged.launch == {"chunk_pages": 16, "num_threads": 2}
    assert merged.measured["hand_set"] == {"estimate_share_max": 8.0, "why": "measured by hand", "date": "2026-12-07"}
    assert merged.measured["tuned"] == {"params": params}
    assert "hand-set ['estimate_share_max'] kept" in done and "['chunk_pages'] dropped" in done
    # nothing set by hand: the study's profile as it is
    plain, done = merge_tuned(Profile.from_dict(profile_dict()), tuned)
    assert plain.config == tuned.config and "hand_set" not in plain.measured and "hand-set" not in done


def test_a_sections_certified_only_knobs_apply_to_certified_servers_only(tmp_path):
    """How a certified step finds T is not a budget study's to set: a budget section's values of
    those knobs never apply, and a budget study exported as a section leaves them out."""
    from louver_sgl.profiles.format import CERTIFIED_ONLY, merge_tuned

    assert {"certified_passes", "certified_rule", "one_scan"} <= set(CERTIFIED_ONLY)
    section = {"config": {"grid_bits": 8, "certified_passes": 1}, "launch": {"one_scan": False}}
    profile = Profile.from_dict(profile_dict(policies={"budget": section, "certified": section}))
    budget = profile.for_policy("budget")
    assert budget.config["grid_bits"] == 8 and "certified_passes" not in budget.config
    assert "one_scan" not in budget.launch
    assert profile.for_policy("certified").config["certified_passes"] == 1
    budget_shapes = {**profile_dict()["shapes"], "policy": "budget"}
    tuned = Profile.from_dict(profile_dict(config={"grid_bits": 8, "certified_rule": "histogram"},
                                           launch={"one_scan": False, "chunk_pages": 64}, shapes=budget_shapes))
    merged, _ = merge_tuned(Profile.from_dict(profile_dict()), tuned)
    assert merged.policies["budget"]["config"] == {"grid_bits": 8}
    assert merged.policies["budget"]["launch"] == {"chunk_pages": 64}


def test_a_profile_without_sections_writes_none():
    assert "policies" not in Profile.from_dict(profile_dict()).to_dict()


def test_corrupt_file_is_rejected(tmp_path):
    with pytest.raises(ProfileError, match="cannot read a JSON object"):
        Profile.load(write(tmp_path, '{"target": "cpu", '))


def test_explicit_profile_applies(tmp_path):
    env = {"LOUVER_PROFILE": write(tmp_path, profile_dict())}
    config, serving, selection = resolve_options("cpu", SHAPES, env, DEVICE)
    assert selection.profile is not None and "LOUVER_PROFILE" in selection.message
    assert (config.page_size, config.grid_bits, config.sink_pages) == (32, 4, 2)
    assert (serving.chunk_pages, serving.num_threads) == (16, 1)
    assert config.policy == "certified" and config.eps == LouverConfig().eps


def test_env_and_config_file_override_the_profile(tmp_path):
    cfg = tmp_path / "louver.json"
    cfg.write_text(json.dumps({"grid_bits": 8, "chunk_pages": 32}))
    env = {"LOUVER_PROFILE": write(tmp_path, profile_dict()), "LOUVER_CONFIG": str(cfg), "LOUVER_SINK_PAGES": "0"}
    config, serving, _ = resolve_options("cpu", SHAPES, env, DEVICE)
    assert (config.page_size, config.grid_bits, config.sink_pages) == (32, 8, 0)
    assert (serving.chunk_pages, serving.num_threads) == (32, 1)


@pytest.mark.parametrize("changes, message", [
    ({"louver_version": "0.0.1"}, "louver_version"),
    ({"target": "cuda"}, "target"),
    ({"shapes": {"head_dim": 128, "num_q_heads": 9, "num_kv_heads": 3, "kv_dtype": "float16"}}, "head_dim"),
    ({"shapes": {"head_dim": 64, "num_q_heads": 9, "num_kv_heads": 3, "kv_dtype": "bfloat16"}}, "kv_dtype"),
    ({"launch": {"block_n": 64}}, "unknown launch parameters"),
])
def test_explicit_mismatched_profile_raises(tmp_path, changes, message):
    env = {"LOUVER_PROFILE": write(tmp_path, profile_dict(**changes))}
    with pytest.raises(ProfileError, match=message):
        resolve_options("cpu", SHAPES, env, DEVICE)


def test_explicit_missing_profile_raises(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        resolve_options("cpu", SHAPES, {"LOUVER_PROFILE": str(tmp_path / "nope.json")}, DEVICE)


def search(tmp_path, **extra) -> dict:
    """An environment whose profile search sees ``tmp_path`` and an empty user directory."""
    return {"LOUVER_PROFILE_DIR": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "home"), **extra}


def test_auto_pick_by_device_key(tmp_path):
    write(tmp_path, profile_dict())
    config, _, selection = resolve_options("cpu", SHAPES, search(tmp_path), DEVICE)
    assert selection.kind == "exact" and "using tuned profile" in selection.message
    assert "tuned for this device, float16 KV" in selection.message
    assert config.page_size == 32


def test_a_profile_tuned_for_the_served_kv_dtype_is_preferred(tmp_path):
    """Beside the device's main (fp16) profile, ``<key>.float32.json`` applies to an fp32 KV pool;
    the fp16 pool keeps the main one."""
    import dataclasses

    fp32_shapes = dict(profile_dict()["shapes"], kv_dtype="float32")
    write(tmp_path, profile_dict())
    write(tmp_path, profile_dict(config={"page_size": 128, "grid_bits": 4}, shapes=fp32_shapes),
          f"{profile_key('cpu', DEVICE)}.float32.json")
    env = search(tmp_path)
    config32, _, selection = resolve_options("cpu", dataclasses.replace(SHAPES, kv_dtype="float32"), env, DEVICE)
    assert config32.page_size == 128 and selection.profile.path.endswith(".float32.json")
    config16, _, _ = resolve_options("cpu", SHAPES, env, DEVICE)
    assert config16.page_size == 32


def test_another_dtype_of_this_device_keeps_its_layout_and_takes_the_generic_dtype_knobs(tmp_path):
    """Level 2: the device's fp16 profile serves an fp32 pool with its index layout and launch;
    where sparse beats dense and when to fall back come from the generic profile of the ISA."""
    import dataclasses

    write(tmp_path, profile_dict(config={"page_size": 32, "grid_bits": 4, "min_sparse_tokens": 65536,
                                         "dense_fallback_fraction": 0.3}))
    generic = load_generic("cpu", "avx512")
    config, serving, selection = resolve_options("cpu", dataclasses.replace(SHAPES, kv_dtype="float32"),
                                                 search(tmp_path), DEVICE)
    assert selection.kind == "other_dtype" and "for float16 KV" in selection.message
    assert "louver-tune tune --quick --kv-dtype float32" in selection.message
    assert (config.page_size, config.grid_bits, serving.chunk_pages, serving.num_threads) == (32, 4, 16, 1)
    for knob in DTYPE_DEPENDENT:
        assert getattr(config, knob) == generic.config[knob]
        assert f"{knob}={generic.config[knob]}" in selection.message
    # a policy section's dtype-dependent knobs were tuned in the other dtype too: the generic ones win
    budget = {"config": {"grid_bits": 8, "min_sparse_tokens": 1024, "dense_fallback_fraction": 0.9}}
    write(tmp_path, profile_dict(config={"page_size": 32, "grid_bits": 4}, policies={"budget": budget}))
    env = {**search(tmp_path), "LOUVER_POLICY": "budget"}
    config, _, _ = resolve_options("cpu", dataclasses.replace(SHAPES, kv_dtype="float32"), env, DEVICE)
    assert config.grid_bits == 8
    for knob in DTYPE_DEPENDENT:
        assert getattr(config, knob) == generic.config[knob]


def test_a_device_without_a_profile_runs_the_generic_profile_of_its_isa(tmp_path):
    """Level 3: no profile of this device (or only one for other attention shapes) -> the generic
    profile of the ISA, and the log line names the command that tunes one."""
    write(tmp_path, profile_dict(shapes={"head_dim": 128, "num_q_heads": 9, "num_kv_heads": 3, "kv_dtype": "float16"}))
    for isa in ("avx512", "avx2"):
        device = DEVICE if isa == "avx512" else "Test CPU 9000 avx2"
        config, serving, selection = resolve_options("cpu", SHAPES, search(tmp_path), device)
        generic = load_generic("cpu", isa)
        assert selection.kind == "generic" and selection.profile == generic
        assert f"generic {isa} profile" in selection.message and "tune --quick --kv-dtype float16" in selection.message
        assert {k: getattr(config, k) for k in generic.config} == dict(generic.config)
        assert serving.num_threads == 0  # the machine's own thread count
    assert "head_dim" in resolve_options("cpu", SHAPES, search(tmp_path), DEVICE)[2].message
    _, _, selection = resolve_options("cpu", SHAPES, search(tmp_path), "Some ARM CPU aarch64")
    assert selection.profile == load_generic("cpu", None) and "generic cpu profile" in selection.message


def test_the_user_profile_directory_is_searched(tmp_path):
    """``louver-tune tune --quick`` writes under $XDG_DATA_HOME/louver_sgl/profiles: found there
    without any variable of louver's."""
    user = tmp_path / "home" / "louver_sgl" / "profiles"
    user.mkdir(parents=True)
    write(user, profile_dict(config={"page_size": 64}))
    config, _, selection = resolve_options("cpu", SHAPES, {"XDG_DATA_HOME": str(tmp_path / "home")}, DEVICE)
    assert selection.kind == "exact" and str(user) in selection.message and config.page_size == 64


@pytest.mark.parametrize("data", [
    profile_dict(louver_version="9.9.9"),
    profile_dict(launch={"block_n": 64}),
    "not json",
])
def test_auto_picked_bad_profile_falls_back_to_the_generic_one(tmp_path, data):
    write(tmp_path, data)
    config, serving, selection = resolve_options("cpu", SHAPES, search(tmp_path), DEVICE)
    assert selection.kind == "generic" and "using the generic avx512 profile" in selection.message
    assert profile_key("cpu", DEVICE) in selection.message  # the rejected file is named
    assert config.page_size == load_generic("cpu", "avx512").config["page_size"]


def test_a_generic_profile_under_a_device_file_name_is_rejected_with_its_reason(tmp_path):
    """A generic-format profile (no shapes) named like this device's tuned one is not a tuned
    profile of this device: it is rejected by name and reason, and the generic level applies
    (it used to reach ``shapes.mismatches`` with no shapes and crash startup)."""
    generic = load_generic("cpu", "avx512").to_dict()
    write(tmp_path, generic)
    config, _, selection = resolve_options("cpu", SHAPES, search(tmp_path), DEVICE)
    assert selection.kind == "generic" and selection.profile == load_generic("cpu", "avx512")
    assert profile_key("cpu", DEVICE) in selection.message and "generic profile" in selection.message
    assert "no shapes" in selection.message


def test_disabled_profile_uses_the_plain_defaults(tmp_path):
    write(tmp_path, profile_dict())
    env = search(tmp_path, LOUVER_PROFILE="none")
    selection = select_profile("cpu", SHAPES, louver_sgl.__version__, env, DEVICE)
    assert selection.profile is None and selection.kind == "none" and "plain defaults" in selection.message
    assert resolve_options("cpu", SHAPES, env, DEVICE)[0] == LouverConfig()


def test_generic_rule_majority_then_gain_and_conservative_dispatch():
    """Per knob the most common choice, a tie going to the profile that gained most; the machine's
    thread count; the largest min_sparse_tokens and dense_fallback_fraction. A profile that does not
    name a knob ran with its default and counts with it (C's fraction 1.0; only A searched
    certified_passes, so the two others' 2 outvote its 1)."""
    def tuned(name, gain, chunk_pages, **config):
        return Profile.from_dict(profile_dict(device_name=f"{name} avx512", config=config,
                                              launch={"chunk_pages": chunk_pages, "num_threads": 2},
                                              measured={"speedup_vs_defaults": gain}))

    profiles = [tuned("A", 1.5, 64, page_size=64, grid_bits=8, min_sparse_tokens=1024, dense_fallback_fraction=0.5,
                      certified_passes=1),
                tuned("B", 3.0, 16, page_size=128, grid_bits=4, min_sparse_tokens=8192, dense_fallback_fraction=0.7),
                tuned("C", 1.2, 32, page_size=128, grid_bits=8, min_sparse_tokens=0)]
    generic = derive_generic(profiles, "cpu", "avx512")
    assert generic.generic and generic.shapes is None and generic.isa == "avx512"
    assert dict(generic.config) == {"page_size": 128, "grid_bits": 8, "min_sparse_tokens": 8192,
                                    "dense_fallback_fraction": 1.0, "certified_passes": 2}
    assert dict(generic.launch) == {"chunk_pages": 16, "num_threads": 0}  # 64, 16, 32 once each: B gained most
    assert derive_generic(profiles, "cpu", "avx2") is None
    assert Profile.from_dict(generic.to_dict()) == generic


def test_shipped_generic_profiles_are_derived_from_the_shipped_tuned_ones():
    """``louver-tune generic`` output is what ships: regenerate it after shipping a tuned profile."""
    from louver_sgl.profiles.generic import GENERIC_DIR, generic_profiles

    tuned = [Profile.load(p) for p in sorted(SHIPPED_DIR.glob("*.json"))]
    derived = generic_profiles(tuned)
    shipped = {p.stem: Profile.load(p) for p in GENERIC_DIR.glob("*.json")}
    assert set(shipped) == set(derived), "run: louver-tune generic"
    for key, profile in derived.items():
        assert shipped[key].to_dict() == profile.to_dict(), f"{key}: run louver-tune generic"
    assert {"cpu_avx512", "cpu_avx2", "cuda_sm90", "cpu", "cuda"} <= set(shipped)


def test_shipped_profiles_are_valid():
    paths = sorted(SHIPPED_DIR.glob("*.json"))
    assert paths, "no profile shipped"
    for path in paths:
        profile = Profile.load(path)
        # a device's main file (<key>.json) or one tuned for a KV dtype (<key>.<dtype>.json)
        assert path.name in profile_file_names(profile_key(profile.target, profile.device_name),
                                               profile.shapes.kv_dtype)
        assert profile.louver_version == louver_sgl.__version__ and profile.isa


def test_shipped_cpu_profile_resolves():
    """The tuned SmolLM2 CPU profile applies to its shapes through the backend's option resolution."""
    path = SHIPPED_DIR / "cpu_amd_epyc_avx512.json"
    profile = Profile.load(path)
    shapes = Shapes(64, 9, 3, "float16")
    config, serving, selection = resolve_options("cpu", shapes, search(SHIPPED_DIR), profile.device_name)
    assert selection.profile is not None and str(path) in selection.message
    assert {k: getattr(config, k) for k in profile.config} == dict(profile.config)
    assert {k: getattr(serving, k) for k in profile.launch} == dict(profile.launch)
    assert profile.measured["confirmation"]["winner"] == profile.measured["tuned"]["trial"]


@pytest.mark.parametrize("device", ["AMD EPYC avx2", "Intel(R) Xeon(R) Processor avx512"])
def test_shipped_fp32_profile_is_chosen_for_an_fp32_pool(device):
    """The main command serves fp32 on CPU: on each CPU class the project runs on, a tuned fp32
    profile applies there (not the generic one), the fp16 one to fp16 pools where there is one."""
    key = profile_key("cpu", device)
    for kv_dtype, name in (("float32", f"{key}.float32.json"), ("float16", f"{key}.json")):
        if not (SHIPPED_DIR / name).is_file():
            assert kv_dtype == "float16", f"no shipped fp32 profile for {device}"
            continue
        _, _, selection = resolve_options("cpu", Shapes(64, 9, 3, kv_dtype), search(SHIPPED_DIR), device)
        assert selection.kind == "exact" and selection.message.find(name) >= 0, selection.message


def test_the_amd_avx512_machine_serves_fp32_with_its_fp32_profile():
    """The fp32 study of the AMD EPYC AVX-512 machine (docs/tuning.md): an fp32 pool there takes its
    own profile, an fp16 one the fp16 profile."""
    config, serving, selection = resolve_options("cpu", Shapes(64, 9, 3, "float32"), search(SHIPPED_DIR),
                                                 "AMD EPYC avx512")
    assert selection.kind == "exact" and "cpu_amd_epyc_avx512.float32.json" in selection.message
    profile = Profile.load(SHIPPED_DIR / "cpu_amd_epyc_avx512.float32.json")
    assert config.grid_bits == 8 and {k: getattr(config, k) for k in profile.config} == dict(profile.config)
    assert {k: getattr(serving, k) for k in profile.launch} == dict(profile.launch)
    _, _, selection = resolve_options("cpu", Shapes(64, 9, 3, "float16"), search(SHIPPED_DIR), "AMD EPYC avx512")
    assert selection.kind == "exact" and selection.message.find("cpu_amd_epyc_avx512.json") >= 0


def test_the_amd_avx512_fp32_profile_serves_budget_with_its_budget_section():
    """A budget server with an fp32 pool on the AMD EPYC AVX-512 machine takes the fp32 profile's
    budget section (docs/tuning.md, its budget study), a certified one the main values."""
    profile = Profile.load(SHIPPED_DIR / "cpu_amd_epyc_avx512.float32.json")
    section = profile.to_dict()["policies"]["budget"]
    env = {**search(SHIPPED_DIR), "LOUVER_POLICY": "budget"}
    config, serving, selection = resolve_options("cpu", Shapes(64, 9, 3, "float32"), env, "AMD EPYC avx512")
    assert "'budget' section" in selection.message and "cpu_amd_epyc_avx512.float32.json" in selection.message
    assert config.policy == "budget"
    assert {k: getattr(config, k) for k in section["config"]} == section["config"]
    assert {k: getattr(serving, k) for k in section["launch"]} == section["launch"]
    config, _, _ = resolve_options("cpu", Shapes(64, 9, 3, "float32"), search(SHIPPED_DIR), "AMD EPYC avx512")
    assert (config.sink_pages, config.recent_pages) == (profile.config["sink_pages"], profile.config["recent_pages"])


def test_cpu_threads_restores_the_count():
    before = torch.get_num_threads()
    with cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with cpu_threads(0):
        assert torch.get_num_threads() == before


def test_served_shapes_at_argument_resolution():
    from types import SimpleNamespace

    from louver_sgl.serving.server_view import served_shapes

    model = SimpleNamespace(head_dim=64, num_attention_heads=18, get_num_kv_heads=lambda tp: 6 // tp,
                            dtype=torch.bfloat16)
    view = SimpleNamespace(tp_size=2, kv_cache_dtype="auto")
    assert served_shapes(view, model) == Shapes(64, 9, 3, "bfloat16")
    assert served_shapes(SimpleNamespace(tp_size=1, kv_cache_dtype="fp8_e4m3"), model) is None


def test_backend_resolves_the_profile_for_its_kv_pool(tmp_path, monkeypatch, caplog):
    """The backend reads H_kv, D and dtype from the KV pool, H_q per rank from the model config."""
    from types import SimpleNamespace

    from louver_sgl.serving.backend import LouverAttnBackend

    monkeypatch.setenv("LOUVER_PROFILE", write(tmp_path, profile_dict()))
    buffer = lambda layer: torch.zeros(128, 3, 64, dtype=torch.float16)
    pool = SimpleNamespace(start_layer=0, get_key_buffer=buffer, get_value_buffer=buffer)
    runner = SimpleNamespace(tp_size=1, model_config=SimpleNamespace(num_attention_heads=9), page_size=32)
    with caplog.at_level("INFO", logger="louver_sgl.serving"):
        config, serving, shapes = LouverAttnBackend._resolve_options(SimpleNamespace(token_to_kv_pool=pool), runner)
    assert config.page_size == 32 and serving.chunk_pages == 16
    assert (shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim) == (9, 3, 64)
    assert "using profile" in caplog.text
    runner.model_config.num_attention_heads = 6  # another model: the explicit profile must not apply
    with pytest.raises(ProfileError, match="num_q_heads"):
        LouverAttnBackend._resolve_options(SimpleNamespace(token_to_kv_pool=pool), runner)
