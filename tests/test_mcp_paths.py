"""MCP file tools under attack (issue 13's suite): path escapes (`..`, absolute, symlinks in
and out, case tricks, Windows separators, ...), a file changed between read and write, a
read-only file, a full disk. Nothing outside the root is touched, nothing is half-written.
Real mcp Client in memory, real engines (a tiny random model for refusals, a tiny model
trained on the exact chats where a sound reply is needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_cases import FILES, SPREAD, SPREAD_EDITED, SPREAD_INSTRUCTION
from test_mcp_safety import call, server_for, text_of

REPO = Path(__file__).resolve().parents[1]


def whole_tree(top: Path) -> dict:
    """Every entry under `top`, symlinks not followed: kind, mode, size, mtime, content, link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            link = os.readlink(p) if p.is_symlink() else None
            data = p.read_bytes() if p.is_file() and not p.is_symlink() else None
            out[str(p.relative_to(top))] = (st.st_mode, st.st_size, st.st_mtime_ns, link, data)
    return out


@pytest.fixture
def arena(tmp_path):
    """tmp/ws is the root; tmp/outside.py, tmp/outdir/secret.py and links lead out of it."""
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (tmp_path / "outside.py").write_text("SECRET = 1\n")
    (tmp_path / "OUTSIDE.PY").write_text("SECRET = 2\n")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "secret.py").write_text("SECRET = 3\n")
    (root / "link_out.py").symlink_to(tmp_path / "outside.py")
    (root / "rel_link_out.py").symlink_to("../outside.py")
    (root / "linkdir").symlink_to(tmp_path / "outdir")
    (root / "sub" / "up").symlink_to("..", target_is_directory=True)
    (root / "dangling.py").symlink_to(tmp_path / "not_yet.py")  # a write would create a file outside
    (root / "loop.py").symlink_to("loop.py")
    return tmp_path, root


ESCAPES = [
    "../outside.py", "../../outside.py", "sub/../../outside.py", "./../outside.py", "sub/./../../outside.py",
    "{top}/outside.py", "/etc/passwd", "/proc/self/environ", "/dev/zero", "/tmp", "~/outside.py",
    "link_out.py", "rel_link_out.py", "linkdir/secret.py", "sub/up/up/outside.py", "sub/up/../outside.py",
    "dangling.py", "loop.py",
    "../OUTSIDE.PY", "../Outside.py", "LINKDIR/secret.py",
    "..\\outside.py", "sub\\..\\..\\outside.py", "C:\\Windows\\win.ini", "\\\\server\\share\\x.py",
    "%2e%2e/outside.py", "file:///etc/passwd", "a\x00b", "", "   ", "sub",
]


@pytest.mark.parametrize("tool", ["rewrite_file", "edit_file", "rename_symbol"])
def test_escapes_refused_and_nothing_touched(tiny_engine, arena, tool):
    top, root = arena
    server = server_for(tiny_engine, root)
    before = whole_tree(top)
    for bad in ESCAPES:
        bad = bad.format(top=top)
        args = {"paths": [bad], "old": "SECRET", "new": "X"} if tool == "rename_symbol" \
            else {"path": bad, "instruction": "replace everything with x"}
        result = call(server, tool, {**args, "apply": True})
        assert result.is_error, (tool, bad, text_of(result))
        assert "Traceback" not in text_of(result)
    assert whole_tree(top) == before
    assert not (top / "not_yet.py").exists()


def test_changed_between_read_and_write_is_not_overwritten(safety_engine, tmp_path):
    from agent_bridge.mcp.backends import EngineBackend

    (tmp_path / "spread.py").write_text(SPREAD)

    class UserSaves(EngineBackend):
        def generate(self, messages, max_tokens, temperature=0.0):
            gen = super().generate(messages, max_tokens, temperature)
            (tmp_path / "spread.py").write_text(SPREAD + "# the user's edit\n")
            return gen

    result = call(server_for(safety_engine, tmp_path, UserSaves(safety_engine), max_edit_hunks=4), "edit_file",
                  {"path": "spread.py", "instruction": SPREAD_INSTRUCTION, "apply": True})
    assert result.is_error and "changed on disk" in text_of(result)
    assert (tmp_path / "spread.py").read_text() == SPREAD + "# the user's edit\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spread.py"]


def test_read_only_file_refused(safety_engine, tmp_path):
    (tmp_path / "spread.py").write_text(SPREAD)
    os.chmod(tmp_path / "spread.py", 0o444)
    before = whole_tree(tmp_path)
    result = call(server_for(safety_engine, tmp_path, max_edit_hunks=4), "edit_file",
                  {"path": "spread.py", "instruction": SPREAD_INSTRUCTION, "apply": True})
    assert result.is_error and "read-only" in text_of(result)
    assert whole_tree(tmp_path) == before


FULL_DISK = """
import json, resource, signal, sys
sys.path.insert(0, {tests!r})
from engine import Engine
from agent_bridge.mcp.backends import EngineBackend
from agent_bridge.mcp.server import build_server
from agent_bridge.mcp.workspace import Workspace
from test_mcp_safety import call, text_of
engine = Engine({model!r}, prefix_cache=False)
server = build_server(EngineBackend(engine), Workspace({root!r}))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))  # the disk fills up
result = call(server, "rename_symbol", {{"paths": ["a.py", "b.py", "c.py"], "old": "add", "new": "plus", "apply": True}})
print(json.dumps({{"error": result.is_error, "text": text_of(result)}}))
"""


def test_full_disk_mid_rename_writes_nothing(safety_engine, tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    before = whole_tree(tmp_path)
    # a.py and b.py fit under the limit, c.py's new text does not
    limit = max(len(FILES["a.py"]), len(FILES["b.py"])) + 8
    assert len(FILES["c.py"].replace("add", "plus")) > limit
    script = FULL_DISK.format(tests=str(REPO / "tests"), model=safety_engine.model_path, root=str(tmp_path), limit=limit)
    env = {**os.environ, "MLX_DSPARK_NO_REEXEC": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] and "nothing was written" in result["text"], result
    assert whole_tree(tmp_path) == before  # no file written, no temp file left
