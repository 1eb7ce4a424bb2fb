"""A job's events, read on the event loop: the generation pump.

A job's events are read by a small pump thread (Job.next_event blocks) and handed to
the loop through an asyncio queue. Whoever stops listening (a client that hangs up,
a finished response) cancels the job, so the engine moves on to the next request; a
job whose client left before any output is parked with its bridge instead (bridge.py),
for a retry of the same request to take over.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request

from engine import Done, EngineError, PrefillProgress, Tokens

from agent_bridge.chat.http_errors import ApiError, from_engine_error

DISCONNECT_POLL_S = 0.5
QUEUED_OPEN_S = 0.3  # a stream whose job has not started by then opens with its queue position
FIRST_EVENT_WAIT_S = 10.0  # a stream not queued waits at most this long for its cached-prefix size
QUEUED_PING_S = 2.0  # a queued stream hears its queue position this often


class ClientGone(Exception):
    """The client hung up while its job ran: the route stops writing (the app answers 499)."""


@dataclass
class Waiting:
    """A request still queued behind others (position 1 is next)."""

    position: int


class Generation:
    """One job seen from the event loop: `async for event in gen.events()`. Besides the engine's
    events it yields `Waiting` while the job is queued. `events` given: a parked job taken over.
    `bridge` is the Bridge (bridge.py) that made it: its metrics, engine and parked jobs (not
    imported here: the bridge builds generations, so the arrow runs bridge -> job_stream)."""

    def __init__(self, bridge: Any, job: Any, request: Request | None, key: str = "",
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
        self.cached_at_accept = 0  # the prefix cache's hold on the prompt when it was accepted (bridge.py)

    @property
    def cached_tokens(self) -> int:
        """What the engine reused, once it started (its first progress event, then its Stats);
        before that, what the prefix cache held when the request was accepted. A taken-over
        job's first event here is a later progress event: its figure comes from the first reader."""
        if self.done is not None:
            return self.done.stats.cached_tokens
        if isinstance(self.first, PrefillProgress) and not self.adopted:
            return self.first.done
        return self.cached_at_accept

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
