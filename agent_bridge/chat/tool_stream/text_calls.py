"""Syntaxes whose arguments are key/value text: Qwen3-Coder's XML and GLM 4.x's
`<arg_key>/<arg_value>`. `ArgsWriter` turns them into JSON as they stream, string values
piece by piece, other values typed from the tool's schema when they end."""

from __future__ import annotations

from agent_bridge.chat.tool_stream.base import ReplyParser, new_value_state, stream_string
from agent_bridge.chat.tool_stream.json_args import ArgsWriter


class KeyValueCalls(ReplyParser):
    """Shared steps: a value streams (strings) or is gathered (other types) up to its end."""

    strip = "newline"

    def begin_value(self, key: str) -> None:
        if self.call is not None:
            self.args(self.writer.key(key))
        self.value_state = new_value_state()

    def read_value(self, ends: list[str]) -> str | None:
        text, marker = stream_string(self, ends, self.strip)
        if self.call is not None:
            self.args(self.writer.chunk(text))
            if marker is not None:
                self.args(self.writer.end_value())
        return marker

    def start(self, name: str) -> None:
        if self.start_call(name):
            self.writer = ArgsWriter(self.schemas.get(self.call.name))

    def end(self) -> None:
        if self.call is not None:
            self.end_call(tail=self.writer.close())
        else:
            self.end_call()
        self.state = "text"


class QwenXml(KeyValueCalls):
    """<tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>
    (Qwen3-Coder, Qwen3.5). One newline around each value is the template's, not the value's."""

    name = "qwen3_coder"
    openers = ("<tool_call>",)
    VALUE_ENDS = ["</parameter>", "<parameter=", "</function>"]

    def open_section(self, marker: str) -> None:
        self.phase, self.head = "function", ""

    def section(self) -> bool:
        if self.phase == "function":  # <function=NAME>
            text, marker = self.until(["<function="])
            if marker is None:
                return False
            self.phase = "name"
            return True
        if self.phase == "name":
            text, marker = self.until([">"])
            self.head += text
            if marker is None:
                return False
            self.start(self.head)
            self.phase = "params"
            return True
        if self.phase == "params":
            if not self.skip_ws():
                return False
            for marker, phase in (("<parameter=", "key"), ("</function>", "after"), ("</tool_call>", "done")):
                if self.buf.startswith(marker):
                    self.take(len(marker))
                    self.phase, self.head = phase, ""
                    break
                if marker.startswith(self.buf):
                    return False  # a marker not yet whole
            else:  # stray text between parameters: skip it
                self.take(1)
            if self.phase == "done":
                self.end()
            return True
        if self.phase == "key":
            text, marker = self.until([">"])
            self.head += text
            if marker is None:
                return False
            self.begin_value(self.head.strip())
            self.phase = "value"
            return True
        if self.phase == "value":
            marker = self.read_value(self.VALUE_ENDS)
            if marker is None:
                return False
            if marker.endswith("<parameter="):
                self.phase, self.head = "key", ""
            elif marker.endswith("</function>"):
                self.phase = "after"
            else:
                self.phase = "params"
            return True
        _, marker = self.until(["</tool_call>"])  # after </function>
        if marker is None:
            return False
        self.end()
        return True


class Glm(KeyValueCalls):
    """<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call> (GLM 4.5-4.7;
    4.7 writes no newlines). Values are stripped, as mlx-lm's glm47 parser does."""

    name = "glm47"
    openers = ("<tool_call>",)
    strip = "space"

    def open_section(self, marker: str) -> None:
        self.phase, self.head = "name", ""

    def section(self) -> bool:
        if self.phase == "name":
            text, marker = self.until(["\n", "<arg_key>", "</tool_call>"])
            self.head += text
            if marker is None:
                return False
            self.start(self.head)
            if marker == "</tool_call>":
                self.end()
            else:
                self.phase = "key" if marker == "<arg_key>" else "between"
            self.head = ""
            return True
        if self.phase == "between":
            text, marker = self.until(["<arg_key>", "</tool_call>"])
            if marker is None:
                return False
            if marker == "</tool_call>":
                self.end()
            else:
                self.phase, self.head = "key", ""
            return True
        if self.phase == "key":
            text, marker = self.until(["</arg_key>"])
            self.head += text
            if marker is None:
                return False
            self.phase = "to_value"
            return True
        if self.phase == "to_value":
            _, marker = self.until(["<arg_value>"])
            if marker is None:
                return False
            self.begin_value(self.head.strip())
            self.phase = "value"
            return True
        marker = self.read_value(["</arg_value>"])
        if marker is None:
            return False
        self.phase, self.head = "between", ""
        return True
