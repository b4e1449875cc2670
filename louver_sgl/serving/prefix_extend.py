"""CPU extend that attends for the extended rows only: ``torch_native_prefix``.

SGLang's ``torch_native`` extend pads each request's queries to the whole sequence and runs
causal attention over ``seq_len x seq_len``, then keeps the last rows: a 64-token question after
a 16K-token cached prefix costs a full 16K x 16K attention in every layer (~90 s for SmolLM2 on
this CPU), so the radix cache saves nothing on time to first token, and each prefill chunk costs
the square of everything before it. This backend computes the same rows directly: the new
queries against the prefix (no mask) and against the new keys (causal), merged by their
log-sum-exps. Cases it does not cover (cross attention, encoder lengths, sliding windows,
non-causal layers) run ``torch_native``'s own code.
"""

from __future__ import annotations

import functools

import torch

NAME = "torch_native_prefix"


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """(out ``[1, H, n, Dv]``, log-sum-exp ``[1, H, n]`` fp32) of torch's CPU flash attention."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float):
    """``prefix_causal_attention`` through SDPA with an explicit ``[n, prefix_len + n]`` mask."""
    n = q.shape[0]
    mask = torch.arange(k.shape[0])[None, :] <= prefix_len + torch.arange(n)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                            scale: float) -> torch.Tensor:
    """Causal attention of ``n`` new queries after ``prefix_len`` cached tokens.

    q: ``[n, H, D]``; k: ``[prefix_len + n, H_kv, D]``; v: ``[prefix_len + n, H_kv, Dv]`` (query
    row i sees keys ``0 .. prefix_len + i``; H a multiple of H_kv, head h reads KV head
    ``h // (H / H_kv)``). Returns ``[n, H, Dv]`` in q's dtype. k and v are cast to q's dtype.
    """
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != prefix_len + n or v.shape[0] != k.shape[0] or heads % kv_heads:
        raise ValueError(f"prefix_causal_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"prefix_len {prefix_len}")
    group = heads // kv_heads
    k, v = k.to(q.dtype), v.to(q.dtype)
    if v.shape[-1] != dim:  # torch's CPU flash kernel wants one head size: masked attention instead
        return _masked_attention(q, k, v, prefix_len, scale)
    q_heads = q.transpose(0, 1)  # [H, n, D]
    k_new = k[prefix_len:].transpose(0, 1).repeat_interleave(group, dim=0)
    v_new = v[prefix_len:].transpose(0, 1).repeat_interleave(group, dim=0)
    out_new, lse_new = _flash(q_heads[None], k_new[None], v_new[None], True, scale)
    if prefix_len == 0:
        return out_new[0].transpose(0, 1)
    # the prefix part needs no mask, so a group's queries share their KV head as one longer query
    q_grouped = q_heads.reshape(kv_heads, group * n, dim)[None]
    out_pre, lse_pre = _flash(q_grouped, k[:prefix_len].transpose(0, 1)[None], v[:prefix_len].transpose(0, 1)[None],
                              False, scale)
    out_pre = out_pre.reshape(1, heads, n, -1)
    lse_pre = lse_pre.reshape(1, heads, n)
    top = torch.maximum(lse_pre, lse_new)
    w_pre, w_new = torch.exp(lse_pre - top), torch.exp(lse_new - top)
    merged = (out_pre.float() * w_pre[..., None] + out_new.float() * w_new[..., None]) / (w_pre + w_new)[..., None]
    return merged[0].transpose(0, 1).to(q.dtype)


@functools.cache
def _backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class PrefixExtendBackend(TorchNativeAttnBackend):
        """``torch_native`` whose causal extend computes the extended rows only."""

        def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                     seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None,
                                     scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                                     sliding_window_size=None):
            windowed = sliding_window_size is not None and sliding_window_size > -1
            if encoder_lens is not None or not causal or is_cross_attn or windowed:
                return super()._run_sdpa_forward_extend(
                    query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                    is_cross_attn, sliding_window_size)
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            start = 0
            rows = req_pool_indices.tolist()
            for row, prefix, new in zip(rows, extend_prefix_lens.tolist(), extend_seq_lens.tolist()):
                tokens = req_to_token[row, : prefix + new]
                output[start : start + new] = prefix_causal_attention(
                    query[start : start + new], k_cache[tokens], v_cache[tokens], prefix, scale)
                start += new
            return output

    return PrefixExtendBackend


def make_prefix_extend_backend(model_runner):
    """The ``torch_native_prefix`` backend for ``model_runner``."""
    return _backend_class()(model_runner)
