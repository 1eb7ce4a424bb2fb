"""Several clients at once, with the real OpenAI and Anthropic SDKs over real sockets: a queued
stream opens at once and hears its queue position, the queue bound answers 429/529 with
retry-after, a retried request takes over its parked job, a client gone at any phase frees the
engine. The engine is held busy deterministically (a blocking `engine.call` on its thread),
never by timing. Model: a tiny random qwen3 (real engine, real tokenizer).
"""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from agent_bridge.app import create_app
from server_harness import RunningServer, check_anthropic_stream, engine_held, sse_events

# ~2,000 tokens: ~250 prefill steps of 8, a prefill phase long enough for a 20 ms poll to see on any CPU
LONG_PROMPT = " ".join(f"word{i}" for i in range(300))


def long_prompt(tag: str) -> str:
    """A long prompt no earlier test's prefix cache holds a part of."""
    return f"[{tag}] {LONG_PROMPT}"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from engine import Engine

    e = Engine(str(tiny_model_dir), prefill_chunk=8)  # many prefill steps: a prefill phase to catch
    yield e
    e.close()


def wait_for(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def settle(app, engine):
    """Nothing queued, running, parked or listened to."""
    bridge = app.state.bridge
    wait_for(lambda: engine.load()["running"] == 0 and engine.load()["queued"] == 0 and not bridge.parked
             and bridge.metrics.in_flight == 0, what=f"an idle engine: {engine.load()} {bridge.parked}")


def anthropic_body(prompt="hi", max_tokens=6, stream=True):
    return {"model": "m", "max_tokens": max_tokens, "stream": stream, "messages": [{"role": "user", "content": prompt}]}


def clients(srv):
    return (anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0),
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0))


def test_queued_streams_open_at_once_and_hear_their_position(engine):
    app = create_app(engine)
    app.state.bridge.takeover_grace_s = 0.2
    with RunningServer(app) as srv:
        ac, oc = clients(srv)
        # warm-up: the SDKs build their event types on first use (a second on a loaded machine)
        list(ac.messages.create(model="m", max_tokens=1, stream=True, messages=[{"role": "user", "content": "w"}]))
        list(oc.chat.completions.create(model="m", max_tokens=1, stream=True, messages=[{"role": "user", "content": "w"}]))
        list(oc.responses.create(model="m", max_output_tokens=1, stream=True, input="w"))
        # each stream opens while the engine is still blocked, so it did not wait for it (no clock:
        # a loaded machine may take seconds; a stream that waited opens only after the 120 s block)
        with engine_held(engine) as still_held:
            a_stream = ac.messages.create(model="m", max_tokens=5, stream=True,
                                          messages=[{"role": "user", "content": "one"}])
            a_events = iter(a_stream)
            assert next(a_events).type == "message_start"
            assert still_held()
            o_stream = oc.chat.completions.create(model="m", max_tokens=5, stream=True,
                                                  messages=[{"role": "user", "content": "two"}])
            o_chunks = iter(o_stream)
            assert next(o_chunks).choices[0].delta.role == "assistant"
            assert still_held()
            r_stream = oc.responses.create(model="m", max_output_tokens=5, stream=True, input="three")
            r_events = iter(r_stream)
            assert next(r_events).type == "response.created"
            assert still_held()
            # the fourth in line reads its queue position from the ping's mlx_dspark field
            with httpx.stream("POST", srv.url + "/v1/messages", json=anthropic_body("four"), timeout=30) as raw:
                seen = ""
                for line in raw.iter_lines():
                    seen += line + "\n"
                    if line.startswith("data:") and '"ping"' in line:
                        break
                pings = [json.loads(d) for e, d in sse_events(seen) if e == "ping"]
                assert pings[0]["mlx_dspark"] == {"phase": "queued", "queue_position": 4}
            assert app.state.bridge.load()["queued"] >= 3
        # released: every stream runs to its end, in its own grammar
        kinds = [e.type for e in a_events]
        assert kinds[-2:] == ["message_delta", "message_stop"]
        chunks = list(o_chunks)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert [e.type for e in r_events][-1] in ("response.incomplete", "response.completed")
        settle(app, engine)


def test_prefill_pings_carry_progress(engine):
    app = create_app(engine)
    with RunningServer(app) as srv:
        r = httpx.post(srv.url + "/v1/messages", json=anthropic_body(long_prompt("pings"), max_tokens=2), timeout=120)
        events = check_anthropic_stream(r.text)
        progress = [e["mlx_dspark"] for e in events if e["type"] == "ping" and "mlx_dspark" in e]
        progress = [p for p in progress if p["phase"] != "queued"]  # maybe one, before the engine took it
        assert len(progress) > 10 and all(p["phase"] == "prefill" for p in progress)
        done = [p["prefilled_tokens"] for p in progress]
        assert done == sorted(done) and progress[-1]["prefilled_tokens"] < progress[-1]["prompt_tokens"]
        # OpenAI routes: an SSE comment the SDK skips
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": long_prompt("pings-openai")}]})
        assert ': mlx_dspark {"phase":"prefill"' in r.text
        settle(app, engine)


def test_queue_bound_answers_each_api_in_its_own_shape(engine):
    app = create_app(engine, max_queue=1)
    app.state.bridge.takeover_grace_s = 0.2
    with RunningServer(app) as srv:
        ac, oc = clients(srv)
        with engine_held(engine):
            with httpx.stream("POST", srv.url + "/v1/messages", json=anthropic_body("queued"), timeout=30) as first:
                lines = first.iter_lines()  # kept: a dropped line iterator closes the connection
                next(lines)
                wait_for(lambda: engine.load()["queued"] == 1, what="one queued request")
                with pytest.raises(openai.RateLimitError) as e:
                    oc.chat.completions.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "x"}])
                assert e.value.status_code == 429 and e.value.response.headers["retry-after"].isdigit()
                assert e.value.response.json()["error"]["type"] == "rate_limit_error"
                with pytest.raises(openai.RateLimitError):
                    oc.responses.create(model="m", input="x", stream=True)
                with pytest.raises(anthropic.OverloadedError) as e:
                    ac.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "x"}])
                assert e.value.status_code == 529 and int(e.value.response.headers["retry-after"]) >= 1
                assert e.value.response.json() == {"type": "error", "error": {
                    "type": "overloaded_error", "message": e.value.response.json()["error"]["message"]}}
                health = httpx.get(srv.url + "/health").json()["load"]
                assert health["queued"] == 1 and health["max_queue"] == 1
                assert health["sequences"][0]["phase"] == "queued"
                metrics = httpx.get(srv.url + "/metrics").text
                assert "mlx_dspark_queue_depth 1" in metrics and 'mlx_dspark_sequences{phase="queued"} 1' in metrics
        settle(app, engine)
        # free again: accepted
        assert ac.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}]).content


def test_retry_of_a_queued_request_takes_it_over(engine):
    app = create_app(engine)
    bridge = app.state.bridge
    bridge.takeover_grace_s = 60  # the test decides when the retry comes
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "retry me"}]}
    with RunningServer(app) as srv:
        _, oc = clients(srv)
        expected = oc.chat.completions.create(**body).choices[0].message.content
        result = {}
        with engine_held(engine):
            with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting (non-streaming: no bytes)
                httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
            wait_for(lambda: len(bridge.parked) == 1, what="the abandoned job parked")
            retry = threading.Thread(target=lambda: result.update(
                r=oc.chat.completions.create(**body)), daemon=True)
            retry.start()
            wait_for(lambda: not bridge.parked, what="the retry taking the parked job")
            assert engine.load()["queued"] == 1  # one job for both: no second copy queued
        retry.join(60)
        assert result["r"].choices[0].message.content == expected
        settle(app, engine)


def test_retry_takes_over_a_prefilling_job_with_its_progress(engine):
    app = create_app(engine)
    bridge = app.state.bridge
    bridge.takeover_grace_s = 60
    body = anthropic_body(long_prompt("retry"), max_tokens=3)
    with RunningServer(app) as srv:
        with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=60):
            wait_for(lambda: any(s["phase"] == "prefill" and s["prefilled_tokens"] > 16
                                 for s in engine.load()["sequences"]), what="prefill under way")
            held = engine_held(engine)
            held.__enter__()  # the job stops between two prefill chunks; then its client hangs up
        try:
            wait_for(lambda: len(bridge.parked) == 1, what="the abandoned job parked")
            progress = engine.load()["sequences"][0]["prefilled_tokens"]
            result = {}
            retry = threading.Thread(target=lambda: result.update(r=httpx.post(
                srv.url + "/v1/messages", json=body, timeout=120)), daemon=True)
            retry.start()
            wait_for(lambda: not bridge.parked, what="the retry taking the prefilling job")
            load = engine.load()
            assert load["running"] == 1 and load["queued"] == 0
            assert load["sequences"][0]["prefilled_tokens"] == progress > 16
        finally:
            held.__exit__(None, None, None)
        retry.join(120)
        check_anthropic_stream(result["r"].text)
        assert bridge.metrics.finishes["cancelled"] == 0
        settle(app, engine)


def test_same_request_from_two_live_clients_runs_twice(engine):
    """Two sub-agents may send the same body: with both listening there is nothing to take over."""
    app = create_app(engine)
    body = anthropic_body("twins", max_tokens=4, stream=False)
    with RunningServer(app) as srv:
        ac, _ = clients(srv)
        out = []
        with engine_held(engine):
            twins = [threading.Thread(target=lambda: out.append(ac.messages.create(**body)), daemon=True)
                     for _ in range(2)]
            for t in twins:
                t.start()
            wait_for(lambda: engine.load()["queued"] == 2, what="two queued copies")
        for t in twins:
            t.join(60)
        assert len(out) == 2 and out[0].content == out[1].content
        settle(app, engine)


@pytest.mark.parametrize("phase", ["queued", "prefill", "decode"])
def test_client_gone_at_every_phase_frees_the_engine(engine, phase):
    app = create_app(engine)
    bridge = app.state.bridge
    bridge.takeover_grace_s = 0.2
    before = dict(bridge.metrics.finishes)
    prompt = long_prompt(phase) if phase == "prefill" else phase
    body = anthropic_body(prompt, max_tokens=3000)
    with RunningServer(app) as srv:
        if phase == "queued":
            with engine_held(engine):
                with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=60) as r:
                    lines = r.iter_lines()
                    next(lines)
                wait_for(lambda: bridge.metrics.in_flight == 0, what="the gone client noticed")
        elif phase == "prefill":
            with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=60) as r:
                lines = r.iter_lines()
                next(lines)
                wait_for(lambda: any(s["phase"] == "prefill" and s["prefilled_tokens"] > 0
                                     for s in engine.load()["sequences"]), what="prefill under way")
        else:
            with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if "text_delta" in line:
                        break
                held = engine_held(engine)
                held.__enter__()  # stopped between two decode rounds; then the client hangs up
            held.__exit__(None, None, None)
            wait_for(lambda: bridge.metrics.finishes["cancelled"] == before.get("cancelled", 0) + 1,
                     what="the decoding job cancelled")
        settle(app, engine)
        ac, _ = clients(srv)
        assert ac.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "next"}]).content
