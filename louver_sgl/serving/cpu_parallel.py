"""Tensor parallelism on CPU: SGLang's process groups without CUDA communicators.

SGLang 0.5.23 runs CPU ranks over gloo (``sglang/srt/platforms/cpu.py:109``), but
``init_model_parallel_group`` (``sglang/srt/distributed/parallel_state.py:2180``) asks for PyNccl
for every backend other than NPU, XPU and mooncake, and ``GroupCoordinator.__init__`` (:463) then
builds a ``PyNcclCommunicator`` on the CPU device, which fails in ``torch.cuda.device``
("Expected a cuda device, but got: cpu"): ``--tp-size 2`` on CPU dies at startup. This hook asks
a gloo group for none of the CUDA communicators (PyNccl, custom all-reduce, MSCCL++, torch
symmetric memory); its all-reduce then takes the path SGLang has for CPU tensors (sgl-kernel's
shared-memory op where it is built, else ``torch.distributed`` over gloo, :695). With it, louver
serves ``--tp-size 2`` on CPU (each rank indexes its own KV heads; docs/serving.md).
"""

from __future__ import annotations

TARGET = "sglang.srt.distributed.parallel_state.init_model_parallel_group"
CUDA_COMMUNICATORS = ("use_pynccl", "use_custom_allreduce", "use_mscclpp", "use_torch_symm_mem_allreduce")


def gloo_without_cuda(original, group_ranks, local_rank, backend, *args, **kwargs):
    """The hook: a gloo group is built with every CUDA communicator off."""
    if backend == "gloo":
        kwargs.update({name: False for name in CUDA_COMMUNICATORS})
    return original(group_ranks, local_rank, backend, *args, **kwargs)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, gloo_without_cuda, HookType.AROUND)
