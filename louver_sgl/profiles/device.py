"""Device names and profile keys: which tuned profile belongs to the hardware we run on.

A profile file is named after its device like SGLang's and vLLM's tuned kernel configs: the raw
name (``torch.cuda.get_device_name()`` for CUDA; CPU model plus ISA level for CPUs) lower-cased,
with every run of non-alphanumerics replaced by ``_`` (``NVIDIA H200`` -> ``nvidia_h200``,
``AMD EPYC`` with AVX-512 -> ``cpu_amd_epyc_avx512``).
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

TARGETS = ("cpu", "cuda")


def normalize_device_name(name: str) -> str:
    """Lower-case ``name`` with runs of non-alphanumerics as single underscores."""
    key = re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")
    if not key:
        raise ValueError(f"device name {name!r} has no letters or digits")
    return key


def cpu_model_name() -> str:
    """The CPU model string from /proc/cpuinfo (or the platform processor name)."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_isa_level(flags: set[str] | None = None) -> str:
    """The widest x86 vector ISA the CPU reports (``avx512``, ``avx2``, ``avx``) or the machine name."""
    flags = cpu_flags() if flags is None else flags
    for level, flag in (("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx")):
        if flag in flags:
            return level
    return normalize_device_name(platform.machine() or "generic")


def cpu_flags() -> set[str]:
    """The ``flags`` of the first processor in /proc/cpuinfo (empty where there is none)."""
    for line in _cpuinfo_lines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def device_name(target: str) -> str:
    """The raw device name of ``target`` on this machine (CUDA: device 0)."""
    if target == "cpu":
        return f"{cpu_model_name()} {cpu_isa_level()}"
    if target == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("target 'cuda' asked for, but torch sees no CUDA device")
        return torch.cuda.get_device_name(0)
    raise ValueError(f"target must be one of {list(TARGETS)}, got {target!r}")


def device_isa(target: str) -> str:
    """The instruction set of ``target`` here: the CPU's ISA level (``avx512``, ``avx2``, ...) or the
    CUDA device's architecture (``sm90`` for compute capability 9.0)."""
    if target == "cpu":
        return cpu_isa_level()
    if target == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("target 'cuda' asked for, but torch sees no CUDA device")
        major, minor = torch.cuda.get_device_capability(0)
        return f"sm{major}{minor}"
    raise ValueError(f"target must be one of {list(TARGETS)}, got {target!r}")


def profile_key(target: str, raw_name: str) -> str:
    """File stem of the profile of ``raw_name``: CPU keys carry a ``cpu_`` prefix."""
    key = normalize_device_name(raw_name)
    return f"cpu_{key}" if target == "cpu" and not key.startswith("cpu_") else key


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
