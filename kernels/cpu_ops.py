"""Loader of the compiled CPU kernels (torch cpp_extension, built once per CPU and cached).

The build happens on first use (about two minutes on two cores) and is cached in the caller's
directory (louver_sgl passes ``LOUVER_KERNEL_CACHE``, default ``~/.cache/louver_sgl/kernels``),
keyed by the source hash and the CPU model and its instruction-set flags because the code is
compiled for the host's instruction set.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

logger = logging.getLogger(__name__)
_SOURCE_DIR = Path(__file__).parent / "cpu"


def _sources() -> list[Path]:
    return sorted(_SOURCE_DIR.glob("*.cpp"))


def _cpuinfo_field(name: str) -> str | None:
    """The value of the first ``name`` line of /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model_name() -> str:
    """The CPU model string from /proc/cpuinfo (or the platform processor name)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def _cpu_flags() -> str:
    """The instruction-set flags of /proc/cpuinfo ("" where there are none)."""
    return _cpuinfo_field("flags") or ""


def _build_dir(cache_dir: Path) -> Path:
    # the model name alone does not identify the instruction set: virtual machines report
    # "AMD EPYC" for CPUs with and without AVX-512
    digest = hashlib.sha256(cpu_model_name().encode() + _cpu_flags().encode())
    # ninja rebuilds a build directory whose sources moved: each checkout gets its own
    digest.update(str(_SOURCE_DIR.resolve()).encode())
    for path in sorted(_SOURCE_DIR.glob("*.[ch]*")):  # sources and headers
        digest.update(path.name.encode() + path.read_bytes())
    key = digest.hexdigest()[:16]
    path = Path(cache_dir) / f"grid_decode_{key}"
    path.mkdir(parents=True, exist_ok=True)
    return path


DEFAULT_CACHE = Path.home() / ".cache" / "louver_sgl" / "kernels"


@functools.cache
def load_cpu_ops(cache_dir: Path = DEFAULT_CACHE):
    """The compiled module (ops: see kernels/cpu/module.cpp), built into or loaded from ``cache_dir``."""
    from torch.utils import cpp_extension

    logger.info("loading louver CPU kernels (compiles on first use)")
    return cpp_extension.load(
        name="louver_grid_decode",
        sources=[str(p) for p in _sources()],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-DAT_PARALLEL_OPENMP=1"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(_build_dir(cache_dir)),
        verbose=False,
    )


# why the kernels did not build, by cache directory (the compiler's message where it ran)
_BUILD_ERRORS: dict[Path, str] = {}


@functools.cache
def cpu_ops_available(cache_dir: Path = DEFAULT_CACHE, disabled: bool = False) -> bool:
    """True when the CPU kernels compile and load here (False, logged once, otherwise);
    ``disabled``: never build them."""
    if disabled:
        _BUILD_ERRORS[Path(cache_dir)] = "disabled by LOUVER_DISABLE_CPU_KERNELS"
        return False
    try:
        load_cpu_ops(cache_dir)
        return True
    except Exception as exc:  # a missing compiler must not break the torch path
        logger.warning("louver CPU kernels unavailable, using the torch path: %s", exc)
        _BUILD_ERRORS[Path(cache_dir)] = _build_message(exc)
        return False


def cpu_ops_build_error(cache_dir: Path = DEFAULT_CACHE) -> str | None:
    """Why the kernels did not build or load into ``cache_dir`` (None if they did or were not tried)."""
    return _BUILD_ERRORS.get(Path(cache_dir))


def _build_message(exc: Exception) -> str:
    """The exception and, for a failed compile, the compiler's output it carries (its tail)."""
    text = f"{type(exc).__name__}: {exc}"
    output = getattr(exc, "output", None) or getattr(exc.__cause__, "output", None)
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    if output and output.strip()[-200:] not in text:  # torch's message usually carries it already
        text += "\n" + output[-4000:]
    return text[-6000:]
