"""The main command's client: a long-context request to a louver server, with louver's account.

    python -m louver_eval.demo_client --url http://127.0.0.1:30000 --stats STATS.json

Waits for the server, then sends a question over ~16K tokens of Paul Graham essays with a planted
passphrase (``eval.niah``), showing the prefill's progress from the server's statistics file
(``LOUVER_STATS_FILE``: index pages built so far); prints the answer and louver's account of the
request (decode steps that took the sparse path, keys attended, certified dropped-mass bound,
pages skipped, index pages built vs reused, time to first token). A second request over the same
document with another question then shows the prefix's index pages reused and the shorter time
to first token.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from .data.fetch_model import ensure_model
from .data.texts import load_text
from .niah import build_prompt, found

SECOND_QUESTION = "Name one topic these essays discuss. Answer in a few words."


def wait_ready(url: str, timeout_s: float = 900.0) -> None:
    start = time.time()
    while time.time() - start < timeout_s:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return
        except OSError:
            time.sleep(2)
    sys.exit(f"the server at {url} did not become ready in {timeout_s:.0f} s")


def read_stats(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def stream_generate(url: str, text: str, max_new_tokens: int, rid: str) -> tuple[str, float, float]:
    """(generated text, seconds to the first token, seconds in all) of one streamed greedy request
    with request id ``rid``."""
    body = {"text": text, "stream": True, "rid": rid,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, first, out = time.time(), None, ""
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            out = json.loads(line[5:])["text"]
            if first is None and out:
                first = time.time() - start
    total = time.time() - start
    return out, first if first is not None else total, total


def show_progress(stats_path: Path, before: dict, prompt_tokens: int, page_size: int, done: threading.Event):
    """Print the prefill's progress (index pages built since ``before``) until ``done``."""
    start = time.time()
    while not done.wait(10.0):
        built = read_stats(stats_path).get("pages_built", 0) - before.get("pages_built", 0)
        tokens = min(prompt_tokens, built * page_size)
        print(f"  prefill: {100 * tokens / prompt_tokens:4.0f}% ({tokens:,} / {prompt_tokens:,} tokens), "
              f"{time.time() - start:.0f} s", flush=True)


ACCOUNT_KEYS = ("sparse_steps", "dense_short_steps", "dense_fallback_steps", "indexed_keys", "attended_keys",
                "indexed_pages", "pages_skipped", "pages_built", "pages_reused")


def account(rid: str, after: dict) -> dict:
    """Request ``rid``'s account from the statistics file (the server keeps one per request id)."""
    mine = after.get("requests", {}).get(rid)
    if mine is None:
        raise RuntimeError(f"the statistics file has no account of request {rid!r}")
    return {k: mine.get(k, 0) for k in (*ACCOUNT_KEYS, "mass_bound_max")}


def print_account(a: dict, ttft: float, total: float, new_tokens: int) -> None:
    steps = a["sparse_steps"] + a["dense_short_steps"] + a["dense_fallback_steps"]
    print(f"  decode request-steps (tokens x layers): {steps:,}: {a['sparse_steps']:,} sparse, "
          f"{a['dense_short_steps']:,} dense (short), {a['dense_fallback_steps']:,} dense (fallback)")
    if a["indexed_keys"]:
        print(f"  keys attended: {100 * a['attended_keys'] / a['indexed_keys']:.1f}% of the indexed keys; "
              f"pages skipped {100 * a['pages_skipped'] / max(a['indexed_pages'], 1):.1f}%")
        print(f"  certified dropped-mass bound: <= {a['mass_bound_max']:.2e} (largest over its sparse steps)")
    print(f"  index pages: {a['pages_built']:,} built, {a['pages_reused']:,} reused from the radix cache")
    decode = (total - ttft) / max(new_tokens - 1, 1)
    print(f"  time to first token {ttft:.1f} s; decode {decode:.2f} s/token")


def run_request(url: str, stats: Path, text: str, prompt_tokens: int, page_size: int, max_new: int):
    before = read_stats(stats)
    done = threading.Event()
    watcher = threading.Thread(target=show_progress, args=(stats, before, prompt_tokens, page_size, done), daemon=True)
    watcher.start()
    rid = f"louver-demo-{uuid.uuid4().hex[:12]}"
    try:
        answer, ttft, total = stream_generate(url, text, max_new, rid)
    finally:
        done.set()
    time.sleep(0.5)  # the scheduler writes the statistics after the forward
    return answer, ttft, total, account(rid, read_stats(stats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--stats", required=True, type=Path, help="the server's LOUVER_STATS_FILE")
    parser.add_argument("--tokens", type=int, default=16000, help="haystack tokens of the long request")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--report", type=Path, default=None,
                        help="also write both requests' accounts, answers and times as JSON to this file")
    args = parser.parse_args()
    if args.tokens < 1 or args.max_new_tokens < 1:
        parser.error("--tokens and --max-new-tokens must be positive")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model()))
    prompt = build_prompt(tokenizer, load_text("paul_graham"), args.tokens, 0.5)
    n = len(tokenizer(prompt.text)["input_ids"])
    wait_ready(args.url)
    page_size = int(read_stats(args.stats).get("page_size") or 64)
    print(f"\n[louver demo] a question over {n:,} tokens of Paul Graham essays with a planted passphrase")
    answer, ttft, total, acct = run_request(args.url, args.stats, prompt.text, n, page_size, args.max_new_tokens)
    print(f"  answer: {answer.strip()!r} ({'correct' if found(prompt.answer, answer) else 'not the planted passphrase'})")
    print_account(acct, ttft, total, args.max_new_tokens)
    second_text = build_prompt(tokenizer, load_text("paul_graham"), args.tokens, 0.5, question=SECOND_QUESTION).text
    print("\n[louver demo] the same document, another question (its prefix is in the radix cache)")
    answer2, ttft2, total2, acct2 = run_request(args.url, args.stats, second_text, n, page_size,
                                                args.max_new_tokens)
    print(f"  answer: {answer2.strip()!r}")
    print_account(acct2, ttft2, total2, args.max_new_tokens)
    print(f"  time to first token: {100 * ttft2 / ttft:.0f}% of the first request's")
    if args.report is not None:
        requests = [{"prompt_tokens": n, "answer": a, "ttft_s": t, "total_s": tt, "account": acc}
                    for a, t, tt, acc in ((answer, ttft, total, acct), (answer2, ttft2, total2, acct2))]
        args.report.write_text(json.dumps({"page_size": page_size, "requests": requests}, indent=1))


if __name__ == "__main__":
    main()
