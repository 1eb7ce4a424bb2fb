"""Malformed and hostile requests: each gets the right status and the API's own error body,
and the server goes on serving normal requests."""

from __future__ import annotations

import httpx
import pytest

from agent_bridge.app import create_app
from server_harness import RunningServer

A, O = "anthropic", "openai"
MSG = [{"role": "user", "content": "hi"}]
LONG = "def rename_symbol(path, old, new):\n    return path.replace(old, new)\n" * 60  # > 256 tokens


def am(**kw):  # an Anthropic body with overrides
    return {"model": "m", "max_tokens": 8, "messages": MSG, **kw}


def oc(**kw):  # an OpenAI chat body with overrides
    return {"model": "m", "messages": MSG, "max_tokens": 8, **kw}


# (name, method, path, request kwargs, status, format, error type, words in the message)
CASES = [
    ("bad json anthropic", "POST", "/v1/messages", {"content": b'{"model": '}, 400, A, "invalid_request_error", "not valid JSON"),
    ("bad json openai", "POST", "/v1/chat/completions", {"content": b"{,}"}, 400, O, "invalid_request_error", "not valid JSON"),
    ("json array body", "POST", "/v1/messages", {"json": [1, 2]}, 400, A, "invalid_request_error", "JSON object"),
    ("empty body", "POST", "/v1/chat/completions", {"content": b""}, 400, O, "invalid_request_error", "empty"),
    ("invalid utf-8", "POST", "/v1/messages", {"content": b'{"model": "\xff\xfe"}'}, 400, A, "invalid_request_error", "JSON"),
    ("nested 100k deep", "POST", "/v1/chat/completions", {"content": b"[" * 100000 + b"]" * 100000}, 400, O,
     "invalid_request_error", ""),
    ("messages missing", "POST", "/v1/messages", {"json": {"model": "m", "max_tokens": 5}}, 400, A, "invalid_request_error", "messages"),
    ("messages empty anthropic", "POST", "/v1/messages", {"json": am(messages=[])}, 400, A, "invalid_request_error", "at least one"),
    ("messages empty openai", "POST", "/v1/chat/completions", {"json": oc(messages=[])}, 400, O, "invalid_request_error", "at least one"),
    ("messages a string", "POST", "/v1/messages", {"json": am(messages="hi")}, 400, A, "invalid_request_error", "expected an array"),
    ("messages of strings", "POST", "/v1/chat/completions", {"json": oc(messages=["hi"])}, 400, O, "invalid_request_error", "expected an object"),
    ("unknown role anthropic", "POST", "/v1/messages", {"json": am(messages=[{"role": "robot", "content": "x"}])}, 400, A,
     "invalid_request_error", "role"),
    ("unknown role openai", "POST", "/v1/chat/completions", {"json": oc(messages=[{"role": "wizard", "content": "x"}])}, 400, O,
     "invalid_request_error", "role"),
    ("max_tokens missing", "POST", "/v1/messages", {"json": {"model": "m", "messages": MSG}}, 400, A, "invalid_request_error", "max_tokens"),
    ("max_tokens a string", "POST", "/v1/messages", {"json": am(max_tokens="10")}, 400, A, "invalid_request_error", "max_tokens"),
    ("max_tokens negative", "POST", "/v1/chat/completions", {"json": oc(max_tokens=-5)}, 400, O, "invalid_request_error", "max_tokens"),
    ("max_tokens huge", "POST", "/v1/messages", {"json": am(max_tokens=10**20)}, 400, A, "invalid_request_error", "max_tokens"),
    ("max_tokens boolean", "POST", "/v1/chat/completions", {"json": oc(max_tokens=True)}, 400, O, "invalid_request_error", "max_tokens"),
    ("max_tokens float", "POST", "/v1/messages", {"json": am(max_tokens=1.5)}, 400, A, "invalid_request_error", "max_tokens"),
    ("temperature a word", "POST", "/v1/chat/completions", {"json": oc(temperature="hot")}, 400, O, "invalid_request_error", "temperature"),
    ("temperature out of range", "POST", "/v1/messages", {"json": am(temperature=7)}, 400, A, "invalid_request_error", "temperature"),
    ("stop not strings", "POST", "/v1/messages", {"json": am(stop_sequences=[1, 2])}, 400, A, "invalid_request_error", "stop_sequences"),
    ("stream not boolean", "POST", "/v1/chat/completions", {"json": oc(stream="yes")}, 400, O, "invalid_request_error", "stream"),
    ("content a number", "POST", "/v1/messages", {"json": am(messages=[{"role": "user", "content": 42}])}, 400, A,
     "invalid_request_error", "content"),
    ("system a number", "POST", "/v1/messages", {"json": am(system=7)}, 400, A, "invalid_request_error", "system"),
    ("tools not a list", "POST", "/v1/messages", {"json": am(tools={"name": "x"})}, 400, A, "invalid_request_error", "tools"),
    ("openai tool without function", "POST", "/v1/chat/completions", {"json": oc(tools=[{"type": "function"}])}, 400, O,
     "invalid_request_error", "tools[0]"),
    ("tool_use without name", "POST", "/v1/messages", {"json": am(messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]},
        {"role": "user", "content": "b"}])}, 400, A, "invalid_request_error", "tool_use"),
    ("tool arguments not json", "POST", "/v1/chat/completions", {"json": oc(messages=[
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                              "function": {"name": "f", "arguments": "{oops"}}]},
        {"role": "user", "content": "b"}])}, 400, O, "invalid_request_error", "not valid JSON"),
    ("tool_choice invalid", "POST", "/v1/chat/completions", {"json": oc(tool_choice="sometimes")}, 400, O,
     "invalid_request_error", "tool_choice"),
    ("thinking type invalid", "POST", "/v1/messages", {"json": am(thinking={"type": "maybe"})}, 400, A,
     "invalid_request_error", "thinking"),
    ("n > 1", "POST", "/v1/chat/completions", {"json": oc(n=3)}, 400, O, "invalid_request_error", "n=1"),
    ("prompt too long anthropic", "POST", "/v1/messages?beta=true", {"json": am(messages=[{"role": "user", "content": LONG}])},
     400, A, "invalid_request_error", "prompt is too long:"),
    ("prompt too long streaming", "POST", "/v1/messages", {"json": am(stream=True, messages=[{"role": "user", "content": LONG}])},
     400, A, "invalid_request_error", "tokens > 256 maximum"),
    ("prompt too long openai", "POST", "/v1/chat/completions", {"json": oc(messages=[{"role": "user", "content": LONG}])},
     400, O, "invalid_request_error", "context_length_exceeded"),
    ("token ids outside vocab", "POST", "/v1/completions", {"json": {"prompt": [1, 2, 10**9], "max_tokens": 2}}, 400, O,
     "invalid_request_error", "vocabulary"),
    ("batched prompts", "POST", "/v1/completions", {"json": {"prompt": ["a", "b"], "max_tokens": 2}}, 400, O,
     "invalid_request_error", "prompt"),
    ("responses previous_response_id", "POST", "/v1/responses", {"json": {"input": "hi", "previous_response_id": "r"}}, 400, O,
     "invalid_request_error", "previous_response_id"),
    ("responses unknown item", "POST", "/v1/responses", {"json": {"input": [{"type": "teleport"}]}}, 400, O,
     "invalid_request_error", "teleport"),
    ("corpus text not string", "POST", "/v1/corpus", {"json": {"text": 5}}, 400, O, "invalid_request_error", "text"),
    ("oversized body", "POST", "/v1/messages", {"content": b'{"x": "' + b"a" * 1_200_000 + b'"}'}, 413, A,
     "request_too_large", "limit"),
    ("unknown route", "POST", "/v1/engines/davinci", {"json": {}}, 404, O, "not_found_error", "no route"),
    ("wrong method", "GET", "/v1/messages", {}, 405, A, "invalid_request_error", "not allowed"),
    ("cross-origin web page", "POST", "/v1/chat/completions", {"json": oc(), "headers": {"Origin": "https://evil.example"}},
     403, O, "permission_error", "cross-origin"),
    ("cross-origin corpus", "POST", "/v1/corpus", {"json": {"text": "x"}, "headers": {"Origin": "http://evil.example:8080"}},
     403, O, "permission_error", "cross-origin"),
    ("unknown model id", "GET", "/v1/models/gpt-17", {}, 404, O, "not_found_error", "gpt-17"),
]


@pytest.fixture(scope="module")
def server(tiny_engine):
    with RunningServer(create_app(tiny_engine, context_window=256, max_body_bytes=1_000_000)) as srv:
        yield srv


def check_body(body: dict, fmt: str, kind: str, words: str, status: int) -> None:
    if fmt == A:
        assert body["type"] == "error" and body["error"]["type"] == kind
        message = body["error"]["message"]
    else:
        err = body["error"]
        assert err["type"] == kind
        message = err["message"] + " " + str(err.get("code"))
    assert isinstance(message, str) and words in message, message
    assert "Traceback" not in message


def test_hostile_requests(server):
    assert len(CASES) >= 25
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for name, method, path, kwargs, status, fmt, kind, words in CASES:
            r = client.request(method, path, **kwargs)
            assert r.status_code == status, (name, r.status_code, r.text[:300])
            assert r.headers["content-type"].startswith("application/json"), name
            check_body(r.json(), fmt, kind, words, status)
        # still serving normally
        ok = client.post("/v1/messages", json=am(max_tokens=4))
        assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 4
        ok = client.post("/v1/chat/completions", json=oc(max_tokens=4), headers={"Origin": "http://localhost:3000"})
        assert ok.status_code == 200
        ok = client.post("/v1/chat/completions", json=oc(max_tokens=4, stream=True))
        assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")


def test_prompt_too_long_wording(server):
    r = httpx.post(server.url + "/v1/messages", json=am(messages=[{"role": "user", "content": LONG}]))
    msg = r.json()["error"]["message"]
    n = int(msg.split(": ")[1].split(" tokens")[0])
    assert msg == f"prompt is too long: {n} tokens > 256 maximum" and n > 256
    r = httpx.post(server.url + "/v1/chat/completions", json=oc(messages=[{"role": "user", "content": LONG}]))
    assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == "messages"


def test_bad_auth(tiny_engine):
    with RunningServer(create_app(tiny_engine, api_key="k1")) as srv, httpx.Client(base_url=srv.url) as client:
        cases = [("/v1/messages", {}, A), ("/v1/messages", {"x-api-key": "nope"}, A),
                 ("/v1/chat/completions", {"Authorization": "Bearer nope"}, O),
                 ("/v1/responses", {"Authorization": "Basic azE="}, O), ("/v1/corpus", {}, O)]
        for path, headers, fmt in cases:
            r = client.post(path, headers=headers, json={})
            assert r.status_code == 401, (path, headers)
            check_body(r.json(), fmt, "authentication_error", "API key", 401)
        r = client.post("/v1/messages", headers={"x-api-key": "k1"}, json=am(max_tokens=2))
        assert r.status_code == 200
        r = client.post("/v1/chat/completions", headers={"Authorization": "Bearer k1"}, content=b"{bad")
        assert r.status_code == 400  # authorised, then judged on its body
