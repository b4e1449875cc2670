"""``sglang.srt.plugins`` entry point: registers the ``louver`` attention backend.

Runs in every SGLang process (launcher, engine, scheduler, detokenizer) through
``sglang.srt.plugins.load_plugins``: installs the CPU rotary-embedding stand-in when CUDA is
absent, adds ``louver`` to the backend registry and the ``--attention-backend`` choices, and wraps
the ``handle_attention_backend_compatibility`` resolution step so that a louver server gets
louver's page size, has CUDA graphs turned off on CPU (the CUDA path is graph-safe), and
fails fast, naming the option, on combinations that would break the index.
"""

from __future__ import annotations

import logging
from typing import Any

from .names import BACKEND_NAME
from .server_view import device_type, served_shapes

logger = logging.getLogger("louver_sgl.serving")
_registered = False


def register() -> None:
    """Idempotent, cheap plugin entry point (no CUDA initialisation, heavy imports deferred)."""
    global _registered
    if _registered:
        return
    from . import rope_fallback

    rope_fallback.install()
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(_create_backend)
    register_resolution_hook("handle_attention_backend_compatibility")(_resolve_louver_args)
    from . import cpu_parallel, host_tier, pool_budget, request_policy

    pool_budget.install()  # the index's bytes per token in SGLang's KV-pool sizing
    host_tier.install()  # pages loaded back from the host tier are rebuilt before they are read
    request_policy.install()  # accuracy chosen per request (custom_params["louver"])
    cpu_parallel.install()  # --tp-size > 1 on CPU: gloo groups without CUDA communicators
    _registered = True


def _create_backend(model_runner):
    from .backend import LouverAttnBackend

    return LouverAttnBackend(model_runner)


def _uses_louver(view: Any) -> bool:
    names = (view.attention_backend, view.decode_attention_backend, view.prefill_attention_backend)
    return BACKEND_NAME in names


def _resolve_louver_args(server_args: Any, previous) -> None:
    previous(server_args)
    from sglang.srt.arg_groups.overrides import declare_resolution, model_config_of, resolved_view

    view = resolved_view(server_args)
    from . import request_policy

    if not _uses_louver(view):
        request_policy.set_served("off")
        return
    from .options import load_options, resolve_options

    model_config = model_config_of(server_args)
    shapes = served_shapes(view, model_config)
    # Invalid LOUVER_* options (and an explicit LOUVER_PROFILE that does not apply) fail here, at
    # startup; the profile also decides the server page size.
    device = device_type(view)
    config, serving = resolve_options(device, shapes)[:2] if shapes else load_options()
    request_policy.set_served("cuda" if device == "cuda" else "cpu", config.threshold.kind)
    check_louver_compatible(view, model_config)
    if device == "cuda" and not config.grid_codes:
        raise ValueError("louver: the clustered family has no CUDA kernels; use LOUVER_FAMILY=grid on GPUs")
    if device != "cuda":  # the CUDA path is graph-safe; the CPU path is not
        _disable_cuda_graphs(server_args, view)
        if serving.sleep_on_idle and not getattr(view, "sleep_on_idle", True):
            logger.info("louver: --sleep-on-idle on (an idle CPU scheduler otherwise keeps a core busy; "
                        "LOUVER_SLEEP_ON_IDLE=0 keeps SGLang's default)")
            declare_resolution(server_args, "louver", sleep_on_idle=True)
    if view.page_size != config.page_size:
        logger.info("louver: setting page_size=%d (index pages are KV pages; was %s)", config.page_size, view.page_size)
        declare_resolution(server_args, "louver", page_size=config.page_size)


def _disable_cuda_graphs(server_args: Any, view: Any) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    logger.warning("louver: CUDA graphs are disabled (the CPU decode path is not graph-capturable)")
    cfg = view.cuda_graph_config
    for phase in (Phase.DECODE, Phase.PREFILL):
        cfg = with_phase(cfg, phase, backend=Backend.DISABLED)
    declare_resolution(server_args, "louver", cuda_graph_config=cfg)


# (option, predicate on the resolved args, why) — each fails startup with a message naming it.
_INCOMPATIBLE = (
    ("--enable-hierarchical-cache", lambda v: bool(getattr(v, "enable_hierarchical_cache", False)),
     "pages move between host and device slots; the index side buffers do not travel with them"),
    ("--speculative-algorithm", lambda v: getattr(v, "speculative_algorithm", None) not in (None, "", "NONE"),
     "speculative decoding moves KV slots (move_kv_cache) and verifies several tokens per step"),
    ("--disaggregation-mode", lambda v: getattr(v, "disaggregation_mode", "null") not in (None, "null", "NULL"),
     "PD disaggregation transfers only registered KV buffers, not the index"),
    ("--enable-unified-memory", lambda v: bool(getattr(v, "enable_unified_memory", False)),
     "the unified pool stores virtual slot ids that the index cannot translate"),
    ("--prefill-attention-backend / --decode-attention-backend",
     lambda v: {v.attention_backend, v.decode_attention_backend, v.prefill_attention_backend} - {None, BACKEND_NAME},
     "louver must serve both prefill and decode: it builds the index of pages filled by prefill"),
    ("--kv-cache-dtype", lambda v: str(getattr(v, "kv_cache_dtype", "auto")) not in ("auto", "float16", "bfloat16", "float32"),
     "quantised KV caches (fp8/fp4) are not supported by the index build yet"),
    ("--dcp-size / --attn-cp-size", lambda v: int(getattr(v, "dcp_size", 1) or 1) > 1 or int(getattr(v, "attn_cp_size", 1) or 1) > 1,
     "context parallelism splits a request's KV across ranks"),
)


def check_louver_compatible(view: Any, model_config: Any) -> None:
    """Raise ``ValueError`` naming the first server option or model feature louver cannot serve."""
    for option, bad, why in _INCOMPATIBLE:
        if bad(view):
            raise ValueError(f"--attention-backend louver does not support {option}: {why}")
    hf = getattr(model_config, "hf_config", None)
    if getattr(model_config, "attention_arch", None) is not None and "MLA" in str(model_config.attention_arch):
        raise ValueError("--attention-backend louver does not support MLA models (latent KV has no per-head keys)")
    if hf is not None and (getattr(hf, "sliding_window", None) or getattr(hf, "layer_types", None)
                           and any(t != "full_attention" for t in hf.layer_types)):
        raise ValueError("--attention-backend louver does not support sliding-window or hybrid-attention models")
    if getattr(model_config, "is_hybrid_swa", False) or getattr(model_config, "is_encoder_decoder", False):
        raise ValueError("--attention-backend louver does not support hybrid-SWA or encoder-decoder models")
