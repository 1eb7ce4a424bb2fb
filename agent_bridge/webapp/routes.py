"""The web app's routes: the page, its static files, and the JSON/SSE API it calls (the same
API scripts can call; docs/webapp.md lists it).

    GET  /                        the page (for a browser; API clients probing / get /health)
    GET  /ui/...                  static files (no API key needed: the page asks for it)
    GET  /v1/server               model, modes, defaults, whether an API key is required
    GET  /v1/telemetry            SSE: a `snapshot` event whenever something changed
    GET  /v1/telemetry/snapshot   the same, once, as JSON
    GET  /v1/cost-curve           the verify cost curve requests use
    POST /v1/tune                 SSE: measure the curve again (`progress` events, then `done`)
    GET  /v1/cache                prefix-cache counters and its biggest radix-tree branches
    POST /v1/cache/evict          RAM tier -> disk tier;  POST /v1/cache/clear: forget both
    GET  /v1/integrations         per client: the config `integrate` writes, and who was seen
    POST /v1/integrations/{client}/write   merge it into place (backups kept), as `integrate --write`
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from engine import available_modes

from agent_bridge.apis.sse import SSE_HEADERS, sse
from agent_bridge.chat.http_errors import ApiError
from agent_bridge.chat.json_body import read_json
from agent_bridge.integrate.clients import CLIENTS, HOOK_SCRIPTS, HOOKS_DIR, Options, claude_hooks_dir, mcp_command, targets
from agent_bridge.integrate.config_files import ConfigError, dumps, merge_into_file
from agent_bridge.serving.routes import health
from agent_bridge.webapp import engine_view

STATIC_DIR = Path(__file__).parent / "static"
STREAM_EVERY_S = 0.5  # telemetry snapshots at most this often
STREAM_IDLE_S = 5.0  # and at least this often (the throughput chart moves on)


async def _optional_json(request: Request) -> dict:
    """The JSON object body, or {} when there is none (these POSTs have defaults)."""
    length = request.headers.get("content-length", "")
    if length.strip() in ("", "0") and "chunked" not in request.headers.get("transfer-encoding", ""):
        return {}
    return await read_json(request)


def wants_page(request: Request) -> bool:
    return request.method == "GET" and "text/html" in request.headers.get("accept", "")


def page(request: Request):
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def home(request: Request):
    """A browser gets the web app; clients probing the base URL get /health's answer."""
    return page(request) if wants_page(request) else await health(request)


async def server_info(request: Request):
    state = request.app.state
    engine = state.bridge.engine
    info = engine.info()
    return JSONResponse({
        "model": state.bridge.model_name, "model_path": info.get("model"), "context_window": state.bridge.context_window,
        "modes": available_modes(), "default_mode": info.get("mode"), "max_draft": info.get("max_draft"),
        "prefix_cache": info.get("prefix_cache") is not None, "api_key_required": bool(state.api_key),
    })


async def telemetry_snapshot(request: Request):
    return JSONResponse(request.app.state.telemetry.snapshot())


async def telemetry_stream(request: Request):
    telemetry = request.app.state.telemetry

    async def events():
        sent, quiet = -1, 0.0
        while True:
            if telemetry.version != sent or quiet >= STREAM_IDLE_S:
                snap = telemetry.snapshot()
                sent, quiet = snap["version"], 0.0
                yield sse("snapshot", snap)
            await asyncio.sleep(STREAM_EVERY_S)  # Starlette ends this when the client leaves
            quiet += STREAM_EVERY_S

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def cost_curve(request: Request):
    return JSONResponse(await run_in_threadpool(engine_view.cost_curve, request.app.state.bridge.engine))


async def tune(request: Request):
    """Re-measure the cost curve, streaming progress. One at a time; requests wait meanwhile."""
    state = request.app.state
    body = await _optional_json(request)
    depths, repeats = body.get("depths"), body.get("repeats")
    if depths is not None and (not isinstance(depths, list) or not depths
                               or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in depths)):
        raise ApiError(400, "depths: expected a list of whole numbers >= 0", param="depths")
    if repeats is not None and (not isinstance(repeats, int) or isinstance(repeats, bool) or not 1 <= repeats <= 20):
        raise ApiError(400, "repeats: expected a whole number from 1 to 20", param="repeats")
    if getattr(state, "tuning", False):
        raise ApiError(409, "a tune is already running")
    state.tuning = True
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def progress(what: str, i: int, n: int) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("progress", {"what": what, "done": i, "total": n}))

    async def run():
        try:
            curve = await run_in_threadpool(engine_view.retune, state.bridge.engine, depths, repeats, progress)
            state.machine = None  # /machine measures its roofline again from the new curve
            await queue.put(("done", curve))
        except Exception as e:  # noqa: BLE001 - reported to the page, not a traceback
            await queue.put(("error", {"error": {"message": f"{type(e).__name__}: {e}"}}))
        finally:
            state.tuning = False

    task = asyncio.create_task(run())  # runs to the end even if the page goes away

    async def events():
        while True:
            kind, data = await queue.get()
            yield sse(kind, data)
            if kind != "progress":
                await task
                return

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def cache(request: Request):
    try:
        limit = max(1, min(200, int(request.query_params.get("limit", 40))))
    except ValueError:
        raise ApiError(400, "limit: expected a whole number", param="limit") from None
    return JSONResponse(await run_in_threadpool(engine_view.cache_view, request.app.state.bridge.engine, limit))


async def cache_evict(request: Request):
    return JSONResponse(await run_in_threadpool(engine_view.drop_cache, request.app.state.bridge.engine, False))


async def cache_clear(request: Request):
    return JSONResponse(await run_in_threadpool(engine_view.drop_cache, request.app.state.bridge.engine, True))


def _integration_options(request: Request, scope: str, transport: str):
    if scope not in ("project", "user"):
        raise ApiError(400, "scope: expected 'project' or 'user'", param="scope")
    if transport not in ("stdio", "http"):
        raise ApiError(400, "transport: expected 'stdio' or 'http'", param="transport")
    host = request.url.hostname or "127.0.0.1"
    opts = Options(port=request.url.port or 80, host=host, scope=scope, transport=transport,
                   command=mcp_command(), model=request.app.state.bridge.model_name)
    if request.app.state.api_key:  # the caller sent it: the clients need it too
        opts.api_key = request.app.state.api_key
    return opts


async def integrations(request: Request):
    q = request.query_params
    opts = _integration_options(request, q.get("scope", "project"), q.get("transport", "stdio"))
    seen = request.app.state.telemetry.snapshot()["clients"]
    out = []
    for name in CLIENTS:
        files = [{"path": str(t.path), "format": t.fmt, "about": t.about, "text": dumps(t.data, t.fmt)}
                 for t in targets(name, opts)]
        out.append({"client": name, "files": files, "seen": seen.get(name)})
    return JSONResponse({"scope": opts.scope, "transport": opts.transport, "clients": out, "seen": seen})


async def integration_write(request: Request):
    """Merge one client's config into place: `integrate CLIENT --write`'s merge and backup rules."""
    client = request.path_params["client"]
    if client not in CLIENTS:
        raise ApiError(404, f"unknown client {client!r}; choose from {', '.join(CLIENTS)}")
    body = await _optional_json(request)
    opts = _integration_options(request, body.get("scope", "project"), body.get("transport", "stdio"))

    def write() -> list[dict]:
        written = []
        for t in targets(client, opts):
            try:
                backup = merge_into_file(t.path, t.data, t.fmt)
            except ConfigError as e:
                raise ApiError(409, f"{e} (nothing written; fix the file or merge the snippet by hand)") from None
            written.append({"path": str(t.path), "backup": str(backup) if backup else None})
        if client == "claude-code":
            dest = claude_hooks_dir(opts)
            dest.mkdir(parents=True, exist_ok=True)
            for script in HOOK_SCRIPTS:
                shutil.copyfile(HOOKS_DIR / script, dest / script)
            written.append({"path": str(dest), "backup": None})
        return written

    return JSONResponse({"client": client, "written": await run_in_threadpool(write)})


routes = [
    Route("/", home, methods=["GET", "HEAD"]),  # clients probe the base URL (Claude Code sends HEAD /)
    Mount("/ui", app=StaticFiles(directory=STATIC_DIR), name="ui"),
    Route("/v1/server", server_info, methods=["GET"]),
    Route("/v1/telemetry", telemetry_stream, methods=["GET"]),
    Route("/v1/telemetry/snapshot", telemetry_snapshot, methods=["GET"]),
    Route("/v1/cost-curve", cost_curve, methods=["GET"]),
    Route("/v1/tune", tune, methods=["POST"]),
    Route("/v1/cache", cache, methods=["GET"]),
    Route("/v1/cache/evict", cache_evict, methods=["POST"]),
    Route("/v1/cache/clear", cache_clear, methods=["POST"]),
    Route("/v1/integrations", integrations, methods=["GET"]),
    Route("/v1/integrations/{client}/write", integration_write, methods=["POST"]),
]
