"""The reply's grammar, built per request: reasoning stays free, then what the client asked for
(a `response_format` schema) or, with strict tools, free text and tool calls valid by construction.

- Reasoning: where the template opened a reasoning block (`<think>` ends the generation prompt),
  any text up to its end marker comes first; where the template lets the model open one
  (`may_think`), an optional block. Only what follows it is constrained.
- Strict tools: every call in the model's call syntax (CALL_GRAMMARS), its opening and closing
  markup spelled out, its name one of the offered tools and its arguments JSON typed by that
  tool's schema; text outside calls stays free. On for a tool the client marks `strict` (OpenAI
  `function.strict`, Anthropic's `strict`) and, for every tool, by the server's `--strict-tools`.

Markers are spelled for the model's tokenizer (`literal`: a special token by its id, else text),
so one grammar serves a tokenizer where `<tool_call>` is one special token and one where it is text.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Callable

from engine import Constraint, InvalidRequestError

from agent_bridge.chat.chat_request import ChatRequest, constraint_for
from agent_bridge.chat.http_errors import bad_request
from agent_bridge.chat.tool_stream import Syntax

# The call syntaxes the grammar spells, as the chat templates write them (whitespace included: a
# small model left free pads with it): opening marker, text up to the name, text from the name to
# the arguments, text after them, closing marker. A forced call's prefix (CALL_OPENINGS) is the
# same text: `<tool_call>\n{"name": "` and `f", "arguments": `.
# Not yet: qwen3_coder and glm47 (arguments as typed XML text, not JSON), kimi_k2 and mistral
# (JSON arguments, other markup: untested on their tokenizers), harmony (channels), mlx-lm's own.
CALL_GRAMMARS = {"hermes": ("<tool_call>", '\n{"name": "', '", "arguments": ', "}\n", "</tool_call>")}
ANY_OBJECT = {"type": "object"}


def reply_constraint(req: ChatRequest, syntax: Syntax, literal: Callable[[str], str],
                     server_strict: bool | None) -> Constraint | None:
    """The engine's constraint for this reply (None: free). `literal` spells a marker for the
    model's tokenizer (engine.grammars.literal); `server_strict` is --strict-tools (None: on for
    the syntaxes CALL_GRAMMARS spells)."""
    tools = strict_tools(req, syntax, server_strict)
    reasoning = reasoning_prefix_kind(req, syntax)
    if tools is None and (req.response_format is None or reasoning is None):
        return constraint_for(req.response_format)
    rules = Rules(literal, syntax.think_start if reasoning == "may" else None)
    body = rules.add(response_body(req)) if req.response_format is not None else None
    if tools is not None:
        calls = CallRules(rules, CALL_GRAMMARS[syntax.name], tools)
        body = calls.reply(req.forced_tool if req.forced_prefix else None, body)
    else:
        body = f"WS? {body}"
    if reasoning == "open":
        body = f"{rules.upto(syntax.think_end)} {body}"
    elif reasoning == "may":
        body = f"({rules.literal(syntax.think_start)} {rules.upto(syntax.think_end)})? {body}"
    what = "tool call" if tools is not None else "response_format"
    return compiled(rules.grammar(body), what)


def reasoning_prefix_kind(req: ChatRequest, syntax: Syntax) -> str | None:
    """"open": the prompt opened a reasoning block; "may": the model may open one; else None.
    A forced call's prefix is past any reasoning."""
    if req.forced_prefix or not syntax.think_end:
        return None
    return "open" if req.starts_thinking else "may" if req.may_think and syntax.think_start else None


def response_body(req: ChatRequest) -> str:
    fmt = req.response_format
    try:
        return schema_lark(fmt["schema"] if fmt["type"] == "json_schema" else True)
    except InvalidRequestError as e:
        raise bad_request(f"response_format: {e}", param="response_format", code="invalid_json_schema") from None


def strict_tools(req: ChatRequest, syntax: Syntax, server_strict: bool | None) -> dict[str, dict] | None:
    """Each offered tool's name -> the schema its arguments keep to, or None (calls are free).
    A schema the client marked strict that doesn't compile is a 400 (ChatRequest checks it
    first); one only the server's flag covers keeps to any JSON object, with a note."""
    if not req.parse_tools or not req.tools:
        return None
    marked = {t["function"]["name"] for t in req.tools if t["function"].get("strict") is True}
    known = syntax.whole is None and syntax.name in CALL_GRAMMARS
    every = known if server_strict is None else server_strict
    if not marked and not every:
        return None
    if not known:
        if marked:
            req.notes.append(f"strict tools are not enforced for this model's tool-call syntax ({syntax.name})")
        return None
    schemas = {}
    for i, tool in enumerate(req.tools):
        fn = tool["function"]
        schema = fn.get("parameters") or ANY_OBJECT
        if fn["name"] not in marked and not every:
            schema = ANY_OBJECT
        try:
            schema_lark(schema)
        except InvalidRequestError as e:
            if fn["name"] in marked:
                raise bad_request(f"tools[{i}] {fn['name']!r}: {e}", param="tools", code="invalid_json_schema") from None
            req.notes.append(f"tools[{i}] {fn['name']!r}: arguments kept to a JSON object only ({e})")
            schema = ANY_OBJECT
        schemas[fn["name"]] = schema
    return schemas


class Rules:
    """A Lark grammar being written: `add` a rule, `upto` a marker, `free_without` one."""

    def __init__(self, literal: Callable[[str], str], may_open: str | None = None):
        """`may_open`: a reasoning block's opening marker the reply may start with; free text that
        starts with it (as text) is that block, not text before a call."""
        self.literal = literal
        self.not_reasoning = f" & ~/{regex_escape(may_open)}(?s:.*)/" if may_open and not self.special(may_open) else ""
        self.lines = ["FREE: /(?s:.+)/", "WS: /[ \\t\\r\\n]{1,4}/"]  # WS bounded: a small model pads forever

    def add(self, body: str, attrs: str = "") -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}{attrs}: {body}")
        return name

    def upto(self, marker: str) -> str:
        """Free text (maybe none), then `marker`."""
        if self.special(marker):  # free text never holds a special token
            return f"FREE? {self.literal(marker)}"
        # lazy: ends at the first marker
        return self.add(f"/(?s:.*){regex_escape(marker)}/{self.not_reasoning}", "[lazy]")

    def free_without(self, marker: str) -> str:
        """Free text (maybe none) that doesn't hold `marker`."""
        if self.special(marker):
            return "FREE?"
        name = f"T{len(self.lines)}"
        self.lines.append(f"{name}: /(?s:.+)/ & ~/(?s:.*{regex_escape(marker)}.*)/{self.not_reasoning}")
        return f"{name}?"

    def special(self, marker: str) -> bool:
        return self.literal(marker).startswith("<")

    def grammar(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.lines])


class CallRules:
    """The rules of one call syntax's calls for a set of tools (name -> argument schema)."""

    def __init__(self, rules: Rules, spelling: tuple[str, str, str, str, str], tools: dict[str, dict]):
        self.rules = rules
        self.opening, head, between, after, closing = spelling
        self.args = {name: rules.add(schema_lark(schema)) for name, schema in tools.items()}
        named = [rules.add(f"{lark_string(json_text(name) + between)} {args}") for name, args in self.args.items()]
        self.named = rules.add(" | ".join(named))  # `f", "arguments": {...}` for each tool f
        self.end = rules.add(f"{lark_string(after)} {rules.literal(closing)}")
        self.call = rules.add(f"{lark_string(head)} {self.named} {self.end}")  # after the opening marker

    def reply(self, forced: str | None, answer: str | None) -> str:
        """Free text and calls; `forced` (a forced call's prefix was written: "" any tool, else
        its name) continues that call first; with `answer` (a response_format rule) the reply
        is that answer or text with at least one call."""
        calls = f"({self.rules.upto(self.opening)} {self.call})"
        rest = f"{calls}* {self.rules.free_without(self.opening)}"
        if forced is not None:
            return f"{self.args[forced] if forced else self.named} {self.end} {rest}"
        if answer is not None:
            return f"(WS? {answer} | {calls}+ {self.rules.free_without(self.opening)})"
        return rest


# An agent sends the same tools every turn: their grammar is compiled once (~100 ms for 20 tools).
@lru_cache(maxsize=64)
def compiled(grammar: str, what: str) -> Constraint:
    return Constraint.lark(grammar, what)


def schema_lark(schema: dict | bool) -> str:
    return _schema_lark(json.dumps(schema))  # key order kept: the grammar writes properties in it


@lru_cache(maxsize=512)
def _schema_lark(schema_json: str) -> str:
    return Constraint.schema_lark(json.loads(schema_json))


def json_text(name: str) -> str:
    """A name as it appears inside a JSON string."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


def lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ (Rust regex syntax; `<` and `>` are left alone:
    escaped they are word boundaries there)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)
