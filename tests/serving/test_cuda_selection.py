"""Server-argument resolution and profiles for the CUDA decode path (checked without a GPU)."""

from __future__ import annotations

import pytest

from louver_sgl.profiles import Profile, ProfileError, Shapes
from louver_sgl.serving import plugin
from louver_sgl.serving.cuda_path import cuda_launch
from louver_sgl.serving.options import profile_values

from test_plugin import _resolve, tiny_model  # noqa: F401  (fixture)


def test_cuda_resolution_keeps_graphs_and_rejects_clustered(tiny_model, monkeypatch):  # noqa: F811
    """On CUDA the decode step is graph-safe: graphs stay as configured; the clustered family,
    which has no CUDA kernels, fails at startup."""
    monkeypatch.setattr(plugin, "device_type", lambda view: "cuda")
    monkeypatch.setenv("LOUVER_PROFILE", "none")  # no device query without a GPU
    view = _resolve(tiny_model)
    assert view.cuda_graph_config.decode.backend != "disabled"
    monkeypatch.setenv("LOUVER_FAMILY", "clustered")
    with pytest.raises(ValueError, match="clustered"):
        _resolve(tiny_model)


def _cuda_profile(launch):
    return Profile("cuda", "NVIDIA H200", "0.1.0", {"grid_bits": 8}, launch, Shapes(128, 32, 8, "bfloat16"))


def test_cuda_profile_launch_parameters():
    """A CUDA profile's Triton launch parameters reach the CUDA path, not the serving options;
    unknown or invalid ones are rejected by name."""
    profile = _cuda_profile({"pages_per_split": 8, "attend_warps": 2})
    assert profile_values(profile) == {"grid_bits": 8}
    launch = cuda_launch(profile)
    assert (launch.pages_per_split, launch.attend_warps) == (8, 2)
    with pytest.raises(ProfileError, match="block_q"):
        profile_values(_cuda_profile({"block_q": 4}))
    with pytest.raises(ValueError, match="power of two"):
        profile_values(_cuda_profile({"attend_warps": 3}))
    assert cuda_launch(None).pages_per_split == 16


def test_shipped_h200_profile_is_valid():
    """The shipped H200 profile parses, carries Triton launch parameters and applies to the
    shapes it was measured on only."""
    from louver_sgl.profiles import SHIPPED_DIR

    profile = Profile.load(SHIPPED_DIR / "nvidia_h200.json")
    assert profile.target == "cuda" and profile.device_name == "NVIDIA H200"
    profile_values(profile)
    assert cuda_launch(profile).pages_per_split == profile.launch["pages_per_split"]
    profile.check_compatible("cuda", Shapes(128, 32, 8, "bfloat16"), profile.louver_version)
    with pytest.raises(ProfileError, match="head_dim"):
        profile.check_compatible("cuda", Shapes(64, 9, 3, "bfloat16"), profile.louver_version)
