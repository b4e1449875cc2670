"""Page build: deterministic bytes, radii that enclose every member, packing round trips."""

from __future__ import annotations

import pytest
import torch

from louver_sgl import LouverConfig, PageIndexStore
from louver_sgl.index.grid import grid_centers, pack_codes, unpack_codes

CONFIGS = [
    LouverConfig(page_size=32, family="grid", grid_bits=2),
    LouverConfig(page_size=32, family="grid", grid_bits=4),
    LouverConfig(page_size=64, family="grid", grid_bits=8),
    LouverConfig(page_size=32, family="clustered", n_subspaces=8, cluster_size=4),
    LouverConfig(page_size=64, family="clustered", n_subspaces=16, cluster_size=4, residual_norms=True),
]


def _store(config, keys):
    store = PageIndexStore(config, len(keys) // config.page_size, keys.shape[1], keys.shape[2], keys.dtype)
    store.build_pages(keys, torch.arange(store.num_pages))
    return store


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.family}-{c.grid_bits}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_build_is_deterministic(config, dtype):
    """Same keys -> same bytes, whether pages are built together, alone, or in another order."""
    keys = (torch.randn(8 * config.page_size, 2, 64, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    a, b = _store(config, keys), _store(config, keys.clone())
    c = PageIndexStore(config, 8, 2, 64, dtype)
    for page in [5, 1, 7, 0, 3, 2, 6, 4]:
        c.build_pages(keys, torch.tensor([page]))
    for name, tensor in a.tensors.items():
        assert torch.equal(tensor.view(torch.uint8), b.tensors[name].view(torch.uint8)), name
        assert torch.equal(tensor.view(torch.uint8), c.tensors[name].view(torch.uint8)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grid_radius_encloses_members(dtype):
    """Every stored key lies within radius of its dequantized bin center (fp64 check)."""
    config = CONFIGS[1]
    keys = (torch.randn(4 * 32, 3, 64) * 100).to(dtype)
    store = _store(config, keys)
    t = store.tensors
    codes = unpack_codes(store.page_codes(torch.arange(4)), 4)
    centers = grid_centers(codes, t["lo"], t["scale"]).double()
    dist = (keys.double().view(4, 32, 3, 64) - centers).abs()
    assert bool((dist <= t["radius"].double().unsqueeze(1)).all())


@pytest.mark.parametrize("config", CONFIGS[3:], ids=["radius", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cluster_radius_encloses_members(config, dtype):
    """‖k_s − c‖ <= cluster radius (and <= residual norm) for every member, in fp64."""
    size, s = config.page_size, config.n_subspaces
    keys = (torch.randn(3 * size, 2, 64) * 7).to(dtype)
    store = _store(config, keys)
    t = store.tensors
    codes = t["codes"].view(3, size, 2, s).long()
    width = 64 // s
    x = keys.double().view(3, size, 2, s, width)
    centers = t["centers"].double()  # [n, H, S, C, w]
    idx = codes.permute(0, 2, 3, 1)[..., None].expand(-1, -1, -1, -1, width)
    own = torch.gather(centers, 3, idx).permute(0, 3, 1, 2, 4)  # [n, P, H, S, w]
    dist = (x - own).norm(dim=-1)
    radius = torch.gather(t["radius"].double(), 3, codes.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    assert bool((dist <= radius).all())
    if config.residual_norms:
        assert bool((dist <= t["residual"].double().view(3, size, 2, s)).all())
    counts = torch.nn.functional.one_hot(codes, size // config.cluster_size).sum(1)
    assert bool((counts == config.cluster_size).all()), "clusters must be balanced"


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (5, 7, 64), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, 7, 64 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_index_bytes_are_reported():
    """Index memory per token and head: grid 4-bit at D=64 fp16 is 32 B codes + page codebooks."""
    store = PageIndexStore(LouverConfig(page_size=64, grid_bits=4), 10, 3, 64, torch.float16)
    assert store.bytes_per_token_head() == pytest.approx(32 + 3 * 2 * 64 / 64)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_block16_codes_are_the_token_codes_rearranged(bits):
    """The block16 layout stores the same codes: page_codes reads back the token layout's bytes,
    and a block's dword j of token t sits at [block, head, j, t]."""
    config = LouverConfig(page_size=32, grid_bits=bits)
    keys = torch.randn(5 * 32, 3, 64, generator=torch.Generator().manual_seed(4)) * 3
    stores = {}
    for layout in ("token", "block16"):
        stores[layout] = PageIndexStore(config, 5, 3, 64, torch.float32, code_layout=layout)
        stores[layout].build_pages(keys, torch.tensor([3, 0, 4, 1, 2]))
    tok, blk = stores["token"], stores["block16"]
    assert blk.tensors["codes"].shape == (5 * 2, 3, 64 * bits // 32, 16, 4)
    pages = torch.tensor([2, 0, 4])
    assert torch.equal(blk.page_codes(pages), tok.page_codes(pages))
    slot, head, word = 37, 2, 1  # page 1, block 0 of it: block row 2, token 5
    assert torch.equal(blk.tensors["codes"][slot // 16, head, word, slot % 16],
                       tok.tensors["codes"][slot, head, 4 * word:4 * word + 4])
    assert blk.code_bytes_per_page() == tok.code_bytes_per_page() == 32 * 3 * 64 * bits // 8
    assert blk.nbytes() == tok.nbytes()


def test_code_layout_default_and_bad_requests():
    """CPU grid stores default to block16 where it applies; a layout that does not fit is refused."""
    assert PageIndexStore(LouverConfig(page_size=32), 2, 2, 64, torch.float16).code_layout == "block16"
    assert PageIndexStore(LouverConfig(page_size=8), 2, 2, 64, torch.float16).code_layout == "token"
    clustered = LouverConfig(page_size=32, family="clustered", n_subspaces=8, cluster_size=4)
    assert PageIndexStore(clustered, 2, 2, 64, torch.float16).code_layout == "token"
    with pytest.raises(ValueError, match="multiple of 16"):
        PageIndexStore(LouverConfig(page_size=8), 2, 2, 64, torch.float16, code_layout="block16")
    with pytest.raises(ValueError, match="code_layout must be"):
        PageIndexStore(LouverConfig(page_size=32), 2, 2, 64, torch.float16, code_layout="rows")
