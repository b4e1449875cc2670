"""Plugin registration, server-argument resolution, options and the CPU rope stand-in."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

from louver_eval.data.tiny_model import make_tiny_llama
from louver_sgl.serving import plugin
from louver_sgl.serving.options import load_options
from louver_sgl.serving.rope_fallback import rotary_embedding


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def _resolve(model: Path, *extra: str):
    plugin.register()
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", str(model), "--device", "cpu", "--attention-backend", "louver", *extra])
    args.resolve_once()
    return resolved_view(args)


def test_entry_point_registers_backend():
    """The installed ``sglang.srt.plugins`` entry point registers louver in SGLang's registry."""
    names = [ep.name for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")]
    assert "louver" in names
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins import load_plugins

    load_plugins()
    assert "louver" in ATTENTION_BACKENDS and "louver" in ATTENTION_BACKEND_CHOICES


def test_resolution_sets_page_size_and_disables_graphs(tiny_model, monkeypatch):
    monkeypatch.setenv("LOUVER_PAGE_SIZE", "32")
    view = _resolve(tiny_model)
    assert view.page_size == 32
    assert view.cuda_graph_config.decode.backend == "disabled"
    assert view.cuda_graph_config.prefill.backend == "disabled"


@pytest.mark.parametrize(
    "extra,option",
    [
        (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
        (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm"),
        (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype"),
        (["--decode-attention-backend", "torch_native"], "--decode-attention-backend"),
        (["--enable-unified-memory"], "--enable-unified-memory"),
    ],
)
def test_incompatible_options_fail_fast(tiny_model, extra, option):
    """Startup with an option louver cannot serve fails with a message that names it."""
    with pytest.raises(ValueError, match=option):
        _resolve(tiny_model, *extra)


def test_invalid_louver_options_fail_at_startup(tiny_model, monkeypatch):
    monkeypatch.setenv("LOUVER_EPS", "2")
    with pytest.raises(ValueError, match="eps"):
        _resolve(tiny_model)


def test_options_from_env_and_json(tmp_path, monkeypatch):
    path = tmp_path / "louver.json"
    path.write_text(json.dumps({"policy": "budget", "budget": 0.05, "chunk_pages": 8}))
    config, serving = load_options({"LOUVER_CONFIG": str(path), "LOUVER_BUDGET": "0.2", "LOUVER_VALUE_GATE": "0"})
    assert (config.policy, config.budget, config.value_gate, serving.chunk_pages) == ("budget", 0.2, False, 8)
    assert serving.huge_pages and not load_options({"LOUVER_HUGE_PAGES": "0"})[1].huge_pages
    with pytest.raises(ValueError, match="LOUVER_HUGE_PAGES"):
        load_options({"LOUVER_HUGE_PAGES": "sometimes"})
    with pytest.raises(ValueError, match="LOUVER_GRID_BITS"):
        load_options({"LOUVER_GRID_BITS": "four"})
    with pytest.raises(ValueError, match="unknown louver options"):
        path.write_text(json.dumps({"epsilon": 0.1}))
        load_options({"LOUVER_CONFIG": str(path)})
    with pytest.raises(ValueError, match="LOUVER_CONFIG"):
        load_options({"LOUVER_CONFIG": str(tmp_path / "missing.json")})


@pytest.mark.parametrize("is_neox", [True, False])
def test_rope_fallback_matches_reference(is_neox):
    """The stand-in rotates q and k in place exactly like the closed-form rotation."""
    torch.manual_seed(0)
    heads, size, n = 3, 16, 5
    inv = 1.0 / (10000 ** (torch.arange(0, size, 2).float() / size))
    freqs = torch.outer(torch.arange(32).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.tensor([0, 3, 7, 8, 31])
    q = torch.randn(n, heads * size)
    k = torch.randn(n, heads * size)
    want_q, want_k = _reference_rope(q, positions, freqs, is_neox, heads, size), _reference_rope(k, positions, freqs, is_neox, heads, size)
    rotary_embedding(positions, q, k, size, cache, is_neox)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)


def _reference_rope(x, positions, freqs, is_neox, heads, size):
    angle = freqs[positions][:, None, :]  # [n, 1, size/2]
    x = x.view(len(positions), heads, size)
    if is_neox:
        a, b = x[..., : size // 2], x[..., size // 2 :]
        return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1).reshape(len(positions), -1)
    a, b = x[..., ::2], x[..., 1::2]
    out = torch.stack([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)
    return out.reshape(len(positions), -1)


def test_every_louver_variable_is_read_in_one_place():
    """``Environment.read`` knows every LOUVER_* variable: options by name, the others as fields;
    a misspelt one fails naming it with the closest known name, and so does a bad flag."""
    from louver_sgl.settings import Environment

    env = Environment.read({"LOUVER_EPS": "1e-2", "LOUVER_STATS_FILE": "/tmp/s.json", "LOUVER_KERNEL_CACHE": "/k",
                            "LOUVER_DISABLE_CPU_KERNELS": "1", "LOUVER_EXTEND_BACKEND": "torch_native", "PATH": "x"})
    assert env.options == {"eps": "1e-2", "extend_backend": "torch_native"}
    assert env.stats_file == "/tmp/s.json" and env.disable_cpu_kernels and str(env.kernel_cache_dir) == "/k"
    with pytest.raises(ValueError, match="unknown louver variable LOUVER_EPSILON; did you mean LOUVER_EPS"):
        Environment.read({"LOUVER_EPSILON": "1e-2"})
    with pytest.raises(ValueError, match="LOUVER_DISABLE_CPU_KERNELS"):
        Environment.read({"LOUVER_DISABLE_CPU_KERNELS": "maybe"})
    with pytest.raises(ValueError, match="LOUVER_POLCY; did you mean LOUVER_POLICY"):
        load_options({"LOUVER_POLCY": "budget"})


def test_index_bytes_enter_the_kv_pool_cell_size(tiny_model, monkeypatch):
    """The pool-sizing hook adds the index's bytes per token (all layers, the configured family
    and width) to SGLang's cell size for a louver server, and nothing for another backend."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import prepare_server_args

    from louver_sgl import LouverConfig
    from louver_sgl.serving import pool_budget

    monkeypatch.setenv("LOUVER_PROFILE", "none")
    monkeypatch.setenv("LOUVER_GRID_BITS", "4")
    plugin.register()
    cells = {}
    for backend in ("louver", "torch_native"):
        args = prepare_server_args(["--model-path", str(tiny_model), "--device", "cpu", "--attention-backend", backend])
        args.resolve_once()
        model_config = ModelConfig.from_server_args(args)
        kvc = SimpleNamespace(server_args=args, model_config=model_config, kv_cache_dtype=torch.bfloat16)
        cells[backend] = pool_budget.cell_size_with_index(lambda self, kvc, n: 1000 * n, None, kvc, 4)
    # expected from the layout itself, not from the product's own count: per token and KV head, the
    # 4-bit codes (D/2 bytes) and the page's three bf16 codebooks (lo, scale, radius: 3·D·2 bytes)
    # spread over its P slots
    h_kv, dim, page = model_config.get_num_kv_heads(1), model_config.head_dim, LouverConfig().page_size
    per_layer = h_kv * (dim * 4 / 8 + 3 * dim * 2 / page)
    assert cells["torch_native"] == 4000
    assert cells["louver"] == 4000 + int(-(-per_layer * 4 // 1))
    assert 0 < per_layer < 1000
