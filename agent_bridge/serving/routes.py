"""The server's own routes, beside the APIs': how it is (/health, /metrics), the machine it
runs on (/machine), and text an agent read for lookup drafting to copy from (/v1/corpus).

    GET  /health      model, context window, load, loaded models (no API key needed)
    GET  /metrics     Prometheus text: requests, generations, queue
    GET  /machine     platform and roofline, measured once on the engine thread
    POST /v1/corpus   {"text", "path"?}: indexed for lookup drafting
"""

from __future__ import annotations

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from engine import describe_platform, machine_report

from agent_bridge.chat.http_errors import ApiError
from agent_bridge.chat.json_body import read_json
from agent_bridge.serving.bridge import Bridge
from agent_bridge.serving.metrics import load_lines
from agent_bridge.serving.model_registry import current_bridge

MAX_CORPUS_CHARS = 2_000_000


async def health(request: Request):
    bridge = current_bridge(request)
    engine = bridge.engine
    body = {"status": "ok", "model": bridge.model_name, "context_window": bridge.context_window,
            "load": bridge.load(), "models": request.app.state.models.describe(),
            "api_key_required": bool(getattr(request.app.state, "api_key", None))}
    if engine.ranks.split:  # a model split over ranks (docs/distributed.md)
        body["ranks"] = {"size": engine.ranks.size, "split": engine.split}
    if engine.failure:  # a rank is gone: every request fails until all ranks restart
        return JSONResponse({**body, "status": "degraded", "error": engine.failure}, status_code=503)
    return JSONResponse(body)


async def metrics(request: Request):
    bridge: Bridge = request.app.state.bridge
    return PlainTextResponse(bridge.metrics.render() + load_lines(bridge.load()),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


async def corpus(request: Request):
    """Text an agent read (Claude Code hooks post files here): lookup drafting can copy from it."""
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
    state = request.app.state
    if getattr(state, "machine", None) is None:
        engine = current_bridge(request).engine
        kv_bits = getattr(engine, "kv_bits", None)
        state.machine = await run_in_threadpool(
            engine.call, lambda t: {**describe_platform(), "roofline": machine_report(t, kv_bits)})
    return JSONResponse(state.machine)


routes = [
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/machine", machine, methods=["GET"]),
    Route("/v1/corpus", corpus, methods=["POST"]),
]
