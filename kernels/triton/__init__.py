"""Triton kernels of the louver GPU path (grid family).

``launch.py`` holds the launch parameters (from the active hardware profile), ``grid_build.py``
the batched page build, ``grid_decode.py`` the decode kernels (exact part and sample, certified
histogram, fused filter + sparse split-K attention). Each kernel has a thin launch wrapper whose
docstring gives every tensor's shape and dtype; the plain-torch specification they are tested
against is ``louver_sgl.index.grid`` and ``louver_sgl.decode.reference``.
"""
