"""Which Triton implementation a CUDA decode batch runs (``decode.dispatch``), and each one's
launch parameters from a CUDA profile's launch section (checked without a GPU)."""

from __future__ import annotations

import pytest

from louver_sgl.decode import dispatch
from louver_sgl.profiles import SHIPPED_DIR, Profile, ProfileError, Shapes
from louver_sgl.serving.options import profile_values

SECTION = {"pages_per_split": 8, "attend_warps": 2, "triton_stream": {"pages_per_split": 32},
           "cuda_dispatch": [{"impl": "triton_stream", "policies": ["budget"], "min_rows": 64},
                             {"impl": "triton_tiled", "min_rows": 8, "min_context": 131072}]}


def test_each_implementation_takes_the_shared_fields_then_its_own():
    assert dispatch.launch_for(SECTION, "triton").pages_per_split == 8
    stream = dispatch.launch_for(SECTION, "triton_stream")
    assert (stream.pages_per_split, stream.attend_warps) == (32, 2)
    assert dispatch.launch_for(None, "triton_tiled") == dispatch.launch_for({}, "triton_tiled")


def test_the_first_matching_rule_chooses():
    rules = dispatch.parse_rules(SECTION)
    assert dispatch.choose(rules, "budget", 64, 8192) == "triton_stream"
    assert dispatch.choose(rules, "certified", 64, 8192) == "triton"  # the first rule is budget-only
    assert dispatch.choose(rules, "certified", 8, 131072) == "triton_tiled"
    assert dispatch.choose(rules, "budget", 8, 32768) == "triton"
    assert dispatch.choose((), "budget", 10**6, 10**6) == "triton"


@pytest.mark.parametrize("section, message", [
    ({"cuda_dispatch": [{"impl": "flash"}]}, "impl must be one of"),
    ({"cuda_dispatch": [{"impl": "triton", "rows": 3}]}, "unknown cuda_dispatch rule fields"),
    ({"cuda_dispatch": [{"impl": "triton", "min_rows": -1}]}, "min_rows must be a non-negative int"),
    ({"cuda_dispatch": {"impl": "triton"}}, "must be a list"),
    ({"triton_tiled": {"tile_warps": 3}}, "power of two"),
    ({"triton_stream": {"block_q": 4}}, "unknown Triton launch parameters"),
])
def test_bad_sections_are_refused_by_name(section, message):
    with pytest.raises(ValueError, match=message):
        dispatch.check_section(section)


def test_a_cuda_profile_carries_sections_and_rules():
    profile = Profile("cuda", "NVIDIA H200", "0.1.0", {"grid_bits": 8}, dict(SECTION), Shapes(128, 32, 8, "bfloat16"))
    assert profile_values(profile) == {"grid_bits": 8}
    bad = Profile("cuda", "NVIDIA H200", "0.1.0", {}, {"cuda_dispatch": [{"impl": "x"}]}, Shapes(128, 32, 8, "bfloat16"))
    with pytest.raises(ValueError, match="impl must be one of"):
        profile_values(bad)


def test_the_shipped_h200_profile_dispatches_as_measured():
    """Run 6: triton_stream with budget 5 % at batch 8 and at batch 1 at 128K; triton elsewhere
    and for certified steps; each with its own pages_per_split."""
    profile = Profile.load(SHIPPED_DIR / "nvidia_h200.json")
    section = {k: v for k, v in profile.launch.items() if k in dispatch.kernel_keys()}
    rules = dispatch.parse_rules(section)
    h_kv = profile.shapes.num_kv_heads
    assert dispatch.choose(rules, "budget", 8 * h_kv, 32768) == "triton_stream"
    assert dispatch.choose(rules, "budget", h_kv, 131072) == "triton_stream"
    assert dispatch.choose(rules, "budget", h_kv, 32768) == "triton"
    assert dispatch.choose(rules, "certified", 8 * h_kv, 131072) == "triton"
    assert dispatch.launch_for(section, "triton").pages_per_split == 8
    assert dispatch.launch_for(section, "triton_stream").pages_per_split == 32
    with pytest.raises(ProfileError):
        profile.check_compatible("cuda", Shapes(64, 9, 3, "bfloat16"), profile.louver_version)
