"""The fault run's client (``router_faults._ask``) against a local HTTP server that misbehaves on
purpose: every failure a client of a killed worker can meet comes back as a status and a message,
and none escapes the run."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from louver_eval.router_faults import FaultPlan, _ask, error_message

PLAN = FaultPlan(max_new_tokens=2, timeout=10.0)


class _Misbehaving(http.server.BaseHTTPRequestHandler):
    """POST /generate answers by the prompt's text: what the test asks this server to do."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = body["text"]
        if mode == "ok":
            self._send(200, b'data: {"text": "hi"}\n\ndata: [DONE]\n\n' if body["stream"] else b'{"text": "hi"}')
        elif mode == "error-json":
            self._send(500, json.dumps({"error": {"message": "worker died"}}).encode())
        elif mode == "error-empty":
            self._send(500, b"{}")
        elif mode == "unavailable":
            self._send(503, b"no healthy worker")
        elif mode == "cut-line":  # promises more than it sends, then closes mid-line
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'data: {"text": "h')
            self.close_connection = True
        elif mode == "cut-chunk":  # a chunked stream whose chunk is cut: IncompleteRead
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b'40\r\ndata: {"text": "h"}\n\n')
            self.close_connection = True

    def _send(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture(scope="module")
def url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_and_an_error_with_its_message(url, stream):
    assert _ask(url, "ok", PLAN, stream) == (200, {"text": "hi"})
    status, body = _ask(url, "error-json", PLAN, stream)
    assert status == 500 and "worker died" in error_message(body)


def test_a_refused_stream_keeps_its_http_status(url):
    status, body = _ask(url, "unavailable", PLAN, stream=True)
    assert status == 503 and "no healthy worker" in error_message(body)


@pytest.mark.parametrize("mode, what", [("cut-line", "mid-chunk"), ("cut-chunk", "IncompleteRead")])
def test_a_broken_stream_is_recorded_not_raised(url, mode, what):
    status, body = _ask(url, mode, PLAN, stream=True)
    assert status == 0 and what in error_message(body)


def test_an_error_without_a_message_is_seen_as_one():
    """The slow fault test asserts every error has a message: an empty body must fail it (the
    recorded text used to be the JSON dump of the body, never empty)."""
    assert error_message({}) == "" and error_message({"error": ""}) == "" and error_message({"error": {}}) == ""
    assert error_message({"detail": "Not Found"}) == "Not Found"
