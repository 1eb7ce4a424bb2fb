"""Strict tools and free reasoning: the reply grammar of agent_bridge/chat/reply_grammar.py.

On the bundled model (hermes `<tool_call>` syntax, its markers special tokens), over sockets
with the real `openai` and `anthropic` clients: tool calls of tools the client marks strict,
and of every tool with the server's --strict-tools, validate against their schemas (integers,
enums, required keys, nested objects: the bundled model copies the schema text instead when
free, scripts/bench_strict_tools.py counts it); greedy with drafts equals constrained without;
strict off leaves replies as they were; a schema that can't compile is a 400. With a template
that opens `<think>`, the reasoning stays free and only the answer after it is constrained.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import mlx.core as mx
import numpy as np
import openai
import pytest

from agent_bridge.app import create_app
from engine import REFERENCE_MODEL_DIR, Engine, GenerationRequest
from server_harness import RunningServer

S = {"type": "string", "maxLength": 16}
SCHEMAS = {
    "read_file": {"type": "object", "properties": {"path": S, "offset": {"type": "integer", "minimum": 0},
                                                   "limit": {"type": "integer", "minimum": 1, "maximum": 500}},
                  "required": ["path", "offset", "limit"], "additionalProperties": False},
    "write_file": {"type": "object", "properties": {"path": S, "content": S,
                                                    "mode": {"enum": ["create", "overwrite", "append"]}},
                   "required": ["path", "content", "mode"], "additionalProperties": False},
    "create_issue": {"type": "object", "properties": {
        "title": S, "priority": {"enum": ["low", "medium", "high"]},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "name": S},
                  "required": ["id", "name"], "additionalProperties": False}},
        "required": ["title", "priority", "owner"], "additionalProperties": False},
}
PROMPTS = ["Read the file config.py.", "Write x = 1 to the file a.py.", "Use a tool."]
MAX_TOKENS = 80


def openai_tools(strict: bool | None) -> list[dict]:
    flag = {} if strict is None else {"strict": strict}
    return [{"type": "function", "function": {"name": n, "description": n.replace("_", " "), "parameters": s, **flag}}
            for n, s in SCHEMAS.items()]


def valid_calls(calls) -> int:
    n = 0
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        n += 1
    return n


@pytest.fixture(scope="module")
def engine():
    eng = Engine(None, max_batch=1, prefix_cache=False)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine):
    with RunningServer(create_app(engine)) as srv:  # --no-strict-tools: only tools marked strict
        yield srv


def oai(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def chat(client, prompt, tools, choice, mode=None, **kw):
    extra = {"mlx_dspark": {"mode": mode}} if mode else None
    return client.chat.completions.create(model="local", messages=[{"role": "user", "content": prompt}], tools=tools,
                                          tool_choice=choice, max_tokens=MAX_TOKENS, extra_body=extra, **kw)


def choices() -> list:
    return ["required", *({"type": "function", "function": {"name": n}} for n in SCHEMAS)]


def test_strict_tools_calls_validate_and_drafts_change_nothing(server):
    client, checked = oai(server), 0
    for prompt in PROMPTS:
        for choice in choices():
            plain = chat(client, prompt, openai_tools(True), choice, mode="baseline")
            calls = plain.choices[0].message.tool_calls
            assert calls and plain.choices[0].finish_reason == "tool_calls", plain.choices[0].message
            checked += valid_calls(calls)
            for mode in ("lookup", "dspark"):  # the verify pass masks every position: greedy output unchanged
                drafted = chat(client, prompt, openai_tools(True), choice, mode=mode)
                assert [(c.function.name, c.function.arguments) for c in drafted.choices[0].message.tool_calls] == \
                    [(c.function.name, c.function.arguments) for c in calls], (mode, prompt, choice)
    assert checked >= len(PROMPTS) * len(choices())
    stream = chat(client, PROMPTS[1], openai_tools(True), "required", stream=True)
    pieces = [d.function.arguments or "" for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]
    whole = chat(client, PROMPTS[1], openai_tools(True), "required").choices[0].message.tool_calls
    assert "".join(pieces) == "".join(c.function.arguments for c in whole)  # streamed, the same valid calls


def test_strict_off_leaves_replies_as_they_were(server, engine):
    """Without strict the server adds no grammar: the reply is the engine's unconstrained one,
    text and all (the bundled model writes the schema out as text here, no call)."""
    client = oai(server)
    for strict in (None, False):
        for prompt in PROMPTS[:2]:
            r = chat(client, prompt, openai_tools(strict), "auto")
            ids = engine.render_chat([{"role": "user", "content": prompt}], openai_tools(strict))
            done = list(engine.generate(GenerationRequest(ids, max_tokens=MAX_TOKENS, mode="baseline")))[-1]
            assert r.choices[0].message.content == done.text and not r.choices[0].message.tool_calls


def test_server_flag_keeps_every_tool_strict(engine):
    with RunningServer(create_app(engine, strict_tools=None)) as srv:  # the serve default: on for hermes
        client = oai(srv)
        for prompt in PROMPTS[:2]:
            for choice in choices()[:2]:
                r = chat(client, prompt, openai_tools(None), choice)
                assert valid_calls(r.choices[0].message.tool_calls) >= 1
        claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
        m = claude.messages.create(model="local", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPTS[1]}],
                                   tools=[{"name": n, "input_schema": s} for n, s in SCHEMAS.items()],
                                   tool_choice={"type": "any"})
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses and m.stop_reason == "tool_use"
        for b in uses:
            jsonschema.validate(b.input, SCHEMAS[b.name])


def test_anthropic_strict_tool(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [{"name": n, "input_schema": s, "strict": True} for n, s in SCHEMAS.items()]
    for choice in ({"type": "any"}, {"type": "tool", "name": "create_issue"}):
        m = claude.messages.create(model="local", max_tokens=MAX_TOKENS, tools=tools, tool_choice=choice,
                                   messages=[{"role": "user", "content": "File an issue about the crash."}])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses and m.stop_reason == "tool_use", m.content
        for b in uses:
            jsonschema.validate(b.input, SCHEMAS[b.name])


def test_a_tool_schema_that_cannot_compile_is_a_400(server):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}, "strict": True}}]
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai(server), "x", bad, "auto")
    assert err.value.status_code == 400 and err.value.code == "invalid_json_schema" and "can't be compiled" in str(err.value)
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="local", max_tokens=8, messages=[{"role": "user", "content": "x"}],
                               tools=[{"name": "f", "input_schema": {"type": "object", "properties": {
                                   "a": {"type": "string", "pattern": "(?<=a)b"}}}, "strict": True}])
    assert err.value.status_code == 400 and err.value.body["error"]["type"] == "invalid_request_error"
    assert "can't be compiled" in err.value.body["error"]["message"]


# -- reasoning first ---------------------------------------------------------------------

THINKING = "I plan: a user called Ada, 36 years old."


@pytest.fixture(scope="module")
def thinking_engine(tmp_path_factory):
    """The bundled model under a template whose generation prompt opens `<think>` (as Qwen3's
    thinking models do); it writes THINKING and `</think>`, then its own logits go on (the
    bundled model was never taught to close a reasoning block)."""
    folder = tmp_path_factory.mktemp("thinking_model")
    for f in REFERENCE_MODEL_DIR.iterdir():
        if f.name != "tokenizer_config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((REFERENCE_MODEL_DIR / "tokenizer_config.json").read_text())
    opening = "{{- '<|im_start|>assistant\\n' }}\n{%- endif %}"
    assert config["chat_template"].endswith(opening) or opening in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(opening, "{{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    eng = Engine(str(folder), max_batch=1, prefix_cache=False)
    reason_first(eng, eng.encode(THINKING) + [eng.tokenizer.convert_tokens_to_ids("</think>")])
    yield eng
    eng.close()


def reason_first(engine, reasoning: list[int]) -> None:
    """After a prompt that ends with `<think>\\n`, the model writes `reasoning`, then goes on as itself."""
    opened = engine.encode("<think>\n")
    model = engine.target.model
    base = type(model)
    seen: list[int] = []

    class ReasonsFirst(base):
        def __call__(self, inputs, cache=None, **kw):
            offset = cache[0].offset if cache else 0
            logits = base.__call__(self, inputs, cache=cache, **kw)
            del seen[offset:]
            seen.extend(np.array(inputs).reshape(-1).tolist())
            start = max((i + len(opened) for i in range(len(seen) - len(opened) + 1)
                         if seen[i : i + len(opened)] == opened), default=None)
            rows, out = logits.shape[1], np.array(logits.astype(mx.float32))
            for r in range(rows):
                k = len(seen) - rows + r + 1 - start if start is not None else -1  # reply tokens before this pick
                if 0 <= k < len(reasoning):
                    out[0, r] = -1e4
                    out[0, r, reasoning[k]] = 0.0
            return mx.array(out)

    model.__class__ = ReasonsFirst


def test_reasoning_stays_free_before_the_schema(thinking_engine):
    schema = {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    with RunningServer(create_app(thinking_engine)) as srv:
        for mode in ("baseline", "lookup"):
            r = oai(srv).chat.completions.create(
                model="local", messages=[{"role": "user", "content": "Describe a user as JSON."}], max_tokens=MAX_TOKENS,
                response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": schema}},
                extra_body={"mlx_dspark": {"mode": mode}})
            message = r.choices[0].message
            assert message.model_extra["reasoning_content"].strip() == THINKING
            jsonschema.validate(json.loads(message.content), schema)
            assert r.choices[0].finish_reason == "stop"
        tools = openai_tools(True)
        r = oai(srv).chat.completions.create(model="local", messages=[{"role": "user", "content": PROMPTS[0]}],
                                             tools=tools, max_tokens=MAX_TOKENS)
        message = r.choices[0].message
        assert message.model_extra["reasoning_content"].strip() == THINKING
        valid_calls(message.tool_calls or [])  # whatever calls follow the reasoning validate


# -- markers that are text, not special tokens (Qwen's `<tool_call>` is an ordinary added token) ----

def byte_tokens(tokenizer, text: str) -> list[int]:
    """`text` one byte per token: markers as plain text, never the special token."""
    return [t for b in text.encode() for t in tokenizer.tokenize_bytes(bytes([b]))]


def accepts(engine, constraint, text: str) -> bool:
    from llguidance import LLMatcher

    matcher = LLMatcher(engine.grammars.tokenizer, constraint.grammar, log_level=0)
    return all(matcher.consume_token(t) for t in byte_tokens(engine.grammars.tokenizer, text)) \
        and matcher.is_accepting()


def test_markers_spelled_as_text(engine):
    """The same grammar where `<think>` and `<tool_call>` are text: reasoning the model may open,
    free text up to each call, the call typed by its schema, free text after."""
    from agent_bridge.chat.chat_request import ChatRequest
    from agent_bridge.chat.reply_grammar import reply_constraint
    from agent_bridge.chat.tool_stream import Syntax

    req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=openai_tools(True))
    req.may_think = True
    constraint = reply_constraint(req, Syntax(), json.dumps, None)
    call = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "offset": 0, "limit": 9}}\n</tool_call>'
    for good in ("just text, no call <tool_ca", call, "<think>a <tool_call> is next</think>Sure. " + call + "\nDone.",
                 "Two: " + call + "\n" + call):
        assert accepts(engine, constraint, good), good
    for bad in (call.replace('"offset": 0', '"offset": "0"'), call.replace("read_file", "delete_file"),
                call.replace(', "limit": 9', ""), call.replace("}}\n</tool_call>", "}}</tool_call>")):
        assert not accepts(engine, constraint, bad), bad
    req.response_format = {"type": "json_schema", "schema": SCHEMAS["read_file"], "name": "r"}
    req.tools, req.parse_tools = None, False
    constraint = reply_constraint(req, Syntax(), json.dumps, None)
    assert accepts(engine, constraint, '<think>hmm</think>\n{"path": "a", "offset": 1, "limit": 2}')
    assert accepts(engine, constraint, '{"path": "a", "offset": 1, "limit": 2}')
    assert not accepts(engine, constraint, 'hmm {"path": "a", "offset": 1, "limit": 2}')


def test_serve_flag():
    from agent_bridge.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).strict_tools is None  # on for the syntaxes the grammar spells
    assert parse(["serve", "--strict-tools"]).strict_tools is True
    assert parse(["serve", "--no-strict-tools"]).strict_tools is False
