"""The real Claude Code CLI (`claude -p`) against the server, with a model that thinks and then
calls Claude Code's Write tool: the thinking block (with its signature_delta) and the streamed
tool_use are accepted, the tool runs, the thinking comes back verified, and the session ends
with the model's answer. The model is scripted (tests/scripted_model.py) on a tiny model with a
real-sized vocabulary; Claude Code, the server and the engine are the real ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from scripted_model import script_engine
from server_harness import RunningServer, build_agent_sized_model

from agent_bridge.app import create_app
from agent_bridge.chat.thinking_signature import ThinkingSigner

CLAUDE = Path(__file__).resolve().parents[1] / ".node" / "node_modules" / ".bin" / "claude"


class RecordingSigner(ThinkingSigner):
    """The server's signer, noting each check of a block that came back."""

    def __init__(self):
        super().__init__()
        self.checks: list[bool] = []

    def verify(self, thinking, signature):
        ok = super().verify(thinking, signature)
        self.checks.append(ok)
        return ok


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed (scripts/setup.sh needs npm)")
def test_claude_code_takes_thinking_and_a_streamed_write(tmp_path_factory, tmp_path):
    if not CLAUDE.exists():
        pytest.skip(f"{CLAUDE} is absent: run scripts/setup.sh")
    from engine import Engine

    work = tmp_path / "work"
    work.mkdir()
    target = work / "hello.txt"
    call = {"name": "Write", "arguments": {"file_path": str(target), "content": "hello from mlx-dspark\n"}}
    model_dir = build_agent_sized_model(tmp_path_factory.mktemp("agent-sized-tools"))
    with Engine(str(model_dir), prefix_cache=False) as engine:
        script = script_engine(engine)
        script.set("<think>The user wants hello.txt; I will write it.</think>\n<tool_call>\n"
                   + json.dumps(call) + "\n</tool_call>", "Done.")
        app = create_app(engine)
        signer = app.state.bridge.signer = RecordingSigner()
        with RunningServer(app) as srv:
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("ANTHROPIC_")}
            env.update(HOME=str(tmp_path), ANTHROPIC_BASE_URL=srv.url, ANTHROPIC_API_KEY="dummy",
                       CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", CLAUDE_CODE_MAX_OUTPUT_TOKENS="512",
                       DISABLE_AUTOUPDATER="1")
            p = subprocess.run([str(CLAUDE), "-p", "write hello.txt", "--output-format", "json",
                                "--allowedTools", "Write", "--permission-mode", "acceptEdits"],
                               env=env, cwd=work, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    result = json.loads(p.stdout)
    assert result["subtype"] == "success" and result["result"] == "Done.", result
    assert target.read_text() == "hello from mlx-dspark\n"  # the streamed call ran
    assert signer.checks and all(signer.checks)  # the thinking block came back, signature verified
