"""One decode API over registered implementations, in FlashInfer's plan/run shape.

    decode = LouverDecode(config, device="cpu")              # impl="auto": best available here
    decode.plan(page_table, seq_lens)                         # host side, once per forward pass
    out = decode.run(q, k_cache, v_cache, store, sigma).out   # device side, once per layer
    stats = decode.run(..., stats=True).stats                 # + StepStats
    result = decode.run(..., attended=True)                   # + attended key set (audits; every impl)

Implementations register by name (``register_implementation``): ``torch`` (vectorised torch, both
bound families), ``cpu`` (the compiled CPU kernels), ``triton`` (the GPU kernels, filter and
attention fused per split) and ``triton_stream`` (the GPU kernels with a separate filter pass that
compacts survivors, then attention over them); both Triton ones run on CPU under
``TRITON_INTERPRET=1`` for tests. ``auto`` picks ``triton`` on CUDA devices and on CPU ``cpu``
where the kernels build and the config is the grid family, else ``torch``. Every config option
means the same on every implementation, or the wrapper's constructor raises ``ValueError``
naming the option and the implementation. ``reference.reference_decode`` is the specification
they are all tested against (tests/test_decode_conformance.py).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..config import LouverConfig
from .contract import Capacity, DecodeImplementation, DecodeResult, HeadShapes, check_shares

# name -> "module:Class" (imported when first asked for: the Triton module needs triton)
_IMPLEMENTATIONS: dict[str, str | type] = {
    "torch": "louver_sgl.decode.impl_torch:TorchDecode",
    "cpu": "louver_sgl.decode.impl_cpu:CpuDecode",
    "triton": "louver_sgl.decode.impl_triton:TritonDecode",
    "triton_stream": "louver_sgl.decode.impl_triton_stream:TritonStreamDecode",
    "triton_tiled": "louver_sgl.decode.impl_triton_tiled:TritonTiledDecode",
}


def register_implementation(name: str, target: str | type) -> None:
    """Register a ``DecodeImplementation`` subclass (or its "module:Class" path) under ``name``."""
    if not name or name == "auto":
        raise ValueError(f"an implementation cannot be named {name!r}")
    _IMPLEMENTATIONS[name] = target


def implementation_names() -> list[str]:
    """Every registered implementation's name."""
    return list(_IMPLEMENTATIONS)


def implementation(name: str) -> type[DecodeImplementation]:
    """The registered implementation class ``name`` (``ValueError`` naming the known ones)."""
    target = _IMPLEMENTATIONS.get(name)
    if target is None:
        raise ValueError(f"unknown decode implementation {name!r}; known: {['auto', *_IMPLEMENTATIONS]}")
    if isinstance(target, str):
        module, _, cls = target.partition(":")
        target = _IMPLEMENTATIONS[name] = getattr(importlib.import_module(module), cls)
    return target


def available_implementations(device: torch.device | str) -> list[str]:
    """The implementations that can run on ``device`` in this process."""
    device = torch.device(device)
    return [name for name in _IMPLEMENTATIONS if _unavailable(name, device) is None]


def _unavailable(name: str, device: torch.device) -> str | None:
    try:
        return implementation(name).unavailable(device)
    except ImportError as exc:  # e.g. no triton in this environment
        return f"it does not import here ({exc})"


def resolve_implementation(impl: str, config: LouverConfig, device: torch.device | str) -> str:
    """The implementation ``impl`` stands for on ``device`` with ``config`` (``auto`` resolved);
    raises ``ValueError`` if it cannot run there or cannot honour an option of ``config``."""
    device = torch.device(device)
    if impl == "auto":
        impl = _auto(config, device)
    why = _unavailable(impl, device)
    if why is not None:
        raise ValueError(f"decode implementation {impl!r} is not available on {device.type}: {why}")
    implementation(impl).check_config(config, device)
    return impl


def uses_int8_token_bounds(impl: str) -> bool:
    """Whether implementation ``impl`` gates tokens and certifies T with the int8 token bounds
    (``reference_compiled.int8_token_bounds_reference``) rather than the store's fp32 ones."""
    return implementation(impl).int8_token_bounds


def _auto(config: LouverConfig, device: torch.device) -> str:
    if device.type == "cuda":
        return "triton"
    if config.grid_codes and _unavailable("cpu", device) is None and _honours("cpu", config, device):
        return "cpu"
    return "torch"


def _honours(impl: str, config: LouverConfig, device: torch.device) -> bool:
    try:
        implementation(impl).check_config(config, device)
    except ValueError:
        return False
    return True


class LouverDecode:
    """The louver decode step of one attention configuration.

    Args:
        config: the ``LouverConfig`` (policy, layout, dispatch); the index store must share its
            index layout.
        device: where the KV caches live. impl: an implementation name or "auto".
        launch: the implementation's launch parameters (``impl_cpu.CpuLaunch`` or a dict of its
            fields for ``cpu``, ``TritonLaunch`` or a dict for ``triton``; None: defaults).
        shapes: the attention shapes (``HeadShapes``); with them ``plan`` allocates every buffer
            and ``run`` allocates none (on ``triton``, with both capacities, the workspace is
            allocated once here: graph-safe). Without them the first run of a plan allocates.
        max_batch, max_pages: fixed capacities of a plan; ``plan`` raises ``ValueError`` naming
            the limit a batch exceeds.
    """

    def __init__(self, config: LouverConfig, device: torch.device | str = "cpu", impl: str = "auto",
                 launch: Any = None, shapes: HeadShapes | None = None, max_batch: int | None = None,
                 max_pages: int | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.impl_name = resolve_implementation(impl, config, self.device)
        cls = implementation(self.impl_name)
        self.impl = cls(config, self.device, launch, shapes, Capacity(max_batch, max_pages))
        self._plan = None

    def plan(self, page_table: torch.Tensor, seq_lens: torch.Tensor) -> "LouverDecode":
        """Plan a decode batch (host side; may allocate): page_table ``[B, max_pages]`` int page
        ids of each request's pages in order, seq_lens ``[B]`` tokens per request including the
        one being decoded. Every later ``run`` until the next ``plan`` is a step of this batch."""
        self._plan = self.impl.plan(page_table, seq_lens)
        return self

    @property
    def current_plan(self):
        """The implementation's plan of the last ``plan`` call (None before any)."""
        return self._plan

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, store, sigma: float,
            out: torch.Tensor | None = None, stats: bool = False, attended: bool = False,
            estimate_share: torch.Tensor | None = None) -> DecodeResult:
        """One decode step of the planned batch for one layer.

        Args:
            q: ``[B, H_q, D]`` queries (any float dtype; any strides on ``cpu``).
            k_cache, v_cache: ``[num_slots, H_kv, D]`` / ``[num_slots, H_kv, D_v]`` paged KV
                buffers (slot = page_id · P + offset).
            store: the layer's ``PageIndexStore`` (every full indexed page built).
            sigma: softmax scale. out: optional caller-owned ``[B, H_q, D_v]`` output.
            stats: also return the ``StepStats``. attended: also return, per request, the bool
                ``[H_q, L]`` attended key set, the one the step itself attended (every implementation;
                an audit aid: it adds a buffer write per attended key and a host loop).
            estimate_share: optional fp64 ``[B]`` CPU tensor, the a-posteriori rule's estimate share
                per request in place of the config's ``estimate_share`` (``share_control.ShareControl``
                picks it per request and layer; implementations with ``takes_shares``).

        Returns a ``DecodeResult``: ``out`` ``[B, H_q, D_v]`` in q's dtype, ``stats`` (None unless
        ``stats`` or ``attended``) and ``attended`` (None unless ``attended``).
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("LouverDecode.run before plan: plan the batch first")
        if attended and not self.impl.returns_attended:
            raise ValueError(f"the {self.impl_name!r} decode implementation does not return the attended set; "
                             "use impl='torch'")
        shares = {}
        if estimate_share is not None:
            if not self.impl.takes_shares:
                raise ValueError(f"the {self.impl_name!r} decode implementation takes no estimate share per request; "
                                 "use impl='cpu' or 'torch'")
            check_shares(estimate_share, q.shape[0], self.config)
            shares["estimate_share"] = estimate_share
        result = self.impl.run(plan, q=q, k_cache=k_cache, v_cache=v_cache, store=store, sigma=sigma, out=out,
                               stats=stats, attended=attended, **shares)
        if result.stats is not None and not (stats or attended):  # implementations may count anyway
            return DecodeResult(result.out)
        return result


def louver_decode(q, k_cache, v_cache, page_table, seq_lens, store, sigma: float, config: LouverConfig | None = None,
                  out=None, impl: str = "auto", launch: Any = None):
    """One decode step in one call (plans, then runs; for scripts and tests): arguments as
    ``LouverDecode.plan`` and ``run``, config defaulting to ``store.config``. Returns
    ``(out [B, H_q, D_v], StepStats)``."""
    decode = LouverDecode(config or store.config, k_cache.device, impl=impl, launch=launch)
    result = decode.plan(page_table, seq_lens).run(q, k_cache, v_cache, store, sigma, out=out, stats=True)
    return result.out, result.stats
