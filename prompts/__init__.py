"""Prompt templates shared by training, the MCP tools and the benchmark.

Each template is a file ``prompts/<name>.md``; ``render`` fills it with ``str.format``
(templates hold no braces other than their fields). See README.md for the contract.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

__all__ = ["names", "load", "render", "extract_code", "fence", "fence_for", "fence_lines"]

_DIR = Path(__file__).resolve().parent


def names() -> list[str]:
    """Names of the available templates (file stems), sorted."""
    return sorted(p.stem for p in _DIR.glob("*.md") if p.stem != "README")


@lru_cache(maxsize=None)
def load(name: str) -> str:
    """Raw text of template ``name`` (``prompts/<name>.md``)."""
    if name not in names():
        raise KeyError(f"unknown prompt template: {name!r}")
    return (_DIR / f"{name}.md").read_text(encoding="utf-8")


def render(name: str, **fields: str) -> str:
    """Template ``name`` filled with ``fields`` through ``str.format``.

    A ``code`` field should end with a newline: the template puts the closing fence
    right after it. ``fence`` and ``lang`` (the DERIVED fields) are filled in from
    ``code`` and ``path`` unless given.
    """
    return load(name).format(**with_derived(fields))


DERIVED = ("fence", "lang")
_LANGS = {".py": "python", ".md": "markdown", ".js": "javascript", ".ts": "typescript", ".rs": "rust",
          ".sh": "bash", ".yml": "yaml", ".rb": "ruby", ".h": "c", ".hpp": "cpp", ".cc": "cpp"}


def with_derived(fields: dict) -> dict:
    """``fields`` plus the fence that fits ``code`` and the language named by ``path``'s suffix."""
    out = dict(fields)
    out.setdefault("fence", fence_for(out.get("code", "")))
    if "lang" not in out:
        suffix = Path(out.get("path", "")).suffix.lower()
        out["lang"] = _LANGS.get(suffix, suffix.lstrip(".")) if suffix else "python"
    return out


def fence_for(code: str) -> str:
    """The backtick fence that safely wraps ``code``: one longer than the longest run of
    backticks in it, at least three (CommonMark: a fence closes only on a run at least as
    long as the one that opened it, so the file's own fences stay content)."""
    longest = max((len(run) for run in _BACKTICK_RUN.findall(code)), default=0)
    return "`" * max(3, longest + 1)


def fence(code: str, lang: str = "python") -> str:
    """An assistant reply holding ``code`` as the whole file: "```python\\n<code>```"
    (more backticks when the file holds a run of three or more)."""
    if code and not code.endswith("\n"):
        code += "\n"
    ticks = fence_for(code)
    return f"{ticks}{lang}\n{code}{ticks}"


_BACKTICK_RUN = re.compile(r"`+")
_OPEN_RE = re.compile(r"^ {0,3}(`{3,})[^`\n]*\n", re.MULTILINE)


def extract_code(text: str) -> str | None:
    """Content of the first complete fenced code block in ``text`` (CommonMark fences).

    The block opens on a line of N >= 3 backticks plus an info string, and closes on
    a line of at least N backticks (up to 3 spaces of indent, nothing after but
    spaces). The content keeps its final newline. ``None`` when there is no complete block.
    """
    for m in _OPEN_RE.finditer(text):
        n = len(m.group(1))
        # nothing but spaces may follow the closing run (a special token like <|im_end|> may)
        close = re.compile(r"^ {0,3}`{%d,}(?=[ \t]*$|<)" % n, re.MULTILINE)
        end = close.search(text, m.end())
        if end is not None:
            return text[m.end() : end.start()]
    return None


def fence_lines(text: str) -> list[str]:
    """Lines of ``text`` that look like a code fence (``` or ~~~) at any indentation: a
    fenced example inside an indented docstring counts as much as one in Markdown."""
    return [line for line in text.splitlines() if line.lstrip().startswith(("```", "~~~"))]
