"""What each agent or editor needs in its config to use the local server and its MCP tools.

`targets(client, opts)` lists the files to merge into (path, format, our part); the
`integrate` command prints or writes them, and integrations/<client>/ holds the same
snippets for the default port.
"""

from __future__ import annotations

import platform
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORT = 8080
DEFAULT_MODEL = "mlx-dspark"
DEFAULT_CONTEXT = 32768
DEFAULT_MAX_OUTPUT = 8192
SERVER_NAME = "mlx-dspark"
# The model name Codex sends. Our server answers with the model it loaded under any name, but Codex
# picks its tools by this name: for one it has no metadata for it offers only its shell, no edit
# tool. This slug of its catalogue carries the freeform apply_patch.
CODEX_MODEL = "gpt-5.5"
HOOKS_DIR = Path(__file__).resolve().parents[2] / "integrations" / "claude-code" / "hooks"
HOOK_SCRIPTS = ("session_start.py", "post_tool_use.py")


@dataclass
class Options:
    port: int = DEFAULT_PORT
    host: str = "127.0.0.1"
    scope: str = "project"  # "project" (the current folder) or "user" (your home)
    transport: str = "stdio"  # how the client reaches the MCP server: "stdio" or "http"
    project: Path = field(default_factory=Path.cwd)
    home: Path = field(default_factory=Path.home)
    command: str = "mlx-dspark"  # the executable a client launches for stdio MCP
    model: str = DEFAULT_MODEL
    context: int = DEFAULT_CONTEXT
    max_output: int = DEFAULT_MAX_OUTPUT
    api_key: str = "local"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def mcp_url(self) -> str:
        return f"{self.base_url}/mcp"

    def root(self) -> Path:
        return self.project if self.scope == "project" else self.home


@dataclass
class Target:
    path: Path
    fmt: str  # json, jsonc, toml, yaml
    data: dict
    about: str


# -- Claude Code ---------------------------------------------------------------------


def claude_env(o: Options) -> dict:
    """Environment that points Claude Code at the local server (also used by `mlx-dspark claude`)."""
    return {
        "ANTHROPIC_BASE_URL": o.base_url,
        "ANTHROPIC_AUTH_TOKEN": o.api_key,
        "ANTHROPIC_MODEL": o.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": o.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": o.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": o.model,
        "ANTHROPIC_SMALL_FAST_MODEL": o.model,
        "CLAUDE_CODE_SUBAGENT_MODEL": o.model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(o.max_output),
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(o.context),
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(o.context),
    }


def mcp_stdio(o: Options) -> dict:
    return {"type": "stdio", "command": o.command, "args": ["mcp"], "env": {}}


def mcp_http(o: Options) -> dict:
    return {"type": "http", "url": o.mcp_url}


def claude_hooks(o: Options, hooks_dir: str) -> dict:
    def cmd(script: str) -> list:
        # `|| true`: a missing python or script must not turn into a blocking hook error
        return [{"type": "command", "command": f'python3 "{hooks_dir}/{script}" --url {o.base_url} || true', "timeout": 5}]

    return {
        "SessionStart": [{"hooks": cmd("session_start.py")}],
        "PostToolUse": [{"matcher": "Read|Edit|Write", "hooks": cmd("post_tool_use.py")}],
    }


def claude_code(o: Options, parts: set[str]) -> list[Target]:
    if o.scope == "project":
        settings = o.project / ".claude" / "settings.json"
        hooks_dir = "$CLAUDE_PROJECT_DIR/.claude/hooks/mlx-dspark"
        mcp_file, mcp_key = o.project / ".mcp.json", "mcpServers"
    else:
        settings = o.home / ".claude" / "settings.json"
        hooks_dir = str(o.home / ".claude" / "hooks" / "mlx-dspark")
        mcp_file, mcp_key = o.home / ".claude.json", "mcpServers"  # user-scope MCP servers live here
    data: dict = {}
    if "model" in parts:
        data["env"] = claude_env(o)
    if "hooks" in parts:
        data["hooks"] = claude_hooks(o, hooks_dir)
    if "mcp" in parts and o.scope == "project":
        data["enabledMcpjsonServers"] = [SERVER_NAME]  # approve our .mcp.json entry (and only it)
    out = []
    if data:
        out.append(Target(settings, "json", data, "Claude Code settings: env block (local model), hooks, MCP approval"))
    if "mcp" in parts:
        entry = mcp_stdio(o) if o.transport == "stdio" else mcp_http(o)
        out.append(Target(mcp_file, "json", {mcp_key: {SERVER_NAME: entry}}, f"MCP server ({o.transport})"))
    return out


def claude_hooks_dir(o: Options) -> Path:
    base = o.project if o.scope == "project" else o.home
    return base / ".claude" / "hooks" / "mlx-dspark"


# -- the others ----------------------------------------------------------------------


def codex(o: Options, parts: set[str]) -> list[Target]:
    path = (o.project / ".codex" if o.scope == "project" else o.home / ".codex") / "config.toml"
    data: dict = {}
    if "model" in parts:
        data["model_providers"] = {SERVER_NAME: {
            "name": "mlx-dspark (local)", "base_url": f"{o.base_url}/v1", "wire_api": "responses",
        }}
        # a profile, so your default model stays as it is: `codex --profile mlx-dspark`
        data["profiles"] = {SERVER_NAME: {"model_provider": SERVER_NAME, "model": CODEX_MODEL,
                                          "model_context_window": o.context}}
    if "mcp" in parts:
        entry = ({"command": o.command, "args": ["mcp"], "startup_timeout_sec": 60} if o.transport == "stdio"
                 else {"url": o.mcp_url})
        data["mcp_servers"] = {SERVER_NAME: entry}
    return [Target(path, "toml", data, "Codex CLI config: model provider (Responses API), profile, MCP server")]


def opencode(o: Options, parts: set[str]) -> list[Target]:
    path = o.project / "opencode.json" if o.scope == "project" else o.home / ".config" / "opencode" / "opencode.json"
    data: dict = {"$schema": "https://opencode.ai/config.json"}
    if "model" in parts:
        data["provider"] = {SERVER_NAME: {
            "npm": "@ai-sdk/openai-compatible", "name": "mlx-dspark (local)",
            "options": {"baseURL": f"{o.base_url}/v1", "apiKey": o.api_key},
            "models": {o.model: {"name": f"{o.model} (local)", "limit": {"context": o.context, "output": o.max_output}}},
        }}
    if "mcp" in parts:
        entry = ({"type": "local", "command": [o.command, "mcp"], "enabled": True} if o.transport == "stdio"
                 else {"type": "remote", "url": o.mcp_url, "enabled": True})
        data["mcp"] = {SERVER_NAME: entry}
    return [Target(path, "json", data, "opencode config: OpenAI-compatible provider and MCP server")]


def cursor(o: Options, parts: set[str]) -> list[Target]:
    path = (o.project if o.scope == "project" else o.home) / ".cursor" / "mcp.json"
    entry = {"command": o.command, "args": ["mcp"]} if o.transport == "stdio" else {"url": o.mcp_url}
    return [Target(path, "json", {"mcpServers": {SERVER_NAME: entry}}, "Cursor MCP servers")] if "mcp" in parts else []


def continue_dev(o: Options, parts: set[str]) -> list[Target]:
    model = {"name": o.model, "provider": "openai", "model": o.model, "apiBase": f"{o.base_url}/v1",
             "apiKey": o.api_key, "roles": ["chat", "edit", "apply"],
             "defaultCompletionOptions": {"contextLength": o.context, "maxTokens": o.max_output}}
    server = ({"name": SERVER_NAME, "command": o.command, "args": ["mcp"]} if o.transport == "stdio"
              else {"name": SERVER_NAME, "type": "streamable-http", "url": o.mcp_url})
    if o.scope == "project":  # workspace blocks: .continue/models/*.yaml, .continue/mcpServers/*.yaml
        block = {"name": "mlx-dspark", "version": "0.0.1", "schema": "v1"}
        out = []
        if "model" in parts:
            out.append(Target(o.project / ".continue" / "models" / "mlx-dspark.yaml", "yaml",
                              {**block, "models": [model]}, "Continue model block"))
        if "mcp" in parts:
            out.append(Target(o.project / ".continue" / "mcpServers" / "mlx-dspark.yaml", "yaml",
                              {**block, "mcpServers": [server]}, "Continue MCP server block"))
        return out
    data: dict = {}
    if "model" in parts:
        data["models"] = [model]
    if "mcp" in parts:
        data["mcpServers"] = [server]
    return [Target(o.home / ".continue" / "config.yaml", "yaml", data, "Continue config: model and MCP server")]


def zed(o: Options, parts: set[str]) -> list[Target]:
    path = o.project / ".zed" / "settings.json" if o.scope == "project" else o.home / ".config" / "zed" / "settings.json"
    data: dict = {}
    if "model" in parts:
        data["language_models"] = {"openai_compatible": {SERVER_NAME: {
            "api_url": f"{o.base_url}/v1",
            "available_models": [{"name": o.model, "display_name": f"{o.model} (local)",
                                  "max_tokens": o.context, "max_output_tokens": o.max_output}],
        }}}
    if "mcp" in parts:
        entry = ({"source": "custom", "command": o.command, "args": ["mcp"], "env": {}} if o.transport == "stdio"
                 else {"source": "custom", "url": o.mcp_url})
        data["context_servers"] = {SERVER_NAME: entry}
    return [Target(path, "jsonc", data, "Zed settings: OpenAI-compatible model and context server")]


def vscode_user_dir(home: Path) -> Path:
    if platform.system() == "Darwin":
        return home / "Library" / "Application Support" / "Code" / "User"
    return home / ".config" / "Code" / "User"


def vscode(o: Options, parts: set[str]) -> list[Target]:
    folder = o.project / ".vscode" if o.scope == "project" else vscode_user_dir(o.home)
    out = []
    if "mcp" in parts:
        entry = mcp_stdio(o) if o.transport == "stdio" else mcp_http(o)
        entry.pop("env", None)
        out.append(Target(folder / "mcp.json", "jsonc", {"servers": {SERVER_NAME: entry}}, "VS Code MCP servers"))
    if "model" in parts:  # Copilot's own Ollama provider lists /api/tags and chats over /v1
        out.append(Target(folder / "settings.json", "jsonc", {"github.copilot.chat.byok.ollamaEndpoint": o.base_url},
                          "VS Code settings: Copilot Chat's Ollama endpoint (pick the model under Manage Models > Ollama)"))
    return out


def aider(o: Options, parts: set[str]) -> list[Target]:
    path = (o.project if o.scope == "project" else o.home) / ".aider.conf.yml"
    if "model" not in parts:
        return []  # aider has no MCP client
    data = {"openai-api-base": f"{o.base_url}/v1", "openai-api-key": o.api_key, "model": f"openai/{o.model}",
            "edit-format": "whole", "show-model-warnings": False}
    return [Target(path, "yaml", data, "aider config: OpenAI-compatible endpoint")]


CLIENTS = {
    "claude-code": claude_code,
    "codex": codex,
    "opencode": opencode,
    "cursor": cursor,
    "continue": continue_dev,
    "zed": zed,
    "vscode": vscode,
    "aider": aider,
}
PARTS = ("model", "mcp", "hooks")


def targets(client: str, o: Options, parts: set[str] | None = None) -> list[Target]:
    if client not in CLIENTS:
        raise KeyError(client)
    return CLIENTS[client](o, set(parts or PARTS))


def mcp_command() -> str:
    """The absolute path of this `mlx-dspark`, so editors that don't share your PATH find it."""
    exe = Path(sys.executable).parent / "mlx-dspark"
    return str(exe) if exe.exists() else (shutil.which("mlx-dspark") or "mlx-dspark")
