"""Pages loaded back from SGLang's host tier (hierarchical cache) into device slots.

HiCache backs device KV pages up to host memory and loads them back into *new* device slots; the
index of a slot describes whatever page was built there before. An AROUND hook on the host
pool's ``load_to_device_per_layer`` marks the destination pages of every load unbuilt in the
louver index of that device pool, so the decode step rebuilds them before it reads them
(``ServingIndex.build_unbuilt``, counted as rebuilt on read). The index does not travel with the
pages: a page build costs a few microseconds per token, less than moving the index bytes would.
"""

from __future__ import annotations

import weakref

TARGET = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost.load_to_device_per_layer"

# device KV pool id -> the ServingIndex beside it (weakly held: a pool outlives no server)
_INDEXES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def track(device_pool, index) -> None:
    """Route loads into ``device_pool`` to ``index`` (a ``ServingIndex``)."""
    _INDEXES[id(device_pool)] = index


def loaded_to_device(original, self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs):
    """The hook: the load, then its destination pages marked unbuilt for that layer."""
    result = original(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs)
    index = _INDEXES.get(id(device_pool))
    if index is not None and not kwargs.get("is_draft", False):
        start = getattr(device_pool, "start_layer", 0) or 0  # the host pool counts the device pool's own layers
        index.invalidate(start + int(layer_id), device_indices)
    return result


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, loaded_to_device, HookType.AROUND)
