"""The reply's grammar, built per request: reasoning stays free, then what the client asked for
(a `response_format` schema) or, with strict tools, free text and tool calls valid by construction.

- Reasoning: where the template opened a reasoning block (`<think>` ends the generation prompt),
  any text up to its end marker comes first; where the template lets the model open one
  (`may_think`), an optional block. Only what follows it is constrained.
- Strict tools: every call in the model's call syntax, as its chat template writes it
  (CALL_GRAMMARS: one small `CallSyntax` per syntax the reply parsers stream), its markup spelled
  out, its name one of the offered tools and its arguments typed by that tool's schema; text
  outside calls stays free. JSON arguments (hermes, kimi_k2, mistral, harmony) keep to the schema
  as JSON; key/value arguments (qwen3_coder's `<parameter=k>`, glm47's `<arg_key>`) are written as
  the reply parser reads them back (tool_stream/json_args.py `ArgsWriter`): the schema's properties
  in its order, the required ones always, a string property as raw text, any other as the JSON text
  the parser types into a value valid under it (`KeyValueCalls`). harmony's reply is a run of
  messages: analysis (the reasoning) and commentary stay free, the last is a call or the final
  answer. On for a tool the client marks `strict` (OpenAI `function.strict`, Anthropic's `strict`)
  and, for every tool, by the server's `--strict-tools`.
- A forced call (tool_choice): CALL_OPENINGS' text is already in the prompt (`opening` + `head`,
  then the tool's name part for a named tool); the grammar goes on from where it ends.

Markers are spelled for the model's tokenizer (`literal`: a special token by its id, else text),
so one grammar serves a tokenizer where `<tool_call>` is one special token and one where it is text.
Free text never holds a marker's text either (spelled in pieces it reads as the marker to the parser).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Callable, Iterable

from engine import Constraint, InvalidRequestError

from agent_bridge.chat.chat_request import ChatRequest, constraint_for
from agent_bridge.chat.http_errors import bad_request
from agent_bridge.chat.tool_stream import Syntax
from agent_bridge.chat.tool_stream.json_args import schema_type

ANY_OBJECT = {"type": "object"}
SOLID = r"[^\s\x1c-\x1f]"  # not what Python's str.strip() strips (the parsers strip with it)
ANY_KEY = r"/[^<>\n]{1,64}/"  # a key where the schema names none
INT_LIMIT = 2**53  # integers written as text are read through float(): exact up to here
NUMBER_LIMIT = 1e15  # an open side of a bounded number (llguidance spells ranges this wide)
NUMBER = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?"  # an unbounded number, finite
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
               "readOnly", "writeOnly", "format", "contentEncoding", "contentMediaType", "nullable"}
UNENFORCED = {"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "patternProperties", "propertyNames",
              "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties", "enum", "const"}


def reply_constraint(req: ChatRequest, syntax: Syntax, literal: Callable[[str], str],
                     server_strict: bool | None) -> Constraint | None:
    """The engine's constraint for this reply (None: free). `literal` spells a marker for the
    model's tokenizer (engine.grammars.literal); `server_strict` is --strict-tools (None: on for
    the syntaxes CALL_GRAMMARS spells)."""
    tools = strict_tools(req, syntax, server_strict)
    spec = call_syntax(syntax)
    reasoning = reasoning_prefix_kind(req, syntax)
    messages = spec is not None and spec.messages and not req.forced_prefix
    if tools is None and (req.response_format is None or (reasoning is None and not messages)):
        return constraint_for(req.response_format)
    rules = Rules(literal, syntax.think_start if reasoning == "may" else None)
    answer = rules.add(response_body(req)) if req.response_format is not None else None
    if tools is not None:
        body = CallRules(rules, spec, tools).reply(req.forced_tool if req.forced_prefix else None, answer)
    elif messages:  # the answer is the last of the reply's messages
        body = spec.reply(rules, None, None, answer)
    else:
        body = f"WS? {answer}"
    if reasoning == "open":
        body = f"{rules.text(syntax.think_end, [syntax.think_end])} {body}"
    elif reasoning == "may":
        body = f"({rules.literal(syntax.think_start)} {rules.text(syntax.think_end, [syntax.think_end])})? {body}"
    what = "tool call" if tools is not None else "response_format"
    return compiled(rules.grammar(body), what)


def call_syntax(syntax: Syntax) -> "CallSyntax | None":
    """The grammar pieces of this model's call syntax (None: one the grammar doesn't spell)."""
    return CALL_GRAMMARS.get(syntax.name) if syntax.whole is None else None


def reasoning_prefix_kind(req: ChatRequest, syntax: Syntax) -> str | None:
    """"open": the prompt opened a reasoning block; "may": the model may open one; else None.
    A forced call's prefix is past any reasoning; a syntax whose reasoning is a message of its
    own (harmony) has none before its reply."""
    spec = call_syntax(syntax)
    if req.forced_prefix or not syntax.think_end or (spec is not None and spec.messages):
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
    A schema the client marked strict that doesn't compile (or that this syntax can't keep its
    arguments to) is a 400 (ChatRequest checks the JSON part first); one only the server's flag
    covers keeps to any JSON object, with a note."""
    if not req.parse_tools or not req.tools:
        return None
    marked = {t["function"]["name"] for t in req.tools if t["function"].get("strict") is True}
    spec = call_syntax(syntax)
    every = spec is not None if server_strict is None else server_strict
    if not marked and not every:
        return None
    if spec is None:
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
            checked(syntax.name, json.dumps(schema))
        except InvalidRequestError as e:
            if fn["name"] in marked:
                raise bad_request(f"tools[{i}] {fn['name']!r}: {e}", param="tools", code="invalid_json_schema") from None
            req.notes.append(f"tools[{i}] {fn['name']!r}: arguments kept to a JSON object only ({e})")
            schema = ANY_OBJECT
        schemas[fn["name"]] = schema
    return schemas


class Rules:
    """A Lark grammar being written: `add` a rule, `text` (free text, then a closing marker),
    and the reply's own free text: `upto` a marker, `free_without` markers."""

    def __init__(self, literal: Callable[[str], str], may_open: str | None = None):
        """`may_open`: a reasoning block's opening marker the reply may start with; free text that
        starts with it (as text) is that block, not text before a call."""
        self.literal = literal
        self.not_reasoning = f"~/{regex_escape(may_open)}(?s:.*)/" if may_open and not self.special(may_open) else ""
        self.lines = ["WS: /[ \\t\\r\\n]{1,4}/"]  # WS bounded: a small model pads forever
        self.names: dict[tuple, str] = {}  # a rule's text -> its name: the same rule written once

    def add(self, body: str, attrs: str = "", terminal: bool = False) -> str:
        key = (body, attrs, terminal)
        if key not in self.names:
            self.names[key] = name = f"{'T' if terminal else 'r'}{len(self.lines)}"
            self.lines.append(f"{name}{attrs}: {body}")
        return self.names[key]

    def text(self, close: str | None = None, without: Iterable[str] = (), lo: int = 0, hi: int | None = None,
             also: Iterable[str] = (), edges: bool = False, top: bool = False) -> str:
        """Free text, then `close` (a marker or text; None: nothing). The text holds none of
        `without` (each as text: a special token's text written in pieces reads as the marker),
        is `lo`..`hi` characters long, matches each regex of `also` whole, and with `edges`
        neither starts nor ends with whitespace; `top`: the reply's own text, which doesn't start
        with the reasoning opener. A closing text is part of the text's lexeme, which ends at
        its first occurrence (lazy: a greedy lexeme would run on into it)."""
        fold = close is not None and not self.special(close)
        if hi == 0 and not fold:
            return self.literal(close) if close is not None else ""
        tail = regex_escape(close) if fold else ""
        lo1 = lo if fold else max(lo, 1)  # a lexeme is never empty: `?` makes the text optional
        parts = [f"/(?s:.{{{lo1},{'' if hi is None else hi}}}){tail}/"]
        parts += [f"/(?:{a}){tail}/" for a in also]
        banned = sorted(set(without))
        if banned:
            parts.append(f"~/(?s:.*({'|'.join(regex_escape(m) for m in banned)}).*){tail}/")
        if edges:  # (as one positive regex: two negated ones cost the matcher ~30x more to build)
            parts.append(f"/(?:{'|' if fold else ''}{SOLID}|{SOLID}(?s:.*){SOLID}){tail}/")
        if top and self.not_reasoning:
            parts.append(self.not_reasoning)
        if fold:
            return self.add(" & ".join(parts), "[lazy]")
        name = self.add(" & ".join(parts), terminal=True)
        text = name if lo > 0 else f"{name}?"
        return f"{text} {self.literal(close)}" if close is not None else text

    def upto(self, marker: str, without: Iterable[str] = ()) -> str:
        """The reply's free text (maybe none), then `marker`; the text holds none of `without`."""
        return self.text(marker, [marker, *without], top=True)

    def free_without(self, *markers: str) -> str:
        """The reply's free text (maybe none) that holds none of `markers`."""
        return self.text(None, markers, top=True)

    def special(self, marker: str) -> bool:
        return self.literal(marker).startswith("<")

    def grammar(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.lines])


class CallSyntax:
    """How one syntax's chat template writes calls, as grammar pieces: the reply parser's
    `opening` marker, then `head` up to the tool's name, then `name` (the name and what follows
    it up to the arguments), the arguments (`args`), then `tail` to the end of the call section.
    `opening` + `head` is CALL_OPENINGS' first text (a forced call's prefix) and CALL_OPENINGS'
    named text is one spelling of `name`: a forced call's grammar starts where they end."""

    opening = "<tool_call>"
    messages = False  # the reply is a run of messages, reasoning one of them (harmony: `reply`)
    json_style: dict = {}  # the JSON arguments' layout, where the model writes them otherwise (x-guidance)

    def head(self, r: Rules) -> str:
        return ""

    def name(self, r: Rules, name: str) -> str:
        raise NotImplementedError

    def tail(self, r: Rules, calls: "CallRules") -> str:
        return ""

    def args(self, r: Rules, schema: dict) -> str:
        return r.add(schema_lark(self.styled(schema)))

    def check(self, schema: dict) -> None:
        """Raises InvalidRequestError where arguments can't be kept to `schema` in this syntax."""
        schema_lark(self.styled(schema))

    def styled(self, schema: dict) -> dict:
        if not self.json_style or not isinstance(schema, dict):
            return schema
        return {**schema, "x-guidance": {**self.json_style, **schema.get("x-guidance", {})}}

    def reply(self, r: Rules, calls: "CallRules | None", forced: str | None, answer: str | None) -> str:
        """Free text and calls; `forced` (a forced call's prefix was written: "" any tool, else
        its name) continues that call first; with `answer` (a response_format rule) the reply
        is that answer or text with at least one call."""
        call = f"({r.upto(self.opening)} {calls.call})"
        rest = f"{call}* {r.free_without(self.opening)}"
        if forced is not None:
            return seq(calls.args[forced] if forced else calls.named, calls.tail, rest)
        if answer is not None:
            return f"(WS? {answer} | {call}+ {r.free_without(self.opening)})"
        return rest


class CallRules:
    """The rules of one call syntax's calls for a set of tools (name -> argument schema)."""

    def __init__(self, rules: Rules, syntax: CallSyntax, tools: dict[str, dict]):
        self.rules, self.syntax = rules, syntax
        self.args = {name: syntax.args(rules, schema) for name, schema in tools.items()}
        named = [rules.add(seq(syntax.name(rules, name), args)) for name, args in self.args.items()]
        self.named = rules.add(" | ".join(named))  # each tool's name, then its arguments
        tail = syntax.tail(rules, self)
        self.tail = rules.add(tail) if tail else ""
        self.call = rules.add(seq(syntax.head(rules), self.named, self.tail))  # after the opening marker

    def reply(self, forced: str | None, answer: str | None) -> str:
        return self.syntax.reply(self.rules, self, forced, answer)


class Hermes(CallSyntax):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`"""

    def head(self, r: Rules) -> str:
        return lark_string('\n{"name": "')

    def name(self, r: Rules, name: str) -> str:
        return lark_string(json_text(name) + '", "arguments": ')

    def tail(self, r: Rules, calls: CallRules) -> str:
        return seq(lark_string("}\n"), r.literal("</tool_call>"))


class Kimi(CallSyntax):
    """`<|tool_calls_section_begin|>` then calls `<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
    {...}<|tool_call_end|>` (the index any digits), then `<|tool_calls_section_end|>`."""

    opening = "<|tool_calls_section_begin|>"

    def head(self, r: Rules) -> str:
        return f"{r.literal('<|tool_call_begin|>')} {lark_string('functions.')}"

    def name(self, r: Rules, name: str) -> str:
        index = r.add("/[0-9]{1,6}/", terminal=True)
        return f"{lark_string(name + ':')} {index} {r.literal('<|tool_call_argument_begin|>')}"

    def tail(self, r: Rules, calls: CallRules) -> str:
        end = r.literal("<|tool_call_end|>")
        return f"{end} ({self.head(r)} {calls.named} {end})* {r.literal('<|tool_calls_section_end|>')}"


class Mistral(CallSyntax):
    """`[TOOL_CALLS]f[ARGS]{...}`, each call its own section, no end marker."""

    opening = "[TOOL_CALLS]"

    def name(self, r: Rules, name: str) -> str:
        return f"{lark_string(name)} {r.literal('[ARGS]')}"


class Harmony(CallSyntax):
    """gpt-oss: after the prompt's `<|start|>assistant`, messages `<|channel|>analysis<|message|>...<|end|>`
    (reasoning) or `<|channel|>commentary<|message|>...<|end|>` (text), each followed by
    `<|start|>assistant`, then the last: a call `<|channel|>commentary to=functions.f <|constrain|>json
    <|message|>{...}<|call|>` or the answer `<|channel|>final<|message|>...<|return|>` (`<|call|>` and
    `<|return|>` may be end-of-turn tokens the engine stops at: optional). Arguments in gpt-oss's
    compact JSON."""

    opening = "<|channel|>"
    messages = True
    json_style = {"item_separator": ",", "key_separator": ":"}
    ENDS = ("<|end|>", "<|call|>", "<|return|>")

    def head(self, r: Rules) -> str:
        return lark_string("commentary to=functions.")

    def name(self, r: Rules, name: str) -> str:
        return seq(lark_string(name + " "), r.literal("<|constrain|>"), lark_string("json"), r.literal("<|message|>"))

    def tail(self, r: Rules, calls: CallRules) -> str:
        return f"{r.literal('<|call|>')}?"

    def reply(self, r: Rules, calls: CallRules | None, forced: str | None, answer: str | None) -> str:
        if forced is not None:  # the call's own message: the turn ends with it
            return seq(calls.args[forced] if forced else calls.named, calls.tail)
        channel, message = r.literal("<|channel|>"), r.literal("<|message|>")
        said = r.text("<|end|>", self.ENDS)  # an analysis or commentary message's text
        before = r.add(f'{channel} ("analysis" | "commentary") {message} {said} {r.literal("<|start|>")} "assistant"')
        if answer is not None:
            final = f"{answer} {r.literal('<|return|>')}?"
        elif r.special("<|return|>"):
            final = f"{r.text(None, self.ENDS)} {r.literal('<|return|>')}?"
        else:  # its text ends at `<|return|>` or at the end of output
            final = f"({r.text('<|return|>', self.ENDS)} | {r.text(None, self.ENDS)})"
        last = f'{lark_string("final")} {message} {final}'
        if calls is not None:
            last = f"{calls.call} | {last}"
        return f"{before}* {channel} ({last})"


class KeyValueCalls(CallSyntax):
    """Arguments written as key/value text, as the reply parser reads them back (json_args.py
    `ArgsWriter`, the value's JSON type from `schema_type`): the schema's properties in its order,
    the required ones always, others maybe (none it doesn't name: `additionalProperties` allows
    them or not, leaving them out is valid); with no properties and extra ones allowed, any keys.
    A string value is raw text (its `enum`, `const`, `minLength`, `maxLength`, `pattern` kept)
    holding none of the markers that end a value for the parser; an integer, number or boolean its
    JSON text (integers within 2**53, which float() reads exactly; numbers finite); anything else
    JSON valid under the property's schema. A JSON string inside such a value is not kept from
    spelling a value's end marker (llguidance's %json takes no such rule): the parser would end the
    value there."""

    close = ""  # what ends a value (text or a marker)
    value_ends: tuple[str, ...] = ()  # where the parser ends a value (as text)
    edges = False  # the parser strips a value's surrounding whitespace
    key_end = ""  # where the parser ends a key

    def key(self, r: Rules, key: str | None) -> str:
        """What comes before a value: the key's markup (None: any key)."""
        raise NotImplementedError

    def after(self, r: Rules) -> str:
        """What follows a value's end."""
        return ""

    def args(self, r: Rules, schema: dict) -> str:
        params = self.params(schema)
        if params is None:  # any keys
            extra = schema.get("additionalProperties", True)
            value = self.value(r, "", extra) if isinstance(extra, dict) and extra else self.free_value(r)
            return f"{r.add(seq(self.key(r, None), value, self.after(r)))}*"
        parts = []
        for key, prop, required in params:
            one = r.add(seq(self.key(r, key), self.value(r, key, prop, schema), self.after(r)))
            parts.append(one if required else f"{one}?")
        return " ".join(parts)

    def check(self, schema: dict) -> None:
        super().check(schema)
        rules = Rules(json.dumps)
        Constraint.lark(rules.grammar(seq('"x"', self.args(rules, schema))), "tool arguments")

    def params(self, schema: dict) -> list[tuple[str, object, bool]] | None:
        """(key, its schema, required) in the schema's order; None: any keys."""
        kind = schema.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise InvalidRequestError(f"arguments of type {kind!r} can't be written as {self.opening} parameters")
        props = schema.get("properties") or {}
        required = [k for k in schema.get("required") or [] if isinstance(k, str)]
        extra = schema.get("additionalProperties", True)
        if UNENFORCED & set(schema):
            word = sorted(UNENFORCED & set(schema))[0]
            raise InvalidRequestError(f"{word!r} on the arguments can't be kept to in key/value parameters")
        if schema.get("minProperties", 0) > len(set(required)) or \
                schema.get("maxProperties", len(props) + len(required)) < len(set(props) | set(required)):
            raise InvalidRequestError("minProperties/maxProperties can't be kept to in key/value parameters")
        if not props and not required and extra is not False:
            return None
        fallback = extra if isinstance(extra, dict) else {}
        keys = [k for k in props if props[k] is not False or k in required]  # (a `false` one can't be there)
        keys += [k for k in dict.fromkeys(required) if k not in props]
        for key in keys:
            if self.key_end in key or key != key.strip() or "\n" in key:
                raise InvalidRequestError(f"the parameter name {key!r} can't be written in this syntax")
        return [(k, props.get(k, fallback), k in required) for k in keys]

    def value(self, r: Rules, key: str, prop: object, root: dict | None = None) -> str:
        """One value, typed as the parser types it, then its end."""
        kind = schema_type(root, key) if root is not None else ""
        if kind in ("string", "str", "text", "enum"):
            return self.string_value(r, key, prop)
        sub = dict(prop) if isinstance(prop, dict) else {} if prop is not False else {"not": {}}
        for defs in ("$defs", "definitions"):  # refs into the tool's schema
            if root is not None and defs in root and defs not in sub:
                sub[defs] = root[defs]
        if kind.startswith("int"):
            sub["type"] = "integer"
            if "enum" not in sub and "const" not in sub:
                sub["minimum"] = max(sub.get("minimum", -INT_LIMIT), -INT_LIMIT)
                sub["maximum"] = min(sub.get("maximum", INT_LIMIT), INT_LIMIT)
        elif kind in ("number", "float", "double"):
            sub["type"] = "number"
            bounds = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
            if not set(sub) - ANNOTATIONS - {"type", "$defs", "definitions"}:
                return seq(r.add(f"/{NUMBER}/", terminal=True), r.literal(self.close))
            if bounds & set(sub) and "enum" not in sub and "const" not in sub:
                if "minimum" not in sub and "exclusiveMinimum" not in sub:
                    sub["minimum"] = -NUMBER_LIMIT
                if "maximum" not in sub and "exclusiveMaximum" not in sub:
                    sub["maximum"] = NUMBER_LIMIT
        elif kind in ("boolean", "bool"):
            sub["type"] = "boolean"
        return seq(r.add(schema_lark(sub)), r.literal(self.close))

    def string_value(self, r: Rules, key: str, prop: object) -> str:
        prop = prop if isinstance(prop, dict) else {}
        unkept = sorted({"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref"} & set(prop))
        if unkept:
            raise InvalidRequestError(f"parameter {key!r}: {unkept[0]!r} can't be kept to in a text value")
        lo, hi, pattern = prop.get("minLength", 0), prop.get("maxLength"), prop.get("pattern")
        choices = prop["enum"] if "enum" in prop else [prop["const"]] if "const" in prop else None
        if choices is not None:
            fits = [c for c in choices if isinstance(c, str) and lo <= len(c) <= (hi if hi is not None else len(c))
                    and (pattern is None or re.search(pattern, c)) and not any(m in c for m in self.value_ends)
                    and (not self.edges or c == c.strip())]
            if not fits:
                raise InvalidRequestError(f"parameter {key!r}: no enum value can be written as text in this syntax")
            return f"({' | '.join(lark_string(c) for c in dict.fromkeys(fits))}) {r.literal(self.close)}"
        also = [pattern_regex(pattern)] if pattern is not None else []
        return r.text(self.close, self.value_ends, lo, hi, also, self.edges)

    def free_value(self, r: Rules) -> str:
        return r.text(self.close, self.value_ends, edges=self.edges)


class QwenXml(KeyValueCalls):
    """`<tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n...</function>\\n</tool_call>`"""

    close = "\n</parameter>"
    value_ends = ("</parameter>", "<parameter=", "</function>")
    key_end = ">"

    def head(self, r: Rules) -> str:
        return lark_string("\n<function=")

    def name(self, r: Rules, name: str) -> str:
        return lark_string(name + ">\n")

    def key(self, r: Rules, key: str | None) -> str:
        if key is None:
            return seq(lark_string("<parameter="), r.add(ANY_KEY, terminal=True), lark_string(">\n"))
        return lark_string(f"<parameter={key}>\n")

    def after(self, r: Rules) -> str:
        return lark_string("\n")

    def tail(self, r: Rules, calls: CallRules) -> str:
        return seq(lark_string("</function>\n"), r.literal("</tool_call>"))


class Glm(KeyValueCalls):
    """`<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>` (GLM 4.7; 4.5 and 4.6
    put a newline after the name and after each key and value: allowed). Values are stripped."""

    close = "</arg_value>"
    value_ends = ("</arg_value>",)
    edges = True
    key_end = "</arg_key>"

    def name(self, r: Rules, name: str) -> str:
        return f'{lark_string(name)} "\\n"?'

    def key(self, r: Rules, key: str | None) -> str:
        text = lark_string(key) if key is not None else r.add(ANY_KEY, terminal=True)
        return f'{r.literal("<arg_key>")} {text} {r.literal("</arg_key>")} "\\n"? {r.literal("<arg_value>")}'

    def after(self, r: Rules) -> str:
        return '"\\n"?'

    def tail(self, r: Rules, calls: CallRules) -> str:
        return r.literal("</tool_call>")


# Each syntax the reply parsers stream (tool_stream PARSERS), as its chat template writes calls
# (whitespace included: a small model left free pads with it).
CALL_GRAMMARS: dict[str, CallSyntax] = {"hermes": Hermes(), "qwen3_coder": QwenXml(), "glm47": Glm(),
                                        "kimi_k2": Kimi(), "mistral": Mistral(), "harmony": Harmony()}


# An agent sends the same tools every turn: their grammar is compiled once (~100 ms for 20 tools).
@lru_cache(maxsize=64)
def compiled(grammar: str, what: str) -> Constraint:
    return Constraint.lark(grammar, what)


@lru_cache(maxsize=1024)
def checked(syntax: str, schema_json: str) -> None:
    """Raises InvalidRequestError where a tool's arguments can't be kept to its schema in `syntax`
    (once per tool: an agent sends the same ones every turn)."""
    CALL_GRAMMARS[syntax].check(json.loads(schema_json))


def schema_lark(schema: dict | bool) -> str:
    return _schema_lark(json.dumps(schema))  # key order kept: the grammar writes properties in it


@lru_cache(maxsize=512)
def _schema_lark(schema_json: str) -> str:
    return Constraint.schema_lark(json.loads(schema_json))


def seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def json_text(name: str) -> str:
    """A name as it appears inside a JSON string."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


def lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def pattern_regex(pattern: str) -> str:
    """A JSON Schema `pattern` (found anywhere in the string, unless anchored) as a whole-text regex."""
    if not isinstance(pattern, str):
        raise InvalidRequestError("a pattern must be a string")
    head = "" if pattern.startswith("^") else "(?s:.*)"
    body = pattern[1:] if pattern.startswith("^") else pattern
    anchored = body.endswith("$") and not body.endswith("\\$")
    body = body[:-1] if anchored else body
    try:
        from llguidance import regex_to_lark

        body = regex_to_lark(body, "dw")
    except Exception as e:
        raise InvalidRequestError(f"the pattern {pattern!r} can't be compiled: {e}") from None
    return f"{head}(?:{body}){'' if anchored else '(?s:.*)'}"


def regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ (Rust regex syntax; `<` and `>` are left alone:
    escaped they are word boundaries there)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text).replace("\n", "\\n")
