"""Issue 16 item 5, through Codex: the real Codex CLI (`codex exec`, Responses API) renames a
held-out file through our server, offline (scripts/codex_session.py runs the session).

What Codex 0.171 sends (recorded with scripts/recording_proxy.py): for a model it has no metadata
for (`model = "local"`) its tools are `exec_command` (a shell in a PTY), `write_stdin`,
`request_user_input`, `view_image`, goal tools, a `namespace` of sub-agent tools and `web_search`:
no edit tool at all. For a model slug in its bundled catalogue (`gpt-5.5` here: only the name
Codex sends; our server serves whatever model it loaded under any name) it adds `apply_patch` as a
`custom` (freeform, lark grammar) tool, the edit tool Codex's own models use. So the session runs
with `model = "gpt-5.5"`; agent_bridge/apis/responses_api.py shows the custom tool to the model as a
function of one string, `input`, and answers its calls as `custom_tool_call` items.
`--sandbox workspace-write` runs the shell and writes the patch in this container (no network).

- `test_scripted_model_renames_through_codex`: a scripted model (tests/scripted_model.py) reads the
  file with `exec_command` (`cat`), patches it with `apply_patch` (an update hunk per renamed
  region, with context, as a Codex model writes one), then answers in one line.
- `test_evaluation_script_through_codex`: scripts/agent_rename_eval.py --client codex (scripted model).
- `test_custom_tool_round_trip`: the custom tool through the real `openai` SDK, whole and streamed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from server_harness import RunningServer, build_agent_sized_model, cli_test

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import agent_rename_eval as evaluation  # noqa: E402
from codex_session import CODEX, apply_patch_for, run_codex_session  # noqa: E402


real_codex = cli_test(CODEX, "the Codex CLI")  # a slow test that runs the Codex CLI


@pytest.fixture(scope="module")
def case() -> evaluation.Case:
    return evaluation.e2e_case()


@pytest.fixture(scope="module")
def agent_sized_model(tmp_path_factory) -> Path:
    return build_agent_sized_model(tmp_path_factory.mktemp("agent-sized-codex"))


@real_codex
def test_scripted_model_renames_through_codex(case, cache_home, tmp_path, agent_sized_model):
    from recording_proxy import RecordingProxy
    from scripted_model import script_engine
    from test_claude_rename_e2e import serve_engine

    from agent_bridge.app import create_app

    read = {"name": "exec_command", "arguments": {"cmd": f"cat {case.name}"}}
    patch = {"name": "apply_patch", "arguments": {"input": apply_patch_for(case.name, case.text, case.expected)}}
    answer = f"Renamed {case.old} to {case.new} in {case.name}."
    capture = tmp_path / "capture.jsonl"
    with serve_engine(str(agent_sized_model)) as engine:
        script_engine(engine).set(*(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in (read, patch)), answer)
        with RunningServer(create_app(engine)) as srv, RecordingProxy(srv.url, capture) as proxy:
            session = run_codex_session(case, srv.url, tmp_path / "session", timeout=480, cli_url=proxy.url)
    report = json.dumps(session.__dict__, indent=1, default=str)[:4000]
    assert session.is_error is False and session.passed, report  # exit 0; on disk: exactly the rename
    assert session.tool_calls == ["shell", "apply_patch"] and session.result == answer, report
    # the server's telemetry: three turns, each ended by the model; the second (the patch) read
    # the first one's whole prompt from the prefix cache, and lookup drafted the patch's lines
    assert [r["finish"] for r in session.requests] == ["stop"] * 3, report
    first, second = session.requests[0], session.requests[1]
    assert second["cached_tokens"] >= first["prompt_tokens"], report
    assert second["drafted_by_source"].get("lookup", 0) > 0, report
    assert second["accepted_by_source"].get("lookup", 0) > 0, report
    # what Codex sent: apply_patch as a custom tool; its call and output came back as custom items
    sent = [json.loads(line) for line in capture.read_text().splitlines()]
    assert [r["path"] for r in sent] == ["/v1/responses"] * 3
    tools = {(t["type"], t.get("name")) for t in sent[0]["body"]["tools"]}
    assert {("function", "exec_command"), ("custom", "apply_patch")} <= tools, tools
    history = sent[2]["body"]["input"]
    kinds = [i.get("type") for i in history]
    assert kinds[-4:] == ["function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output"], kinds
    (call,) = [i for i in history if i.get("type") == "custom_tool_call"]
    assert call["name"] == "apply_patch" and call["input"] == patch["arguments"]["input"]
    (read_output,) = [i for i in history if i.get("type") == "function_call_output"]
    assert case.text.splitlines()[0] in read_output["output"]  # the shell's cat, sent back to the model


@real_codex
def test_evaluation_script_through_codex(case, cache_home, tmp_path, agent_sized_model, capsys):
    """scripts/agent_rename_eval.py --client codex against a running server (a scripted model that
    answers without a tool call): its verdict, table and JSON."""
    from scripted_model import script_engine
    from test_claude_rename_e2e import serve_engine

    from agent_bridge.app import create_app

    with serve_engine(str(agent_sized_model)) as engine:
        script_engine(engine).set("I cannot do that.")
        with RunningServer(create_app(engine)) as srv:
            rc = evaluation.main(["--client", "codex", "--url", srv.url, "--only", case.rel,
                                  "--json", str(tmp_path / "out.json")])
    assert rc == 0
    out = json.loads((tmp_path / "out.json").read_text())
    (session,) = out["sessions"]
    assert (out["client"], out["passed"], session["why"]) == ("codex", 0, "no tool call (answered: 'I cannot do that.')")
    assert session["is_error"] is False and [r["finish"] for r in session["requests"]] == ["stop"]
    assert f"| {case.rel} | {case.old} -> {case.new} | no | no tool call (answered: " in capsys.readouterr().out


# -- the custom tool through the real openai SDK (fast) --

PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
SHELL_TOOL = {"type": "function", "name": "exec_command", "description": "Run a command.",
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    from engine import Engine
    from scripted_model import script_engine

    from agent_bridge.app import create_app

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
    from agent_bridge.apis.responses_api import convert_tools

    (fn,) = convert_tools([PATCH_TOOL, {"type": "web_search"}])
    assert fn["function"]["name"] == "apply_patch"
    assert fn["function"]["parameters"]["required"] == ["input"]
    assert "start: /.+/" in fn["function"]["description"]  # the grammar, for the model to follow


def test_apply_patch_for_changes_only_the_renamed_lines():
    patch = apply_patch_for("f.py", "a\nb\nfoo\nc\n", "a\nb\nbar\nc\n", context=1)
    assert patch == "*** Begin Patch\n*** Update File: f.py\n@@\n b\n-foo\n+bar\n c\n*** End Patch\n"
