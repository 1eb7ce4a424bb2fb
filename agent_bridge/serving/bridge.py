"""What every route shares: the bridge from the event loop to the engine thread.

A `Bridge` renders a chat to prompt ids off the loop, submits the job (or takes over the
same request's parked one), and hands back a `Generation` (job_stream.py) to read it.

Load: past `max_queue` waiting jobs a request is refused (429, or Anthropic's 529) with
`retry-after`. A client that hangs up before any output was sent leaves its job parked
for `TAKEOVER_GRACE_S`: the same request sent again (a client that timed out and
retries) takes it over, with its place in the queue and its prefill progress.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from starlette.requests import Request

from engine import EngineError

from agent_bridge.chat.chat_request import ChatRequest, check_context, force_call, render, resolve_media
from agent_bridge.chat.http_errors import from_engine_error, overloaded
from agent_bridge.chat.reply_grammar import reply_constraint
from agent_bridge.chat.thinking_signature import ThinkingSigner
from agent_bridge.chat.tool_stream import ReplyParser, Syntax, syntax_for
from agent_bridge.chat.turn_replay import Turn, TurnMemory, render_replayed, reply_key
from agent_bridge.serving.job_stream import DISCONNECT_POLL_S, Generation
from agent_bridge.serving.metrics import Metrics

TAKEOVER_GRACE_S = 10.0
DEFAULT_MAX_QUEUE = 32


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
    strict_tools: bool | None = False  # --strict-tools: every tool's calls valid by construction (None: known syntaxes)

    @classmethod
    def for_engine(cls, engine: Any, context_window: int | None, default_max_tokens: int,
                   model_name: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
                   strict_tools: bool | None = False) -> "Bridge":
        window = engine.context_window if context_window is None else min(context_window, engine.context_window)
        name = model_name or Path(str(engine.info().get("model", "local-model"))).name or "local-model"
        return cls(engine, window, default_max_tokens, Metrics(), name, syntax_for(engine.tokenizer), max_queue,
                   strict_tools=strict_tools)

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
        req.may_think = self.may_think(ids) and not req.starts_thinking and not req.assistant_prefix
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

    def may_think(self, prompt_ids: list[int]) -> bool:
        """Templates that know reasoning blocks but leave opening one to the model (Qwen3's
        hybrid thinking); not when the prompt closed one already (thinking turned off)."""
        template = getattr(self.engine.tokenizer, "chat_template", None)
        if not self.syntax.think_start or not isinstance(template, str) or self.syntax.think_start not in template:
            return False
        return self.syntax.think_end not in self.engine.decode(prompt_ids[-8:])

    def literal(self, text: str) -> str:
        """A marker as the reply grammar spells it for this model's tokenizer."""
        return self.engine.grammars.literal(text)

    def parser(self, req: ChatRequest, gen: Generation, id_prefix: str = "call_") -> ReplyParser:
        """The reply parser for this request: the model's syntax, the offered tools; the finished
        reply is remembered so that its echo renders to the same tokens (turn_replay.py)."""
        p = self.syntax.parser(req.tools, parse_tools=req.parse_tools, thinking=req.starts_thinking,
                               id_prefix=id_prefix)
        if req.forced_prefix:
            p.prime(req.forced_prefix)
        p.on_finish = lambda parser: self.remember(req, parser, gen)
        return p

    def remember(self, req: ChatRequest, parser: ReplyParser, gen: Generation) -> None:
        done = gen.done
        if done is None or done.finish_reason in ("length", "cancelled", "stop_string") or req.assistant_prefix:
            return
        self.turns.remember(reply_key(parser), Turn(req.forced_prefix, list(done.token_ids)))

    async def generate(self, req: ChatRequest, prompt_ids: list[int], request: Request | None) -> Generation:
        """Submit (or take over the same request's parked job). A stream starts at once; a plain
        request waits for the engine to start on it, so an early error is still an HTTP error."""
        try:  # the reply's grammar: reasoning free, then the response_format or strict tool calls (off the
            # loop: a new set of tools takes ~100 ms to compile)
            constraint = await anyio.to_thread.run_sync(reply_constraint, req, self.syntax, self.literal,
                                                        self.strict_tools)
        except EngineError as e:
            raise from_engine_error(e) from None
        gen_req = req.generation_request(prompt_ids, constraint)
        gen_req.max_tokens = self.clamp_max_tokens(req.max_tokens, len(prompt_ids))
        key = request_key(request, gen_req)
        gen = await self._take_over(key, request)
        if gen is None:
            if self.engine.load()["queued"] >= self.max_queue:
                raise overloaded(self.max_queue, self.retry_after())
            cached = await self.cached_now(gen_req) if req.stream else 0  # a plain reply reports Stats only
            try:
                job = self.engine.submit(gen_req)
            except EngineError as e:
                raise from_engine_error(e) from None
            gen = Generation(self, job, request, key)
            gen.cached_at_accept = cached
        await gen.start(wait=not req.stream)
        return gen

    async def cached_now(self, gen_req: Any) -> int:
        """How much of the prompt the prefix cache holds as the request is accepted: what a stream's
        opening reports (Anthropic's message_start) when the engine has not started on it yet. The
        engine looks again when it starts (the cache may have changed behind other jobs): the final
        usage reports what it really reused. Off the loop: the engine thread may hold the cache."""
        cached = await anyio.to_thread.run_sync(self.engine.cached_prefix_tokens, gen_req.prompt_ids, gen_req.images)
        return cached or 0

    async def _take_over(self, key: str, request: Request | None) -> Generation | None:
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
        gen = Generation(self, old.job, request, key, events=old.queue)
        gen.cached_at_accept = old.cached_tokens
        return gen

    def park(self, gen: Generation) -> None:
        self.parked[gen.key] = gen
        self.engine.hold(gen.job)  # not started for nobody; one already prefilling goes on
        asyncio.get_running_loop().call_later(self.takeover_grace_s, self._expire, gen)

    def _expire(self, gen: Generation) -> None:
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
    """The same request sent again has the same key (route, rendered prompt, sampling, limits, grammar)."""
    h = hashlib.sha256()
    h.update((request.url.path if request is not None else "").encode())
    images = gen_req.images.hashes if gen_req.images is not None else None  # the same text with another image differs
    grammar = gen_req.constraint.grammar if gen_req.constraint is not None else None  # held to another shape: differs
    h.update(json.dumps([gen_req.max_tokens, repr(gen_req.sampling), gen_req.stop,
                         gen_req.mode, gen_req.max_draft, images, grammar]).encode())
    # the prompt as packed integers: on the event loop, 100k tokens through json.dumps took 15 ms, these 3
    h.update(array.array("q", gen_req.prompt_ids).tobytes())
    return h.hexdigest()
