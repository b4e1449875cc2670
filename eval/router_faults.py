"""A worker killed under load behind sglang-router, then restarted: what clients see.

Two louver workers behind the router (fast failover: ``router.FAST_FAILOVER``), clients sending
greedy requests in a loop. Every prompt's answer is first taken from a worker directly (the
reference). Then, in three phases: the load with both workers; worker 1 killed with SIGKILL (a
crash: in-flight requests on it lose their connection); worker 1 restarted on the same port,
rejoining when the router's health check sees it. Each request is recorded with its phase, HTTP
status, latency, and whether its text equals the reference. Nothing may hang (every request has a
client timeout far above its normal latency), an error must come back as a status and a message,
and an answer must equal the reference. What the restart loses is the worker's radix cache: its
statistics file starts from zero, and the prefixes it serves again are built again. The last
phase also sends prompts of new prefixes: ``cache_aware`` keeps sending the old ones to the
worker that served them while the other was down, and places new ones by load.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from .router import FAST_FAILOVER, healthy_count, louver_workers, sglang_router, start_all, wait_healthy
from .server import free_port, post_json


@dataclass
class Outcome:
    phase: str
    prompt: int
    status: int
    seconds: float
    correct: bool | None  # text equals the reference (None: no answer)
    error: str | None
    streamed: bool = False


@dataclass(frozen=True)
class FaultPlan:
    """clients: concurrent client loops; before/during/after: seconds of load with both workers, after
    the kill, and after the restarted worker is healthy again; timeout: a request's client timeout."""

    clients: int = 2
    before: float = 30.0
    during: float = 30.0
    after: float = 40.0
    max_new_tokens: int = 12
    timeout: float = 300.0


def _ask(url: str, prompt: str, plan: FaultPlan, stream: bool = False) -> tuple[int, dict]:
    """(HTTP status, answer) of a greedy ``/generate``; a streamed one returns its last chunk.
    Errors come back as answers with an ``error`` text: an HTTP error keeps its status (also for
    a stream), a broken connection or stream (the router cannot retry a stream it began) is
    status 0."""
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": plan.max_new_tokens},
            "stream": stream}
    try:
        if not stream:
            return post_json(url, "/generate", body, timeout=plan.timeout)
        return _streamed(url, body, plan.timeout)
    except urllib.error.HTTPError as exc:  # a stream refused before its first chunk
        return exc.code, {"error": f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:200] or exc.reason}"}
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, or cut mid-stream (IncompleteRead)
        return 0, {"error": f"{type(exc).__name__}: {exc!r}"}


def _streamed(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    last, done = None, False
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            line = line.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                try:
                    last = json.loads(line[6:])
                except ValueError:  # a chunk cut in the middle
                    return 0, {"error": f"stream broken mid-chunk: {line[:200]!r}"}
    if not done or last is None or "error" in last:
        return 0, {"error": f"stream ended without [DONE]: {json.dumps(last)[:200]}"}
    return 200, last


def error_message(body: dict) -> str:
    """The human-readable error of an answer (SGLang's ``{"error": {"message": ...}}``, an
    ``error``, ``message`` or ``detail`` text); empty when the answer carries none."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    for text in (error, *(body.get(k) for k in ("message", "detail") if isinstance(body, dict))):
        if isinstance(text, str) and text.strip():
            return text.strip()[:300]
    return ""


def _load(url: str, prompts: list[str], refs: list[str], plan: FaultPlan, phase: dict, stop: threading.Event,
          out: list[Outcome], seed: int, stream: bool) -> None:
    """One client: prompts in a rotating order until ``stop`` (the first ``phase["prompts"]`` of
    them); each request under the phase current when it was sent."""
    i = seed
    while not stop.is_set():
        k, sent_in = i % phase["prompts"], phase["name"]
        start = time.monotonic()
        status, body = _ask(url, prompts[k], plan, stream)
        seconds = time.monotonic() - start
        text = body.get("text") if status == 200 else None
        error = None if status == 200 else error_message(body)
        out.append(Outcome(sent_in, k, status, seconds, None if text is None else text == refs[k], error, stream))
        i += 1


def fault_run(model, prompts: list[str], log_dir: Path, plan: FaultPlan = FaultPlan(),
              worker_extra: list[str] | None = None, worker_env: dict | None = None,
              max_total_tokens: int = 65536, fresh: list[str] = (), policy: str = "cache_aware") -> dict:
    """Run the three phases (module docstring); returns every outcome and the workers' statistics.
    ``fresh``: prompts whose prefixes only the last phase sends (the router has seen them on no
    worker, so ``cache_aware`` places them by load, and the restarted worker gets some)."""
    prompts = list(prompts) + list(fresh)
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = louver_workers(model, 2, log_dir, worker_env, worker_extra, max_total_tokens)
    start_all(workers)
    try:
        refs = [_ask(workers[0].url, p, plan)[1]["text"] for p in prompts]
        with sglang_router([w.url for w in workers], policy, free_port(), log_dir / "router.log",
                           FAST_FAILOVER) as url:
            return _phases(url, workers, prompts, refs, plan, log_dir, len(prompts) - len(fresh))
    finally:
        for worker in workers:
            worker.stop()


def _phases(url, workers, prompts, refs, plan: FaultPlan, log_dir: Path, known: int) -> dict:
    outcomes: list[Outcome] = []
    phase, stop = {"name": "before", "prompts": known}, threading.Event()
    with concurrent.futures.ThreadPoolExecutor(plan.clients) as pool:
        # every other client streams: a broken stream is the error a client of a killed worker sees
        loops = [pool.submit(_load, url, prompts, refs, plan, phase, stop, outcomes, 3 * c, c % 2 == 1)
                 for c in range(plan.clients)]
        time.sleep(plan.before)
        in_flight = _wait_for_decoding(log_dir / "stats-1.json", 60.0)  # kill it while it decodes
        killed_stats = json.loads((log_dir / "stats-1.json").read_text())
        phase["name"] = "killed"
        killed_at = time.monotonic()
        workers[1].kill()
        time.sleep(plan.during)
        phase["name"] = "restarting"
        workers[1].start()
        wait_healthy(url, 2, 120.0)
        rejoined_after = time.monotonic() - killed_at
        phase.update(name="after", prompts=len(prompts))
        time.sleep(plan.after)
        stop.set()
        for loop in loops:
            loop.result()
    restarted = json.loads((log_dir / "stats-1.json").read_text())
    return {"outcomes": [asdict(o) for o in outcomes], "killed_while_decoding": in_flight,
            "rejoined_seconds_after_kill": rejoined_after,
            "healthy_workers_at_end": healthy_count(url),
            "worker1_before_kill": _pages(killed_stats), "worker1_after_restart": _pages(restarted),
            "worker0": _pages(json.loads((log_dir / "stats-0.json").read_text()))}


def _wait_for_decoding(stats_file: Path, timeout: float) -> bool:
    """Wait until the worker writing ``stats_file`` is decoding (its decode forwards move within
    0.2 s); False after ``timeout`` (the kill then may hit an idle worker)."""
    def forwards() -> int:
        try:
            return int(json.loads(stats_file.read_text())["decode_forwards"])
        except (OSError, ValueError, KeyError):
            return -1

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = forwards()
        time.sleep(0.2)
        if before >= 0 and forwards() > before:
            return True
    return False


def _pages(stats: dict) -> dict:
    return {"index_pages_built": stats["pages_built"], "index_pages_reused": stats["pages_reused"],
            "requests": len(stats.get("requests", {})), "decode_forwards": stats["decode_forwards"]}


def summary(run: dict) -> dict:
    """Per phase: requests, answered (200), errors by status, wrong answers, slowest request."""
    phases = {}
    for o in run["outcomes"]:
        p = phases.setdefault(o["phase"], {"requests": 0, "answered": 0, "wrong": 0, "errors": {},
                                           "slowest_seconds": 0.0})
        p["requests"] += 1
        p["slowest_seconds"] = max(p["slowest_seconds"], o["seconds"])
        if o["status"] == 200:
            p["answered"] += 1
            p["wrong"] += o["correct"] is False
        else:
            kind = f"{o['status']}{' (stream)' if o.get('streamed') else ''}"
            p["errors"][kind] = p["errors"].get(kind, 0) + 1
    return phases
