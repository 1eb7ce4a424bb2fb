"""The HTTP server: one Starlette app for the OpenAI, Anthropic, Responses and Ollama APIs.

    app = create_app(engine, api_key=None)      # any ASGI server runs it
    serve(engine, host="127.0.0.1", port=8080)  # or uvicorn, bound to loopback by default

This file only assembles: each wing brings its routes (serving/routes.py, model_registry.py,
apis/*, webapp/routes.py), its middleware (serving/guard.py, telemetry.py, model_registry.py)
and its exception handlers (serving/error_handlers.py); create_app joins them around one
Bridge and registry, and serve() runs the result under uvicorn.

One engine thread owns MLX; requests queue to it in arrival order (Engine.submit), so
many clients may connect at once. `extra_routes` (e.g. an MCP app mounted at /mcp) are
appended; `lifespan` is passed through for whoever mounts something that needs one.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool

from agent_bridge.apis import anthropic_api, ollama_api, openai_api, responses_api
from agent_bridge.chat.json_body import DEFAULT_MAX_BODY_BYTES
from agent_bridge.serving import model_registry
from agent_bridge.serving import routes as server_routes
from agent_bridge.serving.bridge import Bridge, DEFAULT_MAX_QUEUE
from agent_bridge.serving.error_handlers import EXCEPTION_HANDLERS
from agent_bridge.serving.guard import MAX_HEADER_BYTES, GuardMiddleware
from agent_bridge.serving.model_registry import LeaseMiddleware, ModelRegistry
from agent_bridge.serving.telemetry import ClientMiddleware, Telemetry
from agent_bridge.webapp import routes as webapp

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_MAX_TOKENS = 4096


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
    strict_tools: bool | None = False,
) -> Starlette:
    """`load_engine(path)` builds an engine for another model (POST /v1/models/load, and
    requests naming one with `allow_switch`); `max_models` stay loaded (model_registry.py).
    `engine_handle` (an EngineHandle given to the MCP tools) follows the current model.
    `strict_tools` (--strict-tools): every tool's calls valid by construction; None: for the
    call syntaxes the grammar spells (agent_bridge/chat/reply_grammar.py)."""
    bridge = Bridge.for_engine(engine, context_window, default_max_tokens, model_name, max_queue, strict_tools)
    registry = ModelRegistry(bridge, load_engine, allow_switch=allow_switch, max_models=max_models,
                             models_dirs=list(models_dirs), context_window=context_window, handle=engine_handle,
                             memory_budget=int(models_memory_mb * 2**20) if models_memory_mb else None)
    # Each wing lists its own routes; the order matters only where patterns overlap
    # (/v1/models/load before /v1/models/{model:path}), for routing and metrics labels alike.
    routes = [
        *server_routes.routes,
        *model_registry.routes,
        *openai_api.routes,
        *anthropic_api.routes,
        *responses_api.routes,
        *ollama_api.routes,
        *webapp.routes,
        *extra_routes,
    ]
    app = Starlette(
        routes=routes,
        exception_handlers=EXCEPTION_HANDLERS,
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

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with (inner(app) if inner is not None else contextlib.nullcontext()):
            try:
                yield
            finally:  # models loaded since start write their prefix caches to disk too
                await run_in_threadpool(app.state.models.close_all)

    return lifespan
