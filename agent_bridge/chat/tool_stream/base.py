"""The part every syntax shares: text and `<think>` reasoning around tool-call sections,
markers held back until they are known, calls checked against the offered tools.

A syntax subclass names the markers that open a call section (`openers`) and implements
`section()`, which consumes `self.buf` while inside one and returns False when it needs more
text. Everything it consumes is kept in `self.markup` (since the last `mark()`), so a call
that names an unknown tool goes to the client as the text the model wrote, with a note.
"""

from __future__ import annotations

from typing import Any

from agent_bridge.chat.tool_stream.events import CallArgs, CallEnd, CallStart, Event, Reasoning, Text, ToolCall, new_call_id
from agent_bridge.chat.tool_stream.json_args import ArgsWriter, JsonStream, schema_problems


class ReplyParser:
    openers: tuple[str, ...] = ()
    name = "none"

    def __init__(self, tools: list[dict] | None = None, parse_tools: bool = True, thinking: bool = False,
                 think: tuple[str | None, str | None] = ("<think>", "</think>"), id_prefix: str = "call_"):
        self.schemas: dict[str, dict] = {}
        for t in tools or []:
            fn = t.get("function", t)
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                self.schemas[fn["name"]] = fn.get("parameters") or fn.get("input_schema") or {}
        self.parse_tools = parse_tools and bool(self.schemas) and bool(self.openers)
        self.think_start, self.think_end = think
        self.state = "thinking" if thinking and self.think_end else "text"
        self.id_prefix = id_prefix
        self.buf = ""
        self.out: list[Event] = []
        self.primed: list[Event] = []
        self.visible = ""  # all text sent as text (what a client echoes back)
        self.reasoned = False  # some reasoning was sent
        self.on_finish = None  # called with the parser once the reply is whole
        self.calls: list[ToolCall] = []
        self.call: ToolCall | None = None  # the call being written
        self.jstream: JsonStream | None = None  # its arguments, when the model writes JSON
        self.writer: ArgsWriter | None = None  # its arguments, when written as key/value text
        self.value_state = new_value_state()
        self.rejected = ""  # the name of a call that goes out as text
        self.notes: list[str] = []
        self.markup = ""
        self.ws_before_call = ""  # whitespace before a call: noise, unless the call goes out as text
        self.cut = False
        self.pending_ws = ""  # whitespace held until something follows it
        self.fresh = True  # nothing said since the start, a thought or a call: leading whitespace is noise

    # -- driving ------------------------------------------------------------------------
    def prime(self, text: str) -> None:
        """Text the server wrote for the model (a forced call's opening): parsed as the model's,
        its events handed out with the next feed or finish."""
        self.primed = self.feed(text)

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        self.out, self.primed = self.primed, []
        self._run()
        return self.done_step(False)

    def done_step(self, final: bool) -> list[Event]:
        self.visible += "".join(e.text for e in self.out if isinstance(e, Text))
        self.reasoned = self.reasoned or any(isinstance(e, Reasoning) for e in self.out)
        if final and self.on_finish is not None:
            self.on_finish(self)
        return self.out

    def finish(self, cut: bool = False) -> list[Event]:
        """The output ended: at EOS or a stop string, or `cut` by max_tokens."""
        self.out, self.primed, self.cut = self.primed, [], cut
        self._run()
        if cut:  # a marker cut short is markup, not text
            self.buf = self.buf[: len(self.buf) - held_back(self.buf, self._markers() + [self.think_end or ""])]
        if self.state == "text":
            self._text(self.buf)
        elif self.state == "thinking":
            if self.buf:
                self.out.append(Reasoning(self.buf))
        else:
            self.end_of_output()
        if self.pending_ws and not self.fresh and not cut:  # trailing whitespace is the model's text too
            self.out.append(Text(self.pending_ws))
        self.buf, self.pending_ws, self.state = "", "", "text"
        return self.done_step(True)

    def _run(self) -> None:
        while True:
            if self.state == "text":
                progressed = self._top()
            elif self.state == "thinking":
                progressed = self._thinking()
            else:
                progressed = self.section()
            if not progressed:
                return

    def _markers(self) -> list[str]:
        markers = [m for m in (self.think_start,) if m and self.think_end]
        return markers + list(self.openers) if self.parse_tools else markers

    def _top(self) -> bool:
        markers = self._markers()
        i, marker = find_first(self.buf, markers)
        if marker is None:
            self._text(self.buf[: len(self.buf) - held_back(self.buf, markers)])
            self.buf = self.buf[len(self.buf) - held_back(self.buf, markers):]
            return False
        self._text(self.buf[:i])
        self.buf = self.buf[i + len(marker):]
        if marker == self.think_start:
            self.state = "thinking"
        else:
            self.ws_before_call, self.pending_ws = self.pending_ws, ""
            self.markup = marker
            self.state = "section"
            self.open_section(marker)
        return True

    def _thinking(self) -> bool:
        i = self.buf.find(self.think_end)
        if i < 0:
            keep = held_back(self.buf, [self.think_end])
            if len(self.buf) > keep:
                self.out.append(Reasoning(self.buf[: len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        if i:
            self.out.append(Reasoning(self.buf[:i]))
        self.buf = self.buf[i + len(self.think_end):]
        self.state, self.fresh = "text", True
        return True

    # -- for syntaxes -------------------------------------------------------------------
    def open_section(self, marker: str) -> None:
        pass

    def section(self) -> bool:
        raise NotImplementedError

    def end_of_output(self) -> None:
        """Output ended inside a call section: close a started call, drop or release the rest."""
        self.take(len(self.buf))
        if self.call is not None:
            tail, complete = self.close_args()
            self.end_call(complete=complete and not self.cut, tail=tail)
        elif self.rejected:
            self.release_markup(f"the model called {self.rejected!r}, which is not among the offered tools")
        elif self.cut:
            self.notes.append("a tool call cut by max_tokens before its name was written was dropped")
        else:  # the model stopped in the middle of its markup: show what it wrote
            self.release_markup("")
        self.state = "text"

    def close_args(self) -> tuple[str, bool]:
        """At the end of output inside a started call: (what closes its JSON, was it whole)."""
        if self.writer is not None:
            return self.writer.close(), False
        if self.jstream is not None:
            return self.jstream.close(), self.jstream.complete
        return "{}", False

    def take(self, n: int) -> str:
        text, self.buf = self.buf[:n], self.buf[n:]
        self.markup += text
        return text

    def mark(self, text: str = "") -> None:
        """A call's own markup starts here (for releasing it as text)."""
        self.markup = text

    def until(self, markers: list[str]) -> tuple[str, str | None]:
        """Consume up to the first marker (returned, consumed too) or up to a possible partial one."""
        i, marker = find_first(self.buf, markers)
        if marker is None:
            return self.take(len(self.buf) - held_back(self.buf, markers)), None
        text = self.take(i)
        self.take(len(marker))
        return text, marker

    def skip_ws(self) -> bool:
        """Drop leading whitespace; True when something else follows."""
        n = len(self.buf) - len(self.buf.lstrip())
        self.take(n)
        return bool(self.buf)

    def start_call(self, name: str) -> bool:
        """The name is known: start the call, or (unknown tool) keep its markup to release as text."""
        name = name.strip()
        if name not in self.schemas:
            self.rejected = name or "?"
            return False
        self.call = ToolCall(len(self.calls), new_call_id(self.id_prefix), name)
        self.calls.append(self.call)
        self.jstream, self.writer = None, None
        self.out.append(CallStart(self.call))
        return True

    def args(self, text: str) -> None:
        if text and self.call is not None:
            self.call.arguments_json += text
            self.out.append(CallArgs(self.call, text))

    def end_call(self, complete: bool = True, tail: str = "", note: str = "") -> None:
        """The call ended; `tail` is what closes its JSON."""
        if self.call is not None:
            self.args(tail)
            self.call.complete, self.call.note = complete, note
            problems = schema_problems(self.schemas.get(self.call.name), self.call.arguments) if complete else []
            if problems:  # already streamed: the client hears it here (and checks input itself, as Claude Code does)
                self.call.note = "arguments do not match the tool's input schema: " + "; ".join(problems)
            if not complete and not note:
                self.call.note = ("cut by max_tokens; its arguments were closed to stay valid JSON" if self.cut
                                  else "the model stopped inside this call; its arguments were closed")
            if self.call.note:
                self.notes.append(f"tool call {self.call.index} ({self.call.name}): {self.call.note}")
            self.out.append(CallEnd(self.call))
            self.call, self.jstream, self.writer = None, None, None
            self.fresh = True
        elif self.rejected:
            self.release_markup(f"the model called {self.rejected!r}, which is not among the offered tools")
        self.markup = ""

    def release_markup(self, note: str) -> None:
        if note:
            self.notes.append(note + "; its call is returned as text")
        self.pending_ws = self.ws_before_call
        self._text(self.markup)
        self.rejected, self.markup = "", ""

    def end_json_call(self) -> None:
        """End a call whose arguments came through `json_args`: an object the model left
        malformed or unfinished is closed, so the streamed pieces still make valid JSON."""
        if self.call is None:
            self.end_call()
            return
        tail, whole = self.close_args()
        self.end_call(complete=whole, tail="" if whole else tail,
                      note="" if whole else "malformed arguments; closed to stay valid JSON")

    def json_args(self, text: str) -> str:
        """Feed the model's JSON arguments; returns what follows the object once it is complete."""
        if self.jstream is None:
            self.jstream = JsonStream()
        safe, rest = self.jstream.feed(text)
        self.args(safe)
        return rest

    def _text(self, text: str) -> None:
        if not text:
            return
        text = self.pending_ws + text
        self.pending_ws = ""
        if self.fresh:
            text = text.lstrip()
            if not text:
                return
            self.fresh = False
        stripped = text.rstrip()
        self.pending_ws = text[len(stripped):]
        if stripped:
            self.out.append(Text(stripped))


def find_first(text: str, markers: list[str]) -> tuple[int, str | None]:
    best, found = -1, None
    for m in markers:
        i = text.find(m)
        if i >= 0 and (best < 0 or i < best or (i == best and len(m) > len(found))):
            best, found = i, m
    return best, found


def held_back(text: str, markers: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def stream_string(parser: ReplyParser, ends: list[str], strip: str) -> tuple[str, str | None]:
    """Read a text value up to one of `ends`, holding back what may yet be stripped:
    `strip="newline"` drops one leading and one trailing newline (Qwen3-Coder), `"space"`
    all surrounding whitespace (GLM). Returns (text to send, the end marker or None)."""
    raw, marker = parser.until(ends)
    st = parser.value_state
    if not st["started"]:
        if not raw and marker is None:
            return "", None
        if strip == "newline" and raw.startswith("\n"):
            raw = raw[1:]
        st["started"] = True
    if strip == "space" and not st["sent"]:
        raw = raw.lstrip()
    text = st["held"] + raw
    if marker is not None:  # the value's end
        if strip == "newline" and text.endswith("\n"):
            text = text[:-1]
        elif strip == "space":
            text = text.rstrip()
        st["held"] = ""
        return text, marker
    keep = len(text) - len(text.rstrip()) if strip == "space" else (1 if text.endswith("\n") else 0)
    st["held"] = text[len(text) - keep:]
    out = text[: len(text) - keep]
    if out:
        st["sent"] = True
    return out, None


def new_value_state() -> dict[str, Any]:
    return {"started": False, "held": "", "sent": False}
