"""Clients that hang up at every stage (queued, prefill, decode) free the engine within a
prefill chunk or a decode round (issue 13's fault suite). Real uvicorn server and sockets;
a random model large enough that an abandoned job would hold the engine for a long time
(about 16 s of prefill, or a minute of decoding, here)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from agent_bridge.app import create_app
from server_harness import RunningServer
from tiny_models import build_tiny_model

FREED_WITHIN_S = 4.0  # a chunk or round takes well under a second; the poll for a gone client 0.5 s
LONG_TEXT = " ".join(f"w{i % 97}" for i in range(700))  # about 2,700 tokens with the tiny tokenizer


@pytest.fixture(scope="module")
def slow_engine(tmp_path_factory):
    from engine import Engine

    model = build_tiny_model(tmp_path_factory.mktemp("slow"), hidden=256, layers=4, seed=5)
    engine = Engine(str(model), prefix_cache=False, prefill_chunk=64, mode="baseline")
    jobs = []
    submit = engine.submit

    def recording_submit(request):  # keeps a handle on each job, to check it was cancelled
        job = submit(request)
        jobs.append(job)
        return job

    engine.submit = recording_submit
    engine.jobs = jobs
    yield engine
    engine.submit = submit
    engine.close()


@pytest.fixture(scope="module")
def server(slow_engine):
    app = create_app(slow_engine)
    # A job whose client left is kept for a retry of the same request for a grace period
    # (tests/test_server_queue.py); these hang-ups send no retry, so none is waited for.
    app.state.bridge.takeover_grace_s = 0
    with RunningServer(app) as srv:
        yield srv


def probe_wait_s(engine) -> float:
    """How long a one-token request waits for the engine now."""
    from engine import GenerationRequest

    done = engine.submit(GenerationRequest(prompt_ids=[1, 2], max_tokens=1)).result()
    return done.stats.queued_s


def wait_for_job(engine, n_before: int, timeout: float = 30) -> object:
    deadline = time.monotonic() + timeout
    while len(engine.jobs) <= n_before:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.05)
    return engine.jobs[n_before]


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """A request on a plain socket, so the test decides when the connection drops."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def assert_freed(engine, job) -> None:
    deadline = time.monotonic() + FREED_WITHIN_S
    while not job.cancelled:
        assert time.monotonic() < deadline, "the server did not cancel the job of a client that left"
        time.sleep(0.05)
    assert probe_wait_s(engine) < FREED_WITHIN_S


def test_hang_up_while_queued(slow_engine, server):
    from engine import GenerationRequest

    blocker = slow_engine.submit(GenerationRequest(prompt_ids=[5 + i % 300 for i in range(3000)], max_tokens=1))
    n = len(slow_engine.jobs)
    s = raw_post(server.url, "/v1/messages", {"model": "m", "max_tokens": 3000, "stream": True,
                                               "messages": [{"role": "user", "content": LONG_TEXT}]})
    job = wait_for_job(slow_engine, n)
    time.sleep(0.5)
    s.close()  # hung up while queued behind the blocker
    deadline = time.monotonic() + FREED_WITHIN_S
    while not job.cancelled:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    blocker.cancel()
    assert probe_wait_s(slow_engine) < FREED_WITHIN_S  # the abandoned job never ran


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "m", "max_tokens": 3000, "stream": True,
                              "messages": [{"role": "user", "content": LONG_TEXT}]}),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 3000, "messages": [{"role": "user", "content": LONG_TEXT}]}),
    ("/v1/responses", {"model": "m", "max_output_tokens": 3000, "stream": True, "input": LONG_TEXT}),
])
def test_hang_up_during_prefill(slow_engine, server, path, body):
    n = len(slow_engine.jobs)
    s = raw_post(server.url, path, body)
    job = wait_for_job(slow_engine, n)
    time.sleep(1.5)  # well inside the prefill
    s.close()
    assert_freed(slow_engine, job)


@pytest.mark.parametrize("path,body,marker", [
    ("/v1/messages", {"model": "m", "max_tokens": 3000, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
     "content_block_delta"),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 3000, "stream": True,
                              "messages": [{"role": "user", "content": "hi"}]}, '"content":"'),
    ("/v1/responses", {"model": "m", "max_output_tokens": 3000, "stream": True, "input": "hi"}, "output_text.delta"),
])
def test_hang_up_during_decode(slow_engine, server, path, body, marker):
    n = len(slow_engine.jobs)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            seen = ""
            for chunk in r.iter_text():
                seen += chunk
                if marker in seen:
                    break  # decoding has begun: hang up
    job = slow_engine.jobs[n]
    assert_freed(slow_engine, job)
