"""Any other syntax mlx-lm knows (MiniMax, Gemma, pythonic...): its own start/end markers and
parser, the call sent whole once its end marker is read (no argument streaming)."""

from __future__ import annotations

import json
from typing import Any, Callable

from agent_bridge.chat.tool_stream.base import ReplyParser


class WholeCalls(ReplyParser):
    name = "mlx_lm"

    def __init__(self, *args, start: str, end: str, parse: Callable[[str, Any], Any], **kw):
        self.openers, self.end, self.parse = (start,), end, parse
        super().__init__(*args, **kw)
        self.tool_list = [{"type": "function", "function": {"name": n, "parameters": s}}
                          for n, s in self.schemas.items()]

    def section(self) -> bool:
        i = self.buf.find(self.end) if self.end else -1
        if i < 0:
            return False
        body = self.take(i)
        self.take(len(self.end))
        self.whole(body)
        return True

    def end_of_output(self) -> None:
        if self.cut or not self.buf.strip():
            return super().end_of_output()
        self.whole(self.take(len(self.buf)))  # models often stop at EOS without the end marker

    def whole(self, body: str) -> None:
        self.state = "text"
        try:
            parsed = self.parse(body, self.tool_list)
            items = parsed if isinstance(parsed, list) else [parsed]
            for item in items:
                if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", {}), (dict, str)):
                    raise ValueError
        except Exception:
            self.release_markup("")
            return
        for item in items:
            args = item.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
            if self.start_call(item["name"]):
                self.args(json.dumps(args, ensure_ascii=False))
            self.end_call()
