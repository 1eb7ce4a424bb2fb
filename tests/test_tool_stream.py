"""Each syntax's streaming parser on hand-written replies (tests/reply_recordings.py), fed whole,
char by char, in random pieces and marker by marker: the same reply every time, argument pieces
that concatenate to valid JSON, and a cut at every position that leaks no markup."""

from __future__ import annotations

import json
import random
import re

import pytest
from reply_recordings import CASES, MARKUP, TOOLS

from agent_bridge.chat.tool_stream import CallArgs, CallEnd, CallStart, Reply, Syntax, parse_reply


def blocks(reply: Reply) -> list[tuple]:
    return [(b.kind, b.text) if b.kind != "call" else ("call", b.call.name, b.call.arguments) for b in reply.blocks]


def stream(syntax: str, pieces: list[str], cut: bool = False):
    return stream_with(Syntax(syntax), pieces, cut)


def marker_tokens(text: str) -> list[str]:
    """Split as a tokenizer would: markup tokens whole, words and spaces apart."""
    return [t for t in re.split(r"(<\|[a-z_]+\|>|\[TOOL_CALLS\]|\[ARGS\]|</?[a-z_]+>|\s+|\w+)", text) if t]


def check_events(events, reply: Reply) -> None:
    """Starts come before their pieces, pieces add up to each call's JSON, every call ends once."""
    started, ended, pieces = set(), set(), {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.call.name and e.call.index not in started
            started.add(e.call.index)
        elif isinstance(e, CallArgs):
            assert e.call.index in started and e.call.index not in ended
            pieces[e.call.index] = pieces.get(e.call.index, "") + e.text
        elif isinstance(e, CallEnd):
            ended.add(e.call.index)
    assert started == ended
    for call in reply.calls:
        assert pieces.get(call.index, "") == call.arguments_json
        assert isinstance(json.loads(call.arguments_json), dict)


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_reply(case):
    syntax, text, expected = CASES[case]
    reply, p = parse_reply(text, Syntax(syntax), TOOLS)
    assert blocks(reply) == expected
    assert all(c.complete for c in reply.calls) and not p.notes


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("split", ["chars", "tokens", "random"])
def test_streamed_reply_equals_whole(case, split):
    syntax, text, expected = CASES[case]
    if split == "chars":
        pieces = list(text)
    elif split == "tokens":
        pieces = marker_tokens(text)
        assert "".join(pieces) == text
    else:
        rng, pieces, i = random.Random(case), [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            pieces.append(text[i:i + n])
            i += n
    reply, events, _ = stream(syntax, pieces)
    assert blocks(reply) == expected
    check_events(events, reply)
    whole, _ = parse_reply(text, Syntax(syntax), TOOLS)
    assert [c.arguments_json for c in reply.calls] == [c.arguments_json for c in whole.calls]


@pytest.mark.parametrize("case", sorted(CASES))
def test_cut_at_every_position_leaks_no_markup(case):
    syntax, text, expected = CASES[case]
    full, _ = parse_reply(text, Syntax(syntax), TOOLS)
    for n in range(len(text) + 1):
        reply, events, p = stream(syntax, list(text[:n]), cut=True)
        check_events(events, reply)
        assert full.text.startswith(reply.text), (n, reply.text)
        assert full.reasoning.startswith(reply.reasoning), (n, reply.reasoning)
        assert not any(m in reply.text for m in MARKUP), (n, reply.text)
        assert len(reply.calls) <= len(full.calls)
        for got, want in zip(reply.calls, full.calls):
            assert got.name == want.name
            if got.complete:
                assert got.arguments == want.arguments
            else:  # cut inside: each value is a prefix of the real one (or null for a cut number)
                for key, value in got.arguments.items():
                    assert key in want.arguments, (n, key)
                    if isinstance(value, str) and isinstance(want.arguments[key], str):
                        assert want.arguments[key].startswith(value), (n, key, value)
        # the same prefix parsed whole gives the same reply
        whole, _ = parse_reply(text[:n], Syntax(syntax), TOOLS, cut=True)
        assert blocks(whole) == blocks(reply)


def test_mlx_lm_parsers_agree():
    """Our streamed arguments equal what mlx-lm's own parser makes of each call body."""
    from mlx_lm.tool_parsers import glm47, json_tools, kimi_k2, qwen3_coder

    for case, module, pattern in [
        ("hermes", json_tools, r"<tool_call>(.*?)</tool_call>"),
        ("qwen3_coder", qwen3_coder, r"<tool_call>(.*?)</tool_call>"),
        ("glm47", glm47, r"<tool_call>(.*?)</tool_call>"),
        ("kimi_k2", kimi_k2, r"<\|tool_calls_section_begin\|>(.*?)<\|tool_calls_section_end\|>"),
    ]:
        syntax, text, expected = CASES[case]
        theirs = []
        for body in re.findall(pattern, text, re.S):
            parsed = module.parse_tool_call(body.strip() if case == "hermes" else body, TOOLS)
            theirs += [(c["name"], c["arguments"]) for c in (parsed if isinstance(parsed, list) else [parsed])]
        ours = [(b[1], b[2]) for b in expected if b[0] == "call"]
        assert theirs == ours, case


def test_unknown_tool_is_text_with_a_note():
    text = 'Hi <tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call>'
    for pieces in ([text], list(text)):
        reply, events, p = stream("hermes", pieces)
        assert blocks(reply) == [("text", text)]
        assert any("rm_rf" in n for n in p.notes)
    xml = "<tool_call>\n<function=nope>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    reply, _, p = stream("qwen3_coder", list(xml))
    assert blocks(reply) == [("text", xml)] and p.notes


def test_no_tools_offered_leaves_the_syntax_as_text():
    syntax, text, _ = CASES["hermes"]
    reply, _ = parse_reply(text, Syntax(syntax), None)
    assert not reply.calls and "<tool_call>" in reply.text


def test_malformed_call_at_eos_is_text_and_cut_call_is_dropped():
    text = "ok <tool_call>{not json"
    reply, _, _ = stream("hermes", list(text))
    assert blocks(reply) == [("text", text)]
    reply, _, p = stream("hermes", list(text), cut=True)
    assert blocks(reply) == [("text", "ok")] and p.notes


def test_arguments_stream_while_written():
    """A long string value arrives in many pieces, each before the call ends."""
    content = "".join(f"line {i}\n" for i in range(200))
    for syntax, text in [
        ("hermes", '<tool_call>\n{"name": "write_file", "arguments": {"path": "a", "content": '
         + json.dumps(content) + "}}\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=path>\na\n</parameter>\n<parameter=content>\n"
         + content + "\n</parameter>\n</function>\n</tool_call>"),
        ("glm47", "<tool_call>write_file<arg_key>path</arg_key><arg_value>a</arg_value><arg_key>content</arg_key>"
         "<arg_value>" + content + "</arg_value></tool_call>"),
        ("harmony", "<|channel|>commentary to=functions.write_file <|constrain|>json<|message|>"
         + json.dumps({"path": "a", "content": content})),
    ]:
        p = Syntax(syntax).parser(TOOLS)
        seen = []
        for i in range(0, len(text), 10):
            for e in p.feed(text[i:i + 10]):
                if isinstance(e, CallArgs):
                    seen.append(i)
        p.finish()
        assert len(seen) > 100, syntax  # a piece for (almost) every 10 characters written
        assert p.calls[0].arguments["content"].rstrip("\n") == content.rstrip("\n"), syntax


def test_schema_mismatch_is_noted():
    text = '<tool_call>\n{"name": "write_file", "arguments": {"path": 3}}\n</tool_call>'
    reply, _ = parse_reply(text, Syntax("hermes"), TOOLS)
    (call,) = reply.calls
    assert "missing 'content'" in call.note and "'path' is not string" in call.note
    ok, p = parse_reply(CASES["hermes"][1], Syntax("hermes"), TOOLS)
    assert not p.notes and all(not c.note for c in ok.calls)


def test_other_mlx_lm_syntaxes_are_read_whole():
    """A syntax we don't stream (here MiniMax M2, through mlx-lm's own parser) still gives calls."""
    from mlx_lm.tool_parsers import minimax_m2

    syntax = Syntax("mlx_lm", whole=(minimax_m2.tool_call_start, minimax_m2.tool_call_end,
                                     minimax_m2.parse_tool_call))
    text = ('Reading.<minimax:tool_call><invoke name="read_file"><parameter name="path">a.py</parameter>'
            "</invoke></minimax:tool_call>")
    for pieces in ([text], list(text)):
        reply, events, _ = stream_with(syntax, pieces)
        assert blocks(reply) == [("text", "Reading."), ("call", "read_file", {"path": "a.py"})]
        check_events(events, reply)
    reply, _, p = stream_with(syntax, list(text[:40]), cut=True)
    assert blocks(reply) == [("text", "Reading.")] and p.notes


def stream_with(syntax, pieces, cut=False):
    p = syntax.parser(TOOLS)
    events = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish(cut=cut)
    reply = Reply()
    for e in events:
        reply.add(e)
    return reply, events, p
