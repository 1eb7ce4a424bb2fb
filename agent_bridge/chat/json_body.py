"""Reading a request's body as a JSON object, for every route that takes one (the three APIs,
model loading, the corpus, the web app's POSTs): size and syntax checked before any route
looks at it, each failure an ApiError in the caller's own error shape (400/413)."""

from __future__ import annotations

import json

from starlette.requests import Request

from agent_bridge.chat.http_errors import ApiError

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


async def read_json(request: Request, max_bytes: int | None = None) -> dict:
    """The request body as a JSON object, with size and syntax checked (400/413/415)."""
    limit = max_bytes or getattr(request.app.state, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        body = json.loads(raw.decode("utf-8"))  # JSON over HTTP is UTF-8 (RFC 8259): no guessing
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, not {type(body).__name__}")
    return body
