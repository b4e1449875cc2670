"""Evaluation helpers: needle-in-a-haystack prompts and a local SGLang server runner."""
