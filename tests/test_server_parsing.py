"""Model text -> tool calls (scripted text, streamed in every split), and request translation."""

from __future__ import annotations

import pytest

from agent_bridge.apis import anthropic_api
from agent_bridge.apis import openai_api
from agent_bridge.apis import responses_api
from agent_bridge.chat.http_errors import ApiError
from agent_bridge.chat.tool_stream import Reply, Syntax, parse_reply

CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]


def streamed(text: str, step: int, **kw):
    p = Syntax().parser(TOOLS, **kw)
    reply = Reply()
    for i in range(0, len(text), step):
        for e in p.feed(text[i : i + step]):
            reply.add(e)
    for e in p.finish():
        reply.add(e)
    return [(b.kind, b.call.name if b.call else b.text, b.call.arguments if b.call else None) for b in reply.blocks]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_calls_in_any_split(step):
    text = "<think>look first</think>\nLet me read it.\n" + CALL + "\n" + CALL.replace("a.py", "b.py")
    assert streamed(text, step) == [
        ("reasoning", "look first", None),
        ("text", "Let me read it.", None),
        ("call", "read_file", {"path": "a.py"}),
        ("call", "read_file", {"path": "b.py"}),
    ]


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_malformed_calls_become_text(step):
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert streamed(no_name, step) == [("text", no_name, None)]
    unterminated = "ok <tool_call>{not json"
    assert streamed(unterminated, step) == [("text", unterminated, None)]


def test_call_without_end_marker_at_eos_and_text_only_when_tools():
    assert streamed(CALL.replace("</tool_call>", ""), 4)[0][:2] == ("call", "read_file")
    # no tools offered: the syntax is left as the model wrote it
    reply, _ = parse_reply(CALL, tools=None, parse_tools=False)
    assert [(b.kind, b.text) for b in reply.blocks] == [("text", CALL)]
    # a partial marker that never completes is released as text
    assert streamed("a <tool_ca", 1) == [("text", "a <tool_ca", None)]


def test_thinking_opened_by_the_template():
    assert streamed("still thinking</think>Answer", 2, thinking=True) == [
        ("reasoning", "still thinking", None), ("text", "Answer", None)]


def test_anthropic_translation_strips_billing_and_keeps_order():
    body = {
        "model": "m", "max_tokens": 10,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3.abc;"},
                   {"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "system", "content": "env"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "s"},
                                              {"type": "text", "text": "reading"},
                                              {"type": "tool_use", "id": "t1", "name": "Read", "input": {"p": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "file body"}]}, {"type": "text", "text": "go on"}]},
        ],
        "thinking": {"type": "adaptive"}, "context_management": {}, "output_config": {}, "metadata": {},
    }
    req = anthropic_api.parse_request(body, 100)
    other = dict(body, system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=9.9.9.zzz;"},
                               body["system"][1]])
    assert anthropic_api.parse_request(other, 100).messages == req.messages
    assert req.messages == [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "env"},
        {"role": "assistant", "content": "reading", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "Read", "arguments": {"p": 1}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "file body"},
        {"role": "user", "content": "go on"},
    ]
    assert req.template_kwargs == {"enable_thinking": True}
    # a final assistant message is a prefix the model continues
    cont = anthropic_api.parse_request(dict(body, messages=[{"role": "user", "content": "q"},
                                                            {"role": "assistant", "content": "The answer is"}]), 5)
    assert cont.assistant_prefix == "The answer is" and cont.messages[-1] == {"role": "user", "content": "q"}


def test_openai_and_responses_translation():
    msgs = openai_api.parse_chat({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "rules"}]},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]}, 16).messages
    assert msgs[0] == {"role": "system", "content": "rules"}
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    req = responses_api.parse_request({"instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "web_search"}]}, 16)
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert req.tools == [{"type": "function", "function": {"name": "f", "description": "",
                                                           "parameters": {"type": "object"}}}]
    with pytest.raises(ApiError) as e:
        responses_api.parse_request({"input": "q", "previous_response_id": "resp_1"}, 16)
    assert e.value.status == 400 and "previous_response_id" in e.value.message


def test_heartbeat_only_while_nothing_is_emitted():
    from agent_bridge.apis.sse import Heartbeat

    beat = Heartbeat(every_s=0.0)
    assert beat.due(False) and not beat.due(True) and beat.due(False)
    slow = Heartbeat(every_s=3600)
    assert not slow.due(False) and not slow.due(True)
