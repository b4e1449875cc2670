"""Pages loaded back from the host tier into device slots are rebuilt before they are read."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch

from louver_sgl import LouverConfig
from louver_sgl.serving import host_tier
from louver_sgl.serving.pages import ServingIndex

P = 16


def _index():
    keys = torch.randn(8 * P, 2, 64)
    pool = SimpleNamespace(start_layer=0, layer_num=1, get_key_buffer=lambda layer: keys)
    index = ServingIndex(LouverConfig(page_size=P), pool, P)
    index.build(0, torch.arange(8))
    return pool, index, keys


def test_a_load_back_marks_its_destination_pages_unbuilt_and_the_read_rebuilds_them():
    pool, index, keys = _index()
    host_tier.track(pool, index)
    calls = []
    original = lambda *args, **kwargs: calls.append(args)  # noqa: E731 (the host pool's copy)
    keys[3 * P: 5 * P] = torch.randn(2 * P, 2, 64)  # the loaded pages' new contents
    device_indices = torch.arange(3 * P, 5 * P)
    host_tier.loaded_to_device(original, None, pool, torch.arange(2 * P), device_indices, 0, "direct")
    assert calls and index.built[0].tolist() == [True] * 3 + [False] * 2 + [True] * 3
    index.build_unbuilt(0, torch.arange(8)[None], torch.tensor([8 * P]))
    assert bool(index.built[0].all()) and index.pages_rebuilt_on_read == 2
    fresh = ServingIndex(LouverConfig(page_size=P), pool, P)
    fresh.build(0, torch.arange(8))
    for name, tensor in index.stores[0].tensors.items():  # rebuilt from the loaded keys
        assert torch.equal(tensor, fresh.stores[0].tensors[name]), name


def test_loads_into_other_pools_and_draft_loads_are_left_alone():
    pool, index, _ = _index()
    host_tier.track(pool, index)
    other = SimpleNamespace(start_layer=0)
    host_tier.loaded_to_device(lambda *a, **k: None, None, other, None, torch.arange(P), 0, "direct")
    host_tier.loaded_to_device(lambda *a, **k: None, None, pool, None, torch.arange(P), 0, "direct", is_draft=True)
    assert bool(index.built[0].all())


def test_the_hook_fits_the_host_pool_method_it_wraps():
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    params = list(inspect.signature(MHATokenToKVPoolHost.load_to_device_per_layer).parameters)
    assert params[:6] == ["self", "device_pool", "host_indices", "device_indices", "layer_id", "io_backend"]
    module, _, attr = host_tier.TARGET.rpartition(".")
    assert module.endswith("MHATokenToKVPoolHost") and attr == "load_to_device_per_layer"


def test_one_check_says_whether_every_layer_has_a_batchs_pages_built():
    """The built flags of a pool's layers are rows of one table: ``all_built`` answers for every
    layer with a store at once; a write (or a load back) into any layer's page turns it False
    until that layer rebuilds the page; a layer outside the table leaves every check False."""
    keys = torch.randn(8 * P, 2, 64)
    pool = SimpleNamespace(start_layer=2, layer_num=3, get_key_buffer=lambda layer: keys)
    index = ServingIndex(LouverConfig(page_size=P), pool, P)
    for layer in (2, 3, 4):
        index.build(layer, torch.arange(6))
    assert index.table is not None and index.table_rows.tolist() == [0, 1, 2]
    assert index.built[3].data_ptr() == index.table[1].data_ptr()
    needed = index.full_pages(torch.arange(8)[None], torch.tensor([6 * P + 3]))
    assert needed.tolist() == list(range(6)) and index.all_built(needed)
    assert not index.all_built(torch.tensor([6]))
    index.invalidate_pages(3, torch.tensor([4]))
    assert not index.all_built(needed) and index.all_built(torch.tensor([0, 5]))
    index.build_unbuilt(3, torch.arange(8)[None], torch.tensor([6 * P + 3]), needed)
    assert index.all_built(needed) and index.pages_rebuilt_on_read == 0  # (counted on the first layer)
    seen = index.invalidations
    index.invalidate(2, torch.arange(P))  # a write by slot (a prefill, a host-tier load) is counted
    assert index.invalidations == seen + 1 and not index.all_built(needed)
    index.build(2, torch.tensor([0]))
    index.build(7, torch.arange(6))  # a layer the pool's count leaves out
    assert not index.all_built(needed)
