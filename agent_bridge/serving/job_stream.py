"""The server's side of the engine: render, submit, and read a job's events without
blocking the event loop.

A job's events are read by a small pump thread (Job.next_event blocks) and handed to
the loop through an asyncio queue. Whoever stops listening (a client that hangs up,
a finished response) cancels the job, so the engine moves on to the next request.

Load: past `max_queue` waiting jobs a request is refused (429, or Anthropic's 529) with
`retry-after`. A client that hangs up before any output was sent leaves its job parked
for `TAKEOVER_GRACE_S`: the same request sent again (a client that timed out and
retries) takes it over, with its place in the queue and its prefill progress.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

from engine import Done, EngineError, PrefillProgress, Tokens

from agent_bridge.chat.chat_request import ChatRequest, check_context, force_call, render, resolve_media
from agent_bridge.chat.http_errors import ApiError, from_engine_error, overloaded
from agent_bridge.chat.thinking_signature import ThinkingSigner
from agent_bridge.chat.tool_stream import ReplyParser, Syntax, syntax_for
from agent_bridge.chat.turn_replay import Turn, TurnMemory, render_replayed, reply_key
from agent_bridge.serving.metrics import Metrics

DISCONNECT_POLL_S = 0.5
QUEUED_OPEN_S = 0.3  # a stream whose job has not started by then opens with its queue position
FIRST_EVENT_WAIT_S = 10.0  # a stream not queued waits at most this long for its cached-prefix size
QUEUED_PING_S = 2.0  # a queued stream hears its queue position this often
TAKEOVER_GRACE_S = 10.0
DEFAULT_MAX_QUEUE = 32


class ClientGone(Exception):
    pass


@dataclass
class Waiting:
    """A request still queued behind others (position 1 is next)."""

    position: int


@dataclass
class Bridge:
    """What every route shares: the engine, limits, metrics."""

    engine: Any
    context_window: int
    default_max_tokens: int
    metrics: Metrics
    model_name: str
    syntax: Syntax
    max_queue: int = DEFAULT_MAX_QUEUE
    takeover_grace_s: float = TAKEOVER_GRACE_S
    live: dict = field(default_factory=dict)  # request key -> its Generation, while a client listens
    parked: dict = field(default_factory=dict)  # request key -> Generation whose client left, for a retry
    signer: ThinkingSigner = field(default_factory=ThinkingSigner)  # thinking blocks' signatures
    turns: TurnMemory = field(default_factory=TurnMemory)  # replies remembered for their echo

    @classmethod
    def for_engine(cls, engine: Any, context_window: int | None, default_max_tokens: int,
                   model_name: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE) -> "Bridge":
        window = engine.context_window if context_window is None else min(context_window, engine.context_window)
        name = model_name or Path(str(engine.info().get("model", "local-model"))).name or "local-model"
        return cls(engine, window, default_max_tokens, Metrics(), name, syntax_for(engine.tokenizer), max_queue)

    async def prompt_ids(self, req: ChatRequest, check: bool = True) -> list[int]:
        """Render the chat (tokenizing a 15k-token prompt takes a while: off the loop)."""
        try:
            ids = await anyio.to_thread.run_sync(self._render, req)
            if check:
                check_context(ids, self.context_window)
        except EngineError as e:
            raise from_engine_error(e) from None
        return ids

    def _render(self, req: ChatRequest) -> list[int]:
        # images go through the model's processor: no replayed rendering for them
        images = resolve_media(req, self.engine)
        ids = None if images else render_replayed(self.engine, req.messages, req.tools, req.template_kwargs,
                                                  self.turns)
        if ids is None:
            ids = render(self.engine, req)
        elif req.assistant_prefix:
            ids = ids + self.engine.encode(req.assistant_prefix)
        req.starts_thinking = self.starts_thinking(ids) and not req.assistant_prefix
        if req.forced_tool is not None and req.parse_tools:
            ids = force_call(self.engine, self.syntax, req, ids)
        return ids

    async def encode(self, text: str) -> list[int]:
        return await anyio.to_thread.run_sync(self.engine.encode, text)  # it holds the tokenizer lock

    def clamp_max_tokens(self, max_tokens: int, prompt_len: int) -> int:
        return max(1, min(max_tokens, self.context_window - prompt_len))

    def starts_thinking(self, prompt_ids: list[int]) -> bool:
        """Templates that open the thinking block in the generation prompt (`<think>\\n`)."""
        if not self.syntax.think_start:
            return False
        tail = self.engine.decode(prompt_ids[-8:]).rstrip()
        return tail.endswith(self.syntax.think_start)

    def parser(self, req: ChatRequest, gen: "Generation", id_prefix: str = "call_") -> ReplyParser:
        """The reply parser for this request: the model's syntax, the offered tools; the finished
        reply is remembered so that its echo renders to the same tokens (turn_replay.py)."""
        p = self.syntax.parser(req.tools, parse_tools=req.parse_tools, thinking=req.starts_thinking,
                               id_prefix=id_prefix)
        if req.forced_prefix:
            p.prime(req.forced_prefix)
        p.on_finish = lambda parser: self.remember(req, parser, gen)
        return p

    def remember(self, req: ChatRequest, parser: ReplyParser, gen: "Generation") -> None:
        done = gen.done
        if done is None or done.finish_reason in ("length", "cancelled", "stop_string") or req.assistant_prefix:
            return
        self.turns.remember(reply_key(parser), Turn(req.forced_prefix, list(done.token_ids)))

    async def generate(self, req: ChatRequest, prompt_ids: list[int], request: Request | None) -> "Generation":
        """Submit (or take over the same request's parked job). A stream starts at once; a plain
        request waits for the engine to start on it, so an early error is still an HTTP error."""
        gen_req = req.generation_request(prompt_ids)
        gen_req.max_tokens = self.clamp_max_tokens(req.max_tokens, len(prompt_ids))
        key = request_key(request, gen_req)
        gen = await self._take_over(key, request)
        if gen is None:
            if self.engine.load()["queued"] >= self.max_queue:
                raise overloaded(self.max_queue, self.retry_after())
            try:
                job = self.engine.submit(gen_req)
            except EngineError as e:
                raise from_engine_error(e) from None
            gen = Generation(self, job, request, key)
        await gen.start(wait=not req.stream)
        return gen

    async def _take_over(self, key: str, request: Request | None) -> "Generation | None":
        old = self.live.get(key)
        if old is not None and not old.sent_output and old.request is not None \
                and await old.request.is_disconnected():
            for _ in range(int(4 * DISCONNECT_POLL_S / 0.05)):  # its reader notices within a poll
                if old.closed:
                    break
                await asyncio.sleep(0.05)
        old = self.parked.pop(key, None)
        if old is None or old.job.phase == "done" and old.queue.empty():
            return None
        self.engine.hold(old.job, False)
        return Generation(self, old.job, request, key, events=old.queue)

    def park(self, gen: "Generation") -> None:
        self.parked[gen.key] = gen
        self.engine.hold(gen.job)  # not started for nobody; one already prefilling goes on
        asyncio.get_running_loop().call_later(self.takeover_grace_s, self._expire, gen)

    def _expire(self, gen: "Generation") -> None:
        if self.parked.get(gen.key) is gen:
            del self.parked[gen.key]
            gen.job.cancel()
            self.engine.hold(gen.job, False)  # wakes the engine to drop it

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the mean generation time so far, else 5."""
        return max(1, min(60, math.ceil(self.metrics.mean_wall_s() or 5.0)))

    def load(self) -> dict:
        load = self.engine.load()
        load["max_queue"] = self.max_queue
        load["parked"] = len(self.parked)
        return load


def request_key(request: Request | None, gen_req: Any) -> str:
    """The same request sent again has the same key (route, rendered prompt, sampling, limits)."""
    h = hashlib.sha256()
    h.update((request.url.path if request is not None else "").encode())
    images = gen_req.images.hashes if gen_req.images is not None else None  # the same text with another image differs
    h.update(json.dumps([gen_req.prompt_ids, gen_req.max_tokens, repr(gen_req.sampling), gen_req.stop,
                         gen_req.mode, gen_req.max_draft, images]).encode())
    return h.hexdigest()


class Generation:
    """One job seen from the event loop: `async for event in gen.events()`. Besides the engine's
    events it yields `Waiting` while the job is queued. `events` given: a parked job taken over."""

    def __init__(self, bridge: Bridge, job: Any, request: Request | None, key: str = "",
                 events: asyncio.Queue | None = None):
        self.bridge, self.job, self.request, self.key = bridge, job, request, key
        self.adopted = events is not None
        self.queue: asyncio.Queue = events if events is not None else asyncio.Queue()
        self.first: Any = None
        self.done: Done | None = None
        self.sent_output = False  # Tokens handed to the client: from then on a retry starts afresh
        self.closed = False
        self._last_ping = 0.0
        self._polled = time.monotonic()  # when the client's connection was last checked
        self._held: Any = None  # an event taken off the queue, not yet returned (see _next)

    @property
    def cached_tokens(self) -> int:
        """Known once the engine started: its first progress event reports the cached prefix."""
        if self.done is not None:
            return self.done.stats.cached_tokens
        if isinstance(self.first, PrefillProgress):
            return self.first.done
        return 0

    async def start(self, wait: bool = True) -> None:
        self.bridge.metrics.in_flight += 1
        self.bridge.live[self.key] = self
        if not self.adopted:
            self._pump()
        try:
            if wait:
                self.first = await self._next(engine_only=True)
            else:
                # A stream opens at once if it must wait for others; one the engine starts on
                # now first learns its cached prefix (message_start reports it).
                try:
                    self.first = await asyncio.wait_for(self._next(engine_only=True), QUEUED_OPEN_S)
                except asyncio.TimeoutError:
                    if self.job.phase == "queued":
                        self.first = Waiting(max(1, self.bridge.engine.queue_position(self.job)))
                    else:
                        try:
                            self.first = await asyncio.wait_for(self._next(engine_only=True), FIRST_EVENT_WAIT_S)
                        except asyncio.TimeoutError:
                            pass
        except BaseException:
            self.close()
            raise

    def _pump(self) -> None:
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

        threading.Thread(target=pump, name="mlx-dspark-job-pump", daemon=True).start()

    async def _next(self, engine_only: bool = False) -> Any:
        while True:
            # An event taken off the queue is held on self until it is returned: a caller that
            # times this call out (start()'s wait_for) can't lose it at the await below.
            if self._held is None:
                try:
                    self._held = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    pass
            # polled by the clock, not only when idle: prefill progress arrives every chunk, and
            # a client that left during a long prefill must free the engine all the same
            now = time.monotonic()
            if self.request is not None and now - self._polled >= DISCONNECT_POLL_S:
                self._polled = now
                if await self.request.is_disconnected():
                    raise ClientGone() from None
            if self._held is not None:
                event, self._held = self._held, None
                break
            if not engine_only and self.job.phase == "queued" and now - self._last_ping >= QUEUED_PING_S:
                self._last_ping = now
                return Waiting(self.bridge.engine.queue_position(self.job))
        if isinstance(event, EngineError):
            raise from_engine_error(event)
        if isinstance(event, BaseException):
            raise ApiError(500, f"generation failed: {type(event).__name__}: {event}")
        if isinstance(event, Done):
            self.done = event
        return event

    async def events(self) -> AsyncIterator[Any]:
        try:
            event = self.first if self.first is not None else await self._next()
            while True:
                if isinstance(event, Tokens):
                    self.sent_output = True
                yield event
                if isinstance(event, Done):
                    return
                event = await self._next()
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.bridge.metrics.in_flight -= 1
        if self.bridge.live.get(self.key) is self:
            del self.bridge.live[self.key]
        if self.done is None:
            if self.key and not self.sent_output and self.job.phase != "done":
                self.bridge.park(self)  # the client may send it again (a timeout and retry)
            else:
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


def sse_comment(info: dict | None) -> str:
    """A keep-alive the SDKs skip; `info` (queue position, prefill progress) for whoever reads raw SSE."""
    import json

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
