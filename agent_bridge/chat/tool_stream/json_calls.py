"""Syntaxes whose arguments are JSON on the wire: Hermes/Qwen `<tool_call>`, Kimi K2's
section tokens, Mistral's `[TOOL_CALLS]`. The arguments stream through `JsonStream`."""

from __future__ import annotations

import json
import re

from agent_bridge.chat.tool_stream.base import ReplyParser
from agent_bridge.chat.tool_stream.json_args import JsonStream

_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class Hermes(ReplyParser):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` (Hermes, Qwen 2.5/3).

    The usual key order (name first) streams; any other order is read whole at `</tool_call>`."""

    name = "hermes"
    openers = ("<tool_call>",)
    end = "</tool_call>"

    def open_section(self, marker: str) -> None:
        self.phase = "head"

    def section(self) -> bool:
        if self.phase == "head":
            m = _HERMES_HEAD.match(self.buf)
            if m:
                self.take(m.end())
                self.phase = "args" if self.start_call(json.loads(f'"{m.group(1)}"')) else "rest"
                return True
            i = self.buf.find(self.end)
            if i < 0:
                return False
            body = self.take(i)
            self.take(len(self.end))
            self.whole_call(body)
            return True
        if self.phase == "args":
            text = self.buf
            rest = self.json_args(text)
            self.take(len(text) - len(rest))
            if self.jstream.complete or self.jstream.error:
                self.phase = "rest"
                return True
            return False
        _, marker = self.until([self.end])  # after the arguments: up to the end marker
        if marker is None:
            return False
        self.finish_call()
        return True

    def finish_call(self) -> None:
        self.end_json_call()
        self.state = "text"

    def whole_call(self, body: str) -> None:
        """A call in a form that can't stream: parsed at its end."""
        self.state = "text"
        try:
            item = json.loads(body)
            args = item.get("arguments", item.get("parameters", {}))
            args = json.loads(args) if isinstance(args, str) else args
            if not isinstance(item.get("name"), str) or not isinstance(args, dict):
                raise ValueError
        except (ValueError, AttributeError):
            self.release_markup("")  # not a call: what the model wrote goes out as text
            return
        if self.start_call(item["name"]):
            self.args(json.dumps(args, ensure_ascii=False))
        self.end_call()


class Kimi(ReplyParser):
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
    {...}<|tool_call_end|>...<|tool_calls_section_end|>` (Kimi K2)."""

    name = "kimi_k2"
    openers = ("<|tool_calls_section_begin|>",)
    CALL, ARGS, END, SECTION_END = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                                    "<|tool_calls_section_end|>")

    def open_section(self, marker: str) -> None:
        self.phase, self.head = "between", ""

    def section(self) -> bool:
        if self.phase == "between":
            _, marker = self.until([self.CALL, self.SECTION_END])
            if marker == self.CALL:
                self.mark(marker)
                self.phase, self.head = "head", ""
            elif marker == self.SECTION_END:
                self.state = "text"
            return marker is not None
        if self.phase == "head":  # functions.get_weather:0
            text, marker = self.until([self.ARGS])
            self.head += text
            if marker is None:
                return False
            name = re.sub(r":\d+$", "", self.head.strip())
            name = name[len("functions."):] if name.startswith("functions.") else name
            self.phase = "args" if self.start_call(name) else "rest"
            return True
        if self.phase == "args":
            text, marker = self.until([self.END])
            rest = self.json_args(text)
            if marker is None and not rest.strip():
                return False
            if marker is None:  # junk after the object: read on to the end marker
                self.phase = "rest"
                return True
            self.finish_call()
            return True
        _, marker = self.until([self.END])
        if marker is None:
            return False
        self.finish_call()
        return True

    def finish_call(self) -> None:
        self.end_json_call()
        self.phase = "between"


class Mistral(ReplyParser):
    """`[TOOL_CALLS]name[ARGS]{...}` (Mistral Small 3.2, Devstral, Magistral; `[CALL_ID]id`
    may precede `[ARGS]`), and the older `[TOOL_CALLS][{"name": ..., "arguments": ...}]`,
    which is read whole once its array is complete. There is no end marker."""

    name = "mistral"
    openers = ("[TOOL_CALLS]",)

    def open_section(self, marker: str) -> None:
        self.phase, self.head = "start", ""

    def section(self) -> bool:
        if self.phase == "start":
            if not self.skip_ws():
                return False
            self.phase = "array" if self.buf[0] == "[" else "head"
            return True
        if self.phase == "array":
            try:
                items, end = json.JSONDecoder().raw_decode(self.buf)
            except ValueError:
                return False
            self.take(end)
            self.state = "text"
            if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str)
                                                       for i in items):
                self.release_markup("")
                return True
            for item in items:
                args = item.get("arguments", {})
                if self.start_call(item["name"]):
                    self.args(json.dumps(args if isinstance(args, dict) else {}, ensure_ascii=False))
                self.end_call()
            return True
        if self.phase == "head":
            text, marker = self.until(["[ARGS]"])
            self.head += text
            if marker is None:
                return False
            name = self.head.split("[CALL_ID]")[0]
            self.phase = "args" if self.start_call(name) else "rejected"
            return True
        text = self.buf
        rest = self.json_args(text) if self.phase == "args" else self._rejected_json(text)
        self.take(len(text) - len(rest))
        if self.phase == "args" and (self.jstream.complete or self.jstream.error):
            self.end_json_call()
            self.state = "text"
            return True
        if self.phase == "rejected" and self.jstream.complete:
            self.end_call()
            self.state = "text"
            return True
        return False

    def _rejected_json(self, text: str) -> str:
        """An unknown tool's arguments: read (to find their end) but not sent."""
        if self.jstream is None:
            self.jstream = JsonStream()
        _, rest = self.jstream.feed(text)
        if self.jstream.error:
            self.jstream.complete = True
        return rest
