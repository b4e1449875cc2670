"""Run ``sglang.benchmark.one_batch`` with SGLang plugins loaded (it does not load them itself).

Loading plugins registers the louver backend and, on CPU-only hosts, the rotary-embedding
stand-in SGLang needs there. Arguments are those of ``python -m sglang.benchmark.one_batch``.
"""

import runpy

from sglang.srt.plugins import load_plugins

load_plugins()
runpy.run_module("sglang.benchmark.one_batch", run_name="__main__", alter_sys=True)
