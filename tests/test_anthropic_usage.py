"""Anthropic usage through the real `anthropic` client over a socket, on the bundled model:
`message_start` carries the real cached/uncached split (context meters and cost displays read
it there), also when the engine is busy with another request as the turn comes in."""

from __future__ import annotations

import threading
import time

import anthropic
import pytest

from engine import REFERENCE_MODEL_DIR, Engine

from agent_bridge.app import create_app
from server_harness import RunningServer

pytestmark = pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "config.json").exists(),
                                reason="the bundled reference model is absent")

SYSTEM = "You are a careful assistant who answers in one short sentence about Python code."
FIRST = "What does `def add(a, b): return a + b` do?"
SECOND = "And what would `add('a', 'b')` give?"
BUSY_S = 2.0  # the engine thread busy this long: past the stream's wait for the engine to start


@pytest.fixture(scope="module")
def engine():
    with Engine(mode="lookup", max_batch=1, dtype="float32") as e:
        yield e


@pytest.fixture(scope="module")
def claude(engine):
    with RunningServer(create_app(engine)) as srv:
        yield anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)


def _turns(claude) -> list[dict]:
    first = claude.messages.create(model="local", system=SYSTEM, max_tokens=8,
                                   messages=[{"role": "user", "content": FIRST}])
    reply = "".join(b.text for b in first.content if b.type == "text") or "It adds them."
    return [{"role": "user", "content": FIRST}, {"role": "assistant", "content": reply},
            {"role": "user", "content": SECOND}]


def _stream_usage(claude, messages: list[dict]) -> tuple[dict, dict]:
    """(message_start's usage, message_delta's usage) of a streamed turn."""
    start = final = None
    with claude.messages.stream(model="local", system=SYSTEM, max_tokens=4, messages=messages) as stream:
        for event in stream:
            if event.type == "message_start":
                start = event.message.usage.model_dump()
            elif event.type == "message_delta":
                final = event.usage.model_dump()
    return start, final


def _check_split(start: dict, final: dict) -> None:
    assert start["cache_read_input_tokens"] > 0, start
    # the same split at the start as at the end: the cache did not change in between here
    assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"], (start, final)
    assert start["input_tokens"] == final["input_tokens"], (start, final)


def test_message_start_reports_the_cached_prefix(claude):
    start, final = _stream_usage(claude, _turns(claude))
    _check_split(start, final)


def test_message_start_reports_it_while_the_engine_is_busy(engine, claude):
    """The turn queues behind other work (here the engine thread held for BUSY_S, as by another
    request's long prefill chunk): its opening goes out before the engine starts on it, with
    what the prefix cache held when it was accepted."""
    messages = _turns(claude)
    started = threading.Event()

    def busy(_target):
        started.set()
        time.sleep(BUSY_S)

    blocker = threading.Thread(target=engine.call, args=(busy,), daemon=True)
    blocker.start()
    assert started.wait(30)
    t0 = time.monotonic()
    start, final = _stream_usage(claude, messages)
    blocker.join()
    assert time.monotonic() - t0 >= BUSY_S / 2  # it did wait behind the busy engine
    _check_split(start, final)
