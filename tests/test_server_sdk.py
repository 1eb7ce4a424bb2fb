"""The OpenAI and Anthropic Python SDKs against a real server socket, streaming and not,
with and without tools.

Tool calls: a tiny model is trained (seconds, tests/forced_model.py) so that its greedy
reply to an exact chat, tools included, is a Hermes `<tool_call>` - the real engine and
tokenizer produce it, nothing is scripted after the model.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from agent_bridge.app import create_app
from server_harness import RunningServer, check_anthropic_stream, engine_held

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                   "parameters": PARAMS}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": PARAMS}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
                    "parameters": PARAMS}]
ASK_TOOL = "Weather in Paris?"
ASK_TEXT = "Say hello."
ASK_THINK = "Think first."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def forced_engine(tmp_path_factory):
    import forced_model
    from engine import Engine
    from engine.base.chat import render_chat

    def render_with_tools(tok, messages):  # the server renders the offered tools into the prompt
        tools = OPENAI_TOOLS if messages[-1]["content"] == ASK_TOOL else None
        return render_chat(tok, messages, tools=tools)

    chats = [([{"role": "user", "content": ASK_TOOL}], CALL),
             ([{"role": "user", "content": ASK_TEXT}], "Hello there!"),
             ([{"role": "user", "content": ASK_THINK}], "<think>ok</think>Done.")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forced_model, "render_chat", render_with_tools)
        model_dir = forced_model.train_forced_model(tmp_path_factory.mktemp("forced-tools"), chats, seed=5,
                                                    max_steps=600)
    engine = Engine(str(model_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(forced_engine):
    with RunningServer(create_app(forced_engine)) as srv:
        yield srv


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_openai_chat_text(oai):
    r = oai.chat.completions.create(model="local", messages=[{"role": "user", "content": ASK_TEXT}], max_tokens=20)
    assert r.choices[0].message.content == "Hello there!" and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.model_extra["mlx_dspark"]["generated_tokens"] == r.usage.completion_tokens
    chunks = list(oai.chat.completions.create(model="local", messages=[{"role": "user", "content": ASK_TEXT}],
                                              max_tokens=20, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there!"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert len({c.id for c in chunks}) == 1


def test_openai_chat_tool_call(oai):
    msgs = [{"role": "user", "content": ASK_TOOL}]
    r = oai.chat.completions.create(model="local", messages=msgs, tools=OPENAI_TOOLS, max_tokens=40)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    stream = oai.chat.completions.create(model="local", messages=msgs, tools=OPENAI_TOOLS, max_tokens=40, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]  # the name first, then argument pieces
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert all(c.index == 0 and c.id is None for c in calls[1:]) and len(calls) > 2
    assert json.loads("".join(c.function.arguments for c in calls)) == {"city": "Paris"}
    assert deltas[-1].finish_reason == "tool_calls"
    assert "".join(d.delta.content or "" for d in deltas) == ""
    # the same text without tools offered is just text
    r = oai.chat.completions.create(model="local", messages=msgs, max_tokens=40)
    assert r.choices[0].message.tool_calls is None


def test_openai_completions_and_models(oai, server, forced_engine):
    models = oai.models.list()
    assert [m.id for m in models.data] == [oai.models.retrieve(models.data[0].id).id]
    r = oai.completions.create(model="local", prompt="def add(", max_tokens=5)
    # the prompt is not one the model was trained on, and its training ran on this CPU's kernels:
    # where its EOS comes first the reply says so
    n, finish = r.usage.completion_tokens, r.choices[0].finish_reason
    assert (n, finish) == (5, "length") or (n < 5 and finish == "stop"), (n, finish)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(model="local", prompt="def add(",
                                                                          max_tokens=5, stream=True) if c.choices)
    assert streamed == r.choices[0].text  # greedy: the same text both ways


def test_anthropic_text_and_thinking(claude, server):
    m = claude.messages.create(model="local", max_tokens=20, messages=[{"role": "user", "content": ASK_TEXT}])
    assert m.content[0].type == "text" and m.content[0].text == "Hello there!" and m.stop_reason == "end_turn"
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0
    with claude.messages.stream(model="local", max_tokens=20,
                                messages=[{"role": "user", "content": ASK_TEXT}]) as s:
        final = s.get_final_message()
    assert final.content[0].text == "Hello there!" and final.id != m.id
    t = claude.messages.create(model="local", max_tokens=20, messages=[{"role": "user", "content": ASK_THINK}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in t.content] == [
        ("thinking", "ok"), ("text", "Done.")]
    raw = httpx.post(server.url + "/v1/messages", json={"model": "m", "max_tokens": 20, "stream": True,
                                                        "messages": [{"role": "user", "content": ASK_THINK}]}).text
    events = check_anthropic_stream(raw)
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"][0] == "thinking_delta"


def test_anthropic_tool_use(claude, server):
    msgs = [{"role": "user", "content": ASK_TOOL}]
    m = claude.messages.create(model="local", max_tokens=40, messages=msgs, tools=ANTHROPIC_TOOLS)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    with claude.messages.stream(model="local", max_tokens=40, messages=msgs, tools=ANTHROPIC_TOOLS) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris"}
    raw = httpx.post(server.url + "/v1/messages?beta=true",
                     headers={"anthropic-beta": "claude-code-20250219"},
                     json={"model": "m", "max_tokens": 40, "stream": True, "messages": msgs,
                           "tools": ANTHROPIC_TOOLS}).text
    events = check_anthropic_stream(raw)
    pieces = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert {d["type"] for d in pieces} == {"input_json_delta"} and len(pieces) > 2  # streamed as written
    assert json.loads("".join(d["partial_json"] for d in pieces)) == {"city": "Paris"}
    # the tool result goes back in and renders (the model's answer to it is random, but well-formed)
    follow = msgs + [{"role": "assistant", "content": m.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    again = claude.messages.create(model="local", max_tokens=5, messages=follow, tools=ANTHROPIC_TOOLS)
    assert again.usage.output_tokens >= 1
    count = claude.messages.count_tokens(model="local", messages=msgs, tools=ANTHROPIC_TOOLS)
    assert count.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def test_stop_sequences_and_concurrent_clients(claude, oai):
    m = claude.messages.create(model="local", max_tokens=20, messages=[{"role": "user", "content": ASK_TEXT}],
                               stop_sequences=["there"])
    assert m.content[0].text == "Hello " and m.stop_reason == "stop_sequence" and m.stop_sequence == "there"
    r = oai.chat.completions.create(model="local", messages=[{"role": "user", "content": ASK_TEXT}], stop="!")
    assert r.choices[0].message.content == "Hello there"
    # many clients at once: each is queued to the one engine thread and gets its own whole answer
    from concurrent.futures import ThreadPoolExecutor

    def ask(i):
        if i % 2:
            return claude.messages.create(model="m", max_tokens=20, messages=[{"role": "user", "content": ASK_TEXT}]
                                          ).content[0].text
        return oai.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK_TEXT}], stream=True,
                                           max_tokens=20)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(ask, range(6)))
    texts = [r if isinstance(r, str) else "".join(c.choices[0].delta.content or "" for c in r if c.choices)
             for r in results]
    assert texts == ["Hello there!"] * 6


def test_responses_api(oai):
    r = oai.responses.create(model="local", input=ASK_TEXT, max_output_tokens=20)
    assert r.output_text == "Hello there!" and r.status == "completed"
    r = oai.responses.create(model="local", input=[{"role": "user", "content": ASK_TOOL}],
                             tools=RESPONSES_TOOLS, max_output_tokens=40)
    (fc,) = [o for o in r.output if o.type == "function_call"]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
    events = list(oai.responses.create(model="local", input=[{"role": "user", "content": ASK_TOOL}],
                                       tools=RESPONSES_TOOLS, max_output_tokens=40, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output[0].type == "function_call" and done.usage.output_tokens > 0
    # the call's output goes back in as an item, as Codex sends it
    r = oai.responses.create(model="local", max_output_tokens=3, tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": ASK_TOOL},
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}])
    assert r.usage.output_tokens >= 1


def test_health_metrics_corpus(server, forced_engine):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    before = forced_engine.info()["corpus_docs"]
    r = httpx.post(server.url + "/v1/corpus", json={"text": "def f(x):\n    return x * 2\n", "path": "f.py"})
    assert r.status_code == 200 and r.json()["tokens"] > 1
    assert forced_engine.info()["corpus_docs"] == before + 1
    text = httpx.get(server.url + "/metrics").text
    assert 'mlx_dspark_requests_total{method="POST",route="/v1/corpus",status="200"} 1' in text
    for name in ("mlx_dspark_generated_tokens_total", "mlx_dspark_cached_tokens_total",
                 "mlx_dspark_time_to_first_token_seconds_bucket", "mlx_dspark_decode_tokens_per_second_count",
                 "mlx_dspark_draft_acceptance_ratio"):
        assert name in text


def test_api_key(forced_engine):
    with RunningServer(create_app(forced_engine, api_key="s3cret")) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/v1/messages", json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/metrics").status_code == 401
        ok = anthropic.Anthropic(base_url=srv.url, api_key="s3cret", max_retries=0).messages.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": ASK_TEXT}])
        assert ok.usage.output_tokens >= 1
        models = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0).models.list()
        assert len(models.data) == 1


def test_client_disconnect_cancels_generation(tiny_engine):
    """A client that hangs up mid-stream cancels its job: the engine ends it as "cancelled"
    instead of generating the ~4000 tokens it asked for, and serves the next request."""
    app = create_app(tiny_engine)
    metrics = app.state.bridge.metrics
    with RunningServer(app) as srv:
        body = {"model": "m", "max_tokens": 100000, "stream": True, "messages": [{"role": "user", "content": "go"}]}
        with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if "text_delta" in line:
                    break
            # held, the job can't end on its own before its client leaves, however fast the CPU
            # (the tiny model writes its 4,000 tokens in a second or two, or stops sooner)
            with engine_held(tiny_engine):
                r.close()
                deadline = time.monotonic() + 30
                while metrics.in_flight and time.monotonic() < deadline:  # the server noticed
                    time.sleep(0.05)
                assert metrics.in_flight == 0
        deadline = time.monotonic() + 60
        while not metrics.finishes["cancelled"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metrics.finishes["cancelled"] == 1 and metrics.in_flight == 0, dict(metrics.finishes)
        r = httpx.post(srv.url + "/v1/messages", timeout=60,
                       json={"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3
        assert 'mlx_dspark_generations_by_finish_total{finish="cancelled"} 1' in httpx.get(srv.url + "/metrics").text


def test_client_gone_while_queued_is_never_run(tiny_engine):
    """A request whose client hangs up while it waits behind another is dropped from the queue."""
    app = create_app(tiny_engine)
    metrics = app.state.bridge.metrics
    long = {"model": "m", "max_tokens": 100000, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    with RunningServer(app) as srv:
        with httpx.stream("POST", srv.url + "/v1/messages", json=long, timeout=60) as first:
            lines = first.iter_lines()
            while "text_delta" not in next(lines):
                pass
            with engine_held(tiny_engine):  # the first job can't end on its own meanwhile, however fast the CPU
                with pytest.raises(httpx.ReadTimeout):  # queued behind the first: no answer yet, give up
                    httpx.post(srv.url + "/v1/chat/completions", timeout=httpx.Timeout(60, read=1.0),
                               json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000,
                                     "stream": True})
                deadline = time.monotonic() + 30
                while metrics.in_flight > 1 and time.monotonic() < deadline:  # noticed while still queued
                    time.sleep(0.05)
                assert metrics.in_flight == 1, metrics.in_flight
        # the first's client has left too (its job cancelled, or ended on its own); a request queued
        # after them runs next; had the abandoned one run, it would have finished before this one
        r = httpx.post(srv.url + "/v1/messages", timeout=120,
                       json={"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        deadline = time.monotonic() + 10  # the first job's end is counted by its own reader thread
        while sum(metrics.finishes.values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metrics.in_flight == 0
        assert sum(metrics.finishes.values()) == 2 and metrics.finishes["length"] >= 1, dict(metrics.finishes)
