"""The server's side of the engine: render, submit, and read a job's events without
blocking the event loop.

A job's events are read by a small pump thread (Job.next_event blocks) and handed to
the loop through an asyncio queue. Whoever stops listening (a client that hangs up,
a finished response) cancels the job, so the engine moves on to the next request.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

from engine import Done, EngineError, PrefillProgress

from .chat_request import ChatRequest, check_context, render
from .http_errors import ApiError, from_engine_error
from .metrics import Metrics
from .tool_calls import Syntax, syntax_for

DISCONNECT_POLL_S = 0.5


class ClientGone(Exception):
    pass


@dataclass
class Bridge:
    """What every route shares: the engine, limits, metrics."""

    engine: Any
    context_window: int
    default_max_tokens: int
    metrics: Metrics
    model_name: str
    syntax: Syntax

    @classmethod
    def for_engine(cls, engine: Any, context_window: int | None, default_max_tokens: int,
                   model_name: str | None = None) -> "Bridge":
        window = engine.context_window if context_window is None else min(context_window, engine.context_window)
        name = model_name or Path(str(engine.info().get("model", "local-model"))).name or "local-model"
        return cls(engine, window, default_max_tokens, Metrics(), name, syntax_for(engine.tokenizer))

    def _locked(self, fn, *args):
        # engine.encode/render_chat/decode hold the engine's one tokenizer lock themselves
        return fn(*args)

    async def prompt_ids(self, req: ChatRequest, check: bool = True) -> list[int]:
        """Render the chat (tokenizing a 15k-token prompt takes a while: off the loop)."""
        try:
            ids = await anyio.to_thread.run_sync(self._locked, render, self.engine, req)
            if check:
                check_context(ids, self.context_window)
        except EngineError as e:
            raise from_engine_error(e) from None
        return ids

    async def encode(self, text: str) -> list[int]:
        return await anyio.to_thread.run_sync(self._locked, self.engine.encode, text)

    def clamp_max_tokens(self, max_tokens: int, prompt_len: int) -> int:
        return max(1, min(max_tokens, self.context_window - prompt_len))

    def starts_thinking(self, prompt_ids: list[int]) -> bool:
        """Templates that open the thinking block in the generation prompt (`<think>\\n`)."""
        if not self.syntax.think_start:
            return False
        tail = self.engine.decode(prompt_ids[-8:]).rstrip()
        return tail.endswith(self.syntax.think_start)

    async def generate(self, req: ChatRequest, prompt_ids: list[int], request: Request | None) -> "Generation":
        """Submit and wait for the engine to start on it, so an early error is still an HTTP error."""
        gen_req = req.generation_request(prompt_ids)
        gen_req.max_tokens = self.clamp_max_tokens(req.max_tokens, len(prompt_ids))
        try:
            job = self.engine.submit(gen_req)
        except EngineError as e:
            raise from_engine_error(e) from None
        gen = Generation(self, job, request)
        await gen.start()
        return gen


class Generation:
    """One running job seen from the event loop: `async for event in gen` (first event included)."""

    def __init__(self, bridge: Bridge, job: Any, request: Request | None):
        self.bridge, self.job, self.request = bridge, job, request
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first: Any = None
        self.done: Done | None = None
        self._finished = False
        self._polled = time.monotonic()  # when the client's connection was last checked

    @property
    def cached_tokens(self) -> int:
        """Known once the engine started: its first progress event reports the cached prefix."""
        if self.done is not None:
            return self.done.stats.cached_tokens
        if isinstance(self.first, PrefillProgress):
            return self.first.done
        return 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        job, q, metrics = self.job, self.queue, self.bridge.metrics

        def pump() -> None:
            while True:
                try:
                    event = job.next_event()
                except BaseException as e:  # the job's error, handed to the loop
                    event = e
                if isinstance(event, Done):  # counted even when nobody listens any more (a cancelled job)
                    metrics.generation(event.stats, event.finish_reason)
                try:
                    loop.call_soon_threadsafe(q.put_nowait, event)
                except RuntimeError:  # loop closed: nobody is listening
                    job.cancel()
                    return
                if isinstance(event, (Done, BaseException)):
                    return

        self.bridge.metrics.in_flight += 1
        threading.Thread(target=pump, name="mlx-dspark-job-pump", daemon=True).start()
        try:
            self.first = await self._next()
        except BaseException:
            self.close()
            raise

    async def _next(self) -> Any:
        while True:
            try:
                event = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            # polled by the clock, not only when idle: prefill progress arrives every chunk, and
            # a client that left during a long prefill must free the engine all the same
            now = time.monotonic()
            if self.request is not None and now - self._polled >= DISCONNECT_POLL_S:
                self._polled = now
                if await self.request.is_disconnected():
                    raise ClientGone() from None
            if event is not None:
                break
        if isinstance(event, EngineError):
            raise from_engine_error(event)
        if isinstance(event, BaseException):
            raise ApiError(500, f"generation failed: {type(event).__name__}: {event}")
        if isinstance(event, Done):
            self.done = event
        return event

    async def events(self) -> AsyncIterator[Any]:
        try:
            event = self.first
            while True:
                yield event
                if isinstance(event, Done):
                    return
                event = await self._next()
        finally:
            self.close()

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self.bridge.metrics.in_flight -= 1
            if self.done is None:
                self.job.cancel()


DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


async def read_json(request: Request, max_bytes: int | None = None) -> dict:
    """The request body as a JSON object, with size and syntax checked (400/413/415)."""
    import json

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


def sse(event: str | None, data: Any) -> str:
    import json

    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


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


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
