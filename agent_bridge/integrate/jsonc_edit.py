"""Editing JSON and JSON with comments in place: every byte we don't change stays as it was.

`parse` reads the text into nodes that know their spans; `add_member`, `append_item` and
`replace_value` each make one edit and return the new text (callers re-parse for the next
one: config files are small). Comments, trailing commas, layout and string contents are
left alone because only the spans an edit names are touched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class JsoncError(ValueError):
    pass


@dataclass
class Node:
    kind: str  # "object", "array", "value"
    start: int  # first character of the value
    end: int  # one past its last character
    members: dict[str, "Node"] = field(default_factory=dict)  # objects: key -> value node
    items: list["Node"] = field(default_factory=list)  # arrays


def skip(text: str, i: int) -> int:
    """Index of the next character that is not whitespace or inside a comment."""
    n = len(text)
    while i < n:
        if text[i] in " \t\r\n\ufeff":
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                raise JsoncError(f"unterminated comment at {i}")
            i = end + 2
        else:
            break
    return i


def _string_end(text: str, i: int) -> int:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    raise JsoncError(f"unterminated string at {i}")


def parse(text: str) -> Node:
    node, i = _value(text, skip(text, 0))
    if skip(text, i) != len(text):
        raise JsoncError(f"unexpected text at {skip(text, i)}")
    return node


def _value(text: str, i: int) -> tuple[Node, int]:
    if i >= len(text):
        raise JsoncError("unexpected end of text")
    c = text[i]
    if c == "{":
        node, j = Node("object", i, i), skip(text, i + 1)
        while text[j : j + 1] != "}":
            if text[j : j + 1] != '"':
                raise JsoncError(f"expected a key at {j}")
            k_end = _string_end(text, j)
            key = json.loads(text[j:k_end])
            j = skip(text, k_end)
            if text[j : j + 1] != ":":
                raise JsoncError(f"expected ':' at {j}")
            value, j = _value(text, skip(text, j + 1))
            node.members[key] = value
            j = skip(text, j)
            if text[j : j + 1] == ",":
                j = skip(text, j + 1)
            elif text[j : j + 1] != "}":
                raise JsoncError(f"expected ',' or '}}' at {j}")
        node.end = j + 1
        return node, j + 1
    if c == "[":
        node, j = Node("array", i, i), skip(text, i + 1)
        while text[j : j + 1] != "]":
            value, j = _value(text, j)
            node.items.append(value)
            j = skip(text, j)
            if text[j : j + 1] == ",":
                j = skip(text, j + 1)
            elif text[j : j + 1] != "]":
                raise JsoncError(f"expected ',' or ']' at {j}")
        node.end = j + 1
        return node, j + 1
    if c == '"':
        end = _string_end(text, i)
    else:
        end = i
        while end < len(text) and text[end] not in ",]} \t\r\n/":
            end += 1
    try:
        json.loads(text[i:end])
    except ValueError:
        raise JsoncError(f"bad value {text[i:end]!r} at {i}") from None
    return Node("value", i, end), end


def node_at(root: Node, path: list) -> Node:
    node = root
    for key in path:
        node = node.members[key] if node.kind == "object" else node.items[key]
    return node


def _indent_of(text: str, i: int) -> str:
    line_start = text.rfind("\n", 0, i) + 1
    head = text[line_start:i]
    return head[: len(head) - len(head.lstrip())]


def _dump(value: Any, indent: str, step: str) -> str:
    if not isinstance(value, (dict, list)) or not value:
        return json.dumps(value)
    return json.dumps(value, indent=len(step)).replace("\n", "\n" + indent)


def _insert(text: str, container: Node, last: Node | None, entry_for) -> str:
    """Insert a member/item after `last` (or into the empty `container`) on its own line."""
    if last is None:
        outer = _indent_of(text, container.start)
        inner = outer + "  "
        pos = container.start + 1
        return text[:pos] + "\n" + inner + entry_for(inner, "  ") + "\n" + outer + text[container.end - 1:]
    indent = _indent_of(text, last.start)
    if "\n" not in text[container.start : last.start]:
        indent = ""  # a one-line container: stay on its line
    step = "  " if not indent else indent[: max(2, len(indent) - len(_indent_of(text, container.start)))]
    after = skip(text, last.end)
    has_comma = text[after : after + 1] == ","
    pos = after + 1 if has_comma else last.end
    comma = "" if has_comma else ","
    # a comment that ends the line stays with the entry it was written after
    line_end = text.find("\n", pos)
    rest = text[pos : line_end if line_end >= 0 else len(text)]
    if rest.strip().startswith("//"):
        pos_entry = line_end
    else:
        pos_entry = pos
    sep = "\n" + indent if indent else " "
    entry = sep + entry_for(indent, step) + ("," if has_comma else "")
    if pos_entry == pos:
        return text[: last.end] + comma + text[last.end : pos] + entry + text[pos:]
    return text[: last.end] + comma + text[last.end : pos_entry] + entry + text[pos_entry:]


def add_member(text: str, path: list, key: str, value: Any) -> str:
    obj = node_at(parse(text), path)
    last = list(obj.members.values())[-1] if obj.members else None
    return _insert(text, obj, last, lambda ind, step: f"{json.dumps(key)}: {_dump(value, ind, step)}")


def append_item(text: str, path: list, value: Any) -> str:
    arr = node_at(parse(text), path)
    last = arr.items[-1] if arr.items else None
    if last is None and "\n" not in text[arr.start : arr.end]:
        return text[: arr.start + 1] + _dump(value, "", "  ") + text[arr.end - 1 :]
    return _insert(text, arr, last, lambda ind, step: _dump(value, ind, step))


def replace_value(text: str, path: list, value: Any) -> str:
    node = node_at(parse(text), path)
    return text[: node.start] + _dump(value, _indent_of(text, node.start), "  ") + text[node.end :]
