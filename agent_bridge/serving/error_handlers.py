"""What an exception that leaves a route becomes: an error in the caller's API's own shape
(http_errors.py picks it by the path), never a traceback; a client gone gets nothing (499)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from agent_bridge.chat.http_errors import ApiError, error_response
from agent_bridge.serving.job_stream import ClientGone


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


EXCEPTION_HANDLERS = {ApiError: _api_error, HTTPException: _http_error, ClientGone: _client_gone,
                      Exception: _unexpected}
