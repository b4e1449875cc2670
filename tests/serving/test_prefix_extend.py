"""The CPU extend over the extended rows only (``torch_native_prefix``) against fp64 causal
attention, and against SGLang's ``torch_native`` extend inside the attention kit."""

import pytest
import torch

from louver_sgl.serving.prefix_extend import prefix_causal_attention


def reference(q, k, v, prefix_len, scale):
    """fp64 softmax attention; row i sees keys 0 .. prefix_len + i."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale
    keys = torch.arange(k.shape[0])
    mask = keys[None, :] <= prefix_len + torch.arange(n)[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv)


@pytest.mark.parametrize("prefix_len,n", [(0, 1), (0, 37), (1, 1), (64, 5), (300, 64), (1000, 130)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("value_dim", [32, 24])
def test_matches_fp64_causal_attention(prefix_len, n, heads, kv_heads, value_dim):
    gen = torch.Generator().manual_seed(prefix_len * 7 + n + heads)
    q = torch.randn(n, heads, 32, generator=gen)
    k = 2 * torch.randn(prefix_len + n, kv_heads, 32, generator=gen)
    v = torch.randn(prefix_len + n, kv_heads, value_dim, generator=gen)
    out = prefix_causal_attention(q, k, v, prefix_len, 32 ** -0.5)
    assert out.shape == (n, heads, value_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(q, k, v, prefix_len, 32 ** -0.5), atol=2e-5, rtol=1e-4)


def test_half_precision_cache_and_bad_shapes():
    q = torch.randn(8, 4, 16)
    k, v = torch.randn(40, 2, 16).half(), torch.randn(40, 2, 16).half()
    out = prefix_causal_attention(q, k, v, 32, 0.25)
    torch.testing.assert_close(out.double(), reference(q, k.float(), v.float(), 32, 0.25), atol=1e-4, rtol=1e-3)
    with pytest.raises(ValueError, match="prefix_len"):
        prefix_causal_attention(q, k, v, 31, 0.25)
