"""Accuracy and exactness evaluations on real traces and the real model (docs/results.md): exactness at scale, KL, needle-in-a-haystack, accuracy vs keys attended, their tables and plots."""
