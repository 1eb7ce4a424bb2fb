"""The MCP server: tools that hand copy-heavy file work to the local model.

Each tool renders a prompts/ template (system + user), generates through a backend
(the engine in-process, or a running server over HTTP), checks the reply, and returns
a unified diff with the engine's stats; files are written only with apply=true,
atomically, and never from a garbled reply. Templates are exposed as MCP prompts and
the engine status as a resource. Transports: stdio (`mlx-dspark mcp`) and streamable
HTTP at /mcp on `mlx-dspark serve` (see `http_routes`).
"""

from __future__ import annotations

import json
import string
from contextlib import asynccontextmanager
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.prompts.base import Prompt, PromptArgument, UserMessage
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from pydantic import Field

import prompts

from agent_bridge.mcp.backends import STAT_KEYS, BackendError, EngineBackend, run_cancellable
from agent_bridge.mcp.edits import DEFAULT_MAX_EDIT_HUNKS, Edit, GarbledOutput, check_rename, count_hunks, new_text_from_reply
from agent_bridge.mcp.workspace import Workspace, WorkspaceError

STATUS_URI = "dspark://status"
MAX_RENAME_FILES = 32
REPLY_SLACK_TOKENS = 256  # room for the fences and small growth beyond the file's own length

INSTRUCTIONS = (
    "Local model tools (mlx-dspark). Hand mechanical, copy-heavy file work to the local model: "
    "whole-file rewrites, renames across files, targeted edits. The local model re-emits "
    "unchanged code quickly through lookup drafting. Tools return a unified diff and engine "
    "stats; they write nothing unless apply=true. Paths are relative to the workspace root."
)

PathArg = Annotated[str, Field(description="File path, relative to the workspace root (or absolute inside it).")]
ApplyArg = Annotated[bool, Field(description="Write the result to disk (atomically). Default false: only return the diff.")]
ReturnTextArg = Annotated[bool, Field(description="Also return the complete new file text.")]


def build_server(backend, workspace: Workspace, name: str = "mlx-dspark",
                 max_edit_hunks: int = DEFAULT_MAX_EDIT_HUNKS) -> MCPServer:
    server = MCPServer(name, instructions=INSTRUCTIONS, log_level="WARNING")
    tools = FileTools(backend, workspace, max_edit_hunks)
    edit_hint = ToolAnnotations(destructive_hint=True, idempotent_hint=True, open_world_hint=False)

    @server.tool(annotations=edit_hint)
    async def rewrite_file(path: PathArg, instruction: Annotated[str, Field(description="How to rewrite the file.")],
                     apply: ApplyArg = False, return_text: ReturnTextArg = False) -> CallToolResult:
        """Have the local model rewrite a whole file as instructed (refactors, restyling, porting,
        adding types or docstrings throughout). Returns a unified diff plus engine stats (tokens,
        tokens/s, draft acceptance). Nothing is written unless apply=true."""
        return await run_cancellable(tools.file_task, "rewrite_file", path, apply, return_text, instruction=instruction)

    @server.tool(annotations=edit_hint)
    async def edit_file(path: PathArg, instruction: Annotated[str, Field(description="The targeted change, in words.")],
                  apply: ApplyArg = False, return_text: ReturnTextArg = False) -> CallToolResult:
        """Have the local model make one targeted change in a file (fix a line, change a value,
        add a parameter). Returns a unified diff plus engine stats. Nothing is written unless apply=true,
        and a change spread over more than a few hunks is only proposed, never written."""
        return await run_cancellable(tools.file_task, "edit_file", path, apply, return_text, instruction=instruction)

    @server.tool(annotations=edit_hint)
    async def rename_symbol(paths: Annotated[list[str], Field(description="Files to rename in (relative to the workspace root).", min_length=1)],
                      old: Annotated[str, Field(description="Current name of the symbol.", min_length=1)],
                      new: Annotated[str, Field(description="New name of the symbol.", min_length=1)],
                      apply: ApplyArg = False, return_text: ReturnTextArg = False) -> CallToolResult:
        """Rename a symbol (function, class, variable) in each of the given files with the local
        model. Returns one unified diff for all files plus engine stats. With apply=true, files are
        written only if every file's result is sound (all or nothing)."""
        return await run_cancellable(tools.rename, paths, old, new, apply, return_text)

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def generate(prompt: Annotated[str, Field(description="The user message for the local model.")],
                 max_tokens: Annotated[int, Field(description="Most tokens to generate.", ge=1, le=32768)] = 512) -> CallToolResult:
        """Send one prompt to the local model and return its reply and engine stats."""
        return await run_cancellable(tools.generate, prompt, max_tokens)

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    def status() -> CallToolResult:
        """The local model's status: model, context window, decoding mode, cache, speed so far."""
        info = tools.status()
        return CallToolResult(content=[TextContent(type="text", text=json.dumps(info, indent=1))],
                              structured_content=info)

    @server.resource(STATUS_URI, name="engine-status", mime_type="application/json",
                     description="The local engine's status: model, cache, speed.")
    def status_resource() -> str:
        return json.dumps(tools.status(), indent=1)

    for template in prompts.names():
        server.add_prompt(template_prompt(template, workspace))
    return server


def template_fields(name: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(prompts.load(name)) if f]


def template_prompt(name: str, workspace: Workspace) -> Prompt:
    """An MCP prompt for prompts/<name>.md; `code` may be left out and is then read from `path`."""
    fields = [f for f in dict.fromkeys(template_fields(name)) if f not in prompts.DERIVED]
    reads_file = "code" in fields and "path" in fields

    def render(**args: str) -> list[UserMessage]:
        if reads_file and not args.get("code"):
            try:
                _, args["code"] = workspace.read_text(args["path"])
            except WorkspaceError as e:
                raise ValueError(str(e)) from None
        if "code" in args and not args["code"].endswith("\n"):
            args["code"] += "\n"
        return [UserMessage(prompts.render(name, **{f: args.get(f, "") for f in fields}))]

    first_line = prompts.load(name).strip().splitlines()[0] if prompts.load(name).strip() else name
    arguments = [
        PromptArgument(name=f, required=not (f == "code" and reads_file),
                       description="file text (read from path when omitted)" if f == "code" else None)
        for f in fields
    ]
    return Prompt(name=name, description=f"prompts/{name}.md: {first_line[:120]}", arguments=arguments, fn=render)


def task_messages(template: str, path: str, text: str, **fields: str) -> list[dict]:
    """The chat a file tool sends: system.md, then the rendered template (prompts/README.md)."""
    code = text if text.endswith("\n") else text + "\n"
    return [
        {"role": "system", "content": prompts.render("system").strip()},
        {"role": "user", "content": prompts.render(template, path=path, code=code, **fields)},
    ]


class FileTools:
    def __init__(self, backend, workspace: Workspace, max_edit_hunks: int = DEFAULT_MAX_EDIT_HUNKS):
        self.backend = backend
        self.workspace = workspace
        self.max_edit_hunks = max_edit_hunks

    # -- the tools ------------------------------------------------------------------

    def file_task(self, template: str, path: str, apply: bool, return_text: bool, **fields: str) -> CallToolResult:
        real, edit, stats = self._propose(template, path, **fields)
        if template == "edit_file" and (hunks := count_hunks(edit.old, edit.new)) > self.max_edit_hunks:
            # a targeted edit that touches the whole file is more likely damage than the edit
            edit.warnings.append(f"the change spans {hunks} hunks (more than {self.max_edit_hunks}): "
                                 "returned as a proposal, not written; review it, or use rewrite_file")
            apply = False
        if apply and edit.changed:
            self._commit([(real, edit)])
        return self._result(template, [edit], stats, apply, return_text)

    def rename(self, paths: list[str], old: str, new: str, apply: bool, return_text: bool) -> CallToolResult:
        if len(paths) > MAX_RENAME_FILES:
            raise ToolError(f"too many files ({len(paths)} > {MAX_RENAME_FILES}): split the rename")
        if old == new:
            raise ToolError("old and new names are the same")
        planned: list[tuple[Any, Edit]] = []
        stats_all: list[dict] = []
        seen: set = set()
        for p in paths:
            real = self._resolve(p)
            if real in seen:
                continue
            seen.add(real)
            _, text = self._read(p)
            if old not in text:  # nothing to rename: no need to run the model
                planned.append((real, Edit(self.workspace.relative(real), text, text,
                                           [f"{old!r} does not occur in {self.workspace.relative(real)}"])))
                continue
            real, edit, stats = self._propose("rename_symbol", p, old=old, new=new)
            stats_all.append(stats)
            try:
                check_rename(edit, old, new)
            except GarbledOutput as e:
                raise ToolError(f"{edit.path}: the local model's output is not a rename ({e}); nothing was written") from None
            planned.append((real, edit))
        if apply:  # every file checked, then staged and written together: all or nothing
            self._commit([(real, edit) for real, edit in planned if edit.changed])
        return self._result("rename_symbol", [e for _, e in planned], sum_stats(stats_all), apply, return_text)

    def generate(self, prompt: str, max_tokens: int) -> CallToolResult:
        gen = self._generate([{"role": "user", "content": prompt}], max_tokens)
        text = gen.text + f"\n\n[finish: {gen.finish_reason}; {format_stats(gen.stats)}]"
        return CallToolResult(content=[TextContent(type="text", text=text)],
                              structured_content={"text": gen.text, "finish_reason": gen.finish_reason,
                                                  "stats": gen.stats})

    def status(self) -> dict:
        try:
            info = self.backend.status()
        except BackendError as e:
            raise ToolError(str(e)) from None
        return {"workspace_root": str(self.workspace.root), **info}

    # -- pieces ---------------------------------------------------------------------

    def _resolve(self, path: str):
        try:
            return self.workspace.resolve(path)
        except WorkspaceError as e:
            raise ToolError(str(e)) from None

    def _read(self, path: str):
        try:
            return self.workspace.read_text(path)
        except WorkspaceError as e:
            raise ToolError(str(e)) from None

    def _generate(self, messages: list[dict], max_tokens: int):
        try:
            return self.backend.generate(messages, max_tokens)
        except BackendError as e:
            raise ToolError(f"local model: {e}") from None

    def _propose(self, template: str, path: str, **fields: str):
        real, on_disk = self._read(path)
        rel = self.workspace.relative(real)
        crlf = "\r\n" in on_disk  # the model sees and writes LF; the file keeps its CRLF
        text = on_disk.replace("\r\n", "\n") if crlf else on_disk
        messages = task_messages(template, rel, text, **fields)
        file_tokens = self.backend.count_tokens(text)
        max_tokens = int(file_tokens * 1.25) + REPLY_SLACK_TOKENS
        room = self.backend.room(messages)
        if room < file_tokens:
            raise ToolError(f"{rel}: too long for the local model's context window (only {max(room, 0)} tokens left for the reply)")
        gen = self._generate(messages, min(max_tokens, room))
        try:
            new = new_text_from_reply(gen.text, gen.finish_reason, text, rel)
        except GarbledOutput as e:
            head = gen.text[:400]
            raise ToolError(f"{rel}: the local model's output is garbled ({e}); nothing was written.\n"
                            f"[{format_stats(gen.stats)}]\nreply began: {head!r}") from None
        if crlf:
            new = new.replace("\r\n", "\n").replace("\n", "\r\n")
        return real, Edit(rel, on_disk, new), gen.stats

    def _commit(self, planned: list[tuple[Any, Edit]]) -> None:
        # a file may have changed while the model was generating: never overwrite that
        try:
            self.workspace.commit([(str(real), edit.old, edit.new) for real, edit in planned])
        except WorkspaceError as e:
            raise ToolError(f"{e}; nothing was written") from None

    def _result(self, tool: str, edits: list[Edit], stats: dict, applied: bool, return_text: bool) -> CallToolResult:
        changed = [e for e in edits if e.changed]
        diff = "".join(e.diff() for e in changed)
        if not changed:
            state = "no changes"
        elif applied:
            state = f"applied to {', '.join(e.path for e in changed)}"
        else:
            state = "not applied (call again with apply=true to write it)"
        warnings = [w for e in edits for w in e.warnings]
        parts = [f"{tool}: {state}", f"[{format_stats(stats)}]"]
        parts += [f"warning: {w}" for w in warnings]
        if diff:
            parts.append(f"```diff\n{diff}```")
        if return_text:
            for e in edits:
                parts.append(f"new text of {e.path}:\n```\n{e.new}```")
        structured = {
            "applied": bool(applied and changed),
            "changed_files": [e.path for e in changed],
            "diff": diff,
            "warnings": warnings,
            "stats": stats,
        }
        if return_text:
            structured["new_text"] = {e.path: e.new for e in edits}
        return CallToolResult(content=[TextContent(type="text", text="\n".join(parts))], structured_content=structured)


def sum_stats(all_stats: list[dict]) -> dict:
    """One result's stats for several files (engine.Stats.sum does the adding)."""
    if len(all_stats) <= 1:
        return all_stats[0] if all_stats else {}
    from engine import Stats

    total = Stats.sum(all_stats).to_dict()
    return {"files": len(all_stats), **{k: total[k] for k in STAT_KEYS if k in total}}


def format_stats(s: dict) -> str:
    if not s:
        return "no generation needed"
    bits = [f"{s.get('generated_tokens', '?')} tokens"]
    if s.get("decode_tok_s") is not None:
        bits.append(f"{s['decode_tok_s']} tok/s")
    if s.get("acceptance_rate") is not None:
        bits.append(f"acceptance {s['acceptance_rate']}")
    if s.get("mean_accepted") is not None:
        bits.append(f"{s['mean_accepted']} tokens/forward")
    if s.get("mode"):
        bits.append(f"mode {s['mode']}")
    if s.get("wall_s") is not None:
        bits.append(f"{round(float(s['wall_s']), 2)} s")
    return ", ".join(bits)


def http_mount(engine, root=None, host: str = "127.0.0.1", max_edit_hunks: int = DEFAULT_MAX_EDIT_HUNKS):
    """(routes, lifespan) that put streamable-HTTP MCP at /mcp on `mlx-dspark serve`'s app,
    with the tools generating through that server's own engine.

    The MCP session manager needs a running task group: the lifespan provides it.
    """
    server = build_server(EngineBackend(engine), Workspace(root), max_edit_hunks=max_edit_hunks)
    # its own Starlette app is only used for its /mcp route; DNS-rebinding protection follows `host`
    app = server.streamable_http_app(streamable_http_path="/mcp", host=host)
    routes = [r for r in app.routes if getattr(r, "path", None) == "/mcp"]

    @asynccontextmanager
    async def lifespan(_app):
        async with server.session_manager.run():
            yield

    return routes, lifespan
