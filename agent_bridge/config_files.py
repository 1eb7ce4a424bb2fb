"""Reading, merging and writing client config files (JSON, JSON with comments, TOML, YAML).

A merge adds our keys and keeps every existing one; the old file is kept as a
timestamped backup next to it before it is replaced (atomically).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .workspace import write_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(Exception):
    """A config file we can't read or merge safely: the message says which and why."""


# -- merging -------------------------------------------------------------------------


def merge(base: Any, ours: Any, list_key: str = "name") -> Any:
    """`ours` merged into `base`: dicts recursively, our scalar values win; a list of dicts
    keyed by `list_key` (YAML configs) gets our entries replaced in place or appended."""
    if isinstance(base, dict) and isinstance(ours, dict):
        out = dict(base)
        for k, v in ours.items():
            out[k] = merge(base[k], v, list_key) if k in base else v
        return out
    if isinstance(base, list) and isinstance(ours, list) and all(isinstance(x, dict) for x in ours):
        out = list(base)
        for item in ours:
            key = item.get(list_key)
            if key is None:  # no identity to match on: add it once
                if item not in out:
                    out.append(item)
                continue
            idx = next((i for i, x in enumerate(out) if isinstance(x, dict) and key is not None and x.get(list_key) == key), None)
            if idx is None:
                out.append(item)
            else:
                out[idx] = merge(out[idx], item, list_key)
        return out
    return ours


# -- formats -------------------------------------------------------------------------


def loads(text: str, fmt: str, where: str = "") -> Any:
    try:
        if not text.strip():
            return {}
        if fmt == "json":
            return json.loads(text)
        if fmt == "jsonc":
            return json.loads(strip_jsonc(text))
        if fmt == "toml":
            return tomllib.loads(text)
        if fmt == "yaml":
            import yaml

            return yaml.safe_load(text) or {}
    except Exception as e:  # each parser has its own error type
        raise ConfigError(f"{where or 'config'}: cannot parse as {fmt}: {e}") from None
    raise ValueError(f"unknown config format {fmt!r}")


def dumps(data: Any, fmt: str) -> str:
    if fmt in ("json", "jsonc"):
        return json.dumps(data, indent=2) + "\n"
    if fmt == "toml":
        return toml_dumps(data)
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    raise ValueError(f"unknown config format {fmt!r}")


def strip_jsonc(text: str) -> str:
    """JSON with // and /* */ comments and trailing commas (Zed, VS Code) -> plain JSON."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        else:
            out.append(c)
            i += 1
    return re.sub(r",(\s*[}\]])", r"\1", "".join(out))


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if v is None:
        raise ConfigError("TOML has no null value")
    return json.dumps(str(v))  # dates and times read by tomllib


def toml_dumps(data: dict) -> str:
    """A TOML document for `data` (tables, arrays of tables, inline values)."""
    lines: list[str] = []

    def table(d: dict, prefix: list[str]) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict) and not _is_table_array(v)}
        tables = {k: v for k, v in d.items() if isinstance(v, dict)}
        arrays = {k: v for k, v in d.items() if _is_table_array(v)}
        if prefix and (scalars or not (tables or arrays)):
            lines.append(f"[{'.'.join(_toml_key(p) for p in prefix)}]")
        for k, v in scalars.items():
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
        if scalars:
            lines.append("")
        for k, v in tables.items():
            table(v, prefix + [k])
        for k, items in arrays.items():
            for item in items:
                lines.append(f"[[{'.'.join(_toml_key(p) for p in prefix + [k])}]]")
                for ik, iv in item.items():
                    lines.append(f"{_toml_key(ik)} = {_toml_value(iv)}")
                lines.append("")

    table(data, [])
    return "\n".join(lines).rstrip("\n") + "\n"


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


# -- files ---------------------------------------------------------------------------


def merge_into_file(path: Path, ours: Any, fmt: str) -> Path | None:
    """Merge `ours` into the config at `path` (created if missing). Returns the backup path."""
    path = Path(path)
    backup = None
    if path.exists():
        text = path.read_text(encoding="utf-8")
        current = loads(text, fmt, str(path))
        if not isinstance(current, dict):
            raise ConfigError(f"{path}: expected a {fmt} object/table at the top level")
        merged = merge(current, ours)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        backup = path.with_name(f"{path.name}.bak-{stamp}")
        n = 1
        while backup.exists():  # never overwrite an earlier backup
            backup = path.with_name(f"{path.name}.bak-{stamp}-{n}")
            n += 1
        shutil.copy2(path, backup)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = ours
    write_atomic(path, dumps(merged, fmt))
    return backup
