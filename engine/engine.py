"""The engine: one thread owns MLX, the model and its caches; requests queue to it.

`Engine.submit` returns a `Job` whose events (prefill progress, committed tokens,
the end with statistics) are read from any thread; `Job.cancel` stops it between
prefill chunks or decode rounds, or drops it from the queue.

The engine thread runs up to `max_batch` jobs at once, a step each in turn (a prefill
chunk or a decode round): a short request no longer waits for a long one to finish.
Each job keeps its own cache and drafter, so its output is what it would be alone; with
max_batch > 1 a decoding job's attention KV lives in a row of one persistent BatchCache
(engine/caches/batch_cache.py) from the end of its prefill to its end, so the decoding jobs'
verify forwards run as one batched forward without copying any KV per round. Their head
drafts (DSpark, DFlash) run batched too: each round a job first hands the scheduler its
`HeadCall`, and one head forward and one walk draft every row (engine/drafting/heads/drafter.py).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import mlx.core as mx
from mlx_lm.generate import generate_step

from engine.base.bundled import resolve_model
from engine.base.chat import chat_text, render_chat
from engine.base.errors import CancelledError, EngineError, InvalidRequestError, PromptTooLongError
from engine.base.events import Done, PrefillProgress, Stats, Tokens
from engine.base.loop_guard import LoopGuard
from engine.base.piece_encoder import PieceEncoder
from engine.base.sampling import SamplingParams
from engine.base.stops import TextAssembler
from engine.caches.batch_cache import BatchCache, joinable
from engine.caches.kv_segments import KV_BITS, fresh_cache, kv_group_size
from engine.caches.prefix_cache import PrefixCache, cache_identity
from engine.decoding.batch_verify import Forward, run_forwards
from engine.decoding.verify import Round, prefill, speculative_rounds
from engine.drafting.heads.drafter import HeadCall, draft_together
from engine.drafting.heads.loading import precheck
from engine.drafting.lookup import ContextIndexCache, TokenIndex
from engine.drafting.modes import attach_drafter, make_drafter, resolve_mode
from engine.kernels import cpu_attention
from engine.model.target import Target, load_target
from engine.model.vision import PromptImages, Vision, load_vision, position_view, prefill_chunks, set_position_shift
from engine.tuning.batch_cost import quick_surface, surface_for
from engine.tuning.cost_curve import state_rollback
from engine.tuning.draft_control import draft_controller
from engine.tuning.prefill_chunk import chunk_for

DEFAULT_MAX_DRAFT = "auto"  # per round, from the measured verify cost curve (engine/tuning/draft_control.py)
MAX_ENGINE_CORPUS_DOCS = 64
_WAKE = object()  # put on the work queue when a job is queued


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    mode: str | None = None  # None: the engine's default
    max_draft: int | str | None = None  # a cap, "auto", or None: the engine's default
    corpus: list[list[int]] = field(default_factory=list)  # extra sequences to draft from (this request only)
    images: PromptImages | None = None  # a VLM prompt's images (Engine.render_chat_images)


class Job:
    """One queued generation. Iterate it for events; it ends with `Done` or raises."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.created = time.perf_counter()
        self._events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        # Where it stands, written by the engine thread, read by anyone (/health, pings).
        self.phase = "queued"  # then "prefill", "decode", "done"
        self.prefilled = 0
        self.prompt_tokens = len(request.prompt_ids)
        self.generated = 0
        self.held = False  # kept in the queue but not started (its client left; a retry may take it over)

    def status(self) -> dict:
        return {"phase": self.phase, "prefilled_tokens": self.prefilled, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated, "age_s": round(time.perf_counter() - self.created, 3)}

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, event: Any) -> None:
        self._events.put(event)

    def next_event(self, timeout: float | None = None) -> Any:
        """The next event (blocking); raises the engine's error if the job failed."""
        event = self._events.get(timeout=timeout)
        if isinstance(event, BaseException):
            raise event
        return event

    def __iter__(self) -> Iterator[Any]:
        while True:
            event = self.next_event()
            yield event
            if isinstance(event, Done):
                return

    def result(self) -> Done:
        done = None
        for event in self:
            done = event
        return done


class Engine:
    def __init__(
        self,
        model: str | None = None,
        *,
        mode: str = "auto",
        max_draft: int | str = DEFAULT_MAX_DRAFT,
        prefill_chunk: int | None = None,  # None: measured for this machine (engine/tuning/prefill_chunk.py)
        context_window: int | None = None,
        dtype: str | None = None,
        prefix_cache: bool = True,
        prefix_cache_max_ram_mb: float | None = None,
        prefix_cache_dir: str | None = None,
        prefix_cache_max_disk_mb: float | None = None,
        kv_bits: int | None = None,
        drafter: str | None = None,
        drafter_bits: int | None = None,
        loop_guard: int = 0,
        max_batch: int | str = 1,
    ):
        """`loop_guard`: end a generation whose last N committed tokens repeat one short
        n-gram (engine/base/loop_guard.py), as `length`; 0 (the library's default) never does."""
        if kv_bits not in (None, *KV_BITS):
            raise ValueError(f"kv_bits must be one of {KV_BITS}, not {kv_bits!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a whole number >= 1 or None (measured), not {prefill_chunk!r}")
        self.kv_bits = kv_bits
        self.prefix_cache: PrefixCache | None = None

        self.model_path = resolve_model(model or None)  # a bundled model's name -> its folder
        if drafter:  # a head for another model is refused before the model's weights load
            precheck(drafter, self.model_path)
        self.default_mode = mode
        self.max_draft = max_draft
        self.prefill_chunk = prefill_chunk
        if loop_guard:
            LoopGuard(loop_guard)  # a window too small to hold a loop fails here, not per request
        self.loop_guard = loop_guard
        # documents to draft from (files agents read), indexed once on arrival, one per path
        self.corpus: collections.OrderedDict[str, TokenIndex] = collections.OrderedDict()
        self._corpus_lock = threading.Lock()
        self.job_observers: list[Callable[[Job], None]] = []  # see each job before it queues (telemetry)
        self.target: Target | None = None
        self.vision: Vision | None = None  # a VLM's vision half (engine/model/vision.py), else None
        if max_batch != "auto" and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"max_batch must be a whole number >= 1 or 'auto', not {max_batch!r}")
        self.max_batch = 1 if max_batch == "auto" else max_batch
        self.batched_rounds = 0  # sequence rounds verified in a batched forward
        self.batched_drafts = 0  # sequence rounds whose head draft ran in a batched draft
        self._batch = BatchCache()  # the KV of every sequence that decodes batched (engine/caches/batch_cache.py)
        self._work: queue.Queue = queue.Queue()  # calls to run on the engine thread, and wake-ups
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[tuple[Job, Iterator[None]]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._queue_lock = threading.Lock()  # "closed?" and the put are one step (else a late put hangs)
        # The one way in to the tokenizer, for every thread: Hugging Face fast tokenizers fail
        # ("Already borrowed") when two threads use one at once.
        self.tokenizer_lock = threading.RLock()
        self._stopped = threading.Event()
        loaded: Future = Future()
        self._thread = threading.Thread(
            target=self._serve, args=(loaded, dtype), name="mlx-dspark-engine", daemon=True
        )
        self._thread.start()
        loaded.result()  # re-raises ModelLoadError here, in the caller's thread
        self.context_window = context_window or self.target.context_window
        self._pieces = PieceEncoder(self.tokenizer)  # chat prompts tokenised by message pieces
        self._contexts = ContextIndexCache()  # the last request's lookup index, continued
        if not self.prefill_chunk:
            self.prefill_chunk = self.call(chunk_for)
        if drafter or drafter_bits:  # a head checkpoint given by the user: load and pair it now
            try:
                self.call(lambda t: attach_drafter(t, drafter, drafter_bits))
            except BaseException:
                self.close()
                raise
        resolve_mode(mode, self.target)  # fail early on an unknown default mode
        try:
            if kv_bits:
                kv_group_size(self.target.config)  # fail early on a head size KV quantisation can't take
            if max_batch == "auto":  # from this machine's batch cost surface, measured once (engine/tuning/batch_cost.py)
                self.max_batch = self.call(lambda t: quick_surface(t, kv_bits).best_max_batch())
            if prefix_cache:
                mb = lambda v: None if v is None else int(v * (1 << 20))  # noqa: E731
                self.prefix_cache = self.call(lambda t: PrefixCache(
                    self._new_cache, cache_identity(t, kv_bits), mb(prefix_cache_max_ram_mb),
                    prefix_cache_dir, mb(prefix_cache_max_disk_mb)))
        except BaseException:
            self.close()
            raise

    # -- public API, callable from any thread ---------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def submit(self, request: GenerationRequest) -> Job:
        """Queue a generation; a request the engine can't run raises here (EngineError)."""
        self._check_request(request)
        job = Job(request)
        with self._queue_lock:  # the same lock as close(): no job slips in after the engine stops
            if self._closed:
                raise EngineError("engine is closed")
            for observe in self.job_observers:  # before it can emit anything
                observe(job)
            with self._lock:
                self._waiting.append(job)
            self._work.put(_WAKE)
        return job

    def hold(self, job: Job, held: bool = True) -> None:
        """Keep a queued job from starting (or let it start again); a running job runs on."""
        job.held = held
        self._work.put(_WAKE)

    def queue_position(self, job: Job) -> int:
        """1 for the next job to start, 0 once it runs (or left the queue)."""
        with self._lock:
            live = [j for j in self._waiting if not j.cancelled]
        return live.index(job) + 1 if job in live else 0

    def load(self) -> dict:
        """What the engine is doing: queued and running jobs, each with its phase and progress."""
        with self._lock:
            waiting = [j for j in self._waiting if not j.cancelled]
            running = [j for j, _ in self._running]
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

    def call(self, fn: Callable[[Target], Any]) -> Any:
        """Run fn(target) on the engine thread (MLX work outside a generation) and return its result."""
        future: Future = Future()

        def work():
            try:
                future.set_result(fn(self.target))
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

        self._enqueue(work)
        return future.result()

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
        index = TokenIndex(list(token_ids))
        with self._corpus_lock:
            self.corpus.pop(key, None)
            self.corpus[key] = index
            while len(self.corpus) > MAX_ENGINE_CORPUS_DOCS:
                self.corpus.popitem(last=False)

    def info(self) -> dict:
        return {
            "model": self.model_path,
            "identity": self.target.identity,
            "dtype": self.target.dtype,
            "context_window": self.context_window,
            "mode": self.default_mode,
            "max_draft": self.max_draft,
            "corpus_docs": len(self.corpus),
            "kv_bits": self.kv_bits,
            "prefix_cache": self.cache_stats(),
        }

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
        rows = self.call(lambda t: self.prefix_cache.branches(limit))
        for row in rows:
            row["head"], row["tail"] = self.decode(row.pop("head_ids")), self.decode(row.pop("tail_ids"))
        return rows

    def drop_cache(self, disk: bool = False) -> None:
        """Empty the prefix cache's RAM tier: to the disk tier (evict), or forgotten with it (clear)."""
        if self.prefix_cache is not None:
            self.call(lambda t: self.prefix_cache.drop(disk))

    def close(self) -> None:
        if not self._closed:
            if self.prefix_cache is not None:
                try:  # the hot segments go to the disk tier, which outlives us
                    self.call(lambda t: self.prefix_cache.close())
                except Exception as e:
                    logging.getLogger(__name__).warning("prefix cache: not saved on close: %s", e)
            with self._queue_lock:
                self._closed = True
                self._work.put(None)
            self._stopped.wait(timeout=60)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the engine thread ----------------------------------------------------------

    def _enqueue(self, work: Callable[[], None]) -> None:
        with self._queue_lock:
            if self._closed:
                raise EngineError("engine is closed")
            self._work.put(work)

    def _schedule(self) -> None:
        """Run calls as they come; start queued jobs up to max_batch; step the running jobs in turn."""
        while True:
            idle = not self._running and all(j.held and not j.cancelled for j in self._waiting)
            items = [self._work.get()] if idle else []
            while True:
                try:
                    items.append(self._work.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is None:
                    self._fail_all(EngineError("engine is closed"))
                    return
                if item is not _WAKE:
                    item()
            self._admit()
            # One prefill at a time, oldest first (the others' time to first token would all
            # grow if they took turns), interleaved with every decoding job's rounds. A job just
            # started takes its first step at once (its cached prefix is known after it).
            lead = next((j for j, _ in self._running if j.phase == "prefill"), None)
            stepped = [(job, steps, self._step(job, steps)) for job, steps in list(self._running)
                       if job.phase != "prefill" or job is lead or job.cancelled]
            drafting = [(job, steps, c) for job, steps, c in stepped if isinstance(c, HeadCall)]
            if drafting:  # the heads' drafts of this round, one batched draft per head
                self.batched_drafts += draft_together(self.target, [c for _, _, c in drafting])
                stepped += [(job, steps, self._step(job, steps)) for job, steps, _ in drafting]
            forwards = [f for _, _, f in stepped if isinstance(f, Forward)]
            if forwards:
                try:
                    surface = surface_for(self.target, self.kv_bits)  # what batching pays for here
                    self.batched_rounds += run_forwards(self.target, forwards, surface)
                except Exception as e:  # those jobs fail at their next step (no result); the engine goes on
                    logging.getLogger(__name__).error("batched verify failed: %s: %s", type(e).__name__, e)

    def _admit(self) -> None:
        with self._lock:
            for job in [j for j in self._waiting if j.cancelled]:
                self._waiting.remove(job)
                job.phase = "done"
                job.emit(CancelledError("cancelled before it started"))
            for job in [j for j in self._waiting if not j.held][: self.max_batch - len(self._running)]:
                self._waiting.remove(job)
                self._running.append((job, self._steps(job)))

    def _step(self, job: Job, steps: Iterator[Any]) -> Any:
        finished: Any = None
        try:
            return next(steps)
        except StopIteration as stop:
            finished = stop.value
        except EngineError as e:
            finished = e
        except Exception as e:  # never let one request kill the engine thread
            finished = EngineError(f"generation failed: {type(e).__name__}: {e}")
        if finished is not None:
            job.phase = "done"
            self._batch.drop(job)  # its batch row, where it ended without leaving (an error)
            with self._lock:
                self._running.remove((job, steps))
            job.emit(finished)

    def _decoding(self) -> int:
        """How many running jobs decode (their verify forwards may share a batch)."""
        return sum(1 for j, _ in self._running if j.phase == "decode")

    def _fail_all(self, error: EngineError) -> None:
        with self._lock:
            jobs = [j for j, _ in self._running] + list(self._waiting)
            for _, steps in self._running:
                steps.close()
            self._running.clear()
            self._waiting.clear()
            self._batch = BatchCache()
        for job in jobs:
            job.emit(error)

    def _serve(self, loaded: Future, dtype: str | None) -> None:
        try:
            self.target = load_target(self.model_path, dtype=dtype)
            self.vision = load_vision(self.target)
        except BaseException as e:
            loaded.set_exception(e)
            return
        loaded.set_result(True)
        with cpu_attention.engine_thread():  # its forwards may use the CPU kernels (engine/kernels/cpu_attention.py)
            self._schedule()
        self.target = None
        self._stopped.set()
        # Park instead of returning: an MLX worker thread that exits after loading a
        # model makes the process abort at exit ("terminate called without an active
        # exception"). A parked daemon thread holds nothing and ends with the process.
        threading.Event().wait()

    def _steps(self, job: Job) -> Iterator[None]:
        """One job as steps (a prefill chunk, a decode round), yielding between them; returns Done."""
        req, target = job.request, self.target
        t0 = time.perf_counter()
        stats = Stats(queued_s=t0 - job.created)
        prompt = self._check_prompt(req)
        req.sampling.validate(target.vocab_size)
        sampling = req.sampling.for_vocab(target.vocab_size)
        if req.max_tokens < 0:
            raise InvalidRequestError("max_tokens must be >= 0")
        mode = resolve_mode(req.mode or self.default_mode, target)
        stats.mode, stats.prompt_tokens = mode, len(prompt)
        max_tokens = min(req.max_tokens, self.context_window - len(prompt))
        if job.cancelled:
            raise CancelledError("cancelled before it started")

        # the prefix cache's view of the prompt: an image's tokens stand for its hash
        images = req.images
        key = images.key(prompt, target.vocab_size) if images is not None else prompt
        cache, cached = self._acquire_cache(key)
        set_position_shift(cache, images.position_shift if images is not None else 0)  # M-RoPE after images
        stats.cached_tokens = cached
        job.phase, job.prefilled, job.prompt_tokens = "prefill", cached, len(prompt)
        job.emit(PrefillProgress(cached, len(prompt)))  # first event: the cached prefix (APIs report it up front)
        with self._corpus_lock:
            corpus = [*self.corpus.values(), *req.corpus]
        drafter = None if mode == "baseline" else make_drafter(mode, target, corpus)
        if drafter is not None:
            drafter.use_context_cache(self._contexts)
            drafter.start(prompt)
            if not target.can_rollback(cache):
                stats.note = "this model's cache can't be rolled back: decoding without drafts"

        to_prefill = prompt[cached:-1]
        embeddings = None  # images not in the cached prefix: prefill from the image-merged embeddings
        if images is not None and cached < images.end:
            if drafter is not None and drafter.tap_layers:
                raise InvalidRequestError(f"mode {mode!r}: drafter heads don't read image prompts yet; use lookup")
            embeddings = self.vision.features(prompt, images)[cached : len(prompt) - 1]
            embeddings.eval()  # once: the chunks below slice it
        for start, stop in prefill_chunks(len(to_prefill), self.prefill_chunk, embeddings):  # a chunk per step
            yield
            prefill(
                target,
                cache,
                to_prefill[start:stop],
                chunk_size=stop - start,
                cancelled=lambda: job.cancelled,
                on_hidden=getattr(drafter, "observe_prefill", None),
                tap_layers=drafter.tap_layers if drafter is not None else (),
                embeddings=None if embeddings is None else embeddings[start:stop],
            )
            job.prefilled = cached + stop
            job.emit(PrefillProgress(job.prefilled, len(prompt)))
        stats.prefilled_tokens = len(to_prefill) + 1
        if self.prefix_cache is not None:  # models with recurrent/window layers resume only at checkpoints
            self.prefix_cache.checkpoint(key[:-1], cache)
        stats.prefill_s = time.perf_counter() - t0

        if self.max_batch > 1 and mode != "baseline" and joinable(target, cache):
            self._batch.join(cache, owner=job)  # its rounds' KV stays in the batch until it ends: no per-round copy
        controller = None
        if mode == "baseline":
            rounds = plain_rounds(target, cache, prompt[-1], sampling)
        else:
            cap = req.max_draft if req.max_draft is not None else self.max_draft
            if cap == "auto":  # adapt per round to the acceptance seen (engine/tuning/draft_control.py)
                cap = controller = draft_controller(target, len(prompt), self.kv_bits)
                hard_cap = controller.max_cap
            elif isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
                raise InvalidRequestError(f"max_draft must be a whole number >= 0 or 'auto', not {cap!r}")
            else:
                hard_cap = cap
            # Never verify more draft than the request can still emit (a round adds one token of its
            # own): a 1-token request, or the last round of any, drafts nothing it would throw away.
            left = lambda: max(0, max_tokens - len(out) - 1)  # noqa: E731
            cap_now = cap if callable(cap) else (lambda c=cap: c)
            rounds = speculative_rounds(target, cache, prompt[-1], drafter, sampling,
                                        lambda: min(cap_now(), left()), hard_cap=lambda: min(hard_cap, left()),
                                        defer_forward=self.max_batch > 1,
                                        rollback=state_rollback(target, self.kv_bits))

        assembler = TextAssembler(target.tokenizer, req.stop)
        eos = target.eos_token_ids
        out: list[int] = []
        committed = list(key)  # the context the cache holds (a round's tokens past a stop are taken back)
        guard = LoopGuard(self.loop_guard) if self.loop_guard else None
        finish = "length" if max_tokens <= 0 else None
        t_decode = time.perf_counter()
        job.phase = "decode"
        while finish is None:
            if job.cancelled:
                finish = "cancelled"
                break
            if controller is not None:  # the draft that pays depends on how many share the forward
                controller.batch = self._decoding() if self.max_batch > 1 else 1
            rnd = next(rounds)
            if isinstance(rnd, Round):
                yield
            while not isinstance(rnd, Round):  # a head draft, a verify forward: run by the scheduler with the others'
                yield rnd
                rnd = next(rounds)
            committed.extend(rnd.tokens)
            stats.add_round(rnd.drafted, rnd.accepted, rnd.source)
            if controller is not None:
                controller.observe(rnd.drafted, rnd.accepted)
            new_ids, text, provenance = [], "", []
            for used, tok in enumerate(rnd.tokens, 1):
                if tok in eos:
                    finish = "stop"
                    break
                out.append(tok)
                new_ids.append(tok)
                with self.tokenizer_lock:
                    delta, stopped = assembler.add(tok)
                text += delta
                provenance.append([delta, rnd.source if used <= rnd.accepted else "target"])
                if stopped:
                    finish = "stop_string"
                    break
                if len(out) >= max_tokens:
                    finish = "length"
                    break
                if guard is not None and guard.add(tok):
                    finish = "length"
                    stats.note = guard.note()
                    break
            if finish and used < len(rnd.tokens) and rnd.keep_only is not None:
                # tokens drafted past the stop: out of the cache, so what the prefix cache
                # keeps (a turn-end checkpoint, for recurrent models) is the context the client has
                rnd.keep_only(used)
                del committed[len(committed) - (len(rnd.tokens) - used) :]
            if stats.rounds == 1:
                stats.ttft_s = time.perf_counter() - t0
            job.generated = len(out)
            if new_ids or text:
                job.emit(Tokens(new_ids, text, provenance, rnd.drafted))
        rounds.close()
        if drafter is not None:
            drafter.finish()
        with self.tokenizer_lock:
            tail = assembler.finish()
        if tail:
            job.emit(Tokens([], tail))
        now = time.perf_counter()
        stats.decode_s = now - t_decode
        stats.wall_s = now - t0
        stats.generated_tokens = len(out)
        if not stats.ttft_s:
            stats.ttft_s = stats.wall_s
        if self._batch.owns(cache):
            self._batch.leave(cache)  # its KV back in plain KVCaches: for the prefix cache
        self._release_cache(committed, cache)
        return Done(finish, out, assembler.text, stats, stop_string=assembler.stop_string)

    def _check_request(self, req: GenerationRequest) -> None:
        """What makes a request fail, checked before it queues (so an HTTP client gets an HTTP error)."""
        prompt = self._check_prompt(req)
        if req.images is not None:
            if self.vision is None:
                raise InvalidRequestError("this model reads text only: images can't be given to it")
            if req.images.end >= len(prompt):
                raise InvalidRequestError("the prompt must not end with an image's tokens")
        req.sampling.validate(self.target.vocab_size)
        if req.max_tokens < 0:
            raise InvalidRequestError("max_tokens must be >= 0")
        resolve_mode(req.mode or self.default_mode, self.target)
        cap = req.max_draft if req.max_draft is not None else self.max_draft
        if cap != "auto" and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise InvalidRequestError(f"max_draft must be a whole number >= 0 or 'auto', not {cap!r}")

    def _check_prompt(self, req: GenerationRequest) -> list[int]:
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
        return prompt

    # Prefix-cache hooks (engine/caches/prefix_cache.py); n_cached <= len(prompt) - 1.
    def _new_cache(self) -> list:
        return fresh_cache(self.target, self.kv_bits)

    def _acquire_cache(self, prompt: list[int]) -> tuple[list, int]:
        if self.prefix_cache is None:
            return self._new_cache(), 0
        return self.prefix_cache.acquire(prompt)

    def _release_cache(self, tokens: list[int], cache: list) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(tokens, cache)


def engine_stream():
    """The stream mlx-lm's generators must use on the engine thread.

    mlx-lm's default `generation_stream` is thread-local; created on a worker thread
    it aborts the process at exit ("terminate called without an active exception").
    """
    return mx.default_stream(mx.default_device())


def plain_rounds(target: Target, cache: list, last_token: int, sampling: SamplingParams) -> Iterator[Round]:
    """Plain decoding through mlx-lm's own generate_step: the reference, one token a round."""
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    steps = generate_step(
        mx.array([last_token], dtype=mx.uint32),
        target.model,
        max_tokens=-1,
        sampler=sampling.mlx_lm_sampler(),
        prompt_cache=position_view(cache),  # shifted positions after an M-RoPE image (engine/model/vision.py)
        stream=engine_stream(),
    )
    t = time.perf_counter()
    try:
        for token, _ in steps:
            now = time.perf_counter()
            yield Round([int(token)], 0, 0, now - t)
            t = now
    finally:
        steps.close()
