"""Errors every API answers in its own body format and HTTP status.

Handlers raise `ApiError` (protocol-neutral); the server renders it as Anthropic's
`{"type":"error","error":{...}}` on /v1/messages routes, Ollama's `{"error": "..."}` on /api/
routes and OpenAI's `{"error":{...}}` elsewhere. Engine errors map here too, so a client never sees a traceback.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from engine import CancelledError, EngineDownError, EngineError, InvalidRequestError, PromptTooLongError

# status -> (anthropic type, openai type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("request_too_large", "invalid_request_error"),
    415: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    431: ("request_too_large", "invalid_request_error"),
    529: ("overloaded_error", "server_error"),
    499: ("api_error", "api_error"),
    500: ("api_error", "server_error"),
    503: ("overloaded_error", "server_error"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


def overloaded(max_queue: int, retry_after_s: int) -> ApiError:
    """The queue is full: OpenAI clients get 429 rate_limit_error, Anthropic's 529 overloaded_error;
    both with retry-after, which the SDKs (and Claude Code) wait for before retrying."""
    return ApiError(429, f"the server is busy: {max_queue} requests are already waiting; retry in "
                    f"{retry_after_s} s", code="overloaded", headers={"retry-after": str(retry_after_s)})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_engine_error(e: EngineError) -> ApiError:
    if isinstance(e, PromptTooLongError):
        # Claude Code compacts on this exact wording; OpenAI clients look for the code.
        return ApiError(400, str(e), code="context_length_exceeded", param="messages")
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e))
    if isinstance(e, CancelledError):
        return ApiError(499, str(e))
    if isinstance(e, EngineDownError):  # until the server is restarted
        return ApiError(503, str(e))
    return ApiError(500, str(e))


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def anthropic_body(e: ApiError) -> dict:
    kind = _TYPES.get(e.status, ("api_error", "server_error"))[0]
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def openai_body(e: ApiError) -> dict:
    kind = _TYPES.get(e.status, ("api_error", "server_error"))[1]
    code = e.code or {401: "invalid_api_key", 404: "not_found", 413: "request_too_large"}.get(e.status)
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": code}}


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def error_body(e: ApiError, path: str) -> dict:
    if is_ollama_path(path):  # Ollama's shape: the message alone
        return {"error": e.message}
    return anthropic_body(e) if is_anthropic_path(path) else openai_body(e)


def error_response(e: ApiError, path: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.code == "overloaded" and is_anthropic_path(path):
        e = ApiError(529, e.message, headers=e.headers)
    return JSONResponse(error_body(e, path), status_code=e.status, headers={**headers, **e.headers})
