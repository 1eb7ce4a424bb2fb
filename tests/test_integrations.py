"""`mlx-dspark integrate`: snippets parse, merges keep existing keys; the real Claude Code CLI sees the tools."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest
import yaml

from agent_bridge.cli import main
from agent_bridge.integrate.clients import CLIENTS, Options, targets
from agent_bridge.integrate.config_files import loads, strip_jsonc

REPO = Path(__file__).resolve().parents[1]
SNIPPETS = REPO / "integrations"
CLAUDE = REPO / ".node" / "node_modules" / ".bin" / "claude"


def snippet_options(**kw) -> Options:
    return Options(command="mlx-dspark", project=Path("."), home=Path("~"), **kw)


@pytest.mark.parametrize("name,client,kw,parts", [
    ("claude-code/settings.json", "claude-code", {}, {"model", "hooks"}),
    ("claude-code/mcp.json", "claude-code", {}, {"mcp"}),
    ("claude-code/mcp-http.json", "claude-code", {"transport": "http"}, {"mcp"}),
    ("codex/config.toml", "codex", {"scope": "user"}, None),
    ("opencode/opencode.json", "opencode", {}, None),
    ("cursor/mcp.json", "cursor", {}, None),
    ("continue/config.yaml", "continue", {"scope": "user"}, None),
    ("zed/settings.json", "zed", {}, None),
    ("vscode/mcp.json", "vscode", {}, None),
    ("aider/aider.conf.yml", "aider", {}, None),
])
def test_shipped_snippets_parse_and_match_the_generator(name, client, kw, parts):
    path = SNIPPETS / name
    text = path.read_text()
    parsed = {".json": json.loads, ".toml": tomllib.loads, ".yaml": yaml.safe_load, ".yml": yaml.safe_load}[path.suffix](text)
    found = targets(client, snippet_options(**kw), parts)
    if name.startswith("claude-code/mcp"):
        found = [t for t in found if t.path.name == ".mcp.json"]
    assert parsed == found[0].data
    assert (path.parent / "README.md").is_file()


def test_codex_snippet_speaks_responses():
    cfg = tomllib.loads((SNIPPETS / "codex" / "config.toml").read_text())
    assert cfg["model_providers"]["mlx-dspark"]["wire_api"] == "responses"
    assert cfg["model_providers"]["mlx-dspark"]["base_url"] == "http://127.0.0.1:8080/v1"
    assert cfg["mcp_servers"]["mlx-dspark"]["args"] == ["mcp"]
    # a name Codex has tools for: with an unknown one ("mlx-dspark") it offers no edit tool
    assert cfg["profiles"]["mlx-dspark"]["model"] == "gpt-5.5"


@pytest.fixture
def places(tmp_path, monkeypatch):
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(project)
    return home, project


EXISTING = {
    # client: (scope, relative path, format, existing text, a check that their keys survived)
    "claude-code": ("project", ".claude/settings.json", "json",
                    json.dumps({"permissions": {"allow": ["Bash(ls:*)"]}, "env": {"MY_VAR": "1"},
                                "hooks": {"PostToolUse": [{"matcher": "Bash", "hooks": [{"type": "command", "command": "echo hi"}]}]}}),
                    lambda d: d["permissions"]["allow"] == ["Bash(ls:*)"] and d["env"]["MY_VAR"] == "1"
                    and d["hooks"]["PostToolUse"][0]["matcher"] == "Bash" and len(d["hooks"]["PostToolUse"]) == 2),
    "codex": ("user", ".codex/config.toml", "toml",
              'model = "gpt-5"\napproval_policy = "on-request"\n\n[mcp_servers.other]\ncommand = "npx"\nargs = ["-y", "other"]\n\n'
              '[[skills]]\nname = "a"\n',
              lambda d: d["model"] == "gpt-5" and d["mcp_servers"]["other"]["args"] == ["-y", "other"]
              and d["skills"] == [{"name": "a"}]),
    "opencode": ("project", "opencode.json", "json", json.dumps({"theme": "dark", "mcp": {"other": {"type": "local", "command": ["x"]}}}),
                 lambda d: d["theme"] == "dark" and "other" in d["mcp"]),
    "cursor": ("project", ".cursor/mcp.json", "json", json.dumps({"mcpServers": {"other": {"command": "x"}}}),
               lambda d: d["mcpServers"]["other"] == {"command": "x"}),
    "continue": ("user", ".continue/config.yaml", "yaml",
                 "name: mine\nversion: 1.0.0\nschema: v1\nmodels:\n  - name: gpt\n    provider: openai\n    model: gpt-4o\n",
                 lambda d: d["name"] == "mine" and d["models"][0]["name"] == "gpt" and len(d["models"]) == 2),
    "zed": ("project", ".zed/settings.json", "jsonc",
            '// Zed settings\n{\n  "theme": "One Dark", // my theme\n  "url": "http://x//y",\n  "tab_size": 4,\n}\n',
            lambda d: d["theme"] == "One Dark" and d["url"] == "http://x//y" and d["tab_size"] == 4),
    "vscode": ("project", ".vscode/mcp.json", "jsonc", '{"servers": {"other": {"type": "stdio", "command": "x"}}, /* c */}',
               lambda d: d["servers"]["other"]["command"] == "x"),
    "aider": ("project", ".aider.conf.yml", "yaml", "dark-mode: true\nauto-commits: false\n",
              lambda d: d["dark-mode"] is True and d["auto-commits"] is False),
}


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_write_merges_keeps_keys_and_backs_up(client, places, capsys):
    home, project = places
    scope, rel, fmt, existing, kept = EXISTING[client]
    target = (project if scope == "project" else home) / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(existing)

    assert main(["integrate", client, "--scope", scope]) == 0  # print only
    printed = capsys.readouterr().out
    assert str(target) in printed and target.read_text() == existing

    for _ in range(2):  # twice: the second run must change nothing
        assert main(["integrate", client, "--write", "--scope", scope, "--port", "9123", "--transport", "http"]) == 0
        after_first = target.read_text() if _ == 0 else after_first
    merged = loads(target.read_text(), fmt)
    assert kept(merged), merged
    assert "9123" in target.read_text()
    backups = sorted(target.parent.glob(target.name + ".bak-*"))
    assert len(backups) == 1 and backups[0].read_text() == existing
    assert target.read_text() == after_first  # idempotent: no duplicated entries, not even rewritten
    assert "already up to date" in capsys.readouterr().out


def test_claude_code_write_everything(places):
    home, project = places
    assert main(["integrate", "claude-code", "--write", "--port", "8181"]) == 0
    settings = json.loads((project / ".claude" / "settings.json").read_text())
    env = settings["env"]
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8181"
    for key in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL"):
        assert env[key] == "mlx-dspark"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert settings["hooks"]["PostToolUse"][0]["matcher"] == "Read|Edit|Write"
    assert settings["enabledMcpjsonServers"] == ["mlx-dspark"]  # approved once the folder is trusted
    hooks_dir = project / ".claude" / "hooks" / "mlx-dspark"
    assert sorted(p.name for p in hooks_dir.iterdir()) == ["post_tool_use.py", "session_start.py"]
    mcp = json.loads((project / ".mcp.json").read_text())["mcpServers"]["mlx-dspark"]
    assert mcp["type"] == "stdio" and mcp["args"] == ["mcp"] and Path(mcp["command"]).name == "mlx-dspark"


def test_bad_input_is_a_clear_error(places, capsys):
    home, project = places
    (project / "opencode.json").write_text("{not json")
    assert main(["integrate", "opencode", "--write"]) == 2
    err = capsys.readouterr().err
    assert "cannot parse as json" in err and "nothing written" in err
    assert (project / "opencode.json").read_text() == "{not json"
    assert main(["integrate", "aider", "--parts", "mcp"]) == 2
    assert main(["integrate", "codex", "--parts", "bogus"]) == 2


def test_strip_jsonc_keeps_strings():
    assert json.loads(strip_jsonc('{"a": "x // y /* z */", /* c */ "b": [1, 2,],}')) == {"a": "x // y /* z */", "b": [1, 2]}


# -- the real Claude Code CLI ----------------------------------------------------------

needs_claude = pytest.mark.skipif(not CLAUDE.exists(), reason="Claude Code CLI not installed (scripts/setup.sh installs it into .node)")


@pytest.fixture(scope="module")
def mcp_server(tiny_model_dir, tmp_path_factory):
    from agent_bridge.mcp.server import http_mount
    from agent_bridge.app import create_app
    from engine import Engine
    from server_harness import RunningServer

    root = tmp_path_factory.mktemp("claude-ws")
    (root / "a.py").write_text("x = 1\n")
    engine = Engine(str(tiny_model_dir))
    routes, lifespan = http_mount(engine, root=root)
    with RunningServer(create_app(engine, extra_routes=routes, lifespan=lifespan)) as srv:
        yield srv, root
    engine.close()


def claude_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env.update(HOME=str(home), CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1")
    return env


@needs_claude
def test_claude_mcp_list_after_integrate(mcp_server, tmp_path, monkeypatch):
    srv, root = mcp_server
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(root)
    port = srv.url.rsplit(":", 1)[1]
    assert main(["integrate", "claude-code", "--write", "--scope", "user", "--transport", "http",
                 "--parts", "mcp", "--port", port]) == 0
    r = subprocess.run([str(CLAUDE), "mcp", "list"], cwd=root, env=claude_env(home),
                       capture_output=True, text=True, timeout=120)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("mlx-dspark:")), "")
    assert f"{srv.url}/mcp" in line and "Connected" in line, r.stdout + r.stderr


@needs_claude
def test_claude_print_run_sees_the_tools(mcp_server, tmp_path):
    srv, root = mcp_server
    home = tmp_path / "home"
    home.mkdir()
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"mlx-dspark": {"type": "http", "url": f"{srv.url}/mcp"}}}))
    env = claude_env(home)
    # the session itself talks to the same local server (a tiny model: its answer is noise)
    env.update(ANTHROPIC_BASE_URL=srv.url, ANTHROPIC_AUTH_TOKEN="local", ANTHROPIC_MODEL="tiny",
               ANTHROPIC_SMALL_FAST_MODEL="tiny")
    r = subprocess.run([str(CLAUDE), "-p", "say hi", "--mcp-config", str(config), "--strict-mcp-config",
                        "--output-format", "stream-json", "--verbose", "--max-turns", "1"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=180)
    init = next(json.loads(ln) for ln in r.stdout.splitlines() if '"subtype":"init"' in ln)
    assert {"name": "mlx-dspark", "status": "connected"} in init["mcp_servers"], init["mcp_servers"]
    for tool in ("rewrite_file", "rename_symbol", "edit_file", "generate", "status"):
        assert f"mcp__mlx-dspark__{tool}" in init["tools"]


# -- mlx-dspark claude ---------------------------------------------------------------


def test_claude_environment_points_every_alias_at_the_server():
    import argparse

    from agent_bridge.commands.claude import claude_environment

    args = argparse.Namespace(port=8123, host="127.0.0.1", api_key=None, max_output=8192)
    env = claude_environment({"PATH": "/bin", "ANTHROPIC_API_KEY": "sk-cloud"}, {"model": "ref", "context_window": 16384}, args)
    assert env["PATH"] == "/bin" and "ANTHROPIC_API_KEY" not in env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8123" and env["ANTHROPIC_AUTH_TOKEN"] == "local"
    for key in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL"):
        assert env[key] == "ref"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "16384" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"


def test_unknown_arguments_only_for_claude(capsys):
    with pytest.raises(SystemExit):
        main(["integrate", "codex", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@needs_claude
def test_claude_command_starts_a_server_and_runs_claude(tiny_model_dir, tmp_path):
    import re
    import signal
    import socket

    from test_mcp_stdio import mlx_dspark

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tmp_path / "home"
    home.mkdir()
    env = claude_env(home)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    r = subprocess.run([mlx_dspark(), "claude", "--port", str(port), "--serve-model", str(tiny_model_dir),
                        "--claude-bin", str(CLAUDE), "-p", "hi", "--output-format", "json", "--max-turns", "1"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    pid = re.search(r"started one \(pid (\d+)", r.stderr)
    try:
        assert pid, r.stderr
        assert "server ready" in r.stderr
        result = json.loads(r.stdout)  # claude ran, and answered in its own JSON
        assert result["type"] == "result"
        import httpx

        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["model"] == tiny_model_dir.name
    finally:
        if pid:
            os.kill(int(pid.group(1)), signal.SIGTERM)
