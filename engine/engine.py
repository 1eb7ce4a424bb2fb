"""The engine: one thread owns MLX, the model and its caches; requests queue to it.

`Engine.submit` returns a `Job` whose events (prefill progress, committed tokens,
the end with statistics) are read from any thread; `Job.cancel` stops it between
prefill chunks or decode rounds, or drops it from the queue.

The engine thread runs up to `max_batch` jobs at once, a step each in turn (a prefill
chunk or a decode round): a short request no longer waits for a long one to finish.
Each job keeps its own cache and drafter, so its output is what it would be alone; with
max_batch > 1 a decoding job's attention KV moves into a row of one persistent BatchCache
(engine/caches/batch_cache.py) once another job's forward could share its own, and stays there
to its end, so the decoding jobs' verify forwards run as one batched forward without copying
any KV per round; a job that decodes alone (an agent's turn, as a rule) never pays the copy in
and out. Their head drafts (DSpark, DFlash) run batched too: each round a job first hands the
scheduler its `HeadCall`, and one head forward and one walk draft every row
(engine/drafting/heads/drafter.py).

On the engine thread a job is a `Sequence` (engine/sequence.py) that its phases fill in, in
order: `_begin` (the request's settings for this model), `_take_cache` (the prefix cache),
`_make_drafter`, `_image_embeddings`, `_prefill` (a chunk a step), `_start_decoding`,
`_decode` (a round a step, `_commit` each round's tokens) and `_finish` (the prefix cache
takes its cache back). The request was checked once, when it queued (`_check_request`).

Split over ranks (engine/base/ranks.py, engine/model/split.py), every rank runs this engine on
its part of the model. Only the leader (rank 0) takes requests, calls and cancels; at each turn
of the scheduler it shares what it heard since the last (`_News`), and every rank applies it at
that same turn, so all take the same steps, whose forwards carry the activations between them.
Another rank `follow`s until the leader closes.
"""

from __future__ import annotations

import collections
import gc
import hashlib
import itertools
import logging
import pickle
import queue
import secrets
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import mlx.core as mx
from mlx_lm.generate import generate_step

from engine.base.bundled import resolve_model
from engine.base.chat import chat_text, render_chat
from engine.base.errors import CancelledError, EngineDownError, EngineError, InvalidRequestError, PromptTooLongError
from engine.base.events import Done, PrefillProgress, Stats, Tokens
from engine.base.loop_guard import LoopGuard
from engine.base.piece_encoder import PieceEncoder
from engine.base.platform import on_cuda
from engine.base.ranks import OutOfStepError, Ranks, in_step, link_lost, world
from engine.base.sampling import SamplingParams
from engine.base.stops import TextAssembler
from engine.caches.batch_cache import BatchCache, joinable
from engine.caches.kv_segments import fresh_cache, kv_group_size
from engine.caches.prefix_cache import PrefixCache, cache_identity, open_prefix_cache
from engine.config import DEFAULT_MAX_DRAFT, EngineConfig
from engine.decoding.batch_verify import run_forwards
from engine.decoding.grammar import Grammars, GrammarState, logits_processor
from engine.decoding.verify import Round, prefill, speculative_rounds, warm_up
from engine.drafting.heads.drafter import draft_together
from engine.drafting.heads.loading import precheck
from engine.drafting.lookup import ContextIndexCache, TokenIndex
from engine.drafting.modes import attach_drafter, make_drafter, resolve_mode
from engine.kernels import cpu_attention, gpu_attention
from engine.model.target import Target, load_target
from engine.model.vision import PromptImages, Vision, load_vision, position_view, prefill_chunks, set_position_shift
from engine.sequence import DRAFT, FORWARD, GenerationRequest, Job, MirrorJob, Sequence
from engine.tuning.batch_cost import quick_surface, surface_for
from engine.tuning.cost_curve import curve_for_requests, state_rollback
from engine.tuning.draft_control import draft_controller
from engine.tuning.mode_choice import ModeChoice, choose_mode
from engine.tuning.prefill_chunk import chunk_for

__all__ = ["DEFAULT_MAX_DRAFT", "Engine", "EngineConfig", "GenerationRequest", "Job", "engine_stream", "plain_rounds"]

MAX_ENGINE_CORPUS_DOCS = 64
PREFILL_RATE_MIN_TOKENS = 128  # shorter prefills time the per-call overhead, not the rate
# A long prefill hands what it has computed to the disk tier this often (tokens), not only at
# its end: the writer works while the rest is computed, and a crash loses only the tail.
WRITE_AHEAD_TOKENS = 4096
_WAKE = object()  # put on the work queue when a job is held or let go
SPLIT_HEARTBEAT_S = 2.0  # the longest an idle split engine goes without meeting its other ranks
_RUNNING: weakref.WeakSet = weakref.WeakSet()  # engines started and not closed (their objects frozen)


@dataclass
class _Call:
    """A call to run on the engine thread: on every rank (`fn(target, *args)`) or, `local`, on
    this one only (what reads state and runs no forward)."""

    fn: Callable[..., Any]
    args: tuple = ()
    future: Future = field(default_factory=Future)
    local: bool = False


@dataclass
class _News:
    """What the leader heard since the scheduler's last turn, in the order it came: queued jobs
    (uid, request, prompt), corpus documents (key, ids), calls (fn, args), "drop", "max_batch",
    "pause" and "close" orders; then the cancels and holds it saw. Every rank applies it at the same turn."""

    heard: list = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    held: dict[int, bool] = field(default_factory=dict)


class Engine:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **overrides: Any):
        """`config` (engine/config.py, checked there); its fields can be given as keywords
        too, over it: `Engine(path, mode="lookup", max_draft=4)`. `self.config` keeps what it
        was built with; what the engine measured for itself is in its attributes (max_batch...)."""
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, not {type(config).__name__}")
        config = replace(config or EngineConfig(), **overrides) if overrides else config or EngineConfig()
        self.config = config
        self.kv_bits = config.kv_bits
        self.prefix_cache: PrefixCache | None = None

        self.model_path = resolve_model(model or None)  # a bundled model's name -> its folder
        if config.drafter:  # a head for another model is refused before the model's weights load
            precheck(config.drafter, self.model_path)
        self.default_mode = config.mode
        self.max_draft = config.max_draft
        self.prefill_chunk = config.prefill_chunk
        self.loop_guard = config.loop_guard
        # documents to draft from (files agents read), indexed once on arrival, one per path
        self.corpus: collections.OrderedDict[str, TokenIndex] = collections.OrderedDict()
        self._corpus_lock = threading.Lock()
        self.job_observers: list[Callable[[Job], None]] = []  # see each job before it queues (telemetry)
        self.target: Target | None = None
        self.vision: Vision | None = None  # a VLM's vision half (engine/model/vision.py), else None
        self.max_batch = 1 if config.max_batch == "auto" else config.max_batch
        self.batched_rounds = 0  # sequence rounds verified in a batched forward
        self.batched_drafts = 0  # sequence rounds whose head draft ran in a batched draft
        self._batch = BatchCache()  # the KV of every sequence that decodes batched (engine/caches/batch_cache.py)
        self._work: queue.Queue = queue.Queue()  # what the engine thread hears: jobs, calls, wake-ups
        self._uids = itertools.count(1)
        self.ranks: Ranks = world()  # the processes this model is split over (one: a group of one)
        self.failure: str | None = None  # why a split engine stopped (a rank gone): /health says so
        self.split: str | None = None  # how the model is split over `ranks` (None: whole here), once loaded
        self._local: list = []  # the leader's own jobs and calls heard at this turn (`_listen`)
        self._paused_cache: PrefixCache | None = None  # the prefix cache while paused
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._arriving: list[Sequence] = []  # submitted, not yet heard by the engine thread
        self._running: list[Sequence] = []
        self._lock = threading.Lock()
        self._closed = False
        self._queue_lock = threading.Lock()  # "closed?" and the put are one step (else a late put hangs)
        # The one way in to the tokenizer, for every thread: Hugging Face fast tokenizers fail
        # ("Already borrowed") when two threads use one at once.
        self.tokenizer_lock = threading.RLock()
        self._stopped = threading.Event()
        self._contexts = ContextIndexCache()  # the last request's lookup index, continued
        self.last_mode_choice: ModeChoice | None = None  # what `auto` chose last, and why (engine/tuning/mode_choice.py)
        self._start_thread(config)  # (and what needs the model, set there before any job can start)

    def _start_thread(self, config: EngineConfig) -> None:
        """The engine thread, once it has loaded the model and settled (an error re-raised here)."""
        loaded: Future = Future()
        self._thread = threading.Thread(
            target=self._serve, args=(loaded, config), name="mlx-dspark-engine", daemon=True
        )
        self._thread.start()
        loaded.result()  # re-raises ModelLoadError here, in the caller's thread
        # What exists once a model is up (modules, tokenizer, the model's tree: ~220k objects) lives
        # as long as the engine: out of the garbage collector's full collections, which walked it all
        # every few agent turns, 100-300 ms with the GIL held. close() hands it back.
        _RUNNING.add(self)
        gc.freeze()

    def _settle(self, target: Target, config: EngineConfig) -> None:
        """The start on this machine, on the engine thread, in this order: the prefill chunk
        measured (where the config gives none), a given head paired, what would fail every
        request failed here (the default mode, a head size KV quantisation can't take), an
        "auto" max batch measured, the prefix cache opened, the cost curve checked, and for a
        long-lived engine on MLX CUDA the attention graphs of short prefill chunks built and a
        warm turn's forwards run once. Every rank of a split model takes these steps alike
        (their measurements are the leader's)."""
        if self.ranks.split:
            mx.random.seed(self.ranks.share(time.time_ns() % (1 << 32)))  # the same draws on every rank
            if self.vision is not None:
                raise EngineError("a split model reads text only here: its vision half isn't split")
        if not self.prefill_chunk:  # engine/tuning/prefill_chunk.py
            self.prefill_chunk = chunk_for(target)
        if config.drafter or config.drafter_bits:  # a head checkpoint given by the user: load and pair it now
            attach_drafter(target, config.drafter, config.drafter_bits)
        resolve_mode(config.mode, target)  # fail early on an unknown default mode
        if config.kv_bits:
            kv_group_size(target.config)  # fail early on a head size KV quantisation can't take
        if config.max_batch == "auto":  # from this machine's batch cost surface, measured once (engine/tuning/batch_cost.py)
            self.max_batch = quick_surface(target, config.kv_bits).best_max_batch()
        if config.prefix_cache:
            self.prefix_cache = self._open_prefix_cache(target, config)
        if self.max_draft == "auto":
            # the cost curve re-checked (or re-measured) now, not in the first request's time
            curve_for_requests(target, config.kv_bits)
        if config.long_lived:  # cuDNN's graphs of a warm turn's prefill chunk, by bucket, up to the
            # context window: now (3.7 s for 65k on an H100), not one in each turn (engine/kernels/gpu_attention.py)
            gpu_attention.build_for(target.model, self.context_window, getattr(mx, target.dtype, None))
            if self.ranks.share(on_cuda()):  # and a warm turn's kernels readied (engine/decoding/verify.py)
                warm_up(target, self._new_cache())

    def _open_prefix_cache(self, target: Target, config: EngineConfig) -> PrefixCache:
        mb = lambda v: None if v is None else int(v * (1 << 20))  # noqa: E731
        return open_prefix_cache(self._new_cache, cache_identity(target, config.kv_bits), mb(config.prefix_cache_max_ram_mb),
                           config.prefix_cache_dir, mb(config.prefix_cache_max_disk_mb))

    # -- public API, callable from any thread ---------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def submit(self, request: GenerationRequest) -> Job:
        """Queue a generation; a request the engine can't run raises here (EngineError)."""
        self._check_leader("submit")
        prompt = self._check_request(request)
        job = Job(request)
        with self._queue_lock:  # the same lock as close(): no job slips in after the engine stops
            if self._closed:
                raise self._closed_error()
            for observe in self.job_observers:  # before it can emit anything
                observe(job)
            job.uid = next(self._uids)
            seq = Sequence(job, prompt)
            with self._lock:
                self._arriving.append(seq)
            self._work.put(seq)
        return job

    def hold(self, job: Job, held: bool = True) -> None:
        """Keep a queued job from starting (or let it start again); a running job runs on."""
        job.held = held
        self._work.put(_WAKE)

    def queue_position(self, job: Job) -> int:
        """1 for the next job to start, 0 once it runs (or left the queue)."""
        with self._lock:
            live = [s.job for s in [*self._waiting, *self._arriving] if not s.job.cancelled]
        return live.index(job) + 1 if job in live else 0

    def load(self) -> dict:
        """What the engine is doing: queued and running jobs, each with its phase and progress."""
        with self._lock:
            waiting = [s.job for s in [*self._waiting, *self._arriving] if not s.job.cancelled]
            running = [s.job for s in self._running]
        return {"max_batch": self.max_batch, "queued": len(waiting), "running": len(running),
                "batched_rounds": self.batched_rounds,
                "sequences": [j.status() for j in running + waiting]}

    def generate(self, request: GenerationRequest) -> Iterator[Any]:
        """Submit and iterate; closing the iterator early cancels the job."""
        job = self.submit(request)
        try:
            yield from job
        finally:
            job.cancel()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(target, *args) on the engine thread (MLX work outside a generation) and return
        its result. Split over ranks, every rank runs it (its forwards need them all): `fn` and
        `args` must then pickle (a module-level function, plain values)."""
        self._check_leader("call")
        if self.ranks.split:
            try:
                pickle.dumps((fn, args))
            except Exception as e:
                raise EngineError(f"{getattr(fn, '__qualname__', fn)!r} can't be sent to the other ranks "
                                  f"({e}): pass a module-level function and plain arguments") from None
        return self._run_call(_Call(fn, args))

    def inspect(self, fn: Callable[[Target], Any]) -> Any:
        """Run fn(target) on this rank's engine thread alone: for what only reads (no forward)."""
        return self._run_call(_Call(fn, local=True))

    def _run_call(self, call: _Call) -> Any:
        self._enqueue(call)
        return call.future.result()

    def _check_leader(self, what: str) -> None:
        if not self.ranks.leader:
            raise EngineError(f"rank {self.ranks.rank} of a split model follows rank 0: {what} there")

    def encode(self, text: str) -> list[int]:
        with self.tokenizer_lock:  # equal to target.encode(text); re-sent pieces not re-tokenised
            return self._pieces.encode(text)

    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.target.decode(ids)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, **kwargs: Any) -> list[int]:
        with self.tokenizer_lock:
            return render_chat(self.tokenizer, messages, tools=tools, encode=self._pieces.encode, **kwargs)

    @property
    def reads_images(self) -> bool:
        return self.vision is not None

    @property
    def image_marker(self) -> str | None:
        """What a chat message's text holds where an image goes (the model's own image token)."""
        return self.vision.image_marker if self.vision is not None else None

    def render_chat_images(self, messages: list[dict], images: list[bytes], tools: list[dict] | None = None,
                           **kwargs: Any) -> tuple[list[int], PromptImages | None]:
        """Like render_chat, for messages whose texts hold one `image_marker` per image (in order):
        the prompt ids and its images, for GenerationRequest.images."""
        if not images:
            return self.render_chat(messages, tools, **kwargs), None
        if self.vision is None:
            raise InvalidRequestError("this model reads text only: images can't be given to it")
        with self.tokenizer_lock:
            text = chat_text(self.tokenizer, messages, tools=tools, **kwargs)
        return self.vision.prepare(text, images)  # the processor has a tokenizer (and a lock) of its own

    def add_corpus(self, token_ids: list[int], path: str | None = None) -> None:
        """Remember a sequence (a file an agent read, say) for lookup drafting in later requests.

        It is indexed here, once; a later text for the same `path` replaces it (an edited
        file). Without a path, identical texts are one document. The oldest go past 64."""
        if len(token_ids) < 2:
            return
        key = path if path is not None else "sha256:" + hashlib.sha256(repr(list(token_ids)).encode()).hexdigest()
        if self.ranks.split:  # every rank's drafts read it from the same turn on
            self._check_leader("add_corpus")
            self._enqueue(("corpus", key, [int(t) for t in token_ids]))
        else:
            self._index_corpus(key, list(token_ids))

    def _index_corpus(self, key: str, token_ids: list[int]) -> None:
        index = TokenIndex(token_ids)
        with self._corpus_lock:
            self.corpus.pop(key, None)
            self.corpus[key] = index
            while len(self.corpus) > MAX_ENGINE_CORPUS_DOCS:
                self.corpus.popitem(last=False)

    def info(self) -> dict:
        return {
            "model": self.model_path,
            "identity": self.target.identity,
            "dtype": self.target.dtype_name,
            "context_window": self.context_window,
            "mode": self.default_mode,
            "max_draft": self.max_draft,
            "corpus_docs": len(self.corpus),
            "kv_bits": self.kv_bits,
            "prefix_cache": self.cache_stats(),
        }

    def mode_choice(self, prompt_ids: list[int]) -> ModeChoice:
        """What `auto` would run for this prompt here, and why (engine/tuning/mode_choice.py)."""
        return self.call(choose_mode, [int(i) for i in prompt_ids], self.kv_bits)

    def cached_prefix_tokens(self, prompt_ids: list[int], images: PromptImages | None = None) -> int | None:
        """How many of the prompt's tokens the prefix cache holds in RAM now: a read-only look
        from any thread, what the engine would reuse if it started on the prompt at once (it may
        reuse more or less later, when it does start; its Stats say what it did). None when the
        cache's own work kept it busy too long to look; 0 without a prefix cache."""
        if self.prefix_cache is None:
            return 0
        key = images.key(list(prompt_ids), self.target.vocab_size) if images is not None else list(prompt_ids)
        return self.prefix_cache.cached_prefix(key)

    def cache_stats(self) -> dict | None:
        """Prefix-cache counters (entries, bytes in RAM and on disk, hits...); None when it's off."""
        return self.prefix_cache.stats() if self.prefix_cache is not None else None

    def flush_disk(self, timeout: float | None = 30.0) -> bool:
        """Wait until the prefix cache's queued disk writes are done (from any thread, without
        waiting for the engine thread): what a SIGTERM handler calls before the process ends."""
        return self.prefix_cache.flush(timeout) if self.prefix_cache is not None else True

    def cache_branches(self, limit: int = 40) -> list[dict]:
        """The prefix cache's biggest radix-tree branches, with a text preview of each edge."""
        if self.prefix_cache is None:
            return []
        rows = self.inspect(lambda t: self.prefix_cache.branches(limit))
        for row in rows:
            row["head"], row["tail"] = self.decode(row.pop("head_ids")), self.decode(row.pop("tail_ids"))
        return rows

    def drop_cache(self, disk: bool = False) -> None:
        """Empty the prefix cache's RAM tier: to the disk tier (evict), or forgotten with it (clear)."""
        if self.prefix_cache is not None:
            self._order("drop", disk)  # every rank drops its own part

    def set_max_batch(self, max_batch: int) -> None:
        """Run up to `max_batch` jobs at once from the next turn on (every rank alike)."""
        self._order("max_batch", int(max_batch))

    def pause_prefix_cache(self, paused: bool = True) -> None:
        """Run without the prefix cache (each prompt cold, nothing kept) until un-paused: what a
        benchmark of cold prompts wants. On every rank, from the same turn."""
        self._order("pause", paused)

    def _order(self, kind: str, *args: Any) -> None:
        """An order every rank takes at the same turn (`_apply`); returns once it is taken."""
        self._check_leader(kind)
        self._enqueue((kind, *args))
        self.inspect(lambda t: None)  # run at that turn, after the order

    def close(self) -> None:
        """Stop (a split model: every rank); the prefix cache's hot segments go to its disk tier."""
        if not self.ranks.leader:
            self._stopped.wait(timeout=60)  # the leader's close ends this rank's turns
        elif not self._closed:
            with self._queue_lock:
                self._closed = True
                self._work.put(None)
            self._stopped.wait(timeout=60)
        if self in _RUNNING:  # what the start froze can be collected again; the others' frozen again
            _RUNNING.discard(self)
            gc.unfreeze()
            if _RUNNING:
                gc.collect()
                gc.freeze()

    def follow(self) -> None:
        """On a rank other than the leader: take the leader's steps until it closes or is gone."""
        self._stopped.wait()

    def stopped(self, timeout: float | None = None) -> bool:
        """Has the engine thread stopped (waiting up to `timeout` s for it)?"""
        return self._stopped.wait(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the engine thread ----------------------------------------------------------

    def _enqueue(self, work: Any) -> None:
        with self._queue_lock:
            if self._closed:
                raise self._closed_error()
            self._work.put(work)

    def _schedule(self) -> None:
        """Each turn: what was heard applied (jobs queued, calls run, cancels...), queued jobs
        started up to max_batch, the running jobs stepped in turn."""
        while True:
            try:
                news = self.ranks.share(self._listen() if self.ranks.leader else None)
            except Exception as e:  # a collective failed: a rank of the split model is gone
                self._stop_broken(e)
                return
            try:
                if not self._apply(news):
                    return
                self._turn()
            except Exception as e:  # a step failed here, and may not have on the other ranks
                if not self.ranks.split:
                    raise
                self._stop_broken(e, in_step=True)
                return

    def _turn(self) -> None:
        """Queued jobs started up to max_batch, then the running jobs stepped in turn."""
        self._admit()
        # One prefill at a time, oldest first (the others' time to first token would all
        # grow if they took turns), interleaved with every decoding job's rounds. A job just
        # started takes its first step at once (its cached prefix is known after it).
        lead = next((s for s in self._running if s.job.phase == "prefill"), None)
        stepped = [s for s in list(self._running) if s.job.phase != "prefill" or s is lead or s.cancelled]
        for seq in stepped:
            self._step(seq)
        drafting = [s for s in stepped if s.wants == DRAFT]
        if drafting:  # the heads' drafts of this round, one batched draft per head
            self.batched_drafts += draft_together(self.target, [s.call for s in drafting])
            for seq in drafting:
                self._step(seq)
        forwards = [s.call for s in stepped if s.wants == FORWARD and s not in drafting]
        forwards += [s.call for s in drafting if s.wants == FORWARD]
        self._join_batch([s for s in stepped if s.wants == FORWARD])
        if forwards:
            try:
                surface = surface_for(self.target, self.kv_bits)  # what batching pays for here
                self.batched_rounds += run_forwards(self.target, forwards, surface)
            except Exception as e:  # those jobs fail at their next step (no result); the engine goes on
                if self.ranks.split:  # ...unless split: the other ranks may not have failed
                    raise
                logging.getLogger(__name__).error("batched verify failed: %s: %s", type(e).__name__, e)

    def _hold_disk_writes(self) -> None:
        """The disk tier's writers wait while a running request waits for its first token: its
        time to first token is what an agent's turn waits on, the writes can come after. Set where
        that changes: a job admitted, its first token out, a job leaving (not every turn)."""
        if self.prefix_cache is not None:
            self.prefix_cache.hold_writes(any(s.stats.rounds == 0 for s in self._running))

    def _join_batch(self, forwarding: list[Sequence]) -> None:
        """The batch rows for this turn's verify forwards: once two or more with the same taps
        could share one, each joinable sequence among them not yet in the batch moves its KV in
        (once: it stays to its end). A sequence alone keeps its own cache: an agent's single turn
        pays no copy in and out (~0.2 s of a 15k-token warm turn on a 2-core CPU, ~0.1 s of a
        22-38k-token one on an H100). A join that fails (out of memory, say) leaves every
        sequence decoding alone from then on, as a failed batched forward does."""
        if self.max_batch <= 1 or self._batch.failed or len(forwarding) < 2:  # alone: nothing to share
            return
        groups: dict[tuple, list[Sequence]] = {}  # only forwards with the same taps batch (run_forwards)
        for seq in forwarding:
            if self._batch.owns(seq.cache) or joinable(self.target, seq.cache):
                groups.setdefault(tuple(seq.call.taps), []).append(seq)
        for seq in (s for group in groups.values() if len(group) >= 2 for s in group):
            if self._batch.owns(seq.cache):
                continue
            try:
                self._batch.join(seq.cache, owner=seq.job)
            except Exception as e:
                if self.ranks.split:  # the other ranks may not have failed: none can go on alone
                    raise
                self._batch.failed = f"join: {type(e).__name__}: {e}"
                logging.getLogger(__name__).warning("joining the batch failed, sequences decode alone: %s", e)
                return

    def _listen(self) -> _News:
        """The leader's ears: what came in since the last turn (waiting for it when there's
        nothing to do), and the cancels and holds not yet seen."""
        idle = not self._running and all(s.job.held and not s.job.cancelled for s in self._waiting)
        items = []
        if idle:
            try:  # split, an idle leader still meets the others now and then: a lost rank shows in /health
                items.append(self._work.get(timeout=SPLIT_HEARTBEAT_S if self.ranks.split else None))
            except queue.Empty:
                pass
        while True:
            try:
                items.append(self._work.get_nowait())
            except queue.Empty:
                break
        news, self._local = _News(), []
        for item in items:
            if isinstance(item, Sequence):
                news.heard.append(("job", item.job.uid, item.request, item.prompt))
                self._local.append(item)
            elif isinstance(item, _Call):
                if not item.local:
                    news.heard.append(("call", item.fn, item.args))
                self._local.append(item)
            elif item is None:
                news.heard.append(("close",))
            elif item is not _WAKE:
                news.heard.append(item)  # ("corpus", key, ids)
        with self._lock:  # the jobs heard now too: one cancelled before the engine heard it never starts
            seqs = [*self._waiting, *self._running, *(i for i in self._local if isinstance(i, Sequence))]
        news.cancelled = [s.job.uid for s in seqs if s.job.cancelled and not s.cancelled]
        news.held = {s.job.uid: s.job.held for s in seqs if s.job.held != s.held}
        return news

    def _apply(self, news: _News) -> bool:
        """Apply a turn's news, on every rank alike; False once the engine is to stop."""
        mine = iter(self._local)  # the leader's own jobs and calls, in the order they came

        def my_next() -> Any:  # the leader's next job or shared call; its local calls run on the way
            item = next(mine)
            while isinstance(item, _Call) and item.local:
                self._run_local(item)
                item = next(mine)
            return item

        for kind, *rest in news.heard:
            if kind == "job":
                uid, request, prompt = rest
                seq = my_next() if self.ranks.leader else Sequence(MirrorJob(request), prompt)
                seq.job.uid = uid
                with self._lock:
                    self._waiting.append(seq)
                    if seq in self._arriving:
                        self._arriving.remove(seq)
            elif kind == "call":
                fn, args = rest
                self._run_local(my_next() if self.ranks.leader else _Call(fn, args))
            elif kind == "corpus":
                self._index_corpus(*rest)
            elif kind == "drop":
                if self.prefix_cache is not None:
                    self.prefix_cache.drop(*rest)
            elif kind == "max_batch":
                (self.max_batch,) = rest
            elif kind == "pause":
                (paused,) = rest
                if paused and self.prefix_cache is not None:
                    self.prefix_cache.hold_writes(False)  # nothing will lift it while it is put away
                    self._paused_cache, self.prefix_cache = self.prefix_cache, None
                elif not paused and self._paused_cache is not None:
                    self.prefix_cache, self._paused_cache = self._paused_cache, None
            elif kind == "close":
                self._close_prefix_cache()
                self._fail_all(EngineError("engine is closed"))
                return False
        for call in mine:  # leader-only reads after the last shared item
            self._run_local(call)
        self._local = []
        with self._lock:
            seqs = {s.job.uid: s for s in [*self._waiting, *self._running]}
        for uid in news.cancelled:
            if uid in seqs:
                seqs[uid].cancelled = True
        for uid, held in news.held.items():
            if uid in seqs:
                seqs[uid].held = held
        return True

    def _run_local(self, call: _Call) -> None:
        try:
            with in_step(not call.local):  # a leader-only read crosses no rank
                call.future.set_result(call.fn(self.target, *call.args))
        except BaseException as e:  # handed to the caller (on another rank: logged)
            if not self.ranks.leader:
                logging.getLogger(__name__).error("call %r failed here: %s", call.fn, e)
            call.future.set_exception(e)

    def _stop_broken(self, error: Exception, in_step: bool = False) -> None:
        """A rank is gone, out of step, or failed a step the others may have taken: every job
        and call ends with the reason, and the engine takes no more."""
        if isinstance(error, OutOfStepError):
            what = "'s ranks fell out of step"
        elif in_step and not link_lost(error):
            what = f" stopped: a step failed on rank {self.ranks.rank} ({type(error).__name__}; a rank may be gone)"
        else:
            what = " lost a rank"
        self.failure = f"the split model{what} ({error}): restart all ranks"
        logging.getLogger(__name__).error("%s", self.failure)
        with self._queue_lock:
            self._closed = True
        self._fail_all(EngineDownError(self.failure))
        self._close_prefix_cache()  # this rank's part is whole: kept for the restart

    def _closed_error(self) -> EngineError:
        return EngineDownError(self.failure) if self.failure else EngineError("engine is closed")

    def _close_prefix_cache(self) -> None:
        cache = self.prefix_cache or self._paused_cache
        if cache is not None:
            try:  # the hot segments go to the disk tier, which outlives us
                cache.close()
            except Exception as e:
                logging.getLogger(__name__).warning("prefix cache: not saved on close: %s", e)

    def _admit(self) -> None:
        with self._lock:
            for seq in [s for s in self._waiting if s.cancelled]:
                self._waiting.remove(seq)
                seq.job.phase = "done"
                seq.job.emit(CancelledError("cancelled before it started"))
            admitted = [s for s in self._waiting if not s.held][: self.max_batch - len(self._running)]
            for seq in admitted:
                self._waiting.remove(seq)
                seq.steps = self._phases(seq)
                self._running.append(seq)
        if admitted:
            self._hold_disk_writes()

    def _step(self, seq: Sequence) -> None:
        """One step of a running job; at its end (its Done or an error) it leaves the running."""
        finished: Any = None
        try:
            seq.step()
            return
        except StopIteration as stop:
            finished = stop.value
        except EngineError as e:
            finished = e
        except Exception as e:  # never let one request kill the engine thread
            if self.ranks.split:  # the other ranks may have taken this step: none can go on alone
                raise
            finished = EngineError(f"generation failed: {type(e).__name__}: {e}")
        if finished is not None:
            job = seq.job
            job.phase = "done"
            self._batch.drop(job)  # its batch row, where it ended without leaving (an error)
            with self._lock:
                self._running.remove(seq)
            self._hold_disk_writes()
            job.emit(finished)

    def _decoding(self) -> int:
        """How many running jobs decode (their verify forwards may share a batch)."""
        return sum(1 for s in self._running if s.job.phase == "decode")

    def _fail_all(self, error: EngineError) -> None:
        """Every job, and every call not yet run, ends with `error`."""
        calls = [item for item in self._local if isinstance(item, _Call)]
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Sequence):
                item.job.emit(error)
            elif isinstance(item, _Call):
                calls.append(item)
        for call in calls:
            if not call.future.done():
                call.future.set_exception(error)
        with self._lock:
            jobs = [s.job for s in [*self._running, *self._waiting, *self._arriving]]
            for seq in self._running:
                seq.steps.close()
            self._running.clear()
            self._waiting.clear()
            self._arriving.clear()
            self._batch = BatchCache()
        self._hold_disk_writes()
        for job in jobs:
            job.emit(error)

    def _serve(self, loaded: Future, config: EngineConfig) -> None:
        # its forwards may use the CPU kernels (engine/kernels/cpu_attention.py); its steps are
        # every rank's (engine/base/ranks.py)
        with cpu_attention.engine_thread(), in_step():
            try:
                self.target = load_target(self.model_path, dtype=config.dtype, split=config.split)
                self.split = self.target.split
                self.vision = load_vision(self.target)
                self.context_window = config.context_window or self.target.context_window
                self._pieces = PieceEncoder(self.tokenizer)  # chat prompts tokenised by message pieces
                self.grammars = Grammars(self.tokenizer, self.target.vocab_size, self.target.eos_token_ids)  # constraints
                self._settle(self.target, config)
            except BaseException as e:
                self._close_prefix_cache()
                with self._queue_lock:
                    self._closed = True
                loaded.set_exception(e)
            else:
                loaded.set_result(True)
                self._schedule()
        if self.failure is None:  # a broken split engine keeps its tokenizer: requests render, then fail with why
            self.target = None
        self._stopped.set()
        # Park instead of returning: an MLX worker thread that exits after loading a
        # model makes the process abort at exit ("terminate called without an active
        # exception"). A parked daemon thread holds nothing and ends with the process.
        threading.Event().wait()

    # -- a job's phases, on the engine thread ---------------------------------------

    def _phases(self, seq: Sequence) -> Iterator[None]:
        """One job as steps (a prefill chunk, a decode round), yielding between them; returns Done."""
        self._begin(seq)
        self._take_cache(seq)
        self._make_drafter(seq)
        yield from self._prefill(seq, self._image_embeddings(seq))
        self._start_decoding(seq)
        yield from self._decode(seq)
        return self._finish(seq)

    def _begin(self, seq: Sequence) -> None:
        """Its clock and statistics, and the request's settings for this model."""
        job, req, target = seq.job, seq.request, self.target
        seq.t0 = time.perf_counter()
        seq.stats = Stats(queued_s=seq.t0 - job.created)
        seq.sampling = req.sampling.for_vocab(target.vocab_size)
        if self.ranks.split and not seq.sampling.greedy and seq.sampling.seed is None:
            # every rank must draw the same numbers (what it accepts sets the next forward's width)
            seq.sampling = replace(seq.sampling, seed=self.ranks.share(secrets.randbits(31)))
        seq.mode = resolve_mode(req.mode or self.default_mode, target)
        if seq.mode == "auto":  # the mode expected fastest here for this prompt (engine/tuning/mode_choice.py)
            self.last_mode_choice = choose_mode(target, seq.prompt, self.kv_bits, heads=req.images is None)
            seq.mode = self.last_mode_choice.mode
        seq.stats.mode, seq.stats.prompt_tokens = seq.mode, len(seq.prompt)
        seq.max_tokens = min(req.max_tokens, self.context_window - len(seq.prompt))
        if seq.cancelled:
            raise CancelledError("cancelled before it started")

    def _take_cache(self, seq: Sequence) -> None:
        """Its cache from the prefix cache (holding the longest prefix it has) or fresh; the
        first event says how much was cached (APIs report it up front)."""
        job, prompt, images = seq.job, seq.prompt, seq.request.images
        # the prefix cache's view of the prompt: an image's tokens stand for its hash
        seq.key = images.key(prompt, self.target.vocab_size) if images is not None else prompt
        seq.cache, seq.cached = self._acquire_cache(seq.key)
        set_position_shift(seq.cache, images.position_shift if images is not None else 0)  # M-RoPE after images
        seq.stats.cached_tokens = seq.cached
        job.phase, job.prefilled, job.prompt_tokens = "prefill", seq.cached, len(prompt)
        job.emit(PrefillProgress(seq.cached, len(prompt)))

    def _make_drafter(self, seq: Sequence) -> None:
        """The mode's drafter (none for baseline), drafting from the engine's and the request's corpus."""
        with self._corpus_lock:
            corpus = [*self.corpus.values(), *seq.request.corpus]
        seq.drafter = None if seq.mode == "baseline" else make_drafter(seq.mode, self.target, corpus)
        if seq.drafter is not None:
            seq.drafter.use_context_cache(self._contexts)
            seq.drafter.start(seq.prompt)
            if not self.target.can_rollback(seq.cache):
                seq.stats.note = "this model's cache can't be rolled back: decoding without drafts"

    def _image_embeddings(self, seq: Sequence) -> mx.array | None:
        """Where images lie past the cached prefix: the image-merged embeddings to prefill from."""
        images = seq.request.images
        if images is None or seq.cached >= images.end:
            return None
        if seq.drafter is not None and seq.drafter.tap_layers:
            raise InvalidRequestError(f"mode {seq.mode!r}: drafter heads don't read image prompts yet; use lookup")
        embeddings = self.vision.features(seq.prompt, images)[seq.cached : len(seq.prompt) - 1]
        embeddings.eval()  # once: the chunks below slice it
        return embeddings

    def _prefill(self, seq: Sequence, embeddings: mx.array | None) -> Iterator[None]:
        """The prompt past its cached prefix but for its last token, a chunk a step; then a
        checkpoint for the prefix cache (models with recurrent/window layers resume only at one)."""
        job, drafter, prompt = seq.job, seq.drafter, seq.prompt
        to_prefill = prompt[seq.cached : -1]
        computing = 0.0  # this prompt's own prefill time (other requests' steps run between chunks)
        written = 0  # tokens of to_prefill handed to the prefix cache so far
        for start, stop in prefill_chunks(len(to_prefill), self.prefill_chunk, embeddings, depth=seq.cached):
            yield
            t0 = time.perf_counter()
            prefill(
                self.target,
                seq.cache,
                to_prefill[start:stop],
                chunk_size=stop - start,
                cancelled=lambda: seq.cancelled,
                on_hidden=getattr(drafter, "observe_prefill", None),
                tap_layers=drafter.tap_layers if drafter is not None else (),
                embeddings=None if embeddings is None else embeddings[start:stop],
            )
            computing += time.perf_counter() - t0
            job.prefilled = seq.cached + stop
            job.emit(PrefillProgress(job.prefilled, len(prompt)))
            if self.prefix_cache is not None and stop < len(to_prefill) and stop - written >= WRITE_AHEAD_TOKENS:
                self.prefix_cache.write_ahead(seq.key[: job.prefilled], seq.cache)
                written = stop
        seq.stats.prefilled_tokens = len(to_prefill) + 1
        if self.prefix_cache is not None:
            if len(to_prefill) >= PREFILL_RATE_MIN_TOKENS:  # the rate a disk restore must beat
                self.prefix_cache.note_prefill(len(to_prefill), computing)
            self.prefix_cache.checkpoint(seq.key[:-1], seq.cache)
        seq.stats.prefill_s = time.perf_counter() - seq.t0

    def _start_decoding(self, seq: Sequence) -> None:
        """Its rounds: plain (baseline) or drafted and verified (their forwards handed to the
        scheduler, which moves the KV into a batch row once another's forward could share one);
        and what ends them (a stop, the length, a loop)."""
        target, req = self.target, seq.request
        seq.grammar = self.grammars.start(req.constraint) if req.constraint is not None else None
        if seq.mode == "baseline":
            seq.rounds = plain_rounds(target, seq.cache, seq.prompt[-1], seq.sampling, seq.grammar)
        else:
            cap = req.max_draft if req.max_draft is not None else self.max_draft  # checked when it queued
            if cap == "auto":  # adapt per round to the acceptance seen (engine/tuning/draft_control.py)
                cap = seq.controller = draft_controller(target, len(seq.prompt), self.kv_bits, seq.mode)
                hard_cap = seq.controller.max_cap
            else:
                hard_cap = cap
            # Never verify more draft than the request can still emit (a round adds one token of its
            # own): a 1-token request, or the last round of any, drafts nothing it would throw away.
            left = lambda: max(0, seq.max_tokens - len(seq.out) - 1)  # noqa: E731
            cap_now = cap if callable(cap) else (lambda c=cap: c)
            seq.rounds = speculative_rounds(target, seq.cache, seq.prompt[-1], seq.drafter, seq.sampling,
                                            lambda: min(cap_now(), left()), hard_cap=lambda: min(hard_cap, left()),
                                            defer_forward=self.max_batch > 1,
                                            rollback=state_rollback(target, self.kv_bits), grammar=seq.grammar)
        seq.assembler = TextAssembler(target.tokenizer, req.stop)
        seq.eos = target.eos_token_ids
        seq.committed = list(seq.key)  # the context the cache holds (a round's tokens past a stop are taken back)
        seq.guard = LoopGuard(self.loop_guard) if self.loop_guard else None
        seq.finish = "length" if seq.max_tokens <= 0 else None
        seq.t_decode = time.perf_counter()
        seq.job.phase = "decode"

    def _decode(self, seq: Sequence) -> Iterator[None]:
        """A round a step until it finishes or is cancelled. A round's head draft and verify
        forward, where it defers them, are steps of their own, left to the scheduler."""
        while seq.finish is None:
            if seq.cancelled:
                seq.finish = "cancelled"
                break
            if seq.controller is not None:  # the draft that pays depends on how many share the forward
                seq.controller.batch = self._decoding() if self.max_batch > 1 else 1
            rnd = next(seq.rounds)
            if isinstance(rnd, Round):
                yield
            while not isinstance(rnd, Round):  # a head draft, a verify forward: run by the scheduler with the others'
                seq.wait_on(rnd)
                yield
                rnd = next(seq.rounds)
            self._commit(seq, rnd)

    def _commit(self, seq: Sequence, rnd: Round) -> None:
        """A round's tokens, up to what ends the generation (EOS, a stop string, the length, a
        loop), into the output and out as one Tokens event."""
        job, stats, out = seq.job, seq.stats, seq.out
        seq.committed.extend(rnd.tokens)
        stats.add_round(rnd.drafted, rnd.accepted, rnd.source)
        if seq.controller is not None:
            seq.controller.observe(rnd.drafted, rnd.accepted, rnd.source)
        new_ids, text, provenance = [], "", []
        for used, tok in enumerate(rnd.tokens, 1):
            if tok in seq.eos:
                seq.finish = "stop"
                break
            out.append(tok)
            new_ids.append(tok)
            with self.tokenizer_lock:
                delta, stopped = seq.assembler.add(tok)
            text += delta
            provenance.append([delta, rnd.source if used <= rnd.accepted else "target"])
            if stopped:
                seq.finish = "stop_string"
                break
            if len(out) >= seq.max_tokens:
                seq.finish = "length"
                break
            if seq.guard is not None and seq.guard.add(tok):
                seq.finish = "length"
                stats.note = seq.guard.note()
                break
        if seq.finish is None and seq.grammar is not None and seq.grammar.done:
            seq.finish = "stop"  # the constraint is complete: only the end could follow
        if seq.finish and used < len(rnd.tokens) and rnd.keep_only is not None:
            # tokens drafted past the stop: out of the cache, so what the prefix cache
            # keeps (a turn-end checkpoint, for recurrent models) is the context the client has
            rnd.keep_only(used)
            del seq.committed[len(seq.committed) - (len(rnd.tokens) - used) :]
        if stats.rounds == 1:
            stats.ttft_s = time.perf_counter() - seq.t0
            self._hold_disk_writes()  # its first token is out: the writes may go on before its next round
        job.generated = len(out)
        if new_ids or text:
            job.emit(Tokens(new_ids, text, provenance, rnd.drafted))

    def _finish(self, seq: Sequence) -> Done:
        """Its last text and statistics; its cache back to the prefix cache (out of the batch first)."""
        job, stats, assembler = seq.job, seq.stats, seq.assembler
        seq.rounds.close()
        if seq.drafter is not None:
            seq.drafter.finish()
        with self.tokenizer_lock:
            tail = assembler.finish()
        if tail:
            job.emit(Tokens([], tail))
        now = time.perf_counter()
        stats.decode_s = now - seq.t_decode
        stats.wall_s = now - seq.t0
        stats.generated_tokens = len(seq.out)
        if not stats.ttft_s:
            stats.ttft_s = stats.wall_s
        # the last round's taking back is lazy (the next pass would have evaluated it): evaluated
        # now, on every rank alike, not whenever the prefix cache next touches it
        mx.eval([c.state for c in seq.cache])
        if self._batch.owns(seq.cache):
            self._batch.leave(seq.cache)  # its KV back in plain KVCaches: for the prefix cache
        self._release_cache(seq.committed, seq.cache)
        return Done(seq.finish, seq.out, assembler.text, stats, stop_string=assembler.stop_string)

    def _check_request(self, req: GenerationRequest) -> list[int]:
        """What makes a request fail, checked once, before it queues (so an HTTP client gets an
        HTTP error); returns its prompt ids (an empty prompt: the model's BOS)."""
        prompt = [int(t) for t in req.prompt_ids]
        if not prompt:
            bos = getattr(self.tokenizer, "bos_token_id", None)
            if bos is None:
                raise InvalidRequestError("the prompt is empty (and this model has no BOS token to start from)")
            prompt = [bos]
        vocab = self.target.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise InvalidRequestError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.context_window:
            raise PromptTooLongError(len(prompt), self.context_window)
        if req.images is not None:
            if self.vision is None:
                raise InvalidRequestError("this model reads text only: images can't be given to it")
            if req.images.end >= len(prompt):
                raise InvalidRequestError("the prompt must not end with an image's tokens")
        req.sampling.validate(vocab)
        if req.constraint is not None:
            self.grammars.check(req.constraint)
        if req.max_tokens < 0:
            raise InvalidRequestError("max_tokens must be >= 0")
        resolve_mode(req.mode or self.default_mode, self.target)
        cap = req.max_draft if req.max_draft is not None else self.max_draft
        if cap != "auto" and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise InvalidRequestError(f"max_draft must be a whole number >= 0 or 'auto', not {cap!r}")
        return prompt

    # Prefix-cache hooks (engine/caches/prefix_cache.py); n_cached <= len(prompt) - 1.
    def _new_cache(self) -> list:
        return fresh_cache(self.target, self.kv_bits)

    def _acquire_cache(self, prompt: list[int]) -> tuple[list, int]:
        if self.prefix_cache is None:
            return self._new_cache(), 0
        cache, n = self.prefix_cache.acquire(prompt)
        # Split over ranks, each holds its own part of every entry, and may have evicted or
        # restored otherwise: all start from the shortest prefix any of them holds.
        while len(set(held := self.ranks.gather(n))) > 1:
            if n > min(held):
                self.prefix_cache.release(prompt[:n], cache)
                cache, n = self.prefix_cache.acquire(prompt[: min(held) + 1])
        return cache, n

    def _release_cache(self, tokens: list[int], cache: list) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(tokens, cache)


def engine_stream():
    """The stream mlx-lm's generators must use on the engine thread.

    mlx-lm's default `generation_stream` is thread-local; created on a worker thread
    it aborts the process at exit ("terminate called without an active exception").
    """
    return mx.default_stream(mx.default_device())


def plain_rounds(target: Target, cache: list, last_token: int, sampling: SamplingParams,
                 grammar: GrammarState | None = None) -> Iterator[Round]:
    """Plain decoding through mlx-lm's own generate_step: the reference, one token a round;
    a `grammar` masks each step's logits before mlx-lm's sampler picks."""
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    steps = generate_step(
        mx.array([last_token], dtype=mx.uint32),
        target.model,
        max_tokens=-1,
        sampler=sampling.mlx_lm_sampler(),
        prompt_cache=position_view(cache),  # shifted positions after an M-RoPE image (engine/model/vision.py)
        stream=engine_stream(),
        logits_processors=[logits_processor(grammar)] if grammar is not None else None,
    )
    t = time.perf_counter()
    generated: list[int] = []
    try:
        for token, _ in steps:
            if grammar is not None:  # advanced already where mlx-lm ran the next step first
                generated.append(int(token))
                grammar.follow(generated)
            now = time.perf_counter()
            yield Round([int(token)], 0, 0, now - t)
            t = now
    finally:
        steps.close()
