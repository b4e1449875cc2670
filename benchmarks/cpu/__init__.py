"""Kernel-level CPU benchmarks: the decode step against the best dense path, same-process A/B of two kernel builds, byte floors, fallback and prefill-build costs."""
