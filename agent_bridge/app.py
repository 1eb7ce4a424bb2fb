"""The HTTP server: one Starlette app for the OpenAI, Anthropic and Responses APIs.

    app = create_app(engine, api_key=None)      # any ASGI server runs it
    serve(engine, host="127.0.0.1", port=8080)  # or uvicorn, bound to loopback by default

One engine thread owns MLX; requests queue to it in arrival order (Engine.submit), so
many clients may connect at once. `extra_routes` (e.g. an MCP app mounted at /mcp) are
appended; `lifespan` is passed through for whoever mounts something that needs one.
"""

from __future__ import annotations

import hmac
from typing import Any, Callable, Sequence

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from agent_bridge.apis import anthropic_api, openai_api, responses_api
from agent_bridge.chat.http_errors import ApiError, error_response
from agent_bridge.serving import model_registry
from agent_bridge.serving.job_stream import Bridge, ClientGone, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, read_json
from agent_bridge.serving.metrics import load_lines
from agent_bridge.serving.model_registry import LeaseMiddleware, ModelRegistry, current_bridge
from agent_bridge.serving.telemetry import ClientMiddleware, Telemetry
from agent_bridge.webapp import routes as webapp

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_MAX_TOKENS = 4096
OPEN_PATHS = ("/", "/health")  # reachable without the API key
MAX_HEADER_BYTES = 64 * 1024  # all request headers together; more is no client we serve
OPEN_PREFIXES = ("/ui/",)  # the web app's static files (the page then asks for the key)
MAX_CORPUS_CHARS = 2_000_000


async def health(request: Request):
    bridge = current_bridge(request)
    return JSONResponse({"status": "ok", "model": bridge.model_name, "context_window": bridge.context_window,
                         "load": bridge.load(), "models": request.app.state.models.describe(),
                         "api_key_required": bool(getattr(request.app.state, "api_key", None))})


async def home(request: Request):
    """A browser gets the web app; clients probing the base URL get /health's answer."""
    return webapp.page(request) if webapp.wants_page(request) else await health(request)


async def metrics(request: Request):
    bridge: Bridge = request.app.state.bridge
    return PlainTextResponse(bridge.metrics.render() + load_lines(bridge.load()),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


async def corpus(request: Request):
    """Text an agent read (Claude Code hooks post files here): lookup drafting can copy from it."""
    bridge: Bridge = request.app.state.bridge
    body = await read_json(request)
    text, path = body.get("text"), body.get("path")
    if not isinstance(text, str):
        raise ApiError(400, "text: expected a string", param="text")
    if path is not None and not isinstance(path, str):
        raise ApiError(400, "path: expected a string", param="path")
    if len(text) > MAX_CORPUS_CHARS:
        raise ApiError(413, f"text is {len(text)} characters; the limit is {MAX_CORPUS_CHARS}")
    bridge = current_bridge(request)
    ids = await bridge.encode(text)
    await anyio.to_thread.run_sync(bridge.engine.add_corpus, ids, path)  # indexing takes a while: off the loop
    return JSONResponse({"ok": True, "path": path, "tokens": len(ids)})


async def machine(request: Request):
    """The roofline (memory bandwidth, plain-decode ceiling, verify cost curve, best speedup
    for a perfect drafter); measured on the engine thread on first call, then kept."""
    from starlette.concurrency import run_in_threadpool

    from engine import describe_platform, machine_report

    state = request.app.state
    if getattr(state, "machine", None) is None:
        engine = current_bridge(request).engine
        kv_bits = getattr(engine, "kv_bits", None)
        state.machine = await run_in_threadpool(
            engine.call, lambda t: {**describe_platform(), "roofline": machine_report(t, kv_bits)})
    return JSONResponse(state.machine)


def _route_label(request_path: str, routes: Sequence[Any]) -> str:
    for r in routes:
        path = getattr(r, "path", None)
        if path and (request_path == path or (getattr(r, "path_format", "").endswith("}") and
                                              request_path.startswith(path.split("{")[0]))):
            return path
        if path and r.__class__.__name__ == "Mount" and request_path.startswith(path.rstrip("/") + "/"):
            return path
    return "other"


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")


def _origin_allowed(scope) -> bool:
    """Agents and SDKs send no Origin; a browser does. A web page must not drive the local
    model (or feed its corpus) behind the user's back, DNS rebinding included."""
    from urllib.parse import urlsplit

    for k, v in scope.get("headers", []):
        if k.lower() == b"origin":
            origin = v.decode("latin-1")
            return origin != "null" and (urlsplit(origin).hostname or "") in LOOPBACK_HOSTS
    return True


def _same_origin(scope) -> bool:
    """The page served by this server itself (Origin == Host), e.g. opened from another machine."""
    from urllib.parse import urlsplit

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


async def _api_error(request: Request, exc: ApiError):
    return error_response(exc, request.url.path)


async def _http_error(request: Request, exc: HTTPException):
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
    return error_response(ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail))), request.url.path)


async def _client_gone(request: Request, exc: ClientGone):
    return PlainTextResponse("", status_code=499)


async def _unexpected(request: Request, exc: Exception):
    # A bug of ours: the client still gets its own error format, not a traceback.
    return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"), request.url.path)


def create_app(
    engine: Any,
    *,
    api_key: str | None = None,
    context_window: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue: int = DEFAULT_MAX_QUEUE,
    extra_routes: Sequence[Any] = (),
    lifespan: Any = None,
    models_dirs: Sequence[str] = (),
    load_engine: Callable[[str], Any] | None = None,
    allow_switch: bool = False,
    max_models: int = 1,
    engine_handle: Any = None,
    models_memory_mb: float | None = None,
) -> Starlette:
    """`load_engine(path)` builds an engine for another model (POST /v1/models/load, and
    requests naming one with `allow_switch`); `max_models` stay loaded (model_registry.py).
    `engine_handle` (an EngineHandle given to the MCP tools) follows the current model."""
    bridge = Bridge.for_engine(engine, context_window, default_max_tokens, model_name, max_queue)
    registry = ModelRegistry(bridge, load_engine, allow_switch=allow_switch, max_models=max_models,
                             models_dirs=list(models_dirs), context_window=context_window, handle=engine_handle,
                             memory_budget=int(models_memory_mb * 2**20) if models_memory_mb else None)
    routes = [
        Route("/", home, methods=["GET", "HEAD"]),  # clients probe the base URL (Claude Code sends HEAD /)
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/machine", machine, methods=["GET"]),
        Route("/v1/corpus", corpus, methods=["POST"]),
        *model_registry.routes,
        *openai_api.routes,
        *anthropic_api.routes,
        *responses_api.routes,
        *webapp.routes,
        *extra_routes,
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, ClientGone: _client_gone,
                            Exception: _unexpected},
        lifespan=lifespan,
    )
    app.state.bridge = bridge
    app.state.max_body_bytes = max_body_bytes
    app.state.models_dirs = list(models_dirs)  # where `GET /v1/models?all=1` also looks
    app.state.models = registry
    app.state.api_key = api_key
    app.state.telemetry = Telemetry.watch(engine)
    app.add_middleware(LeaseMiddleware, registry=registry)
    app.add_middleware(ClientMiddleware, telemetry=app.state.telemetry)
    app.add_middleware(GuardMiddleware, bridge=bridge, api_key=api_key, routes=routes)
    return app


def serve(engine: Any, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, log_level: str = "info", **app_kwargs: Any) -> None:
    import uvicorn

    app_kwargs["lifespan"] = closing_models(app_kwargs.get("lifespan"))
    uvicorn.run(create_app(engine, **app_kwargs), host=host, port=port, log_level=log_level, **UVICORN_OPTIONS)


SHUTDOWN_GRACE_S = 10  # open streams get this long after SIGTERM before they are cut
UVICORN_OPTIONS = {
    "timeout_keep_alive": 30,
    "timeout_graceful_shutdown": SHUTDOWN_GRACE_S,
    # h11 drops a connection whose headers pass 16 KB before they are complete, or not, as the
    # bytes happen to arrive; headers up to 4x the limit reach GuardMiddleware's clear 431
    "h11_max_incomplete_event_size": 4 * MAX_HEADER_BYTES,
}


def closing_models(inner: Any = None):
    """A lifespan that closes every loaded model's engine (its disk tier written) when the
    server shuts down.

    uvicorn re-raises SIGTERM/SIGINT once its own shutdown is done, which ends the process
    before any `with engine:` around `serve()` can close it: the lifespan runs before that."""
    import contextlib

    from starlette.concurrency import run_in_threadpool

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with (inner(app) if inner is not None else contextlib.nullcontext()):
            try:
                yield
            finally:  # models loaded since start write their prefix caches to disk too
                await run_in_threadpool(app.state.models.close_all)

    return lifespan
