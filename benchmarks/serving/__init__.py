"""Benchmarks through an SGLang server: TPOT/throughput grids against torch_native, one-batch steps, soaks and telemetry sums."""
