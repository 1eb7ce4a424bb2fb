"""What a reply parser reports while the model writes: text, reasoning and tool calls.

A tool call is reported in three steps so clients can show it growing: `CallStart` as soon
as the tool's name is known, `CallArgs` pieces of its JSON arguments as the model writes
them (the pieces always concatenate to valid JSON once the call ends), `CallEnd`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    index: int  # position among this reply's calls (OpenAI's `tool_calls[i].index`)
    id: str
    name: str
    arguments_json: str = ""  # exactly the concatenated CallArgs pieces
    complete: bool = False  # False: cut by max_tokens (or malformed); its JSON was closed for it
    note: str = ""

    @property
    def arguments(self) -> dict:
        try:
            value = json.loads(self.arguments_json) if self.arguments_json else {}
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass
class Text:
    text: str


@dataclass
class Reasoning:
    text: str


@dataclass
class CallStart:
    call: ToolCall


@dataclass
class CallArgs:
    call: ToolCall
    text: str


@dataclass
class CallEnd:
    call: ToolCall


Event = Text | Reasoning | CallStart | CallArgs | CallEnd


@dataclass
class Block:
    """One piece of the whole reply: merged text, merged reasoning, or one call."""

    kind: str  # "text", "reasoning" or "call"
    text: str = ""
    call: ToolCall | None = None


@dataclass
class Reply:
    blocks: list[Block] = field(default_factory=list)

    def add(self, event: Event) -> None:
        if isinstance(event, (Text, Reasoning)):
            kind = "text" if isinstance(event, Text) else "reasoning"
            if self.blocks and self.blocks[-1].kind == kind:
                self.blocks[-1].text += event.text
            else:
                self.blocks.append(Block(kind, event.text))
        elif isinstance(event, CallStart):
            self.blocks.append(Block("call", call=event.call))

    @property
    def calls(self) -> list[ToolCall]:
        return [b.call for b in self.blocks if b.kind == "call"]

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "text")

    @property
    def reasoning(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "reasoning")
