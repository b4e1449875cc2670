"""Profiles: file format, validation, selection at startup, and how options resolve over them."""

from __future__ import annotations

import json

import pytest
import torch

import louver_sgl
from louver_sgl import LouverConfig
from louver_sgl.profiles import (SHIPPED_DIR, Profile, ProfileError, Shapes, cpu_isa_level,
                                 normalize_device_name, profile_key, select_profile)
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


def test_auto_pick_by_device_key(tmp_path):
    write(tmp_path, profile_dict())
    config, _, selection = resolve_options("cpu", SHAPES, {"LOUVER_PROFILE_DIR": str(tmp_path)}, DEVICE)
    assert selection.profile is not None and "using tuned profile" in selection.message
    assert config.page_size == 32


def test_a_profile_tuned_for_the_served_kv_dtype_is_preferred(tmp_path):
    """Beside the device's main (fp16) profile, ``<key>.float32.json`` applies to an fp32 KV pool;
    the fp16 pool keeps the main one."""
    import dataclasses

    fp32_shapes = dict(profile_dict()["shapes"], kv_dtype="float32")
    write(tmp_path, profile_dict())
    write(tmp_path, profile_dict(config={"page_size": 128, "grid_bits": 4}, shapes=fp32_shapes),
          f"{profile_key('cpu', DEVICE)}.float32.json")
    env = {"LOUVER_PROFILE_DIR": str(tmp_path)}
    config32, _, selection = resolve_options("cpu", dataclasses.replace(SHAPES, kv_dtype="float32"), env, DEVICE)
    assert config32.page_size == 128 and selection.profile.path.endswith(".float32.json")
    config16, _, _ = resolve_options("cpu", SHAPES, env, DEVICE)
    assert config16.page_size == 32


@pytest.mark.parametrize("data", [
    profile_dict(shapes={"head_dim": 128, "num_q_heads": 9, "num_kv_heads": 3, "kv_dtype": "float16"}),
    profile_dict(louver_version="9.9.9"),
    profile_dict(launch={"block_n": 64}),
    "not json",
])
def test_auto_picked_bad_profile_falls_back_to_defaults(tmp_path, data):
    write(tmp_path, data)
    config, serving, selection = resolve_options("cpu", SHAPES, {"LOUVER_PROFILE_DIR": str(tmp_path)}, DEVICE)
    assert selection.profile is None and "using the built-in defaults" in selection.message
    assert config == LouverConfig() and serving.chunk_pages == 64


def test_unknown_device_and_disabled_profile_use_defaults(tmp_path):
    write(tmp_path, profile_dict())
    sel = select_profile("cpu", SHAPES, louver_sgl.__version__, {"LOUVER_PROFILE_DIR": str(tmp_path)}, "Other CPU")
    assert sel.profile is None and "no tuned profile for 'Other CPU'" in sel.message
    env = {"LOUVER_PROFILE_DIR": str(tmp_path), "LOUVER_PROFILE": "none"}
    assert select_profile("cpu", SHAPES, louver_sgl.__version__, env, DEVICE).profile is None


def test_shipped_profiles_are_valid():
    paths = sorted(SHIPPED_DIR.glob("*.json"))
    assert paths, "no profile shipped"
    for path in paths:
        profile = Profile.load(path)
        # a device's main file (<key>.json) or one tuned for a KV dtype (<key>.<dtype>.json)
        assert path.name in profile_file_names(profile_key(profile.target, profile.device_name),
                                               profile.shapes.kv_dtype)
        assert profile.louver_version == louver_sgl.__version__


def test_shipped_cpu_profile_resolves():
    """The tuned SmolLM2 CPU profile applies to its shapes through the backend's option resolution."""
    path = SHIPPED_DIR / "cpu_amd_epyc_avx512.json"
    profile = Profile.load(path)
    shapes = Shapes(64, 9, 3, "float16")
    config, serving, selection = resolve_options("cpu", shapes, {"LOUVER_PROFILE_DIR": str(SHIPPED_DIR)},
                                                 profile.device_name)
    assert selection.profile is not None and str(path) in selection.message
    assert {k: getattr(config, k) for k in profile.config} == dict(profile.config)
    assert {k: getattr(serving, k) for k in profile.launch} == dict(profile.launch)
    assert profile.measured["confirmation"]["winner"] == profile.measured["tuned"]["trial"]


def test_shipped_fp32_profile_is_chosen_for_an_fp32_pool():
    """The main command serves fp32 on CPU: the AVX2 machine's fp32 profile applies there, the
    fp16 one to fp16 pools."""
    for kv_dtype, name in (("float32", "cpu_amd_epyc_avx2.float32.json"), ("float16", "cpu_amd_epyc_avx2.json")):
        _, _, selection = resolve_options("cpu", Shapes(64, 9, 3, kv_dtype), {"LOUVER_PROFILE_DIR": str(SHIPPED_DIR)},
                                          "AMD EPYC avx2")
        assert selection.profile is not None and selection.message.find(name) >= 0, selection.message


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
