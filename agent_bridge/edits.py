"""Turning a model's reply into a checked file edit: extract, sanity-check, diff.

The model answers with the whole new file in one fenced block (see prompts/README.md).
A reply cut by max_tokens, or without a complete block, is garbled: it is reported
and never written.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import prompts


class GarbledOutput(Exception):
    """The model's reply can't be trusted as the new file; the message says why."""


@dataclass
class Edit:
    path: str  # as shown to the agent (relative to the workspace root)
    old: str
    new: str
    warnings: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def diff(self) -> str:
        return unified_diff(self.old, self.new, self.path)


def unified_diff(old: str, new: str, path: str) -> str:
    lines = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}"
    )
    out = []
    for line in lines:
        out.append(line)
        if not line.endswith("\n"):  # keep the diff well-formed when a file lacks a final newline
            out.append("\n\\ No newline at end of file\n")
    return "".join(out)


def new_text_from_reply(reply: str, finish_reason: str, old: str) -> str:
    """The new file text in `reply`, or GarbledOutput saying why it can't be used."""
    if finish_reason == "length":
        raise GarbledOutput("the reply was cut off by max_tokens before the file was complete")
    code = prompts.extract_code(reply)
    if code is None:
        raise GarbledOutput("the reply holds no complete fenced code block")
    if not old.endswith("\n") and code.endswith("\n"):
        code = code[:-1]  # the template adds a newline the file never had
    if old.strip() and not code.strip():
        raise GarbledOutput("the reply's code block is empty")
    return code


def check_rename(edit: Edit, old_name: str, new_name: str) -> None:
    """A rename keeps the line count; a leftover `old_name` is worth a warning, not a refusal
    (it may sit in a string or a longer identifier)."""
    n_old, n_new = edit.old.count("\n"), edit.new.count("\n")
    if n_old != n_new:
        raise GarbledOutput(f"a rename changed the number of lines ({n_old} -> {n_new})")
    if old_name in edit.new:
        edit.warnings.append(f"{old_name!r} still appears {edit.new.count(old_name)} time(s) in {edit.path}")
    if edit.changed and new_name not in edit.new:
        edit.warnings.append(f"{new_name!r} does not appear in {edit.path}")

