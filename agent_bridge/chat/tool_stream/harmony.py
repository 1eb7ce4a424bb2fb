"""gpt-oss's harmony format: the reply is a run of messages, each
`[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][<|constrain|>json]<|message|>BODY` ended by
`<|end|>`, `<|call|>` or `<|return|>` (the last two are end-of-turn tokens, so the engine may stop
before them). `analysis` is reasoning, `final` and a `commentary` without a recipient are text,
`commentary to=functions.NAME` is a call whose body is its JSON arguments."""

from __future__ import annotations

import re

from agent_bridge.chat.tool_stream.base import ReplyParser, held_back
from agent_bridge.chat.tool_stream.events import Reasoning, Text

_ENDS = ["<|end|>", "<|call|>", "<|return|>"]
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class Harmony(ReplyParser):
    name = "harmony"

    def __init__(self, tools: list[dict] | None = None, parse_tools: bool = True, **kw):
        kw["think"] = (None, None)  # reasoning is the analysis channel
        super().__init__(tools, parse_tools, **kw)
        self.parse_tools = parse_tools and bool(self.schemas)
        self.state, self.phase, self.head = "section", "header", ""

    def section(self) -> bool:
        if self.phase == "header":
            text, marker = self.until(["<|message|>"])
            self.head += text
            if marker is None:
                return False
            channel = _CHANNEL.search(self.head)
            recipient = _RECIPIENT.search(self.head)
            channel = channel.group(1) if channel else "final"
            if recipient and recipient.group(1).startswith("functions.") and self.parse_tools:
                self.mark(self.head + "<|message|>")
                self.phase = "args" if self.start_call(recipient.group(1)[len("functions."):]) else "rejected"
            else:
                self.phase = "analysis" if channel == "analysis" else "text"
            self.head = ""
            return True
        text, marker = self.until(_ENDS)
        if self.phase == "analysis":
            if text:
                self.out.append(Reasoning(text))
        elif self.phase == "text":
            self._text(text)
        elif self.phase == "args":
            rest = self.json_args(text)
            if rest.strip() and not self.jstream.error:
                self.jstream.error = "text after the arguments"
        if marker is None:
            return False
        self.end_message()
        return True

    def end_message(self) -> None:
        if self.phase == "args":
            whole = self.jstream is not None and self.jstream.complete
            self.end_call(complete=whole, tail="" if whole else self.close_args()[0],
                          note="" if whole else "malformed arguments; closed to stay valid JSON")
        elif self.phase == "rejected":
            self.end_call()
        elif self.phase == "analysis":
            self.fresh = True
        self.phase, self.head = "header", ""

    def finish(self, cut: bool = False):
        self.out, self.primed, self.cut = self.primed, [], cut
        self._run()
        if cut and self.phase != "header":  # an end marker cut short is markup
            self.buf = self.buf[: len(self.buf) - held_back(self.buf, _ENDS)]
        if self.phase == "header":
            if self.head.strip() and not cut and "<|channel|>" not in self.head:
                self._text(self.head + self.buf)  # no harmony at all: plain text
        elif self.phase == "analysis" and self.buf:
            self.out.append(Reasoning(self.buf))
        elif self.phase == "text":
            self._text(self.buf)
        elif self.phase == "args":  # the engine stopped at <|call|>, or max_tokens cut the arguments
            self.json_args(self.buf)
            tail, whole = self.close_args()
            self.end_call(complete=whole and not cut, tail=tail)
        elif self.phase == "rejected":
            self.end_call()
        if self.pending_ws and not self.fresh and not cut:
            self.out.append(Text(self.pending_ws))
        self.buf, self.pending_ws, self.phase, self.head = "", "", "header", ""
        return self.done_step(True)

