"""Issue 13 item 3: `integrate --write` keeps the user's config whole (lists, comments,
layout, string values, symlinks, the backup)."""

from __future__ import annotations

import json

import pytest

from agent_bridge.integrate.config_files import loads, merge, merge_into_file, strip_jsonc


def test_lists_of_strings_merge_as_sets():
    base = {"enabledMcpjsonServers": ["github", "mlx-dspark"], "permissions": {"allow": ["Bash(ls)"]}}
    ours = {"enabledMcpjsonServers": ["mlx-dspark"], "permissions": {"allow": ["mcp__mlx-dspark"]}}
    assert merge(base, ours) == {"enabledMcpjsonServers": ["github", "mlx-dspark"],
                                 "permissions": {"allow": ["Bash(ls)", "mcp__mlx-dspark"]}}


def test_claude_settings_keep_other_servers(tmp_path):
    path = tmp_path / "settings.json"
    path.write_text('{\n  "enabledMcpjsonServers": ["github"],\n  "model": "opus"\n}\n')
    merge_into_file(path, {"enabledMcpjsonServers": ["mlx-dspark"], "env": {"A": "1"}}, "json")
    data = json.loads(path.read_text())
    assert data["enabledMcpjsonServers"] == ["github", "mlx-dspark"] and data["model"] == "opus"
    assert data["env"] == {"A": "1"}


TOML = '''# my codex config
model = "o3"  # the default

[mcp_servers.github]
command = "gh-mcp"   # keep me
args = ["serve"]

[profiles.fast]
model = "o4-mini"
'''


def test_toml_keeps_comments_and_layout(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(TOML)
    ours = {"model_provider": "mlx-dspark", "mcp_servers": {"mlx-dspark": {"command": "mlx-dspark", "args": ["mcp"]}}}
    merge_into_file(path, ours, "toml")
    text = path.read_text()
    for line in TOML.splitlines():
        assert line in text  # every original line, comments included, is still there
    data = loads(text, "toml")
    assert data["mcp_servers"]["mlx-dspark"] == {"command": "mlx-dspark", "args": ["mcp"]}
    assert data["mcp_servers"]["github"]["command"] == "gh-mcp" and data["model_provider"] == "mlx-dspark"


YAML = '''# continue config
name: My setup   # mine
models:
  - name: gpt
    provider: openai   # hosted
    roles: [chat]
mcpServers:
  - name: github
    command: gh
'''


def test_yaml_keeps_comments(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(YAML)
    ours = {"models": [{"name": "mlx-dspark", "provider": "openai", "apiBase": "http://127.0.0.1:8080/v1"}],
            "mcpServers": [{"name": "mlx-dspark", "command": "mlx-dspark", "args": ["mcp"]}]}
    merge_into_file(path, ours, "yaml")
    text = path.read_text()
    for comment in ("# continue config", "# mine", "# hosted"):
        assert comment in text
    data = loads(text, "yaml")
    assert [m["name"] for m in data["models"]] == ["gpt", "mlx-dspark"]
    assert [m["name"] for m in data["mcpServers"]] == ["github", "mlx-dspark"]


JSONC = '''// Zed settings
{
  "theme": "One Dark", // my theme
  /* block
     comment */
  "note": "a, ] b,}",
  "context_servers": {
    "github": { "command": "gh" },
  },
  "language_models": {"openai": {"api_url": "https://api.openai.com/v1"}}
}
'''


def test_jsonc_keeps_comments_strings_and_layout(tmp_path):
    path = tmp_path / "settings.json"
    path.write_text(JSONC)
    ours = {"context_servers": {"mlx-dspark": {"command": {"path": "mlx-dspark", "args": ["mcp"]}}},
            "language_models": {"openai": {"api_url": "http://127.0.0.1:8080/v1"}}}
    merge_into_file(path, ours, "jsonc")
    text = path.read_text()
    for kept in ("// Zed settings", '"theme": "One Dark", // my theme', "/* block\n     comment */",
                 '"note": "a, ] b,}",', '"github": { "command": "gh" },'):
        assert kept in text
    data = loads(text, "jsonc")
    assert data["note"] == "a, ] b,}" and data["theme"] == "One Dark"
    assert set(data["context_servers"]) == {"github", "mlx-dspark"}
    assert data["language_models"]["openai"]["api_url"] == "http://127.0.0.1:8080/v1"


def test_trailing_comma_removal_leaves_strings_alone():
    assert json.loads(strip_jsonc('{"a": "x,}", "b": [1, 2,],}')) == {"a": "x,}", "b": [1, 2]}
    assert json.loads(strip_jsonc('{"a": ",]"}')) == {"a": ",]"}


def test_symlinked_dotfile_is_written_through(tmp_path):
    real = tmp_path / "dotfiles" / "settings.json"
    real.parent.mkdir()
    real.write_text('{"model": "opus"}\n')
    link = tmp_path / "settings.json"
    link.symlink_to(real)
    backup = merge_into_file(link, {"env": {"A": "1"}}, "json")
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert json.loads(real.read_text()) == {"model": "opus", "env": {"A": "1"}}
    assert backup is not None and json.loads(backup.read_text()) == {"model": "opus"}


def test_merge_is_idempotent(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"enabledMcpjsonServers": ["github"]}\n')
    ours = {"enabledMcpjsonServers": ["mlx-dspark"], "env": {"A": "1"}}
    merge_into_file(path, ours, "json")
    once = path.read_text()
    merge_into_file(path, ours, "json")
    assert path.read_text() == once
