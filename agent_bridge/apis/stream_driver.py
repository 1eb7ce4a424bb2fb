"""One streaming loop for the three APIs; each API only says how events look on its wire.

    wire = AnthropicWire(...)                      # a Wire: opening, ping, segment, closing, error
    return EventStream(drive(gen, parser, wire), gen)

`drive` feeds the engine's text to the output parser, hands the parsed segments to the
wire, sends keep-alives while the request waits, prefills or holds output back (a tool
call being written), maps an error to the API's in-stream error event, stops quietly when
the client is gone, and finishes with the wire's closing events.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from engine import Done, PrefillProgress, Tokens

from agent_bridge.apis.sse import Heartbeat
from agent_bridge.chat.http_errors import ApiError
from agent_bridge.chat.tool_stream import Event, Reply, Text
from agent_bridge.serving.job_stream import ClientGone, Generation, Waiting


class Wire:
    """How one API writes a generation. Each method returns the SSE text to send."""

    def opening(self) -> list[str]:
        """Sent as soon as the request is accepted (before the engine starts on it)."""
        return []

    def ping(self, info: dict | None) -> list[str]:
        """A keep-alive; `info` says what the request waits on (queue position, prefill progress)."""
        return [": ping\n\n"]

    def segment(self, event: Event) -> list[str]:
        """One parser event (tool_stream.events: Text, Reasoning, CallStart, CallArgs, CallEnd)."""
        raise NotImplementedError

    def tokens(self, event: Tokens) -> list[str]:
        """After a batch of committed tokens' segments: extra events about the tokens themselves
        (how each was produced, for the web app); none by default."""
        return []

    def closing(self, done: Done, has_calls: bool) -> list[str]:
        raise NotImplementedError

    def error(self, e: ApiError) -> list[str]:
        raise NotImplementedError


class PlainText:
    """The parser for raw completions: text goes out as it comes."""

    calls: list = []
    notes: list = []

    def feed(self, text: str) -> list[Event]:
        return [Text(text)] if text else []

    def finish(self, cut: bool = False) -> list[Event]:
        return []


def progress_info(event: Any) -> dict | None:
    """What a ping tells the client about a request not yet decoding (the `mlx_dspark` field)."""
    if isinstance(event, Waiting):
        return {"phase": "queued", "queue_position": event.position}
    if isinstance(event, PrefillProgress):
        return {"phase": "prefill", "prefilled_tokens": event.done, "prompt_tokens": event.total}
    return None


async def drive(gen: Generation, parser: Any, wire: Wire) -> AsyncIterator[str]:
    for line in wire.opening():
        yield line
    beat = Heartbeat()
    try:
        async for event in gen.events():
            if isinstance(event, Tokens):
                segs = parser.feed(event.text)
                for seg in segs:
                    for line in wire.segment(seg):
                        yield line
                for line in wire.tokens(event):
                    yield line
                if beat.due(bool(segs)):
                    for line in wire.ping(None):
                        yield line
            elif isinstance(event, (PrefillProgress, Waiting)):
                for line in wire.ping(progress_info(event)):
                    yield line
    except ApiError as e:
        for line in wire.error(e):
            yield line
        return
    except ClientGone:
        return
    for seg in parser.finish(cut=cut_short(gen.done)):
        for line in wire.segment(seg):
            yield line
    for line in wire.closing(gen.done, bool(parser.calls)):
        yield line


def cut_short(done: Any) -> bool:
    """The reply was cut by max_tokens (a call in it is then incomplete, and reported so)."""
    return done is not None and done.finish_reason == "length"


def whole_reply(parser: Any, text: str, done: Any) -> Reply:
    """A non-streaming reply: the same parser and events a stream would have sent."""
    reply = Reply()
    for event in parser.feed(text) + parser.finish(cut=cut_short(done)):
        reply.add(event)
    return reply


async def collect_text(gen: Generation) -> str:
    """A non-streaming request's whole text."""
    text = ""
    async for event in gen.events():
        if isinstance(event, Tokens):
            text += event.text
    return text
