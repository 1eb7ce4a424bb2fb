"""An assistant turn that comes back renders to the tokens the model wrote.

A chat template re-renders an earlier reply from its parsed parts (tool calls as JSON its own
way, reasoning dropped or moved), which is rarely the exact text the model produced: the
prompt then differs from the cached one at the first reply and the prefix cache misses from
there. So the server remembers each finished reply by what the client will send back (its
tool-call ids, or its text when it has none) and, when that assistant message returns,
renders the conversation with a placeholder in its place and splices in the model's own
token ids.

Around the placeholder the template writes the assistant header its way for history and its
generation prompt its way for a new reply (`<think>\\n`, harmony's `<|channel|>final<|message|>`):
their common prefix is kept, the rest replaced by the generation prompt's tail, so the turn is
exactly prompt + output as it was generated.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from agent_bridge.chat.chat_request import fold_system_messages

PLACEHOLDER = "MLXDSPARKTURN{}END"
_PROBE = [{"role": "user", "content": "MLXDSPARKPROBE"}]


@dataclass
class Turn:
    written: str  # what the server wrote for the model after the generation prompt (a forced call's opening)
    output_ids: list[int]


def turn_key(message: dict) -> tuple | None:
    """What identifies an assistant message the client sends back."""
    if message.get("role") != "assistant":
        return None
    calls = message.get("tool_calls")
    if calls:
        return ("calls",) + tuple(str(c.get("id", "")) for c in calls)
    text = (message.get("content") or "").strip()
    return ("text", text) if text else None


class TurnMemory:
    def __init__(self, size: int = 256):
        self.size = size
        self.turns: OrderedDict[tuple, Turn] = OrderedDict()

    def remember(self, key: tuple | None, turn: Turn) -> None:
        if key is None:
            return
        self.turns[key] = turn
        self.turns.move_to_end(key)
        while len(self.turns) > self.size:
            self.turns.popitem(last=False)

    def get(self, key: tuple | None) -> Turn | None:
        return self.turns.get(key) if key is not None else None


def reply_key(parser: Any) -> tuple | None:
    """The key of a reply as the parser saw it (the same the client's echo will have). Call ids
    are unique; a reply of text alone is keyed by its text, so only one without reasoning is
    kept (another conversation's echo of the same words must not bring this one's thoughts)."""
    if parser.calls:
        return ("calls",) + tuple(c.id for c in parser.calls)
    text = parser.visible.strip()
    return ("text", text) if text and not parser.reasoned else None


def _apply(tokenizer: Any, messages: list[dict], tools: Any, generation: bool, kwargs: dict) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation,
                                         tokenize=False, **kwargs)


def render_replayed(engine: Any, messages: list[dict], tools: Any, kwargs: dict, memory: TurnMemory) -> list[int] | None:
    """Prompt ids with remembered turns spliced in; None when no message is one (or the template can't)."""
    turns: list[Turn] = []
    shown = []
    for m in messages:
        turn = memory.get(turn_key(m))
        if turn is None:
            shown.append(m)
        else:
            shown.append({"role": "assistant", "content": PLACEHOLDER.format(len(turns))})
            turns.append(turn)
    if not turns:
        return None
    tok = engine.tokenizer
    try:
        try:
            text = _apply(tok, shown, tools, True, kwargs)
        except Exception:  # templates that refuse a second system message (chat_request.render)
            text = _apply(tok, fold_system_messages(shown), tools, True, kwargs)
        fresh = _apply(tok, _PROBE, tools, True, kwargs)
        history = _apply(tok, _PROBE + [{"role": "assistant", "content": PLACEHOLDER.format("P")}], tools, False, kwargs)
    except Exception:
        return None
    header = history[: history.find(PLACEHOLDER.format("P"))]
    common = 0
    while common < min(len(header), len(fresh)) and header[common] == fresh[common]:
        common += 1
    drop, tail = len(header) - common, fresh[common:]  # history's header part -> generation prompt's tail
    ids: list[int] = []
    rest = text
    for i, turn in enumerate(turns):
        before, found, rest = rest.partition(PLACEHOLDER.format(i))
        if not found or (drop and not before.endswith(header[common:])):
            return None
        ids += engine.encode(before[: len(before) - drop] + tail)
        if turn.written:
            ids += engine.encode(turn.written)
        ids += turn.output_ids
    return ids + engine.encode(rest)
