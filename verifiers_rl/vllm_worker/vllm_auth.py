"""An ASGI middleware for the vLLM server: every route but ``/health`` needs the API key.

vLLM's own ``--api-key`` / ``VLLM_API_KEY`` guards only the paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``; the routes that change the served weights (``/collective_rpc``, ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) and the other dev-mode routes
(``/reset_prefix_cache``, ``/sleep``, ...) answer anyone. ``verifiers_rl.inference.vllm.server`` adds this class
with ``--middleware vllm_auth.RequireAPIKey`` whenever the server has a key, so the key guards them all. ``/health``
stays open (readiness probes; it says nothing but "up").

Runs in the vLLM venv: standard library only (no verifiers_rl imports).
"""

from __future__ import annotations

import hmac
import os

KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable; the launcher and the client (verifiers_rl.inference) read it too
OPEN_PATHS = frozenset({"/health"})


class RequireAPIKey:
    """Answers 401 (HTTP) or closes (websocket) unless ``Authorization: Bearer <$VLLM_API_KEY>`` is sent."""

    def __init__(self, app):
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"vllm_auth.RequireAPIKey needs the key in ${KEY_ENV}.")
        self._key = key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": b'{"error": "Unauthorized: this server needs its API key"}'})

    def _allowed(self, scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS:
            return True
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # Constant-time comparison: the answer's timing says nothing about how much of a guess was right.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
