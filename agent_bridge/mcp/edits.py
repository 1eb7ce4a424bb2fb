"""Turning a model's reply into a checked file edit: extract, sanity-check, diff.

The model answers with the whole new file in one fenced block (see prompts/README.md).
A reply cut by max_tokens, or without a complete block, is garbled: it is reported
and never written.
"""

from __future__ import annotations

import difflib
import io
import re
import tokenize
from dataclasses import dataclass, field

import prompts

DEFAULT_MAX_EDIT_HUNKS = 3  # edit_file writes a change this confined; a larger one is only proposed


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


def count_hunks(old: str, new: str, context: int = 3) -> int:
    """Hunks in the unified diff old -> new (changes closer than 2*context lines share one)."""
    matcher = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(), autojunk=False)
    return sum(1 for _ in matcher.get_grouped_opcodes(context)) if old != new else 0


def new_text_from_reply(reply: str, finish_reason: str, old: str, path: str = "file") -> str:
    """The new file text in `reply`, or GarbledOutput saying why it can't be used.

    Besides a cut or missing block, two signs of a reply that lost part of the file are
    refused (with the diff): code-fence lines added or dropped at any indentation (the
    model closed the fence around the file early, stripped a block's fences, or lost one
    line of a docstring's fenced example), and a reply that is the file's beginning only."""
    if finish_reason == "length":
        raise GarbledOutput("the reply was cut off by max_tokens before the file was complete")
    code = prompts.extract_code(reply)
    if code is None:
        raise GarbledOutput("the reply holds no complete fenced code block")
    if not old.endswith("\n") and code.endswith("\n"):
        code = code[:-1]  # the template adds a newline the file never had
    if old.strip() and not code.strip():
        raise GarbledOutput("the reply's code block is empty")
    old_lines, new_lines = old.splitlines(), code.splitlines()
    if len(new_lines) < len(old_lines) and old_lines[: len(new_lines)] == new_lines \
            and any(line.strip() for line in old_lines[len(new_lines):]):
        raise GarbledOutput(f"the reply loses the file's tail ({len(old_lines) - len(new_lines)} lines); "
                            f"refused:\n{unified_diff(old, code, path)}")
    n_old, n_new = len(prompts.fence_lines(old)), len(prompts.fence_lines(code))
    if n_old != n_new:
        raise GarbledOutput(f"the reply {'drops' if n_new < n_old else 'adds'} code-fence lines "
                            f"({n_old} -> {n_new}); refused:\n{unified_diff(old, code, path)}")
    return code


def renamed_only(old_line: str, new_line: str, old: str, new: str) -> bool:
    """Whether `new_line` is `old_line` with some of its `old` identifiers turned into `new`."""
    pieces = re.split(rf"(?<![\w$]){re.escape(old)}(?![\w$])", old_line)
    either = f"(?:{re.escape(old)}|{re.escape(new)})"
    return re.fullmatch(either.join(re.escape(p) for p in pieces), new_line) is not None


def python_tokens_renamed_only(old_text: str, new_text: str, old: str, new: str) -> str | None:
    """None if new_text's Python tokens are old_text's with names `old` -> `new` (strings and
    comments may change by the same rename); else what differs."""
    def tokens(text: str) -> list:
        return [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
                if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]

    try:
        before = tokens(old_text)
    except (tokenize.TokenError, SyntaxError):
        return None  # not Python we can read: the line check alone decides
    try:
        after = tokens(new_text)
    except (tokenize.TokenError, SyntaxError) as e:
        return f"the result no longer tokenizes as Python ({e})"
    if len(before) != len(after):
        return f"the token count changed ({len(before)} -> {len(after)})"
    for a, b in zip(before, after):
        if a.type == b.type and (a.string == b.string or renamed_only(a.string, b.string, old, new)):
            continue
        return f"line {b.start[0]}: token {a.string!r} became {b.string!r}"
    return None


def check_rename(edit: Edit, old_name: str, new_name: str) -> None:
    """A rename keeps every line but those where `old_name` became `new_name` at identifier
    boundaries (Python: also token for token); a leftover `old_name` is worth a warning, not a
    refusal (it may sit in a string or a longer identifier)."""
    old_lines, new_lines = edit.old.splitlines(), edit.new.splitlines()
    if len(old_lines) != len(new_lines) or edit.old.count("\n") != edit.new.count("\n"):
        raise GarbledOutput(f"a rename changed the number of lines ({edit.old.count(chr(10))} -> {edit.new.count(chr(10))})")
    for i, (a, b) in enumerate(zip(old_lines, new_lines), 1):
        if a != b and not renamed_only(a, b, old_name, new_name):
            raise GarbledOutput(f"line {i} changed beyond the rename: {a!r} -> {b!r}")
    if edit.path.endswith((".py", ".pyi")):
        problem = python_tokens_renamed_only(edit.old, edit.new, old_name, new_name)
        if problem:
            raise GarbledOutput(problem)
    if old_name in edit.new:
        edit.warnings.append(f"{old_name!r} still appears {edit.new.count(old_name)} time(s) in {edit.path}")
    if edit.changed and new_name not in edit.new:
        edit.warnings.append(f"{new_name!r} does not appear in {edit.path}")
