"""What the engine is doing, live: every job from any client (HTTP APIs, MCP tools, the web
app) with its phase, drafting by position, throughput over time, and which clients called.

Fed by the engine's job events: `Telemetry.watch(engine)` adds an engine job observer that
has each new job report its events here as the engine thread emits them. `ClientMiddleware` names
the HTTP client behind each request (from its User-Agent) for the jobs it submits.
Everything is kept in a few bounded structures under one lock; `snapshot()` is what the
web app's telemetry stream sends (GET /v1/telemetry).
"""

from __future__ import annotations

import collections
import contextvars
import itertools
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engine import Done, PrefillProgress, Tokens

RECENT_JOBS = 40
TIMELINE_S = 120  # seconds of throughput history kept
API_PATHS = ("/v1/chat", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/models", "/v1/corpus", "/mcp")

# User-Agent fragments (lower case) -> the client's name, first match wins. Integrations use
# the same names (agent_bridge/integrate/clients.py); SDK names stand for scripts.
CLIENT_SIGNS = (
    ("claude-cli", "claude-code"), ("claude-code", "claude-code"), ("codex", "codex"),
    ("opencode", "opencode"), ("cursor", "cursor"), ("continue", "continue"), ("zed", "zed"),
    ("vscode", "vscode"), ("copilot", "vscode"), ("aider", "aider"), ("litellm", "aider"),
    ("mlx-dspark-webapp", "web app"), ("anthropic/", "anthropic-sdk"), ("openai/", "openai-sdk"),
    ("python-httpx", "httpx"), ("mozilla", "browser"),
)

# Jobs submitted outside an HTTP API handler: in `serve` these are the MCP tools (their session
# task does not inherit the /mcp request's context).
current_client: contextvars.ContextVar[str] = contextvars.ContextVar("mlx_dspark_client", default="mcp tools")


def client_name(user_agent: str, path: str = "", hint: str = "") -> str:
    ua = f"{hint} {user_agent}".lower()
    name = next((n for sign, n in CLIENT_SIGNS if sign in ua), user_agent.split("/")[0][:40] or "unknown")
    return f"mcp ({name})" if path.startswith("/mcp") else name


@dataclass
class JobRecord:
    id: int
    client: str
    submitted: float  # wall clock (time.time)
    mode: str = ""
    phase: str = "queued"  # queued -> prefill -> decode -> done / error
    started: float = 0.0
    first_token: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_done: int = 0
    generated: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_by_source: dict = field(default_factory=dict)  # the engine's counts, at the end
    accepted_by_source: dict = field(default_factory=dict)
    finish: str = ""
    note: str = ""  # the engine's (e.g. "loop guard: ...")
    ended: float = 0.0
    decode_tok_s: float = 0.0
    ttft_s: float = 0.0

    def view(self) -> dict:
        d = asdict(self)
        d["tokens_per_forward"] = round(self.generated / self.rounds, 3) if self.rounds else 0.0
        d["acceptance"] = round(self.accepted / self.drafted, 4) if self.drafted else 0.0
        return d


@dataclass
class Telemetry:
    started: float = field(default_factory=time.time)
    jobs: dict[int, JobRecord] = field(default_factory=dict)  # in flight, by id
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_JOBS))
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    tokens_per_forward: list[int] = field(default_factory=list)  # [n] = rounds that committed n+1 tokens
    timeline: dict[int, list[int]] = field(default_factory=dict)  # second -> [tokens, forwards]
    clients: dict[str, dict] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    version: int = 0  # bumped on every change: the stream sends only when it moved
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def watch(cls, engine: Any) -> "Telemetry":
        """The telemetry of this engine: one per engine, which sees every job it is given."""
        for observer in engine.job_observers:
            if isinstance(getattr(observer, "__self__", None), cls):
                return observer.__self__
        telemetry = cls()
        engine.job_observers.append(telemetry.follow)
        return telemetry

    def follow(self, job: Any) -> None:
        """Record `job`'s events as the engine emits them (called before the job queues)."""
        client = current_client.get()
        request = getattr(job, "request", None)
        rec = JobRecord(next(self._ids), client, time.time(), mode=str(getattr(request, "mode", "") or ""),
                        prompt_tokens=len(getattr(request, "prompt_ids", ()) or ()))
        with self._lock:
            self.jobs[rec.id] = rec
            self.totals["requests"] += 1
            self.version += 1
        emit = job.emit

        def observed_emit(event: Any) -> None:
            try:
                self.observe(rec, event)
            finally:
                emit(event)

        job.emit = observed_emit

    def observe(self, rec: JobRecord, event: Any) -> None:
        now = time.time()
        with self._lock:
            self.version += 1
            if not rec.started:
                rec.started = now
            if isinstance(event, PrefillProgress):
                if rec.phase == "queued":
                    rec.cached_tokens = event.done
                rec.phase, rec.prefill_done, rec.prompt_tokens = "prefill", event.done, event.total
            elif isinstance(event, Tokens):
                self._tokens(rec, event, now)
            elif isinstance(event, Done):
                self._done(rec, event, now)
            elif isinstance(event, BaseException):
                rec.phase, rec.finish, rec.ended = "error", f"{type(event).__name__}: {event}"[:200], now
                self._retire(rec)

    def _tokens(self, rec: JobRecord, event: Tokens, now: float) -> None:
        if rec.phase != "decode":
            rec.phase, rec.first_token, rec.prefill_done = "decode", now, rec.prompt_tokens
        rec.generated += len(event.token_ids)
        bucket = self.timeline.setdefault(int(now), [0, 0])
        bucket[0] += len(event.token_ids)
        if not event.provenance:
            return
        accepted = sum(1 for _, source in event.provenance if source != "target")
        rec.rounds += 1
        rec.drafted += event.drafted
        rec.accepted += accepted
        bucket[1] += 1
        for counts, n in ((self.drafted_by_position, event.drafted), (self.accepted_by_position, accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1
        n = len(event.provenance)
        self.tokens_per_forward.extend([0] * (n - len(self.tokens_per_forward)))
        self.tokens_per_forward[n - 1] += 1
        for old in [s for s in self.timeline if s < now - TIMELINE_S]:
            del self.timeline[old]

    def _done(self, rec: JobRecord, done: Done, now: float) -> None:
        s = done.stats  # the engine's own counts replace the live estimate
        rec.phase, rec.finish, rec.ended, rec.mode, rec.note = "done", done.finish_reason, now, s.mode, s.note
        rec.prompt_tokens, rec.cached_tokens, rec.generated = s.prompt_tokens, s.cached_tokens, s.generated_tokens
        rec.rounds, rec.drafted, rec.accepted = s.rounds, s.drafted_tokens, s.accepted_tokens
        rec.drafted_by_source, rec.accepted_by_source = dict(s.drafted_by_source), dict(s.accepted_by_source)
        rec.decode_tok_s, rec.ttft_s = round(s.decode_tok_s, 2), round(s.ttft_s, 4)
        self.totals["generated_tokens"] += s.generated_tokens
        self._retire(rec)

    def _retire(self, rec: JobRecord) -> None:
        self.jobs.pop(rec.id, None)
        self.recent.append(rec)
        self.totals["finished"] += 1

    def saw_client(self, name: str, user_agent: str, path: str) -> None:
        with self._lock:
            seen = self.clients.setdefault(name, {"requests": 0, "first_seen": time.time()})
            seen.update(requests=seen["requests"] + 1, last_seen=time.time(), user_agent=user_agent[:200],
                        last_path=path)
            self.version += 1

    def snapshot(self) -> dict:
        now = time.time()
        with self._lock:
            second = int(now)
            throughput = [[s, *self.timeline.get(s, [0, 0])] for s in range(second - TIMELINE_S + 1, second + 1)]
            in_flight = [r.view() for r in self.jobs.values()]
            return {
                "now": now,
                "uptime_s": round(now - self.started, 1),
                "version": self.version,
                "queue_depth": sum(1 for r in self.jobs.values() if r.phase == "queued"),
                "in_flight": in_flight,
                "recent": [r.view() for r in reversed(self.recent)],
                "throughput": throughput,  # [unix second, tokens, target forwards]
                "drafted_by_position": list(self.drafted_by_position),
                "accepted_by_position": list(self.accepted_by_position),
                "tokens_per_forward": list(self.tokens_per_forward),
                "clients": {k: dict(v) for k, v in self.clients.items()},
                "totals": dict(self.totals),
            }


class ClientMiddleware:
    """Names the client of each API request (for the jobs it starts and the integrations page)."""

    def __init__(self, app: Any, telemetry: Telemetry):
        self.app, self.telemetry = app, telemetry

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path.startswith(API_PATHS) or (path == "/" and scope.get("method") == "HEAD")):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        ua = headers.get("user-agent", "")
        name = client_name(ua, path, headers.get("x-client-name", ""))
        self.telemetry.saw_client(name, ua, path)
        token = current_client.set(name)
        try:
            await self.app(scope, receive, send)
        finally:
            current_client.reset(token)
