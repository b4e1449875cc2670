"""Speed-of-light rows of the GPU benchmark: what the louver step's two passes could cost at best.

* ``code_scan``: reads every indexed token's codes through the page table and does one integer
  tensor-core dot per tile (against 16 rows of weights, the filter's shape), with no page terms,
  no bounds and no compaction; one value per program is written so that nothing is optimised
  away. Its time is the floor of a filter pass over the codes.
* ``folded_lists``: per (request, KV head) a sorted random subset of a fraction of the tokens,
  head-folded (index = slot·H_kv + h, Vortex's layout), in the CSR form SGLang's Triton decode
  kernel reads (``kv_indptr``, ``kv_indices``), and the same subset as ``triton_tiled`` lists,
  so both attention kernels can be timed on the same rows.

Each has a plain-torch reference (``code_scan_reference``; the lists are plain torch already)
tested under the Triton interpreter (``tests/gpu/test_gpu_sol.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _code_scan_kernel(table_ptr, lens_ptr, codes_ptr, w_ptr, out_ptr, stride_tb, stride_cs, stride_ch,
                      P: tl.constexpr, D: tl.constexpr, TP: tl.constexpr, BITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    N: tl.constexpr = TP * P
    pages = tl.load(lens_ptr + b) // P
    j = tl.arange(0, TP)
    p = tile * TP + j
    page = tl.load(table_ptr + b * stride_tb + p, mask=p < pages, other=0).to(tl.int64)
    tok = tl.arange(0, P)
    slots = tl.reshape(page[:, None] * P + tok[None, :], (N,))
    live = tl.reshape((p < pages)[:, None] & (tok[None, :] >= 0), (N,))
    dim = tl.arange(0, D)
    per_byte: tl.constexpr = 8 // BITS
    byte = tl.load(codes_ptr + slots[:, None] * stride_cs + h * stride_ch + (dim // per_byte)[None, :],
                   mask=live[:, None], other=0)
    mask: tl.constexpr = (1 << BITS) - 1
    codes = ((byte.to(tl.int32) >> ((dim % per_byte) * BITS)[None, :]) & mask).to(tl.float16)
    r = tl.arange(0, 16)
    w = tl.load(w_ptr + r[:, None] * D + dim[None, :])
    acc = tl.dot(w, tl.trans(codes), out_dtype=tl.float32)  # [16, N]
    row = (b * tl.num_programs(1) + h) * tl.num_programs(2) + tile
    tl.store(out_ptr + row, tl.sum(tl.sum(acc, 1), 0))


def code_scan(page_table, seq_lens, codes, weights, out, page_size: int, bits: int, tile_pages: int,
              num_warps: int = 4) -> None:
    """out ``[B, H_kv, NT]`` fp32: per (request, KV head, tile of ``tile_pages`` pages) the sum of
    ``weights`` ``[16, D]`` fp16 dotted with the tile's unpacked codes (``codes`` ``[slots, H_kv,
    D·bits/8]`` uint8) of its full pages."""
    batch, h_kv, n_tiles = out.shape
    dim = weights.shape[1]
    _code_scan_kernel[(batch, h_kv, n_tiles)](
        page_table, seq_lens, codes, weights, out, page_table.stride(0), codes.stride(0), codes.stride(1),
        P=page_size, D=dim, TP=tile_pages, BITS=bits, num_warps=num_warps)


def code_scan_reference(page_table, seq_lens, codes, weights, page_size: int, bits: int, tile_pages: int,
                        n_tiles: int) -> torch.Tensor:
    """``code_scan`` in plain torch (fp64)."""
    batch, h_kv = page_table.shape[0], codes.shape[1]
    per_byte = 8 // bits
    shifts = (torch.arange(weights.shape[1]) % per_byte) * bits
    out = torch.zeros(batch, h_kv, n_tiles, dtype=torch.float64)
    for b in range(batch):
        pages = int(seq_lens[b]) // page_size
        for t in range(n_tiles):
            ids = page_table[b, t * tile_pages: min((t + 1) * tile_pages, pages)].long()
            if len(ids) == 0:
                continue
            slots = (ids[:, None] * page_size + torch.arange(page_size)).reshape(-1)
            raw = codes[slots][..., torch.arange(weights.shape[1]) // per_byte].long()  # [N, H_kv, D]
            unpacked = ((raw >> shifts) & ((1 << bits) - 1)).double()
            out[b, :, t] = torch.einsum("nhd,rd->h", unpacked, weights.double())
    return out


def folded_lists(page_table, seq_lens, h_kv: int, page_size: int, fraction: float, capacity: int, seed: int = 0):
    """A random ``fraction`` of every request's tokens per KV head, as (CSR for SGLang's decode:
    ``kv_indptr`` ``[B·H_kv + 1]`` int32, ``kv_indices`` int32 head-folded; ``triton_tiled``
    lists: ``slot`` ``[B, H_kv, capacity]`` int32, ``total`` ``[B, H_kv]`` int32)."""
    gen = torch.Generator().manual_seed(seed)
    batch = page_table.shape[0]
    device = page_table.device
    indptr, indices = [0], []
    slot = torch.zeros(batch, h_kv, capacity, dtype=torch.int32)
    total = torch.zeros(batch, h_kv, dtype=torch.int32)
    table = page_table.cpu().long()
    for b in range(batch):
        n = int(seq_lens[b])
        count = max(1, round(fraction * n))
        for h in range(h_kv):
            pos = torch.randperm(n, generator=gen)[:count].sort().values
            slots = table[b, pos // page_size] * page_size + pos % page_size
            indices.append(slots * h_kv + h)
            indptr.append(indptr[-1] + count)
            slot[b, h, :count] = slots.to(torch.int32)
            total[b, h] = count
    csr = (torch.tensor(indptr, dtype=torch.int32, device=device), torch.cat(indices).to(device, torch.int32))
    return csr, dict(slot=slot.to(device), total=total.to(device))
