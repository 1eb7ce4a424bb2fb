"""Hostile requests against all three APIs (issue 13's suite): malformed and truncated JSON,
wrong types at every level, unknown content blocks, broken tool schemas, huge bodies and
headers, bad auth, cross-origin, prompts over the window, invalid UTF-8. Each must get a
4xx in the API's own error shape, and the server must keep serving. Real uvicorn server,
real sockets, a tiny random model."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from agent_bridge.app import create_app
from server_harness import RunningServer

WINDOW = 256
LONG = "def rename_symbol(path, old, new):\n    return path.replace(old, new)\n" * 60  # > WINDOW tokens
TOOL_OPENAI = {"type": "function", "function": {"name": "read", "description": "d",
                                                "parameters": {"type": "object", "properties": {"p": {"type": "string"}}}}}

APIS = {
    "openai": ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "temperature": 0.0,
                                         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                         "tools": [TOOL_OPENAI]}),
    "anthropic": ("/v1/messages", {"model": "m", "max_tokens": 4, "temperature": 0.0, "system": "be brief",
                                   "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                   "tools": [{"name": "read", "description": "d",
                                              "input_schema": {"type": "object", "properties": {"p": {"type": "string"}}}}]}),
    "responses": ("/v1/responses", {"model": "m", "max_output_tokens": 4, "temperature": 0.0, "instructions": "be brief",
                                    "input": [{"type": "message", "role": "user",
                                               "content": [{"type": "input_text", "text": "hi"}]}],
                                    "tools": [{"type": "function", "name": "read", "description": "d",
                                               "parameters": {"type": "object", "properties": {"p": {"type": "string"}}}}]}),
}
WRONG = [123, "text", [1], {"a": 1}, True, -1.5]


def wrong_for(value):
    """Values of another JSON type than `value` (bool and numbers count as different)."""
    def same(a, b):
        return type(a) is type(b) or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                       and not isinstance(a, bool) and not isinstance(b, bool))
    return [w for w in WRONG if not same(w, value)]


def set_at(body, path, value):
    out = copy.deepcopy(body)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def drop_at(body, path):
    out = copy.deepcopy(body)
    node = out
    for k in path[:-1]:
        node = node[k]
    del node[path[-1]]
    return out


# fields whose wrong types must be refused, per API (path into the valid body)
TYPED = {
    "openai": [("max_tokens",), ("temperature",), ("messages",), ("messages", 0), ("messages", 0, "role"),
               ("messages", 0, "content"), ("messages", 0, "content", 0), ("messages", 0, "content", 0, "text"),
               ("messages", 0, "content", 0, "type"), ("tools",), ("tools", 0), ("tools", 0, "function"),
               ("tools", 0, "function", "name"), ("tools", 0, "function", "parameters"), ("model",)],
    "anthropic": [("max_tokens",), ("temperature",), ("system",), ("messages",), ("messages", 0), ("messages", 0, "role"),
                  ("messages", 0, "content"), ("messages", 0, "content", 0), ("messages", 0, "content", 0, "text"),
                  ("messages", 0, "content", 0, "type"), ("tools",), ("tools", 0), ("tools", 0, "name"),
                  ("tools", 0, "input_schema"), ("model",)],
    "responses": [("max_output_tokens",), ("temperature",), ("instructions",), ("input", 0), ("input", 0, "role"),
                  ("input", 0, "content"), ("input", 0, "content", 0), ("input", 0, "content", 0, "text"),
                  ("input", 0, "content", 0, "type"), ("tools",), ("tools", 0), ("tools", 0, "name"),
                  ("tools", 0, "parameters"), ("model",)],
}
# fields that are accepted as either of two types, or where a string is the normal form
ALSO_OK = {("messages", 0, "content"): (str,), ("input",): (str,), ("system",): (list,), ("input", 0, "content"): (str,),
           ("messages", 0, "content", 0, "type"): (), ("input", 0, "content", 0, "type"): ()}


def cases():
    out = []
    for api, (path, good) in APIS.items():
        raw = json.dumps(good).encode()
        for cut in (1, len(raw) // 4, len(raw) // 2, 3 * len(raw) // 4, len(raw) - 1):
            out.append((api, f"truncated at {cut}", {"content": raw[:cut]}, 400))
        for name, content in [("empty", b""), ("spaces", b"   "), ("single quotes", b"{'model': 'm'}"),
                              ("array", b"[]"), ("string", b'"hi"'), ("number", b"42"), ("null", b"null"),
                              ("missing value", b'{"model":}'), ("trailing comma", b'{"model": "m",}'),
                              ("invalid utf-8 bytes", b'{"model": "\xc3\x28"}'), ("utf-16", json.dumps(good).encode("utf-16")),
                              ("lone surrogate", b'{"model": "\\ud800", "max_tokens": 4, "messages": 5}'),
                              ("NaN", raw.replace(b'"temperature": 0.0', b'"temperature": NaN')),
                              ("deep nesting", b"[" * 50000 + b"]" * 50000)]:
            out.append((api, name, {"content": content}, 400))
        for field in TYPED[api]:
            for w in wrong_for(_get(good, field)):
                if isinstance(w, ALSO_OK.get(field, ())) or (field[-1] == "type" and isinstance(w, str)):
                    continue
                out.append((api, f"{'.'.join(map(str, field))}={json.dumps(w)}", {"json": set_at(good, field, w)}, 400))
        for field in [("messages",) if api != "responses" else ("input",), ("max_tokens",) if api == "anthropic" else None]:
            if field:
                out.append((api, f"missing {field[0]}", {"json": drop_at(good, field)}, 400))
        block = ("messages", 0, "content", 0) if api != "responses" else ("input", 0, "content", 0)
        out.append((api, "unknown content block", {"json": set_at(good, block, {"type": "hologram", "data": "x"})}, 400))
        out.append((api, "prompt over the window", {"json": set_at(good, block[:-1], LONG)}, 400))
        out.append((api, "huge body", {"content": b'{"model": "' + b"a" * 1_100_000 + b'"}'}, 413))
        out.append((api, "huge header", {"json": good, "headers": {"x-junk": "a" * 200_000}}, 431))
        out.append((api, "many headers", {"json": good, "headers": {f"x-h{i}": "v" * 100 for i in range(2000)}}, 431))
        out.append((api, "cross-origin", {"json": good, "headers": {"Origin": "https://evil.example"}}, 403))
        out.append((api, "null origin", {"json": good, "headers": {"Origin": "null"}}, 403))
        out.append((api, "form content", {"content": b"a=1&b=2", "headers": {"content-type": "application/x-www-form-urlencoded"}}, 400))
    return out


def _get(body, path):
    for k in path:
        body = body[k]
    return body


CASES = cases()


@pytest.fixture(scope="module")
def server(tiny_engine):
    with RunningServer(create_app(tiny_engine, context_window=WINDOW, max_body_bytes=1_000_000)) as srv:
        yield srv


def check_shape(api: str, r: httpx.Response) -> None:
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    body = r.json()
    if api == "anthropic":
        assert body["type"] == "error" and isinstance(body["error"]["type"], str)
        message = body["error"]["message"]
    else:
        assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
        message = body["error"]["message"]
    assert isinstance(message, str) and message and "Traceback" not in message


def still_serving(client: httpx.Client) -> None:
    for api, (path, good) in APIS.items():
        r = client.post(path, json=good)
        assert r.status_code == 200, (api, r.text[:300])


def test_at_least_100_cases():
    assert len(CASES) >= 100
    assert {api for api, *_ in CASES} == set(APIS)


def test_hostile_requests(server):
    failures = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for api, name, kwargs, status in CASES:
            path = APIS[api][0]
            try:
                r = client.post(path, **kwargs)
            except httpx.HTTPError as e:
                failures.append((api, name, f"connection: {e}"))
                continue
            if r.status_code != status or not 400 <= r.status_code < 500:
                failures.append((api, name, r.status_code, r.text[:200]))
                continue
            try:
                check_shape(api, r)
            except (AssertionError, ValueError, KeyError) as e:
                failures.append((api, name, "shape", r.text[:200], str(e)))
        still_serving(client)
    assert not failures, "\n".join(map(str, failures))


def test_bad_auth_in_each_shape(tiny_engine):
    with RunningServer(create_app(tiny_engine, api_key="k1")) as srv, httpx.Client(base_url=srv.url) as client:
        for api, (path, good) in APIS.items():
            for headers in ({}, {"x-api-key": "nope"}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic azE="},
                            {"Authorization": "Bearer k1x"}, {"x-api-key": "K1"}):
                r = client.post(path, headers=headers, json=good)
                assert r.status_code == 401, (api, headers)
                check_shape(api, r)
        r = client.post("/v1/messages", headers={"x-api-key": "k1"}, json=APIS["anthropic"][1])
        assert r.status_code == 200
