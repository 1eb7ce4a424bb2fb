"""Prompt templates shared by training, the MCP tools and the benchmark.

Each template is a file ``prompts/<name>.md``; ``render`` fills it with ``str.format``
(templates hold no braces other than their fields). See README.md for the contract.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

__all__ = ["names", "load", "render", "extract_code", "fence"]

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
    right after it.
    """
    return load(name).format(**fields)


def fence(code: str, lang: str = "python") -> str:
    """An assistant reply holding ``code`` as the whole file: "```python\\n<code>```"."""
    if code and not code.endswith("\n"):
        code += "\n"
    return f"```{lang}\n{code}```"


_FENCE_RE = re.compile(r"^```[^\n`]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def extract_code(text: str) -> str | None:
    """Content of the first complete fenced code block in ``text``.

    The opening fence line and the closing fence are removed; the content keeps its
    final newline. ``None`` when there is no complete block.
    """
    m = _FENCE_RE.search(text)
    return None if m is None else m.group(1)
