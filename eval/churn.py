"""Load and radix churn against a running server: many concurrent requests over a small KV pool.

Requests share a few long prefixes (radix hits) and have mixed lengths, so that the cache evicts
and KV pages are refilled by other requests; every ``drop_every``-th request is streamed and the
client drops it after its first chunks. Probe prompts are answered before and after: a stale index
read after a refill would change their greedy tokens.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
import urllib.request
from dataclasses import dataclass, field

from .server import generate


@dataclass(frozen=True)
class ChurnPlan:
    requests: int = 64
    concurrency: int = 8
    prefixes: int = 4
    prefix_words: tuple[int, ...] = (300, 700, 1100)
    suffix_words: tuple[int, ...] = (5, 40, 150)
    max_new_tokens: int = 12
    drop_every: int = 6
    seed: int = 0


@dataclass
class ChurnResult:
    completed: int = 0
    dropped: int = 0
    failed: list = field(default_factory=list)
    seconds: float = 0.0


def churn_prompts(text: str, plan: ChurnPlan) -> list[str]:
    """``plan.requests`` prompts: one of ``plan.prefixes`` shared prefixes (mixed lengths) plus a
    suffix of mixed length, all cut from ``text``."""
    rng = random.Random(plan.seed)
    words = text.split()
    prefixes = []
    for i in range(plan.prefixes):
        n = plan.prefix_words[i % len(plan.prefix_words)]
        start = rng.randrange(0, len(words) - n)
        prefixes.append(" ".join(words[start: start + n]))
    prompts = []
    for _ in range(plan.requests):
        n = rng.choice(plan.suffix_words)
        start = rng.randrange(0, len(words) - n)
        prompts.append(rng.choice(prefixes) + "\n\n" + " ".join(words[start: start + n]))
    return prompts


def dropped_stream(url: str, text: str, chunks: int = 2, timeout: float = 600.0) -> None:
    """A streamed request the client abandons after ``chunks`` chunks (the connection closes)."""
    body = {"text": text, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 64}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=timeout)
    try:
        seen = 0
        for raw in resp:
            if raw.strip().startswith(b"data:"):
                seen += 1
                if seen >= chunks:
                    break
    finally:
        resp.close()


def run_churn(url: str, text: str, plan: ChurnPlan) -> ChurnResult:
    """Send the plan's requests ``plan.concurrency`` at a time; count completed, dropped, failed."""
    result = ChurnResult()
    start = time.time()

    def one(item):
        i, prompt = item
        if plan.drop_every and i % plan.drop_every == plan.drop_every - 1:
            dropped_stream(url, prompt)
            return "dropped", None
        out = generate(url, prompt, max_new_tokens=plan.max_new_tokens)
        ok = bool(out.get("meta_info", {}).get("completion_tokens"))
        return ("completed" if ok else "failed"), out

    with concurrent.futures.ThreadPoolExecutor(plan.concurrency) as pool:
        for i, (kind, out) in enumerate(pool.map(_guard(one), enumerate(churn_prompts(text, plan)))):
            if kind == "completed":
                result.completed += 1
            elif kind == "dropped":
                result.dropped += 1
            else:
                result.failed.append((i, out))
    result.seconds = time.time() - start
    return result


def _guard(fn):
    def wrapped(item):
        try:
            return fn(item)
        except Exception as exc:  # a failed request is a result, not a crash of the driver
            return "failed", repr(exc)
    return wrapped


def probe_answers(url: str, probes: list[str], max_new_tokens: int = 16) -> list[list[int]]:
    """Greedy output ids of each probe prompt, one request at a time."""
    return [generate(url, p, max_new_tokens=max_new_tokens)["output_ids"] for p in probes]
