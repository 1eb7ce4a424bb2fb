"""Where the MCP tools get their text from: the engine in this process, or a running
`mlx-dspark serve` over its OpenAI chat endpoint (`mlx-dspark mcp --server URL`)."""

from __future__ import annotations

import contextvars
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio


class BackendError(Exception):
    """Generation failed (server down, bad reply, engine refused): a message for the agent."""


class CallJobs:
    """The engine jobs one MCP tool call started, cancelled with the call."""

    def __init__(self):
        self.jobs: list = []
        self.cancelled = False
        self.lock = threading.Lock()

    def add(self, job) -> None:
        with self.lock:
            self.jobs.append(job)
            if self.cancelled:
                job.cancel()

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            for job in self.jobs:
                job.cancel()


_CALL: contextvars.ContextVar[CallJobs | None] = contextvars.ContextVar("mlx_dspark_mcp_call", default=None)


async def run_cancellable(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a tool's blocking work on a worker thread (the event loop serves everyone else
    meanwhile); when the call is cancelled (MCP `notifications/cancelled`, a closed session)
    its engine jobs are cancelled too, so the engine moves on to the next request."""
    call = CallJobs()
    token = _CALL.set(call)  # the worker thread runs in a copy of this context
    try:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        call.cancel()
        raise
    finally:
        _CALL.reset(token)


@dataclass
class Generation:
    text: str
    finish_reason: str  # "stop", "length", ...
    stats: dict = field(default_factory=dict)  # tokens, tokens/s, acceptance, mode, ...


class Tally:
    """What this MCP server has generated so far (for status()), summed by engine.Stats.sum."""

    def __init__(self) -> None:
        self.calls = 0
        self.total: dict = {}
        self.last: dict = {}
        self.lock = threading.Lock()

    def record(self, stats: dict) -> None:
        from engine import Stats

        with self.lock:
            self.calls += 1
            self.total = Stats.sum([self.total, stats]).to_dict()
            self.last = dict(stats)

    def to_dict(self) -> dict:
        with self.lock:
            return {"calls": self.calls, "generated_tokens": self.total.get("generated_tokens", 0),
                    "decode_tok_s": self.total.get("decode_tok_s", 0.0),
                    "acceptance_rate": self.total.get("acceptance_rate", 0.0), "last": self.last}


STAT_KEYS = ("mode", "prompt_tokens", "cached_tokens", "generated_tokens", "rounds", "drafted_tokens",
             "accepted_tokens", "mean_accepted", "acceptance_rate", "decode_tok_s", "ttft_s", "decode_s", "wall_s")


class EngineBackend:
    """Generates with an in-process `engine.Engine` (public API only)."""

    def __init__(self, engine, mode: str = "auto"):
        self.engine = engine
        self.mode = mode
        self.totals = Tally()

    def count_tokens(self, text: str) -> int:
        return len(self.engine.encode(text))

    def room(self, messages: list[dict]) -> int:
        """Tokens left for the reply after this prompt."""
        return self.engine.context_window - len(self.engine.render_chat(messages))

    def generate(self, messages: list[dict], max_tokens: int, temperature: float = 0.0) -> Generation:
        from engine import EngineError, GenerationRequest, SamplingParams

        try:
            ids = self.engine.render_chat(messages)
            request = GenerationRequest(
                prompt_ids=ids,
                max_tokens=max(1, min(max_tokens, self.engine.context_window - len(ids))),
                sampling=SamplingParams(temperature=temperature),
                mode=self.mode,
            )
            job = self.engine.submit(request)  # the same queue and scheduler as the HTTP APIs
            if (call := _CALL.get()) is not None:
                call.add(job)
            done = job.result()
        except EngineError as e:
            raise BackendError(str(e)) from None
        d = done.stats.to_dict()
        stats = {k: d[k] for k in STAT_KEYS if k in d}
        self.totals.record(stats)
        return Generation(done.text, done.finish_reason, stats)

    def status(self) -> dict:
        return {"backend": "in-process", **self.engine.info(), "mcp_totals": self.totals.to_dict()}


class HTTPBackend:
    """Generates through a running server's `/v1/chat/completions` (non-streaming)."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600.0):
        import httpx

        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        headers = {"Authorization": f"Bearer {api_key or 'local'}"}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self.model = model
        self.totals = Tally()

    def count_tokens(self, text: str) -> int:
        return len(text) // 3 + 1  # an estimate: the tokenizer lives in the server

    def room(self, messages: list[dict]) -> int:
        return 1 << 30  # the server clamps max_tokens to its context window itself

    def _get(self, path: str) -> dict:
        import httpx

        try:
            r = self.client.get(path, timeout=10)
            r.raise_for_status()
            return r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise BackendError(f"server {self.url} did not answer {path}: {e}") from None

    def _model(self) -> str:
        if self.model is None:
            data = self._get("/v1/models").get("data") or [{}]
            self.model = data[0].get("id") or "local"
        return self.model

    def generate(self, messages: list[dict], max_tokens: int, temperature: float = 0.0) -> Generation:
        import httpx

        body = {"model": self._model(), "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "stream": False}
        t0 = time.perf_counter()
        try:
            r = self.client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as e:
            raise BackendError(f"server {self.url} unreachable: {e}") from None
        wall = time.perf_counter() - t0
        try:
            data = r.json()
        except ValueError:
            raise BackendError(f"server {self.url} answered {r.status_code} with non-JSON") from None
        if r.status_code != 200:
            err = data.get("error") if isinstance(data, dict) else None
            msg = err.get("message") if isinstance(err, dict) else str(data)[:500]
            raise BackendError(f"server {self.url} refused the request ({r.status_code}): {msg}")
        try:
            choice = data["choices"][0]
            text = choice["message"].get("content") or ""
            finish = choice.get("finish_reason") or "stop"
        except (KeyError, IndexError, TypeError):
            raise BackendError(f"server {self.url} sent an unexpected reply: {str(data)[:300]}") from None
        usage = data.get("usage") or {}
        # mlx-dspark serve adds the engine's stats to its reply; another server may not
        extra = data.get("mlx_dspark") or {}
        stats = {k: extra[k] for k in STAT_KEYS if k in extra}
        stats.setdefault("prompt_tokens", usage.get("prompt_tokens"))
        stats.setdefault("generated_tokens", usage.get("completion_tokens"))
        stats.setdefault("wall_s", round(wall, 4))
        if "decode_tok_s" not in stats and stats.get("generated_tokens") and wall > 0:
            stats["decode_tok_s"] = round(stats["generated_tokens"] / wall, 2)  # end-to-end, prefill included
            stats.setdefault("decode_s", wall)
        self.totals.record(stats)
        return Generation(text, finish, stats)

    def status(self) -> dict:
        return {"backend": "http", "server": self.url, **self._get("/health"), "mcp_totals": self.totals.to_dict()}
