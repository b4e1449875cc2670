"""The serving plots' choice of decode metric and their speedups (no figure is drawn)."""

from benchmarks.serving.serving_plots import itl_key, speedups


def row(config, n, mean, median=None, workload="random", concurrency=4):
    r = {"config": config, "workload": workload, "concurrency": concurrency, "input_len": n, "mean_itl_ms": mean}
    if median is not None:
        r["median_itl_ms"] = median
    return r


def test_median_itl_only_where_every_row_of_the_panel_has_it():
    rows = [row("torch_native", 8192, 2857.0, 1626.0), row("budget-0.05", 8192, 1528.0, 503.0),
            row("torch_native", 8192, 1239.0, workload="shared-prefix"),
            row("budget-0.05", 8192, 294.0, 290.0, workload="shared-prefix")]
    assert itl_key(rows, "random", 4) == "median_itl_ms"
    assert itl_key(rows, "shared-prefix", 4) == "mean_itl_ms"  # one row lacks the median
    assert speedups(rows, "random", 4) == {"budget-0.05": [(8192, 1626.0 / 503.0)]}
    assert speedups(rows, "shared-prefix", 4) == {"budget-0.05": [(8192, 1239.0 / 294.0)]}
