"""Server-sent events as the APIs and the web app write them: an event's text, keep-alives,
and the response that carries a generation's stream and always ends its job."""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse

from agent_bridge.serving.job_stream import Generation

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(event: str | None, data: Any) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def sse_comment(info: dict | None) -> str:
    """A keep-alive the SDKs skip; `info` (queue position, prefill progress) for whoever reads raw SSE."""
    return f": mlx_dspark {json.dumps(info, separators=(',', ':'))}\n\n" if info else ": ping\n\n"


class Heartbeat:
    """While output is held back (a tool call being written), send a keep-alive now and then:
    clients with a stream-idle timeout would otherwise give up on a long call."""

    def __init__(self, every_s: float = 5.0):
        self.every_s = every_s
        self.last = time.monotonic()

    def due(self, emitted: bool) -> bool:
        now = time.monotonic()
        if emitted or now - self.last >= self.every_s:
            self.last = now
            return not emitted
        return False


class EventStream(StreamingResponse):
    """An SSE response that always ends its job: also when the client is gone before the
    body started (Starlette then never iterates, so the generator's own cleanup never runs)."""

    def __init__(self, content: AsyncIterator[str], gen: Generation):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except RuntimeError:  # still running in a cancelled task: it ends with that task
                    pass
