"""Streaming parsers of model replies: text, reasoning and tool calls, one per syntax.

`syntax_for(tokenizer)` picks the parser from the model's chat template (the markers mlx-lm's
own `_infer_tool_parser` looks for, plus harmony); `make_parser(...)` builds one per reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent_bridge.chat.tool_stream.base import ReplyParser
from agent_bridge.chat.tool_stream.events import Block, CallArgs, CallEnd, CallStart, Event, Reasoning, Reply, Text, ToolCall, new_call_id
from agent_bridge.chat.tool_stream.harmony import Harmony
from agent_bridge.chat.tool_stream.json_calls import Hermes, Kimi, Mistral
from agent_bridge.chat.tool_stream.text_calls import Glm, QwenXml
from agent_bridge.chat.tool_stream.whole_calls import WholeCalls

PARSERS = {p.name: p for p in (Hermes, QwenXml, Glm, Kimi, Mistral, Harmony)}


@dataclass
class Syntax:
    """Which parser a model's replies need, and its reasoning markers."""

    name: str = "hermes"
    think_start: str | None = "<think>"
    think_end: str | None = "</think>"
    whole: tuple | None = None  # (start, end, parse) of an mlx-lm parser we don't stream

    def parser(self, tools: list[dict] | None = None, parse_tools: bool = True, thinking: bool = False,
               id_prefix: str = "call_") -> ReplyParser:
        kw = dict(parse_tools=parse_tools, thinking=thinking, think=(self.think_start, self.think_end),
                  id_prefix=id_prefix)
        if self.whole is not None:
            start, end, parse = self.whole
            return WholeCalls(tools, start=start, end=end, parse=parse, **kw)
        return PARSERS[self.name](tools, **kw)


# How each syntax opens a call, and a call of one named tool (tool_choice any / tool / required).
CALL_OPENINGS = {
    "hermes": ('<tool_call>\n{"name": "', '{name}", "arguments": '),
    "qwen3_coder": ("<tool_call>\n<function=", "{name}>\n"),
    "glm47": ("<tool_call>", "{name}\n"),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.", "{name}:0<|tool_call_argument_begin|>"),
    "mistral": ("[TOOL_CALLS]", "{name}[ARGS]"),
    "harmony": ("<|channel|>commentary to=functions.", "{name} <|constrain|>json<|message|>"),
}


def forced_call_prefix(syntax: Syntax, name: str, close_thinking: bool) -> str:
    """The text that makes the model's reply begin with a call (of `name`, or of any tool when
    `name` is empty). Raises ValueError when this syntax can't be constrained that way."""
    if syntax.whole is not None:
        if name:
            raise ValueError("this model's tool-call syntax can't be constrained to one named tool")
        opening = syntax.whole[0]
    else:
        start, named = CALL_OPENINGS[syntax.name]
        opening = start + (named.format(name=name) if name else "")
    if close_thinking and syntax.think_end:  # as with Anthropic's API, a forced call skips reasoning
        opening = syntax.think_end + "\n\n" + opening
    return opening


def syntax_for(tokenizer: Any) -> Syntax:
    """The syntax of this tokenizer's model (an mlx-lm TokenizerWrapper), Hermes by default."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    s = Syntax()
    if getattr(tokenizer, "has_thinking", False):
        s.think_start, s.think_end = tokenizer.think_start, tokenizer.think_end
    if "<|channel|>" in template and "<|message|>" in template:
        s.name = "harmony"
    elif "<arg_key>" in template:
        s.name = "glm47"
    elif "<tool_call>\\n<function=" in template or "<tool_call>\n<function=" in template:
        s.name = "qwen3_coder"
    elif "<|tool_calls_section_begin|>" in template:
        s.name = "kimi_k2"
    elif "[TOOL_CALLS]" in template:
        s.name = "mistral"
    elif getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_call_start not in (None, "<tool_call>"):
        s.whole = (tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser)
        s.name = "mlx_lm"
    return s


def parse_reply(text: str, syntax: Syntax | None = None, tools: list[dict] | None = None, cut: bool = False,
                **kw) -> tuple[Reply, ReplyParser]:
    """A whole reply at once (non-streaming responses)."""
    p = (syntax or Syntax()).parser(tools, **kw)
    reply = Reply()
    for e in p.feed(text) + p.finish(cut=cut):
        reply.add(e)
    return reply, p


__all__ = ["Block", "CallArgs", "CallEnd", "CallStart", "Event", "PARSERS", "Reasoning", "Reply", "ReplyParser",
           "Syntax", "Text", "ToolCall", "forced_call_prefix", "new_call_id", "parse_reply", "syntax_for"]
