"""Start a local SGLang HTTP server in a subprocess, wait until it serves, query it, stop it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


# SmolLM2's 8K context stretched to 32K by YaRN, as scripts/run.sh serves it (SGLang reads the
# context length from max_position_embeddings)
YARN_CONTEXT = 32768
YARN_32K_ARGS = ["--json-model-override-args", json.dumps({
    "max_position_embeddings": YARN_CONTEXT, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 8192,
                                                          "rope_theta": 100000.0}})]
NATIVE_CONTEXT = 8192  # SmolLM2's own context
# SGLang's torch_native extend is seq x seq per chunk: at 32K one chunk takes longer than the
# scheduler watchdog's default 300 s, which then kills the server
LONG_PREFILL_ARGS = ["--watchdog-timeout", "3600"]


def long_context_args(tokens: int) -> list[str]:
    """Server flags for requests of up to ``tokens`` tokens (prompt plus output): none within the
    model's own 8K context; past it, the YaRN stretch to 32K and a watchdog above the longest
    dense extend chunk. ValueError past the 32K YaRN context (the server would refuse them)."""
    if tokens > YARN_CONTEXT:
        raise ValueError(f"{tokens} tokens do not fit the {YARN_CONTEXT}-token YaRN context")
    return YARN_32K_ARGS + LONG_PREFILL_ARGS if tokens > NATIVE_CONTEXT else []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def sglang_server(model: str | Path, backend: str, port: int, env: dict[str, str] | None = None,
                  extra: list[str] | None = None, timeout: float = 300.0, log_path: Path | None = None,
                  max_total_tokens: int | None = 40000):
    """Yield the base URL of ``python -m sglang.launch_server`` on 127.0.0.1:``port`` (CPU).

    ``max_total_tokens`` None: no ``--max-total-tokens``, so SGLang sizes the KV pool from
    ``--mem-fraction-static``."""
    server = ServerProcess(model, backend, port, env, extra, log_path, max_total_tokens)
    server.start(timeout)
    try:
        yield server.url
    finally:
        server.stop()


@contextmanager
def sglang_servers(servers: list[ServerProcess], timeout: float = 600.0) -> Iterator[list[str]]:
    """Yield the base URLs of ``servers``, launched at once (their startups, mostly single-threaded
    imports and model loading, overlap), and stop every one of them on exit. A test that queries
    one server after another can stop each when it is done (``ServerProcess.stop`` is idempotent):
    give them ``--sleep-on-idle`` (``SLEEP_ON_IDLE``) so that the idle ones leave the cores alone."""
    try:
        start_all(servers, timeout)
        yield [server.url for server in servers]
    finally:
        for server in servers:
            server.stop()


def start_all(servers: list[ServerProcess], timeout: float = 600.0) -> None:
    """Launch every server at once, then wait for each (their startups overlap)."""
    for server in servers:
        server.launch()
    for server in servers:
        wait_ready(server.url, server.proc, timeout)


# An idle SGLang scheduler polls its sockets without pause; with this flag it sleeps between
# requests, so that servers started together do not slow down the one being queried
SLEEP_ON_IDLE = ["--sleep-on-idle"]


class ServerProcess:
    """One ``python -m sglang.launch_server`` on 127.0.0.1:``port`` (CPU) that can be started,
    stopped, killed and started again on the same port. ``cpus``: the cores it may run on
    (``taskset -c`` list, e.g. ``"1"``; its OpenMP threads are set to their count)."""

    def __init__(self, model: str | Path, backend: str, port: int, env: dict[str, str] | None = None,
                 extra: list[str] | None = None, log_path: Path | None = None,
                 max_total_tokens: int | None = 40000, cpus: str | None = None) -> None:
        pool = ["--max-total-tokens", str(max_total_tokens)] if max_total_tokens is not None else []
        self.command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
                        "--attention-backend", backend, "--host", "127.0.0.1", "--port", str(port),
                        *pool, "--skip-server-warmup", *(extra or [])]
        self.env = {**os.environ, **(env or {})}
        if cpus is not None:
            self.command = ["taskset", "-c", cpus, *self.command]
            self.env["OMP_NUM_THREADS"] = str(_count_cpus(cpus))
        self.port, self.log_path, self.proc, self.cpus = port, log_path, None, cpus
        self.url = f"http://127.0.0.1:{port}"

    def launch(self) -> None:
        """Start the process (append to the log: a restart keeps the earlier run's lines)."""
        log = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        if self.log_path:
            log.close()

    def start(self, timeout: float = 300.0) -> None:
        """Launch and wait until ``/health`` answers."""
        self.launch()
        try:
            wait_ready(self.url, self.proc, timeout)
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL the server and every process it started (a crash, as far as clients can tell)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def stop_servers_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit``, so that the ``finally`` blocks that stop this process's
    servers run: they live in sessions of their own, and a plainly terminated parent would leave
    them holding their KV pools."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _count_cpus(cpus: str) -> int:
    """Cores in a ``taskset -c`` list (``"0"``, ``"0-3"``, ``"0,2"``)."""
    count = 0
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during startup")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"server at {url} not ready after {timeout:.0f} s")


def generate(url: str, text: str, max_new_tokens: int = 24, timeout: float = 600.0, **extra) -> dict:
    """Greedy ``/generate`` request; returns the JSON response (``text``, ``output_ids``, ``meta_info``).
    ``extra``: more request fields (``rid``) and ``custom_params`` (into ``sampling_params``)."""
    sampling = {"temperature": 0, "max_new_tokens": max_new_tokens}
    if "custom_params" in extra:
        sampling["custom_params"] = extra.pop("custom_params")
    status, body = post_json(url, "/generate", {"text": text, "sampling_params": sampling, **extra}, timeout)
    if status != 200:
        raise urllib.error.HTTPError(url + "/generate", status, json.dumps(body), None, None)
    return body


def post_json(url: str, path: str, body: dict, timeout: float = 600.0) -> tuple[int, dict]:
    """POST ``body`` as JSON to ``url + path``; returns (HTTP status, the parsed answer), errors included."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(text)
        except json.JSONDecodeError:
            return exc.code, {"error": text}
