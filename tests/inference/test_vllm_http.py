"""``VLLMTransport``'s one retry policy, for blocking and async calls alike, against a real local HTTP server that
fails on purpose (a vLLM server cannot be made to answer 503 on demand; tests/vllm_backend covers the real one:
refused connections, a killed server, timeouts)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from verifiers_rl.inference.vllm.http import VLLMError, VLLMRequestError, VLLMTransport, VLLMUnavailableError


class FlakyServer:
    """Answers each path with the statuses queued for it, in order, then 200 ``{"ok": true}``; records every
    request's path and Authorization header."""

    def __init__(self):
        self.queued: dict[str, list[int]] = {}
        self.seen: list[tuple[str, str | None]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.seen.append((self.path, self.headers.get("Authorization")))
                statuses = owner.queued.get(self.path) or [200]
                status = statuses.pop(0)
                body = json.dumps({"ok": True} if status == 200 else {"error": {"message": f"failure {status}"}})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def count(self, path: str) -> int:
        return sum(seen == path for seen, _ in self.seen)


@pytest.fixture
def flaky():
    server = FlakyServer()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def test_blocking_and_async_calls_share_one_retry_policy(flaky):
    http = VLLMTransport(flaky.url, max_retries=2, retry_backoff_s=0.01, api_key="k-123")
    # Two 5xx, then an answer: both kinds of call retry and succeed on the third attempt.
    flaky.queued["/sync"] = [503, 502]
    flaky.queued["/async"] = [503, 500]
    assert http.request("POST", "/sync", {}) == {"ok": True}
    assert asyncio.run(http.arequest("POST", "/async", {})) == {"ok": True}
    assert flaky.count("/sync") == 3 and flaky.count("/async") == 3
    # Three 5xx exhaust max_retries=2 the same way on both paths.
    flaky.queued["/sync-down"] = [503] * 3
    flaky.queued["/async-down"] = [503] * 3
    with pytest.raises(VLLMUnavailableError, match=r"failed POST /sync-down 3 time\(s\).*HTTP 503: failure 503"):
        http.request("POST", "/sync-down", {})
    with pytest.raises(VLLMUnavailableError, match=r"failed POST /async-down 3 time\(s\).*HTTP 503: failure 503"):
        asyncio.run(http.arequest("POST", "/async-down", {}))
    # A 4xx is the caller's error: raised at once, with its status.
    flaky.queued["/bad"] = [400, 400]
    with pytest.raises(VLLMRequestError, match=r"refused POST /bad \(HTTP 400\): failure 400") as error:
        asyncio.run(http.arequest("POST", "/bad", {}))
    assert error.value.status == 400 and flaky.count("/bad") == 1
    # A worker's error in /collective_rpc (HTTP 500) would fail again: not retried, and not "unavailable".
    flaky.queued["/collective_rpc"] = [500, 500]
    with pytest.raises(VLLMError, match="failed POST /collective_rpc: HTTP 500") as error:
        http.rpc("some_method")
    assert not isinstance(error.value, VLLMUnavailableError) and error.value.status == 500
    assert flaky.count("/collective_rpc") == 1
    # Every request carried the key.
    assert {header for _, header in flaky.seen} == {"Bearer k-123"}
    http.close()
