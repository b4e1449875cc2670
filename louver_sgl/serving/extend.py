"""The extend (prefill) backend louver composes: the one SGLang would pick on the device.

Louver serves both phases (it must see prefill to build the index of the pages prefill fills),
but its prefill is dense attention, which SGLang's own backends do best: FlashInfer, FA3 or
Triton on CUDA, ``intel_amx`` (where SGLang's CPU kernels load) on CPU. The option
``extend_backend`` (``LOUVER_EXTEND_BACKEND``) names one; ``auto`` takes SGLang's choice, except
that on a CPU without ``intel_amx`` it takes ``torch_native_prefix`` (``prefix_extend``): SGLang's
``torch_native`` there attends over the whole sequence for every extend, so a cached prefix saves
no prefill time.
"""

from __future__ import annotations

import logging

from .prefix_extend import NAME as PREFIX_EXTEND
from .prefix_extend import make_prefix_extend_backend

logger = logging.getLogger("louver_sgl.serving")


def default_extend_backend(model_runner) -> str:
    """SGLang's own choice of attention backend for this runner's device and model."""
    device = str(getattr(model_runner, "device", "cpu"))
    if not device.startswith("cuda"):
        return "intel_amx" if _has_amx() else PREFIX_EXTEND
    try:
        from sglang.srt.arg_groups.model_override_base import get_default_attn_backend

        return get_default_attn_backend(model_runner.server_args, False, model_runner.model_config)
    except Exception as exc:  # SGLang's chooser needs a fully resolved server; Triton always runs
        logger.info("louver: SGLang's default attention backend not resolvable here (%s); using triton", exc)
        return "triton"


def _has_amx() -> bool:
    try:
        from sglang.srt.platforms import get_platform

        return bool(get_platform().has_amx)
    except Exception:
        return False


def make_extend_backend(name: str, model_runner):
    """(name, backend) of the extend backend ``name`` (``auto``: ``default_extend_backend``).

    An explicitly named backend that cannot be built is an error naming it; under ``auto`` a
    backend that does not build here (``intel_amx`` without SGLang's CPU kernels) falls back to
    ``torch_native``, logged.
    """
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from .names import BACKEND_NAME

    chosen = default_extend_backend(model_runner) if name == "auto" else name
    if chosen == PREFIX_EXTEND:
        return chosen, make_prefix_extend_backend(model_runner)
    if chosen == BACKEND_NAME:
        raise ValueError("LOUVER_EXTEND_BACKEND=louver: the extend backend must be a dense SGLang backend")
    if chosen not in ATTENTION_BACKENDS:
        raise ValueError(f"LOUVER_EXTEND_BACKEND={chosen!r} is not a registered SGLang attention backend; "
                         f"known: {sorted([PREFIX_EXTEND] + [n for n in ATTENTION_BACKENDS if n != BACKEND_NAME])}")
    try:
        return chosen, ATTENTION_BACKENDS[chosen](model_runner)
    except Exception as exc:
        if name != "auto" or chosen == "torch_native":
            raise ValueError(f"LOUVER_EXTEND_BACKEND={chosen!r} does not build here: {exc}") from exc
        logger.warning("louver: extend backend %s does not build here (%s); using %s", chosen, exc, PREFIX_EXTEND)
        return PREFIX_EXTEND, make_prefix_extend_backend(model_runner)
