"""Pure-torch stand-in for ``vllm._custom_ops.rotary_embedding``.

On a host without CUDA (and without SGLang's CPU engine), SGLang's rotary embedding binds this
vLLM op at construction; it is absent there, so the plugin registers this stand-in with the same
signature (in place on ``query`` and ``key``). Never installed when CUDA is available.
"""

from __future__ import annotations

import sys
import types

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox) -> None:
    """Apply RoPE in place. positions ``[T]``; query/key ``[T, H * head_size]`` (or 3-D views);
    cos_sin_cache ``[max_pos, rot_dim]`` holding cos then sin halves."""
    pos = positions.flatten()
    n = pos.shape[0]
    cos, sin = cos_sin_cache.index_select(0, pos).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1] * 2
    for tensor in (query, key):
        if tensor is None:
            continue
        view = tensor.view(n, -1, head_size)
        view[..., :rot] = _rotate(view[..., :rot].clone(), cos.to(view.dtype), sin.to(view.dtype), is_neox)


def install() -> bool:
    """Register the stand-in as ``vllm._custom_ops`` when CUDA is absent; True if installed."""
    if torch.cuda.is_available() or "vllm._custom_ops" in sys.modules:
        return False
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding
    package = sys.modules.get("vllm") or types.ModuleType("vllm")
    if not hasattr(package, "__path__"):
        package.__path__ = []
    package._custom_ops = ops
    sys.modules["vllm"] = package
    sys.modules["vllm._custom_ops"] = ops
    return True
