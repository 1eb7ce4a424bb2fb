"""Claude Code hooks, fed the JSON Claude Code sends on stdin, with the server up and down."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent_bridge.app import create_app
from server_harness import RunningServer

HOOKS = Path(__file__).resolve().parents[1] / "integrations" / "claude-code" / "hooks"


def run_hook(script: str, event, url: str) -> subprocess.CompletedProcess:
    stdin = event if isinstance(event, str) else json.dumps(event)
    # the hooks are plain-stdlib scripts: run them with a bare interpreter, outside the venv's site
    return subprocess.run([sys.executable, "-I", str(HOOKS / script), "--url", url], input=stdin,
                          capture_output=True, text=True, timeout=20)


def free_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


def session_event(cwd: Path) -> dict:
    return {"session_id": "abc", "transcript_path": str(cwd / "t.jsonl"), "cwd": str(cwd),
            "hook_event_name": "SessionStart", "source": "startup"}


def tool_event(cwd: Path, tool: str, path: str) -> dict:
    tool_input = {"file_path": path} if tool != "Edit" else {"file_path": path, "old_string": "a", "new_string": "b"}
    return {"session_id": "abc", "transcript_path": str(cwd / "t.jsonl"), "cwd": str(cwd),
            "hook_event_name": "PostToolUse", "tool_name": tool, "tool_input": tool_input,
            "tool_response": {"filePath": path, "success": True}}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from engine import Engine

    e = Engine(str(tiny_model_dir))  # its own engine: these tests count its corpus
    yield e
    e.close()


def test_hooks_with_the_server_up(engine, tmp_path):
    (tmp_path / "mod.py").write_text("def helper(x):\n    return x * 2\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 10)
    with RunningServer(create_app(engine, model_name="tiny-test")) as srv:
        start = run_hook("session_start.py", session_event(tmp_path), srv.url)
        before = len(engine.corpus)
        read = run_hook("post_tool_use.py", tool_event(tmp_path, "Read", str(tmp_path / "mod.py")), srv.url)
        edit = run_hook("post_tool_use.py", tool_event(tmp_path, "Edit", "mod.py"), srv.url)  # relative to cwd
        after_files = len(engine.corpus)
        skipped = [
            run_hook("post_tool_use.py", tool_event(tmp_path, "Read", str(tmp_path / "blob.bin")), srv.url),
            run_hook("post_tool_use.py", tool_event(tmp_path, "Bash", str(tmp_path / "mod.py")), srv.url),
            run_hook("post_tool_use.py", tool_event(tmp_path, "Read", str(tmp_path / "gone.py")), srv.url),
            run_hook("post_tool_use.py", "not json", srv.url),
        ]
    out = json.loads(start.stdout)["hookSpecificOutput"]
    assert start.returncode == 0 and out["hookEventName"] == "SessionStart"
    assert "tiny-test" in out["additionalContext"] and "context window" in out["additionalContext"]
    assert read.returncode == 0 and edit.returncode == 0 and read.stdout == ""
    assert after_files == before + 1  # read, then edited: one document per path
    assert list(engine.corpus.values())[-1].tokens == engine.encode("def helper(x):\n    return x * 2\n")
    assert all(r.returncode == 0 and r.stdout == "" for r in skipped)
    assert len(engine.corpus) == after_files  # binary, other tools, missing files, garbage: nothing posted


def test_hooks_with_the_server_down(tmp_path):
    (tmp_path / "mod.py").write_text("x = 1\n")
    url = free_url()
    start = run_hook("session_start.py", session_event(tmp_path), url)
    post = run_hook("post_tool_use.py", tool_event(tmp_path, "Write", str(tmp_path / "mod.py")), url)
    context = json.loads(start.stdout)["hookSpecificOutput"]["additionalContext"]
    assert start.returncode == 0 and "not reachable" in context and "mlx-dspark serve" in context
    assert post.returncode == 0 and post.stdout == "" and post.stderr == ""
