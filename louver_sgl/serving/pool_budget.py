"""The index's memory inside SGLang's KV-pool sizing.

SGLang sizes the KV pool from a per-token cell size (bytes of K and V over all layers) and the
memory ``--mem-fraction-static`` leaves; louver's page index adds bytes per token of its own
(codes, plus per-page codebooks amortised over the page). An AROUND hook on
``DefaultPoolConfigurator._compute_cell_size`` adds them, so the number of KV tokens SGLang
allocates leaves room for the index at the same fraction. An explicit ``--max-total-tokens``
stays exact: the pool and the index are allocated for that many tokens (the log line says both).
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger("louver_sgl.serving")

TARGET = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"


def index_bytes_per_token(config, num_kv_heads: int, head_dim: int, kv_dtype) -> float:
    """Index bytes per token slot of one layer (all its KV heads), for ``config``'s index layout."""
    from ..index.store import PageIndexStore

    probe = PageIndexStore(config, 1, num_kv_heads, head_dim, kv_dtype)
    return probe.bytes_per_token_head() * num_kv_heads


def cell_size_with_index(original, self, kvc, num_layers: int) -> int:
    """The hook: SGLang's cell size plus louver's index bytes per token when louver serves."""
    cell = original(self, kvc, num_layers)
    try:
        extra = louver_cell_size(kvc, num_layers)
    except Exception as exc:  # sizing must never block a server that louver does not serve
        logger.warning("louver: index bytes not added to the KV pool sizing (%s)", exc)
        return cell
    if extra:
        logger.info("louver: KV pool cell %d bytes/token + index %d bytes/token (%.1f%%) over %d layers",
                    cell, extra, 100.0 * extra / max(cell, 1), num_layers)
    return cell + extra


def louver_cell_size(kvc, num_layers: int) -> int:
    """Index bytes per token over ``num_layers`` layers, 0 where louver is not the backend."""
    from sglang.srt.arg_groups.overrides import resolved_view

    from .names import BACKEND_NAME
    from .options import resolve_options
    from .server_view import device_type, served_shapes

    view = resolved_view(kvc.server_args)
    if BACKEND_NAME not in (view.attention_backend, view.decode_attention_backend):
        return 0
    shapes = served_shapes(view, kvc.model_config)
    config = resolve_options(device_type(view), shapes)[0] if shapes else None
    if config is None:
        return 0
    config = config.with_(page_size=int(view.page_size or config.page_size))
    per_layer = index_bytes_per_token(config, shapes.num_kv_heads, shapes.head_dim, kvc.kv_cache_dtype)
    return int(math.ceil(per_layer * num_layers))


def install() -> None:
    """Register the hook (applied by SGLang's ``load_plugins`` after the plugins loaded)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, cell_size_with_index, HookType.AROUND)
