"""The door every request passes first: header size, the browser's origin, the API key; and
each request counted in the metrics under its route's path (not the raw path: one label per
route, whatever a client sends)."""

from __future__ import annotations

import hmac
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from agent_bridge.chat.http_errors import ApiError, error_response
from agent_bridge.serving.bridge import Bridge

OPEN_PATHS = ("/", "/health")  # reachable without the API key
OPEN_PREFIXES = ("/ui/",)  # the web app's static files (the page then asks for the key)
MAX_HEADER_BYTES = 64 * 1024  # all request headers together; more is no client we serve
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")


def _route_label(request_path: str, routes: Sequence[Any]) -> str:
    for r in routes:
        path = getattr(r, "path", None)
        if path and (request_path == path or (getattr(r, "path_format", "").endswith("}") and
                                              request_path.startswith(path.split("{")[0]))):
            return path
        if path and r.__class__.__name__ == "Mount" and request_path.startswith(path.rstrip("/") + "/"):
            return path
    return "other"


def _origin_allowed(scope) -> bool:
    """Agents and SDKs send no Origin; a browser does. A web page must not drive the local
    model (or feed its corpus) behind the user's back, DNS rebinding included."""
    for k, v in scope.get("headers", []):
        if k.lower() == b"origin":
            origin = v.decode("latin-1")
            return origin != "null" and (urlsplit(origin).hostname or "") in LOOPBACK_HOSTS
    return True


def _same_origin(scope) -> bool:
    """The page served by this server itself (Origin == Host), e.g. opened from another machine."""
    headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    origin, host = headers.get(b"origin"), headers.get(b"host")
    return bool(origin and host) and urlsplit(origin).netloc == host


class GuardMiddleware:
    """Origin and API key checks (the key on every route but /health), and request metrics."""

    def __init__(self, app: Callable, bridge: Bridge, api_key: str | None, routes: Sequence[Any]):
        self.app, self.bridge, self.api_key, self.routes = app, bridge, api_key, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status_seen = {"status": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status_seen["status"] = message["status"]
            await send(message)

        try:
            header_bytes = sum(len(k) + len(v) for k, v in scope.get("headers", []))
            if header_bytes > MAX_HEADER_BYTES:
                response = error_response(ApiError(431, f"request headers are {header_bytes} bytes; "
                                                   f"the limit is {MAX_HEADER_BYTES}"), path)
                return await response(scope, receive, send_wrapper)
            # Another origin is refused; the page's own origin too unless a key guards the server
            # (without one, a DNS-rebound page would look same-origin).
            if not _origin_allowed(scope) and not (self.api_key and _same_origin(scope)):
                response = error_response(ApiError(403, "cross-origin requests from web pages are refused"), path)
                return await response(scope, receive, send_wrapper)
            if self.api_key and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES) \
                    and not self._authorized(scope):
                response = error_response(ApiError(401, "invalid or missing API key: send "
                                                   "'Authorization: Bearer KEY' or 'x-api-key: KEY'"), path)
                return await response(scope, receive, send_wrapper)
            await self.app(scope, receive, send_wrapper)
        finally:
            self.bridge.metrics.request(scope.get("method", ""), _route_label(path, self.routes), status_seen["status"])

    def _authorized(self, scope) -> bool:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-api-key") or ""
        auth = headers.get("authorization", "")
        if not given and auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return bool(given) and hmac.compare_digest(given.encode(), self.api_key.encode())
