"""What the louver plugin reads off SGLang's resolved server arguments."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("louver_sgl.serving")


def device_type(view: Any) -> str:
    import torch

    device = str(getattr(view, "device", None) or "")
    return "cpu" if device == "cpu" or not torch.cuda.is_available() else "cuda"


def served_shapes(view: Any, model_config: Any):
    """Per-rank attention shapes of the served model, or None where they cannot be read here
    (the backend then applies the profile with the server's page size)."""
    from ..profiles import Shapes

    try:
        tp_size = int(getattr(view, "tp_size", 1) or 1)
        kv_dtype = str(getattr(view, "kv_cache_dtype", "auto") or "auto")
        if kv_dtype == "auto":
            kv_dtype = str(model_config.dtype).replace("torch.", "")
        return Shapes(int(model_config.head_dim), int(model_config.num_attention_heads) // tp_size,
                      int(model_config.get_num_kv_heads(tp_size)), kv_dtype)
    except Exception as exc:  # best effort: never block startup on reading shapes
        logger.debug("louver: attention shapes not readable at argument resolution (%s)", exc)
        return None
