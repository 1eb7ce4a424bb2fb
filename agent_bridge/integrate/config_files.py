"""Reading, merging and writing client config files (JSON, JSON with comments, TOML, YAML).

A merge adds our keys and keeps every existing one; the old file is kept as a
timestamped backup next to it before it is replaced (atomically).
"""

from __future__ import annotations

import copy
import io
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from agent_bridge.integrate import jsonc_edit
from agent_bridge.mcp.workspace import write_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(Exception):
    """A config file we can't read or merge safely: the message says which and why."""


# -- merging -------------------------------------------------------------------------
# A merge is a list of edits ("add" a key, "append" to a list, "set" a value), planned on
# the parsed data and then applied to the document itself (tomlkit, ruamel.yaml, or the
# JSONC span editor), so that the user's comments and layout survive.


def plan(base: Any, ours: Any, path: tuple = (), list_key: str = "name") -> list[tuple]:
    """The edits that merge `ours` into `base`: dicts recursively, our scalar values win;
    lists of scalars as sets (the user's items kept, in order, ours appended); lists of
    dicts matched on `list_key` (YAML configs)."""
    if isinstance(base, dict) and isinstance(ours, dict):
        ops: list[tuple] = []
        for k, v in ours.items():
            ops += plan(base[k], v, path + (k,), list_key) if k in base else [("add", path, k, v)]
        return ops
    if isinstance(base, list) and isinstance(ours, list):
        ops, seen = [], list(base)
        for item in ours:
            key = item.get(list_key) if isinstance(item, dict) else None
            idx = next((i for i, x in enumerate(base) if isinstance(x, dict) and x.get(list_key) == key), None) \
                if key is not None else None
            if idx is not None:
                ops += plan(base[idx], item, path + (idx,), list_key)
            elif item not in seen:
                ops.append(("append", path, None, item))
                seen.append(item)
        return ops
    return [] if base == ours else [("set", path[:-1], path[-1], ours)]


def apply(doc: Any, ops: list[tuple]) -> Any:
    """Apply planned edits to a mutable document (plain data, tomlkit or ruamel.yaml)."""
    for op, path, key, value in ops:
        node = doc
        for k in path:
            node = node[k]
        if op == "append":
            node.append(value)
        else:
            node[key] = value
    return doc


def merge(base: Any, ours: Any, list_key: str = "name") -> Any:
    """`ours` merged into a copy of `base` (see `plan`)."""
    if not isinstance(base, (dict, list)):
        return ours
    return apply(copy.deepcopy(base), plan(base, ours, (), list_key))


def edit_text(text: str, fmt: str, ops: list[tuple]) -> str:
    """`text` with the planned edits made in place, everything else kept."""
    if fmt in ("json", "jsonc"):
        for op, path, key, value in ops:
            if op == "add":
                text = jsonc_edit.add_member(text, list(path), key, value)
            elif op == "append":
                text = jsonc_edit.append_item(text, list(path), value)
            else:
                text = jsonc_edit.replace_value(text, [*path, key], value)
        return text
    if fmt == "toml":
        import tomlkit

        return tomlkit.dumps(apply(tomlkit.parse(text), ops))
    if fmt == "yaml":
        yaml = _round_trip_yaml()
        doc = apply(yaml.load(text), ops)
        out = io.StringIO()
        yaml.dump(doc, out)
        return out.getvalue()
    raise ValueError(f"unknown config format {fmt!r}")


def _round_trip_yaml():
    from ruamel.yaml import YAML

    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap the user's long lines
    return yaml


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
    """JSON with // and /* */ comments and trailing commas (Zed, VS Code) -> plain JSON.
    String contents are copied untouched, commas inside them included."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i) or text.startswith("/*", i):
            out.append(" ")
            i = jsonc_edit.skip(text, i)
        elif c == "," and text[jsonc_edit.skip(text, i + 1) : jsonc_edit.skip(text, i + 1) + 1] in ("}", "]"):
            i += 1  # a trailing comma
        else:
            out.append(c)
            i += 1
    return "".join(out)


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
    """Merge `ours` into the config at `path` (created if missing), keeping its comments and
    layout; a symlink is written through. Returns the backup path (None for a new file).

    Nothing is written unless the edited text reads back as exactly the merge."""
    path = Path(path)
    real = path.resolve() if path.is_symlink() else path  # a dotfile linked from a dotfiles repo
    if not real.exists():
        real.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(real, dumps(ours, fmt))
        return None
    text = real.read_text(encoding="utf-8")
    current = loads(text, fmt, str(path))
    if not isinstance(current, dict):
        raise ConfigError(f"{path}: expected a {fmt} object/table at the top level")
    ops = plan(current, ours)
    if not ops:
        return None  # already merged: nothing to write, nothing to back up
    merged = apply(copy.deepcopy(current), ops)
    try:
        new_text = edit_text(text, fmt, ops) if text.strip() else dumps(merged, fmt)
    except Exception as e:  # each editor has its own error types
        raise ConfigError(f"{path}: cannot edit this {fmt} file in place: {e}") from None
    if loads(new_text, fmt, str(path)) != merged:
        raise ConfigError(f"{path}: the edited file would not read back as the merge")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup = path.with_name(f"{path.name}.bak-{stamp}")
    n = 1
    while backup.exists():  # never overwrite an earlier backup
        backup = path.with_name(f"{path.name}.bak-{stamp}-{n}")
        n += 1
    shutil.copy2(real, backup)
    write_atomic(real, new_text)
    return backup
