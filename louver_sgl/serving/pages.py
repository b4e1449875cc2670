"""The page index of a server: one ``PageIndexStore`` per layer beside SGLang's KV pool.

Stores are indexed by page id (= slot // page_size), so a request whose prefix matched in the
radix cache reads the pages' index already built by the first request. Lifecycle: any write into
a page invalidates its index; a page is built when it becomes full inside the forward that fills
it; a full page found unbuilt when read (written outside the backend, or refilled after it was
freed) is built then and counted.
"""

from __future__ import annotations

import logging

import torch

from ..config import LouverConfig
from ..index.store import PageIndexStore

logger = logging.getLogger("louver_sgl.serving")


class ServingIndex:
    """The index stores of every layer of a KV pool, and which pages are built."""

    def __init__(self, config: LouverConfig, pool, page_size: int, code_layout: str | None = None) -> None:
        self.config, self.pool, self.page_size, self.code_layout = config, pool, page_size, code_layout
        self.stores: dict[int, PageIndexStore] = {}
        self.built: dict[int, torch.Tensor] = {}
        self.pages_rebuilt_on_read = 0  # on the first layer (one count per page)
        self.first_layer = getattr(pool, "start_layer", 0) or 0
        # every layer's built flags as rows of one table [layers, pages] where the pool says how
        # many layers it has (built[layer] are views of its rows): one check covers all layers
        self.table: torch.Tensor | None = None
        self.table_rows: torch.Tensor | None = None  # the rows of the layers with a store
        # calls of invalidate (writes by slot: prefill, host-tier loads, which may land while a
        # decode forward runs); a check of all_built holds until this moves
        self.invalidations = 0

    def store(self, layer_id: int) -> PageIndexStore:
        store = self.stores.get(layer_id)
        if store is None:
            k_buffer = self.pool.get_key_buffer(layer_id)
            num_pages = k_buffer.shape[0] // self.page_size
            store = PageIndexStore(self.config, num_pages, k_buffer.shape[1], k_buffer.shape[2], k_buffer.dtype,
                                   k_buffer.device, self.code_layout)
            self.stores[layer_id] = store
            self.built[layer_id] = self._flags(layer_id, num_pages, k_buffer.device)
        return store

    def _flags(self, layer_id: int, num_pages: int, device) -> torch.Tensor:
        """The built flags of a new layer's store: a row of the table where there is one."""
        layers = getattr(self.pool, "layer_num", None)
        row = layer_id - self.first_layer
        if isinstance(layers, int) and 0 <= row < layers:
            if self.table is None:
                self.table = torch.zeros(layers, num_pages, dtype=torch.bool, device=device)
            if self.table.shape[1] == num_pages:
                rows = [] if self.table_rows is None else self.table_rows.tolist()
                self.table_rows = torch.tensor(sorted(rows + [row]), dtype=torch.long, device=device)
                return self.table[row]
        return torch.zeros(num_pages, dtype=torch.bool, device=device)  # all_built then says False

    def all_built(self, pages: torch.Tensor) -> bool:
        """Whether every layer with a store has built every page of ``pages`` ``[n]`` (one check for
        all layers, on the table; False without one: then each layer checks its own)."""
        if self.table_rows is None or len(self.table_rows) != len(self.built):
            return False
        table = self.table if len(self.table_rows) == self.table.shape[0] else self.table[self.table_rows]
        return bool(table[:, pages].all())

    def build(self, layer_id: int, page_ids: torch.Tensor) -> None:
        """Build pages ``page_ids`` ``[n]`` of layer ``layer_id`` from the pool's keys (host sync)."""
        if page_ids.numel() == 0:
            return
        page_ids = torch.unique(page_ids.long())
        self.store(layer_id).build_pages(self.pool.get_key_buffer(layer_id), page_ids)
        self.built[layer_id][page_ids] = True

    def invalidate(self, layer_id: int, slots: torch.Tensor) -> None:
        """Mark the pages of ``slots`` ``[n]`` as unbuilt (they were just written)."""
        self.invalidations += 1
        self.invalidate_pages(layer_id, slots.long() // self.page_size)

    def invalidate_pages(self, layer_id: int, page_ids: torch.Tensor) -> None:
        """Mark pages ``page_ids`` ``[n]`` (int64) as unbuilt (they were just written; the decode
        path's own writes, which it accounts for itself: ``invalidations`` does not move)."""
        self.store(layer_id)
        self.built[layer_id][page_ids] = False

    def full_pages(self, page_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """The page ids ``[n]`` of a decode batch's full pages (``page_table`` ``[B, max_pages]``,
        ``seq_lens`` ``[B]``): the pages its steps read through the index."""
        slots = torch.arange(page_table.shape[1], device=page_table.device)
        return page_table[slots[None, :] < (seq_lens // self.page_size)[:, None]]

    def build_unbuilt(self, layer_id: int, page_table: torch.Tensor, seq_lens: torch.Tensor,
                      needed: torch.Tensor | None = None) -> None:
        """Build full pages of a decode batch that are read but not built (``needed``: its
        ``full_pages``, where the caller has them)."""
        self.store(layer_id)
        if needed is None:
            needed = self.full_pages(page_table, seq_lens)
        missing = needed[~self.built[layer_id][needed]]
        if missing.numel():
            if layer_id == self.first_layer:
                self.pages_rebuilt_on_read += int(missing.numel())
            self.build(layer_id, missing)

    def allocated(self) -> dict:
        """What the index really holds now: the layers with a store, the bytes of their tensors'
        storages (as allocated, not as the layout implies) and the KV slots one layer covers."""
        storages: dict[int, int] = {}
        for store in self.stores.values():
            for t in store.tensors.values():
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        slots = int(self.pool.get_key_buffer(self.first_layer).shape[0])
        return {"layers": len(self.stores), "kv_slots": slots, "bytes": int(sum(storages.values()))}

    def log_memory_estimate(self) -> None:
        """Log the index memory of every layer against the KV pool's."""
        pool = self.pool
        try:
            k = pool.get_key_buffer(self.first_layer)
            probe = PageIndexStore(self.config, 1, k.shape[1], k.shape[2], k.dtype)
            per_layer = probe.bytes_per_token_head() * k.shape[1] * k.shape[0]
            kv_per_layer = 2 * k.numel() * k.element_size()
            logger.info("louver: index memory %.1f MiB (%.1f%% of the KV pool) over %d layers",
                        per_layer * pool.layer_num / 2**20, 100 * per_layer / kv_per_layer, pool.layer_num)
        except Exception as exc:  # an estimate only; never block startup on it
            logger.debug("louver: no index memory estimate (%s)", exc)
