"""One rename session through the real Codex CLI (`codex exec`, Responses API), judged like
scripts/agent_rename_eval.py's Claude Code sessions (`--client codex` there).

    codex exec --skip-git-repo-check --sandbox workspace-write --json "Rename OLD to NEW in FILE"

in a fresh project folder and a fresh HOME/CODEX_HOME whose config.toml points a `model_providers`
entry at the server (`wire_api = "responses"`). `model = "gpt-5.5"` (`clients.CODEX_MODEL`, as
`mlx-dspark integrate codex` writes it): only the name Codex sends (our server answers with the
model it loaded under any name); Codex picks its tools by that name, and for a model it has no
metadata for (`local`) it offers no edit tool at all, only its shell (`exec_command`). With a
catalogue slug it adds `apply_patch`, a freeform `custom` tool, as its own models use.
`--sandbox workspace-write` lets the shell and apply_patch write in the project here.

The session's tool calls come from `--json`'s events: `command_execution` (the shell, shown as
"shell"), `file_change` (apply_patch), `mcp_tool_call`, ...; "!" marks one that failed.
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import time
from pathlib import Path

from agent_bridge.integrate.clients import CODEX_MODEL

ROOT = Path(__file__).resolve().parents[1]
CODEX = ROOT / ".node" / "node_modules" / ".bin" / "codex"


def codex_env(url: str, home: Path) -> dict:
    """Codex offline against `url` with its own HOME and CODEX_HOME (no BLAS preload for node)."""
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(
        f'model = "{CODEX_MODEL}"\nmodel_provider = "mlx"\n\n[model_providers.mlx]\nname = "mlx-dspark"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\n')
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(HOME=str(home), CODEX_HOME=str(home / ".codex"))
    return env


def codex_exec(prompt: str, url: str, project: Path, home: Path, timeout: float = 600,
               codex: Path = CODEX) -> tuple[int | None, list[dict], str]:
    """Run `codex exec --json PROMPT` in `project`: (exit status or None on timeout, its events, stderr)."""
    cmd = [str(codex), "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", "--json", prompt]
    try:
        p = subprocess.run(cmd, cwd=project, env=codex_env(url, home), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=timeout)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = e.stdout or "", str(e.stderr or ""), None
        out = out.decode() if isinstance(out, bytes) else out
    events = []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return rc, events, err


def tool_calls(events: list[dict]) -> list[dict]:
    """[{"name", "item", "failed"}] for each finished tool item, in order."""
    names = {"command_execution": "shell", "file_change": "apply_patch"}
    calls = []
    for e in events:
        item = e.get("item") or {}
        if e.get("type") != "item.completed" or item.get("type") in ("agent_message", "reasoning", "error", None):
            continue
        failed = item.get("status") == "failed" or item.get("exit_code") not in (None, 0)
        calls.append({"name": names.get(item["type"], item.get("tool") or item["type"]), "item": item, "failed": failed})
    return calls


def judge(case, on_disk: str, rc: int | None, calls: list[dict], answer: str, error: str) -> str:
    """'' when the session passed, else why not (agent_rename_eval.judge's verdicts, Codex's tools)."""
    from agent_rename_eval import first_difference

    if rc is None:
        return "timeout"
    if on_disk == case.expected and rc == 0 and not error:
        return ""
    said = f" (CLI: {error[:100]})" if error else f" (answered: {answer[:60]!r})" if answer else ""
    if on_disk == case.expected:
        return "CLI error" + said
    if not calls:
        return "no tool call" + said
    edits = [c for c in calls if c["name"] == "apply_patch"]
    if not edits and on_disk == case.text:
        return f"no edit (tools: {' '.join(c['name'] for c in calls)})" + said
    if edits and all(c["failed"] for c in edits):
        return "apply_patch failed" + said
    if on_disk == case.text:
        return "file unchanged" + said
    return "wrong content: " + first_difference(case.expected, on_disk)


def run_codex_session(case, url: str, workdir: Path, timeout: float = 600, codex: Path = CODEX, cli_url: str | None = None):
    """One `codex exec` rename in a fresh project (`workdir`/project) and HOME, judged, with the
    server's per-request statistics (an agent_rename_eval.Session). Codex talks to `cli_url`
    (a recording proxy) if given."""
    from agent_rename_eval import Session, fresh_project, last_job, requests_since

    project, home, target = fresh_project(case, workdir)
    seen = last_job(url)
    s = Session(case.rel, case.old, case.new)
    t0 = time.perf_counter()
    rc, events, stderr = codex_exec(case.prompt, cli_url or url, project, home, timeout, codex)
    s.wall_s = round(time.perf_counter() - t0, 2)
    answers = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
               and (e.get("item") or {}).get("type") == "agent_message"]
    errors = [e.get("error", {}).get("message") or e.get("message", "") for e in events
              if e.get("type") in ("turn.failed", "error")]
    error = "; ".join(map(str, errors)) or (f"exit {rc}: {stderr.strip()[-200:]}" if rc not in (0, None) else "")
    s.is_error = None if rc is None else bool(error)
    s.result = answers[-1] if answers else error
    calls = tool_calls(events)
    s.tool_calls = [c["name"] + ("!" if c["failed"] else "") for c in calls]
    s.tool_errors = [f"{c['name']}: {json.dumps(c['item'])[:200]}" for c in calls if c["failed"]][:3]
    s.why = judge(case, target.read_text(), rc, calls, s.result, error)
    if s.why == "timeout":
        s.why = f"timeout after {timeout:.0f} s"
    s.passed = not s.why
    s.requests = requests_since(url, seen)
    return s


def apply_patch_for(name: str, old: str, new: str, context: int = 3) -> str:
    """The apply_patch input that turns `old` into `new`: one `@@` hunk per changed region, with
    `context` lines around it (as a Codex model writes one; the scripted test's reply)."""
    a, b = old.splitlines(), new.splitlines()
    lines = ["*** Begin Patch", f"*** Update File: {name}"]
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context):
        lines.append("@@")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                lines += [" " + x for x in a[i1:i2]]
            else:
                lines += ["-" + x for x in a[i1:i2]] + ["+" + x for x in b[j1:j2]]
    return "\n".join(lines + ["*** End Patch"]) + "\n"
