"""Issue 16 item 5, through Codex: the real Codex CLI (`codex exec`, Responses API) renames a
held-out file through our server, offline.

What Codex 0.171 sends (recorded with scripts/recording_proxy.py): for a model it has no metadata
for (`model = "local"`) its tools are `exec_command` (a shell in a PTY), `write_stdin`,
`request_user_input`, `view_image`, goal tools, a `namespace` of sub-agent tools and `web_search`:
no edit tool at all. For a model slug in its bundled catalogue (`gpt-5.5` here: only the name
Codex sends; our server serves whatever model it loaded under any name) it adds `apply_patch` as a
`custom` (freeform, lark grammar) tool, the edit tool Codex's own models use. So the session runs
with `model = "gpt-5.5"`; agent_bridge/responses_api.py shows the custom tool to the model as a
function of one string, `input`, and answers its calls as `custom_tool_call` items.
`--sandbox workspace-write` runs the shell and writes the patch in this container (no network).

- `test_scripted_model_renames_through_codex`: a scripted model (tests/scripted_model.py) reads the
  file with `exec_command` (`cat`), patches it with `apply_patch` (an update hunk per renamed
  region, with context, as a Codex model writes one), then answers in one line.
- `test_custom_tool_round_trip`: the custom tool through the real `openai` SDK, whole and streamed.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_harness import RunningServer, build_agent_sized_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import agent_rename_eval as evaluation  # noqa: E402

CODEX = ROOT / ".node" / "node_modules" / ".bin" / "codex"
# The held-out file of tests/test_claude_rename_e2e.py (one the bundled model renames through Claude Code).
CASE_FILE = "generate_utils.py"
# A model in Codex's catalogue whose tools include the freeform apply_patch (see above).
CODEX_MODEL = "gpt-5.5"


def apply_patch_for(name: str, old: str, new: str, context: int = 3) -> str:
    """The apply_patch input that turns `old` into `new`: one `@@` hunk per changed region."""
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


def codex_exec(prompt: str, url: str, workdir: Path, timeout: float = 480) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`codex exec --json PROMPT` in `workdir`/project with its own HOME and CODEX_HOME, against `url`."""
    home = workdir / "home"
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(
        f'model = "{CODEX_MODEL}"\nmodel_provider = "mlx"\n\n[model_providers.mlx]\nname = "mlx-dspark"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\n')
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(HOME=str(home), CODEX_HOME=str(home / ".codex"))
    p = subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", "--json", prompt],
                       cwd=workdir / "project", env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=timeout)
    return p, [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed (setup.sh needs npm)")
@pytest.mark.skipif(not CODEX.exists(), reason="the Codex CLI is absent: run setup.sh")
def test_scripted_model_renames_through_codex(cache_home, tmp_path):
    from recording_proxy import RecordingProxy
    from scripted_model import script_engine
    from test_claude_rename_e2e import serve_engine

    case = next(c for c in evaluation.held_out_cases() if c.rel == CASE_FILE)
    project = tmp_path / "session" / "project"
    project.mkdir(parents=True)
    (project / case.name).write_text(case.text)
    read = {"name": "exec_command", "arguments": {"cmd": f"cat {case.name}"}}
    patch = {"name": "apply_patch", "arguments": {"input": apply_patch_for(case.name, case.text, case.expected)}}
    answer = f"Renamed {case.old} to {case.new} in {case.name}."
    model = build_agent_sized_model(tmp_path / "model")
    capture = tmp_path / "capture.jsonl"
    with serve_engine(str(model)) as engine:
        script_engine(engine).set(*(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in (read, patch)), answer)
        from agent_bridge.server import create_app

        with RunningServer(create_app(engine)) as srv, RecordingProxy(srv.url, capture) as proxy:
            t0 = time.perf_counter()
            p, events = codex_exec(case.prompt, proxy.url, tmp_path / "session")
            wall = time.perf_counter() - t0
            requests = evaluation.finished_jobs(srv.url, settle_s=60)
    report = f"rc {p.returncode} ({wall:.1f} s)\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}\n" + json.dumps(requests)[:3000]
    assert p.returncode == 0, report
    assert (project / case.name).read_text() == case.expected, report  # exactly the rename, on disk
    done = [e["item"] for e in events if e.get("type") == "item.completed"]
    assert [i["type"] for i in done] == ["command_execution", "file_change", "agent_message"], report
    assert done[0]["exit_code"] == 0 and done[0]["aggregated_output"] == case.text  # the shell read the file
    assert done[1]["status"] == "completed" and done[1]["changes"][0]["kind"] == "update"
    assert done[2]["text"] == answer
    # the server's telemetry: three requests; the second (the patch) read the first one's prompt from the cache
    assert len(requests) == 3 and [r["finish"] for r in requests] == ["stop"] * 3, report
    first, second = requests[0], requests[1]
    assert second["cached_tokens"] >= first["prompt_tokens"], report
    assert second["drafted_by_source"].get("lookup", 0) > 0, report  # the patch's lines are the file's: lookup drafts them
    # what Codex sent: apply_patch as a custom tool; then its call and output came back as custom items
    sent = [json.loads(line)["body"] for line in capture.read_text().splitlines()]
    assert len(sent) == 3
    assert {(t["type"], t.get("name")) for t in sent[0]["tools"]} >= {("function", "exec_command"), ("custom", "apply_patch")}
    kinds = [i.get("type") for i in sent[2]["input"]]
    assert kinds[-4:] == ["function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output"], kinds
    (call,) = [i for i in sent[2]["input"] if i.get("type") == "custom_tool_call"]
    assert call["name"] == "apply_patch" and call["input"] == patch["arguments"]["input"]


# -- the custom tool through the real openai SDK (fast) --

PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
SHELL_TOOL = {"type": "function", "name": "exec_command", "description": "Run a command.",
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    from engine import Engine
    from scripted_model import script_engine

    from agent_bridge.server import create_app

    engine = Engine(str(tiny_model_dir), prefix_cache=False)
    script = script_engine(engine)
    with RunningServer(create_app(engine)) as srv:
        yield srv, script
    engine.close()


def test_custom_tool_round_trip(scripted):
    import openai

    srv, script = scripted
    patch = "*** Begin Patch\n*** Update File: a.py\n@@\n-x = \"1\"\n+y = \"1\"\n*** End Patch\n"
    script.set("<tool_call>\n" + json.dumps({"name": "apply_patch", "arguments": {"input": patch}}) + "\n</tool_call>")
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="m", input="Rename x to y in a.py", tools=[SHELL_TOOL, PATCH_TOOL])
    whole = oai.responses.create(**kw)
    with oai.responses.stream(**kw) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_response()
    for r in (whole, streamed):
        (item,) = r.output
        assert (item.type, item.name, item.input) == ("custom_tool_call", "apply_patch", patch)
        assert item.call_id
    assert "response.custom_tool_call_input.done" in kinds and "response.function_call_arguments.delta" not in kinds
    # the call and its output come back as history: the model answers after them
    script.set("Done.")
    follow = oai.responses.create(model="m", tools=[SHELL_TOOL, PATCH_TOOL], input=[
        {"role": "user", "content": "Rename x to y in a.py"},
        {"type": "custom_tool_call", "call_id": item.call_id, "name": "apply_patch", "input": patch},
        {"type": "custom_tool_call_output", "call_id": item.call_id, "output": "Success. Updated: a.py"}])
    assert follow.output_text == "Done."


def test_custom_tool_is_shown_as_a_function_of_one_string():
    from agent_bridge.responses_api import convert_tools

    (fn,) = convert_tools([PATCH_TOOL, {"type": "web_search"}])
    assert fn["function"]["name"] == "apply_patch"
    assert fn["function"]["parameters"]["required"] == ["input"]
    assert "start: /.+/" in fn["function"]["description"]  # the grammar, for the model to follow


def test_apply_patch_for_changes_only_the_renamed_lines():
    patch = apply_patch_for("f.py", "a\nb\nfoo\nc\n", "a\nb\nbar\nc\n", context=1)
    assert patch == "*** Begin Patch\n*** Update File: f.py\n@@\n b\n-foo\n+bar\n c\n*** End Patch\n"
