"""Several louver workers behind ``sglang-router`` on one machine.

Each worker is a plain ``python -m sglang.launch_server ... --attention-backend louver`` on its
own port, pinned to its share of the cores (``taskset``; SGLang's own ``--dp-size`` on a CPU
needs ``SGLANG_CPU_OMP_THREADS_BIND`` and, without sgl-kernel's CPU build, does not pin its
ranks: docs/serving.md). The router is ``python -m sglang_router.launch_router --worker-urls
...``; with ``cache_aware`` it sends a request to the worker whose radix tree holds the longest
prefix of it, so the prefix's KV pages and their louver index are reused there.

    python -m louver_eval.router --workers 2 --port 30000      # scripts/router.sh: workers + router, until Ctrl-C
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

from .server import YARN_32K_ARGS, ServerProcess, free_port, start_all, stop_servers_on_sigterm

POLICIES = ("cache_aware", "round_robin")
# SGLang's /health runs a one-token generation and waits up to 20 s for the scheduler to answer;
# a CPU worker in a long prefill misses the router's 5 s check timeout, and after a few misses the
# router marks every busy worker unhealthy and answers 503 (measured: 9 of 24 requests under
# round_robin with 6K-token prefixes on one core per worker). Workers answer /health without a
# generation: the router then checks that the process serves HTTP, which is what a killed worker
# fails; a stuck scheduler is caught by the request timeouts.
WORKER_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
# Fail over within seconds instead of the router's minutes (health checks every 60 s, 3 misses):
# a worker is out after 2 failed checks 2 s apart, or 2 failed requests in a row, and back after
# one good check.
FAST_FAILOVER = ["--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                 "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
                 "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "5"]


def split_cores(workers: int, cores: int | None = None) -> list[str]:
    """A ``taskset`` core list per worker: the cores split evenly (several workers share a core
    only when there are more workers than cores)."""
    cores = cores or os.cpu_count() or 1
    if workers >= cores:
        return [str(i % cores) for i in range(workers)]
    per = cores // workers
    return [f"{i * per}-{i * per + per - 1}" if per > 1 else str(i * per) for i in range(workers)]


def louver_workers(model: str | Path, count: int, log_dir: Path, env: dict[str, str] | None = None,
                   extra: list[str] | None = None, max_total_tokens: int = 65536) -> list[ServerProcess]:
    """``count`` louver workers (not started), each on a free port, its share of the cores, its
    own statistics file (``log_dir/stats-<i>.json``) and log (``log_dir/worker-<i>.log``)."""
    workers = []
    for i, cpus in enumerate(split_cores(count)):
        worker_env = {**WORKER_ENV, "LOUVER_STATS_FILE": str(log_dir / f"stats-{i}.json"), **(env or {})}
        workers.append(ServerProcess(model, "louver", free_port(), worker_env, extra, log_dir / f"worker-{i}.log",
                                     max_total_tokens, cpus=cpus))
    return workers


@contextmanager
def sglang_router(worker_urls: list[str], policy: str, port: int, log_path: Path,
                  extra: list[str] | None = None, timeout: float = 120.0) -> Iterator[str]:
    """``python -m sglang_router.launch_router`` on 127.0.0.1:``port`` in front of ``worker_urls``;
    yields its URL once every worker is registered and healthy."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--log-level", "info", *(extra or [])]
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, len(worker_urls), timeout, proc)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def router_workers(url: str) -> list[dict]:
    """The router's worker list (``GET /workers``): url, health and load of each."""
    with urllib.request.urlopen(url + "/workers", timeout=5) as resp:
        data = json.loads(resp.read())
    return data.get("workers", data) if isinstance(data, dict) else data


def healthy_count(url: str) -> int:
    try:
        return sum(1 for w in router_workers(url) if w.get("is_healthy", w.get("healthy", False)))
    except OSError:
        return 0


def wait_healthy(url: str, count: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until the router reports ``count`` healthy workers."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"router exited with code {proc.returncode} during startup")
        if healthy_count(url) >= count:
            return
        time.sleep(1)
    raise TimeoutError(f"router at {url}: fewer than {count} healthy workers after {timeout:.0f} s")


def serve(args: argparse.Namespace) -> None:
    """Start the workers and the router, print the address, serve until interrupted."""
    from .data.fetch_model import ensure_model

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = louver_workers(args.model or ensure_model(), args.workers, log_dir,
                             extra=["--dtype", "float32", *YARN_32K_ARGS, *args.worker_args])
    with ExitStack() as stack:
        for worker in workers:
            stack.callback(worker.stop)
        start_all(workers)
        url = stack.enter_context(sglang_router([w.url for w in workers], args.policy, args.port,
                                                log_dir / "router.log", FAST_FAILOVER))
        print(f"louver router ready at {url} ({args.policy}; workers "
              f"{', '.join(f'{w.url} on cores {w.cpus}' for w in workers)}; logs and statistics in {log_dir})",
              flush=True)
        try:
            while all(w.proc.poll() is None for w in workers):
                time.sleep(2)
            print("a worker exited; stopping", file=sys.stderr)
        except KeyboardInterrupt:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description="louver workers behind sglang-router on this machine")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--port", type=int, default=30000, help="the router's port")
    parser.add_argument("--policy", default="cache_aware", choices=POLICIES)
    parser.add_argument("--model", help="default: the offline SmolLM2-135M-Instruct (fp32, YaRN 32K)")
    parser.add_argument("--log-dir", default="/tmp/louver-router")
    parser.add_argument("worker_args", nargs="*", help="more sglang.launch_server flags for every worker")
    stop_servers_on_sigterm()
    serve(parser.parse_args())


if __name__ == "__main__":
    main()
