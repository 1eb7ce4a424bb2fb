"""Strict tools on the bundled model: how many of its tool calls validate, with and without them.

For each tool set (schemas with integers, enums, required keys, nested objects, arrays) and each
prompt, the bundled model answers greedily twice through the server's own path (the chat
template with the tools, the reply grammar of agent_bridge/chat/reply_grammar.py, the hermes
reply parser), with tool_choice "required" and with a named tool (the server writes the call's
opening, the model its name and arguments): with strict tools off, then on. A call counts as valid when its name is one of
the offered tools and its arguments parse and validate (`jsonschema`) against that tool's
schema; a `<tool_call>` the parser can't read counts as an invalid call.

    .venv/bin/python scripts/bench_strict_tools.py [--max-tokens 96] [--mode lookup]
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

from agent_bridge.chat.chat_request import ChatRequest
from agent_bridge.chat.reply_grammar import reply_constraint
from agent_bridge.chat.tool_stream import forced_call_prefix, parse_reply, syntax_for
from engine import Engine, GenerationRequest

S = {"type": "string", "maxLength": 24}
TOOL_SETS = {
    "files": [
        ("read_file", {"type": "object", "properties": {"path": S, "offset": {"type": "integer", "minimum": 0},
                                                        "limit": {"type": "integer", "minimum": 1, "maximum": 500}},
                       "required": ["path", "offset", "limit"], "additionalProperties": False}),
        ("write_file", {"type": "object", "properties": {"path": S, "content": S,
                                                         "mode": {"enum": ["create", "overwrite", "append"]}},
                        "required": ["path", "content", "mode"], "additionalProperties": False}),
    ],
    "shell": [
        ("run", {"type": "object", "properties": {"command": S, "timeout": {"type": "integer", "maximum": 600},
                                                  "background": {"type": "boolean"}},
                 "required": ["command", "timeout", "background"], "additionalProperties": False}),
    ],
    "edit": [
        ("edit", {"type": "object", "properties": {"path": S, "old": S, "new": S, "count": {"type": "integer"}},
                  "required": ["path", "old", "new", "count"], "additionalProperties": False}),
        ("search", {"type": "object", "properties": {"pattern": S, "kind": {"enum": ["regex", "literal"]},
                                                     "paths": {"type": "array", "items": S, "maxItems": 3}},
                    "required": ["pattern", "kind", "paths"], "additionalProperties": False}),
    ],
    "issue": [
        ("create_issue", {"type": "object", "properties": {
            "title": S, "priority": {"enum": ["low", "medium", "high"]},
            "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "name": S},
                      "required": ["id", "name"], "additionalProperties": False}},
            "required": ["title", "priority", "owner"], "additionalProperties": False}),
    ],
    "weather": [
        ("get_weather", {"type": "object", "properties": {"city": S, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7},
                                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                         "required": ["city", "days", "unit"], "additionalProperties": False}),
    ],
}
PROMPTS = ["Read the file config.py.", "Write x = 1 to the file a.py.", "Run the tests.",
           "Rename foo to bar in main.py.", "Use a tool.", "What is the weather in Paris this week?"]


def tools_of(specs) -> list[dict]:
    return [{"type": "function", "function": {"name": n, "description": f"{n.replace('_', ' ')}.", "parameters": s}}
            for n, s in specs]


def reply(engine, syntax, tools, prompt, strict: bool, forced: str, max_tokens: int, mode: str):
    """The reply to `prompt` with tool_choice `forced` ("": any tool, else that one), as served."""
    req = ChatRequest(messages=[{"role": "user", "content": prompt}], tools=tools, max_tokens=max_tokens,
                      forced_tool=forced)
    req.forced_prefix = forced_call_prefix(syntax, forced, False)
    ids = engine.render_chat(req.messages, tools) + engine.encode(req.forced_prefix)
    constraint = reply_constraint(req, syntax, engine.grammars.literal, strict)
    done = list(engine.generate(GenerationRequest(ids, max_tokens=max_tokens, mode=mode, constraint=constraint)))[-1]
    parsed, _ = parse_reply(req.forced_prefix + done.text, syntax, tools, cut=done.finish_reason == "length")
    return done, parsed


def count_calls(done, parsed, schemas) -> tuple[int, int]:
    """(calls written, calls valid): the forced call counts, written or not; a `<tool_call>`
    the parser didn't turn into a call is an invalid one."""
    written = max(1 + done.text.count("<tool_call>"), len(parsed.calls))
    valid = 0
    for call in parsed.calls:
        try:
            jsonschema.validate(json.loads(call.arguments_json), schemas[call.name])
            valid += call.complete  # a call cut short or closed for it by the parser is not valid
        except (KeyError, ValueError, jsonschema.ValidationError):
            pass
    return written, valid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--mode", default="lookup")
    args = ap.parse_args()
    engine = Engine(None, max_batch=1, prefix_cache=False)
    syntax = syntax_for(engine.tokenizer)
    totals = {False: [0, 0, 0.0, 0, 0], True: [0, 0, 0.0, 0, 0]}  # written, valid, seconds, tokens, forwards
    try:
        for set_name, specs in TOOL_SETS.items():
            tools, schemas = tools_of(specs), dict(specs)
            for prompt, forced in [(p, f) for p in PROMPTS for f in ["", specs[-1][0]]]:
                for strict in (False, True):
                    started = time.perf_counter()
                    done, parsed = reply(engine, syntax, tools, prompt, strict, forced, args.max_tokens, args.mode)
                    written, valid = count_calls(done, parsed, schemas)
                    t = totals[strict]
                    t[0], t[1] = t[0] + written, t[1] + valid
                    t[2], t[3] = t[2] + time.perf_counter() - started, t[3] + len(done.token_ids)
                    t[4] += done.stats.rounds
                    print(f"{set_name:8} {forced or '(any)':12} strict={'on ' if strict else 'off'} {valid}/{written} valid  "
                          f"{prompt[:32]!r}: {done.text[:110]!r}", flush=True)
    finally:
        engine.close()
    for strict, (written, valid, secs, tokens, forwards) in totals.items():
        rate = valid / written if written else float("nan")
        print(f"strict {'on ' if strict else 'off'}: {valid}/{written} tool calls valid ({rate:.0%}), "
              f"{tokens / max(forwards, 1):.2f} tokens per forward, {tokens / secs:.0f} tok/s over {tokens} tokens "
              f"(mode {args.mode}; the grammar compiled per request)")


if __name__ == "__main__":
    main()
