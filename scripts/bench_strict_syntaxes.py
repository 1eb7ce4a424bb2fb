"""Strict tools in every call syntax: what the reply grammar costs per request for a set of 20 tools.

For each syntax of agent_bridge/chat/reply_grammar.py (CALL_GRAMMARS) and tool_choice auto / any
tool / a named tool: the grammar written and compiled once (`reply_constraint` with its caches
cleared: what a new tool set costs; an agent sends the same tools every turn, so later requests
reuse it), then per request the engine's matcher built over the tokenizer (`Grammars.start`)
and its first mask. The tokenizer is the bundled model's (8k tokens; its `<tool_call>` and
`<think>` are special tokens, the other syntaxes' markers text) unless --tokenizer names a
tokenizer.json.

    .venv/bin/python scripts/bench_strict_syntaxes.py [--tools 20] [--repeat 5] [--tokenizer PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

from agent_bridge.chat import reply_grammar
from agent_bridge.chat.chat_request import ChatRequest
from agent_bridge.chat.reply_grammar import CALL_GRAMMARS, reply_constraint
from agent_bridge.chat.tool_stream import CALL_OPENINGS, Syntax
from engine import REFERENCE_MODEL_DIR
from engine.decoding.grammar import Grammars

S = {"type": "string", "maxLength": 64}
SHAPES = [
    {"type": "object", "properties": {"path": S, "offset": {"type": "integer", "minimum": 0},
                                      "limit": {"type": "integer", "minimum": 1, "maximum": 500}},
     "required": ["path"], "additionalProperties": False},
    {"type": "object", "properties": {"path": S, "content": {"type": "string"},
                                      "mode": {"enum": ["create", "overwrite", "append"]}},
     "required": ["path", "content"], "additionalProperties": False},
    {"type": "object", "properties": {"command": S, "timeout": {"type": "integer", "maximum": 600},
                                      "background": {"type": "boolean"}}, "required": ["command"]},
    {"type": "object", "properties": {"pattern": S, "kind": {"enum": ["regex", "literal"]},
                                      "paths": {"type": "array", "items": S, "maxItems": 8}},
     "required": ["pattern"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": S, "priority": {"enum": ["low", "medium", "high"]}, "ratio": {"type": "number"},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "name": S},
                  "required": ["id", "name"], "additionalProperties": False}},
     "required": ["title", "owner"], "additionalProperties": False},
]


def tools(n: int) -> list[dict]:
    """n tools, each schema its own (as an agent's are): one of SHAPES, its string lengths varied."""
    def varied(schema, i):
        if isinstance(schema, dict):
            return {k: (64 + i if k == "maxLength" else varied(v, i)) for k, v in schema.items()}
        return [varied(v, i) for v in schema] if isinstance(schema, list) else schema
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": f"tool {i}",
                                              "parameters": varied(SHAPES[i % len(SHAPES)], i)}} for i in range(n)]


def grammars(tokenizer_json: str) -> Grammars:
    import transformers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    eos = [i for i in (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")) if i is not None]
    return Grammars(types.SimpleNamespace(_tokenizer=hf), tok.get_vocab_size(), eos)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tools", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokenizer", default=str(REFERENCE_MODEL_DIR / "tokenizer.json"))
    args = ap.parse_args()
    g = grammars(args.tokenizer)
    offered = tools(args.tools)
    print(f"{args.tools} tools, tokenizer {args.tokenizer} ({g.vocab_size} tokens)")
    g.check(reply_constraint(ChatRequest(messages=[{"role": "user", "content": "x"}], tools=offered), Syntax(),
                             g.literal, None))  # (warm up)
    print(f"{'syntax':12} {'tool_choice':11} {'grammar':>8} {'compile':>9} {'matcher':>9} {'1st mask':>9}")
    for name in CALL_GRAMMARS:
        start, named = CALL_OPENINGS[name]
        for forced in (None, "", offered[-1]["function"]["name"]):
            req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=offered, forced_tool=forced)
            if forced is not None:
                req.forced_prefix = start + (named.format(name=forced) if forced else "")
            reply_grammar._schema_lark.cache_clear()
            reply_grammar.compiled.cache_clear()
            reply_grammar.checked.cache_clear()
            began = time.perf_counter()
            constraint = reply_constraint(req, Syntax(name), g.literal, None)
            compile_s = time.perf_counter() - began
            g.check(constraint)
            builds, masks = [], []
            for _ in range(args.repeat):
                began = time.perf_counter()
                state = g.start(constraint)
                builds.append(time.perf_counter() - began)
                began = time.perf_counter()
                state.allowed()
                masks.append(time.perf_counter() - began)
            choice = "auto" if forced is None else "required" if not forced else "named"
            print(f"{name:12} {choice:11} {len(constraint.grammar) // 1024:6d}kB {compile_s * 1e3:7.1f}ms "
                  f"{statistics.median(builds) * 1e3:7.2f}ms {statistics.median(masks) * 1e3:7.2f}ms", flush=True)


if __name__ == "__main__":
    main()
