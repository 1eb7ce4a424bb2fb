"""The pieces under the MCP tools: reply checks, diffs, atomic writes."""

from __future__ import annotations

import pytest

from agent_bridge.mcp.edits import Edit, GarbledOutput, check_rename, new_text_from_reply, unified_diff
from agent_bridge.mcp.workspace import Workspace, WorkspaceError, write_atomic

OLD = "a = 1\nb = 2\n"


def test_reply_checks():
    assert new_text_from_reply("```python\na = 1\nb = 3\n```", "stop", OLD) == "a = 1\nb = 3\n"
    with pytest.raises(GarbledOutput, match="max_tokens"):
        new_text_from_reply("```python\na = 1\nb = 3\n```", "length", OLD)
    with pytest.raises(GarbledOutput, match="no complete fenced"):
        new_text_from_reply("```python\na = 1\nb = 3\n", "stop", OLD)  # closing fence missing
    with pytest.raises(GarbledOutput, match="empty"):
        new_text_from_reply("```python\n```", "stop", OLD)
    # a file without a final newline keeps having none
    assert new_text_from_reply("```python\nx = 2\n```", "stop", "x = 1") == "x = 2"


def test_rename_checks():
    edit = Edit("m.py", "def f():\n    pass\n", "def g():\n\n    pass\n")
    with pytest.raises(GarbledOutput, match="number of lines"):
        check_rename(edit, "f", "g")
    edit = Edit("m.py", "f = 1\nprint('f')\n", "g = 1\nprint('f')\n")
    check_rename(edit, "f", "g")
    assert edit.warnings and "still appears" in edit.warnings[0]


def test_unified_diff_shape():
    d = unified_diff("x = 1\ny = 2", "x = 1\ny = 3", "p.py")
    assert d.startswith("--- a/p.py\n+++ b/p.py\n@@")
    assert "-y = 2\n\\ No newline at end of file\n+y = 3\n\\ No newline at end of file\n" in d


def test_write_atomic_never_partial(tmp_path):
    target = tmp_path / "f.py"
    target.write_text(OLD)
    with pytest.raises(UnicodeEncodeError):
        write_atomic(target, "ok\n" + "\ud800")  # cannot be encoded: fails before any byte lands
    assert target.read_text() == OLD
    write_atomic(target, "new\n")
    assert target.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["f.py"]


def test_workspace_resolution(tmp_path):
    (tmp_path / "in.py").write_text("x\n")
    ws = Workspace(tmp_path)
    assert ws.resolve("in.py") == (tmp_path / "in.py").resolve()
    assert ws.resolve(str(tmp_path / "in.py")) == (tmp_path / "in.py").resolve()
    for bad in ("..", "../x", "/", "", "a\x00b"):
        with pytest.raises(WorkspaceError):
            ws.resolve(bad)
    with pytest.raises(WorkspaceError, match="not a directory"):
        Workspace(tmp_path / "in.py")
