"""Tool arguments as JSON text that is valid whenever it is cut.

`JsonStream` checks JSON that the model writes itself (Hermes, Kimi, harmony, Mistral) one
character at a time and releases only what can still be closed into valid JSON: an object
key waits for its colon, a comma for the next value, a number or literal for its end, an
escape for its last character. `close()` then finishes a cut-off value (`"`, `null`, `}`).

`ArgsWriter` builds the JSON for syntaxes whose arguments are not JSON on the wire (Qwen3-Coder
`<parameter=k>v</parameter>`, GLM `<arg_key>k</arg_key><arg_value>v</arg_value>`): string
values (by the tool's input schema) stream as they are written; other values are typed from
the schema (numbers, booleans, objects) when they end.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

WS = " \t\n\r"
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")


class JsonStream:
    """Feed JSON text for one object; get back the part that is safe to send."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.state = "start"
        self.held = ""
        self.token = ""  # a number or literal being read
        self.hex_left = 0
        self.in_key = False
        self.complete = False
        self.error = ""
        self.sent = False

    def feed(self, text: str) -> tuple[str, str]:
        """(text safe to send, text after the object's end or after an error)."""
        out: list[str] = []
        for i, c in enumerate(text):
            if self.complete or self.error:
                return "".join(out), text[i:]
            if not self._char(c, out):
                self.error = f"invalid JSON at {c!r}"
                return "".join(out), text[i:]
        return "".join(out), ""

    def close(self) -> str:
        """What makes the text sent so far valid JSON (for a value cut short)."""
        if self.complete:
            return ""
        if not self.sent:
            return "{}"
        tail = ""
        if self.state in ("string", "escape", "unicode") and not self.in_key:
            tail = '"'
        elif self.state in ("value", "token") and self.stack[-1] == "{":
            tail = "null"
        return tail + "".join("}" if s == "{" else "]" for s in reversed(self.stack))

    def _release(self, out: list[str]) -> None:
        out.append(self.held)
        self.held = ""
        self.sent = True

    def _char(self, c: str, out: list[str]) -> bool:
        s = self.state
        if s == "string":
            self.held += c
            if c == '"':
                self.state = "colon" if self.in_key else "after"
            elif c == "\\":
                self.state = "escape"
            elif ord(c) < 0x20:
                return False
            if not self.in_key and self.state != "escape":
                self._release(out)
            return True
        if s == "escape":
            self.held += c
            if c == "u":
                self.state, self.hex_left = "unicode", 4
                return True
            if c not in '"\\/bfnrt':
                return False
            self.state = "string"
            if not self.in_key:
                self._release(out)
            return True
        if s == "unicode":
            if c not in "0123456789abcdefABCDEF":
                return False
            self.held += c
            self.hex_left -= 1
            if self.hex_left == 0:
                self.state = "string"
                if not self.in_key:
                    self._release(out)
            return True
        if s == "token":
            if c.isalnum() or c in "+-.":
                self.token += c
                return any(lit.startswith(self.token) for lit in _LITERALS) or bool(
                    re.fullmatch(r"-?[0-9.eE+-]*", self.token))
            if self.token not in _LITERALS and not _NUMBER.fullmatch(self.token):
                return False
            self.held += self.token
            self.token = ""
            self._release(out)
            self.state = "after"
            return self._char(c, out)
        if c in WS:
            if s != "start":  # (leading whitespace is the wire's, not the arguments')
                self.held += c
            return True
        if s == "start":
            if c != "{":  # tool arguments are an object
                return False
            return self._open(c, out, "key_or_end")
        if s in ("value", "value_or_end"):
            if c == "]" and s == "value_or_end":
                return self._close(c, out)
            if c in "{[":
                return self._open(c, out, "key_or_end" if c == "{" else "value_or_end")
            if c == '"':
                self.held += c
                self.state, self.in_key = "string", False
                self._release(out)
                return True
            if c == "-" or c.isalnum():
                self.state, self.token = "token", c
                return any(lit.startswith(c) for lit in _LITERALS) or c == "-" or c.isdigit()
            return False
        if s in ("key", "key_or_end"):
            if c == "}" and s == "key_or_end":
                return self._close(c, out)
            if c != '"':
                return False
            self.held += c
            self.state, self.in_key = "string", True
            return True
        if s == "colon":
            if c != ":":
                return False
            self.held += c
            self._release(out)
            self.state = "value"
            return True
        if s == "after":
            if c == ",":
                self.held += c
                self.state = "key" if self.stack[-1] == "{" else "value"
                return True
            if c in "}]":
                return self._close(c, out)
            return False
        return False

    def _open(self, c: str, out: list[str], state: str) -> bool:
        self.stack.append(c)
        self.held += c
        self._release(out)
        self.state = state
        return True

    def _close(self, c: str, out: list[str]) -> bool:
        if not self.stack or self.stack[-1] != ("{" if c == "}" else "["):
            return False
        self.stack.pop()
        self.held += c
        self._release(out)
        self.state = "after"
        if not self.stack:
            self.complete = True
        return True


# -- arguments written as key/value text --------------------------------------------------

_STRING_TYPES = {"string", "str", "text", "enum"}


def schema_type(schema: dict | None, key: str) -> str:
    """The JSON type the tool's schema gives `key` ("" when it doesn't say)."""
    prop = ((schema or {}).get("properties") or {}).get(key)
    if not isinstance(prop, dict):
        return ""
    kind = prop.get("type")
    if isinstance(kind, list):  # ["string", "null"]
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else ""
    if not kind and "enum" in prop and all(isinstance(v, str) for v in prop["enum"]):
        kind = "string"
    return str(kind or "").lower()


def typed_value(raw: str, kind: str) -> Any:
    """A value written as text, typed by its schema (as mlx-lm's qwen3_coder/glm47 parsers do)."""
    if kind in _STRING_TYPES:
        return raw
    text = raw.strip()
    if kind.startswith("int"):
        try:
            number = float(text)
            return int(number) if number == int(number) else number
        except ValueError:
            return raw
    if kind in ("number", "float", "double"):
        try:
            number = float(text)
            return int(number) if number == int(number) and "." not in text else number
        except ValueError:
            return raw
    if kind in ("boolean", "bool"):
        return text.lower() == "true" if text.lower() in ("true", "false") else raw
    for load in (json.loads, ast.literal_eval):  # objects, arrays, or a type the schema doesn't give
        try:
            value = load(text)
        except Exception:
            continue
        if kind in ("object", "array", "") or value is None:
            return value
    return raw


class ArgsWriter:
    """Builds a JSON object from key/value pieces; `key`, `chunk`, `end_value` and `close`
    return the JSON text to send."""

    def __init__(self, schema: dict | None) -> None:
        self.schema = schema
        self.count = 0
        self.kind: str | None = None  # the open value's type; None between values
        self.pending = ""  # a non-string value, typed when it ends

    @property
    def streaming(self) -> bool:
        return self.kind in _STRING_TYPES

    def key(self, name: str) -> str:
        self.kind = schema_type(self.schema, name)
        self.pending = ""
        head = ("{" if self.count == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        self.count += 1
        return head + ('"' if self.streaming else "")

    def chunk(self, raw: str) -> str:
        if self.streaming:
            return json.dumps(raw, ensure_ascii=False)[1:-1]
        self.pending += raw
        return ""

    def end_value(self) -> str:
        if self.kind is None:
            return ""
        out = '"' if self.streaming else json.dumps(typed_value(self.pending, self.kind), ensure_ascii=False)
        self.kind, self.pending = None, ""
        return out

    def close(self) -> str:
        """The end of the object; also finishes a value cut short."""
        return self.end_value() + ("}" if self.count else "{}")


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


def schema_problems(schema: dict | None, args: dict) -> list[str]:
    """Where arguments break the top level of the tool's input schema (required keys, JSON
    types, keys it forbids). Deeper rules are the client's to check, as with any API."""
    if not isinstance(schema, dict):
        return []
    props = schema.get("properties") or {}
    problems = [f"missing {k!r}" for k in schema.get("required") or [] if k not in args]
    for key, value in args.items():
        prop = props.get(key)
        if prop is None:
            if schema.get("additionalProperties") is False:
                problems.append(f"unknown {key!r}")
            continue
        kinds = prop.get("type") if isinstance(prop, dict) else None
        kinds = [kinds] if isinstance(kinds, str) else kinds or []
        types: tuple = ()
        for k in kinds:
            t = _JSON_TYPES.get(k, ())
            types += t if isinstance(t, tuple) else (t,)
        if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            problems.append(f"{key!r} is not {' or '.join(kinds)}")
    return problems
