"""A generation three ways: what was asked (`GenerationRequest`), what the asker holds
(`Job`: events, cancel, progress, read from any thread) and what the engine thread works on
(`Sequence`: the job's checked prompt, cache, drafter, rounds and output so far).

A sequence's steps run on the engine thread (engine/engine.py's phases). After each step
its `wants` tells the scheduler what it left there: nothing (it steps again next turn), a
head draft (`call` is a HeadCall, drafted with the others' by `draft_together`) or a verify
forward (`call` is a Forward, run with the others' by `run_forwards`).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from engine.base.events import Done, Stats
from engine.base.loop_guard import LoopGuard
from engine.base.sampling import SamplingParams
from engine.base.stops import TextAssembler
from engine.decoding.grammar import Constraint, GrammarState
from engine.drafting.drafter import Drafter
from engine.drafting.heads.drafter import HeadCall
from engine.model.vision import PromptImages

NOTHING, DRAFT, FORWARD = "", "draft", "forward"  # what a sequence's step leaves for the scheduler


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
    constraint: Constraint | None = None  # the reply's grammar (a JSON schema...): engine/decoding/grammar.py


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

    uid: int = 0  # the engine's number for it, the same on every rank of a split model

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


class MirrorJob(Job):
    """A leader's job as another rank of a split model runs it (engine/base/ranks.py): the same
    steps, its events heard by no one."""

    def emit(self, event: Any) -> None:
        pass


@dataclass(eq=False)
class Sequence:
    """One job on the engine thread: made when it queues (its prompt checked), filled in by
    its phases as it runs. Only the engine thread touches it once it runs."""

    job: Job
    prompt: list[int]  # the checked ids (an empty prompt: the model's BOS)
    steps: Iterator[None] | None = None  # its phases as steps, from when it starts
    # its job's cancel and hold as the scheduler saw them at its last turn: what the engine
    # thread acts on (a split model's ranks all act at the same turn)
    cancelled: bool = False
    held: bool = False
    # set when it starts
    t0: float = 0.0
    stats: Stats = field(default_factory=Stats)
    sampling: SamplingParams | None = None  # the request's, for the model's vocabulary
    mode: str = ""  # resolved ("auto" -> a mode this model can run)
    max_tokens: int = 0  # the request's, within the context window
    # the prefix cache's part
    key: list[int] = field(default_factory=list)  # the prompt as the prefix cache sees it (an image as its hash)
    cache: list = field(default_factory=list)
    cached: int = 0  # prompt tokens its cache held from the start
    # drafting and decoding
    drafter: Drafter | None = None
    controller: Any = None  # a DraftController where the draft cap is "auto"
    rounds: Iterator[Any] | None = None  # verify.speculative_rounds or plain_rounds
    assembler: TextAssembler | None = None
    eos: Any = ()  # the model's end-of-sequence ids
    guard: LoopGuard | None = None
    grammar: GrammarState | None = None  # where the reply stands in its request's constraint
    out: list[int] = field(default_factory=list)  # the tokens generated
    committed: list[int] = field(default_factory=list)  # the context its cache holds
    finish: str | None = None
    t_decode: float = 0.0
    # what its last step left for the scheduler
    wants: str = NOTHING
    call: Any = None  # the HeadCall or Forward it waits on

    @property
    def request(self) -> GenerationRequest:
        return self.job.request

    def wait_on(self, call: Any) -> None:
        """Leave a round's head draft (a HeadCall) or verify forward (a Forward) to the scheduler."""
        self.call = call
        self.wants = DRAFT if isinstance(call, HeadCall) else FORWARD

    def step(self) -> None:
        """Run its next step (raises StopIteration with its Done at its end)."""
        self.wants, self.call = NOTHING, None
        next(self.steps)
