"""One-question studies on captured traces: bound families, the certified rule against an exact oracle, the provisional threshold, tuned-vs-default comparisons."""
