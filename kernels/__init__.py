"""Compute kernels of louver-sgl (import name ``louver_kernels``; the folder is ``kernels/``)."""
