"""The model's text -> text, thinking and tool calls, as it streams.

Models write tool calls in their own syntax (Hermes/Qwen: `<tool_call>{json}</tool_call>`).
mlx-lm's tokenizer wrapper knows each model's markers and parser (mlx_lm/tool_parsers);
we use those when the tokenizer has them and fall back to the Hermes form. Text that
might be the start of a marker is held back until it is known not to be. A call that
doesn't parse is passed through as text, never an error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from mlx_lm.tool_parsers import json_tools


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class Segment:
    kind: str  # "text", "thinking" or "tool_call"
    text: str = ""
    call: ToolCall | None = None


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


@dataclass
class Syntax:
    tool_start: str | None = json_tools.tool_call_start
    tool_end: str | None = json_tools.tool_call_end
    parse: Callable[[str, Any], Any] = json_tools.parse_tool_call
    think_start: str | None = None
    think_end: str | None = None


def syntax_for(tokenizer: Any) -> Syntax:
    """The markers of this tokenizer's model (mlx-lm's TokenizerWrapper), Hermes by default."""
    s = Syntax()
    if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_call_start:
        s.tool_start, s.tool_end, s.parse = tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser
    if getattr(tokenizer, "has_thinking", False):
        s.think_start, s.think_end = tokenizer.think_start, tokenizer.think_end
    return s


def _to_calls(parsed: Any, id_prefix: str) -> list[ToolCall]:
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError("not a tool call")
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ValueError("tool arguments are not an object")
        calls.append(ToolCall(new_call_id(id_prefix), item["name"], args))
    return calls


class OutputParser:
    """Feed text deltas; get Segments (text/thinking deltas, whole tool calls)."""

    def __init__(self, syntax: Syntax | None = None, tools: list[dict] | None = None,
                 parse_tools: bool = True, thinking: bool = False, id_prefix: str = "call_"):
        self.s = syntax or Syntax()
        self.tools = tools
        self.parse_tools = parse_tools and bool(self.s.tool_start and self.s.tool_end)
        self.state = "thinking" if thinking and self.s.think_end else "text"
        self.buf = ""
        self.pending_ws = ""  # whitespace-only text held until something follows it
        self.ws_before_call = ""
        self.fresh = True  # no text since the start, a thought or a call: leading whitespace is noise
        self.id_prefix = id_prefix
        self.calls: list[ToolCall] = []

    def _openers(self) -> list[tuple[str, str]]:
        out = []
        if self.parse_tools:
            out.append((self.s.tool_start, "call"))
        if self.s.think_start and self.s.think_end:
            out.append((self.s.think_start, "thinking"))
        return out

    def feed(self, text: str) -> list[Segment]:
        self.buf += text
        out: list[Segment] = []
        while True:
            if self.state == "text":
                hits = [(self.buf.find(m), m, st) for m, st in self._openers()]
                hits = [h for h in hits if h[0] >= 0]
                if hits:
                    i, marker, state = min(hits)
                    self._text(self.buf[:i], out)
                    self.buf = self.buf[i + len(marker):]
                    self.state = state
                    if state == "call":  # whitespace before a call is noise, unless the call is malformed
                        self.ws_before_call, self.pending_ws = self.pending_ws, ""
                    continue
                hold = _partial_overlap(self.buf, [m for m, _ in self._openers()])
                self._text(self.buf[: len(self.buf) - hold], out)
                self.buf = self.buf[len(self.buf) - hold:]
                return out
            if self.state == "thinking":
                i = self.buf.find(self.s.think_end)
                if i >= 0:
                    if self.buf[:i]:
                        out.append(Segment("thinking", self.buf[:i]))
                    self.buf = self.buf[i + len(self.s.think_end):]
                    self.state, self.fresh = "text", True
                    continue
                hold = _partial_overlap(self.buf, [self.s.think_end])
                if len(self.buf) > hold:
                    out.append(Segment("thinking", self.buf[: len(self.buf) - hold]))
                self.buf = self.buf[len(self.buf) - hold:]
                return out
            # inside a tool call: wait for its end marker
            i = self.buf.find(self.s.tool_end)
            if i < 0:
                return out
            body, self.buf = self.buf[:i], self.buf[i + len(self.s.tool_end):]
            self.state = "text"
            self._call(body, out, closed=True)

    def finish(self) -> list[Segment]:
        """The output ended: flush what was held back."""
        out: list[Segment] = []
        if self.state == "call":
            self._call(self.buf, out, closed=False)  # models often stop at EOS without the end marker
        elif self.state == "thinking":
            if self.buf:
                out.append(Segment("thinking", self.buf))
        else:
            self._text(self.buf, out)
        if self.pending_ws:  # trailing whitespace is the model's text too (say, before a stop string)
            out.append(Segment("text", self.pending_ws))
            self.pending_ws = ""
        self.buf, self.state = "", "text"
        return out

    def _call(self, body: str, out: list[Segment], closed: bool) -> None:
        try:
            calls = _to_calls(self.s.parse(body, self.tools), self.id_prefix)
        except Exception:  # malformed: the text goes to the client as it was written
            raw = self.s.tool_start + body + (self.s.tool_end if closed else "")
            self.pending_ws = self.ws_before_call
            self._text(raw, out)
            return
        self.calls.extend(calls)
        self.fresh = True
        out.extend(Segment("tool_call", call=c) for c in calls)

    def _text(self, text: str, out: list[Segment]) -> None:
        if not text:
            return
        text = self.pending_ws + text
        if self.fresh:
            text = text.lstrip()
            self.pending_ws = ""
            if not text:
                return
            self.fresh = False
        if not text.strip():
            self.pending_ws = text
            return
        stripped = text.rstrip()
        self.pending_ws = text[len(stripped):]
        out.append(Segment("text", stripped))


def _partial_overlap(text: str, markers: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def parse_text(text: str, syntax: Syntax | None = None, tools: list[dict] | None = None, **kw) -> list[Segment]:
    """The whole output at once (non-streaming responses): merged segments."""
    p = OutputParser(syntax, tools, **kw)
    merged: list[Segment] = []
    for seg in p.feed(text) + p.finish():
        if merged and seg.kind != "tool_call" and merged[-1].kind == seg.kind:
            merged[-1].text += seg.text
        else:
            merged.append(seg)
    return merged
