"""Issue 16 item 5: the real Claude Code CLI renames a held-out file through our server, offline.

One session of scripts/agent_rename_eval.py (`claude -p "Rename OLD to NEW in FILE"` on one of its
held-out mlx_lm files, `E2E_FILE`) against a real server on serve's defaults, and the checks the issue
names: `is_error` false, the file on disk renamed exactly, the second request (the Write) read the
first one's whole prompt from the prefix cache, and lookup drafted tokens of the re-emitted file.

- `test_bundled_model_renames_through_claude_code`: the bundled model, a model that decides for
  itself. It runs where the model has its agent-format stage (a `train_stats*.json` beside it
  counting `agent_frames`; MLX_DSPARK_E2E_BUNDLED=1 runs it regardless, failing where it can't).
  MLX_DSPARK_E2E_MODEL=DIR runs it on other weights (new weights before they are copied in).
- `test_scripted_model_renames_through_claude_code`: the same path and checks with a scripted model
  (tests/scripted_model.py: a tiny model whose replies are Read, then Write, then a sentence), so
  every assertion's plumbing is tested apart from the model's skill.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from server_harness import RunningServer, build_agent_sized_model, cli_test

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import agent_rename_eval as evaluation  # noqa: E402

# The bundled model, or candidate weights in another folder before they are copied in.
MODEL = Path(os.environ.get("MLX_DSPARK_E2E_MODEL") or ROOT / "engine" / "reference_model")


def has_agent_stage() -> bool:
    """A stage of the model was trained on Claude Code sessions (its statistics, which
    training/train.py writes, count `agent_frames`)."""
    return any(json.loads(p.read_text()).get("agent_frames") for p in MODEL.glob("train_stats*.json"))


real_cli = cli_test(evaluation.CLAUDE, "the Claude Code CLI")  # a slow test that runs the Claude Code CLI


@pytest.fixture(scope="module")
def case() -> evaluation.Case:
    return evaluation.e2e_case()


@pytest.fixture(scope="module")
def agent_sized_model(tmp_path_factory) -> Path:
    """A tiny model whose tokenizer makes Claude Code's prompt agent-sized (~24k tokens)."""
    return build_agent_sized_model(tmp_path_factory.mktemp("agent-sized-rename"))


def serve_engine(model: str):
    """An engine with `mlx-dspark serve`'s defaults (the loop guard on, the prefix cache on)."""
    from agent_bridge.commands.common import add_engine_args, engine_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_from_args(parser.parse_args(["--model", model]), persistent=True)


def rename_session(engine, case, tmp_path, capture: Path | None = None) -> tuple[evaluation.Session, str]:
    """One session and the server's /metrics after it; with `capture`, the CLI goes through
    scripts/recording_proxy.py into that file."""
    import httpx

    from agent_bridge.app import create_app
    from recording_proxy import RecordingProxy

    with RunningServer(create_app(engine)) as srv, RecordingProxy(srv.url, capture) as proxy:
        session = evaluation.run_session(case, srv.url, tmp_path / "session", timeout=480,
                                         cli_url=proxy.url if capture else None)
        return session, httpx.get(srv.url + "/metrics").text


def check(session: evaluation.Session) -> None:
    report = f"{session.why or 'renamed'}; the CLI said {session.result[:200]!r}\n" \
             + json.dumps(session.__dict__, indent=1, default=str)[:4000]
    assert session.is_error is False, report
    assert session.passed, report  # on disk: exactly the expected rename
    read, write = session.requests[0], session.requests[1]
    assert write["cached_tokens"] >= read["prompt_tokens"], report  # the first request's prefix, from the cache
    assert write["drafted_by_source"].get("lookup", 0) > 0, report  # lookup drafted the re-emitted file
    assert write["accepted_by_source"].get("lookup", 0) > 0, report


@real_cli
@pytest.mark.skipif(not has_agent_stage() and not os.environ.get("MLX_DSPARK_E2E_BUNDLED"),
                    reason="the bundled model has no agent-format stage yet (no train_stats*.json with agent_frames)")
def test_bundled_model_renames_through_claude_code(case, cache_home):
    # A fixed project path, not pytest's numbered one: the model copies the path into its calls,
    # and this small one copies some random folder names wrong, so the test runs where it was checked.
    where = Path(tempfile.gettempdir()) / "mlx-dspark-e2e-rename"
    try:
        with serve_engine(str(MODEL)) as engine:
            session, _ = rename_session(engine, case, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    check(session)
    assert session.tool_calls[:2] == ["Read", "Write"], session.tool_calls


@real_cli
def test_scripted_model_renames_through_claude_code(case, cache_home, tmp_path, agent_sized_model):
    from scripted_model import script_engine

    path = str(tmp_path / "session" / "project" / case.name)  # where run_session puts the file
    read = {"name": "Read", "arguments": {"file_path": path}}
    write = {"name": "Write", "arguments": {"file_path": path, "content": case.expected}}
    with serve_engine(str(agent_sized_model)) as engine:
        script = script_engine(engine)
        script.set(*(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in (read, write)),
                   f"Renamed {case.old} to {case.new} in {case.name}.")
        session, metrics = rename_session(engine, case, tmp_path, capture=tmp_path / "capture.jsonl")
    check(session)
    lookup = sum(r["drafted_by_source"].get("lookup", 0) for r in session.requests)
    assert f'mlx_dspark_drafted_tokens_by_drafter_total{{drafter="lookup"}} {lookup}' in metrics
    assert session.tool_calls == ["Read", "Write"], session.tool_calls
    # what the CLI sent, recorded on the way: three turns, each re-sending the whole conversation
    sent = [json.loads(line) for line in (tmp_path / "capture.jsonl").read_text().splitlines()]
    assert [r["path"] for r in sent] == ["/v1/messages?beta=true"] * 3
    assert sent[0]["headers"]["user-agent"].startswith("claude-cli/")
    assert {"Read", "Write"} <= {t["name"] for t in sent[0]["body"]["tools"]}
    last = sent[2]["body"]["messages"]
    assert [b["name"] for m in last if isinstance(m["content"], list) for b in m["content"]
            if b.get("type") == "tool_use"] == ["Read", "Write"]
    assert session.result == f"Renamed {case.old} to {case.new} in {case.name}."
    assert [r["finish"] for r in session.requests] == ["stop"] * 3  # each turn ended at the model's EOS


def test_judge_names_why_a_session_failed(case):
    """The evaluation's verdicts, from what a session leaves behind."""
    judge = evaluation.judge
    read = {"name": "Read", "input": {}, "error": None}
    write = {"name": "Write", "input": {}, "error": None}
    assert judge(case, case.expected, [read, write], False, "Done.") == ""
    assert judge(case, case.expected, [read, write], True, "API Error: boom").startswith("CLI error: API Error")
    assert judge(case, case.text, [], False, "I renamed it.") == "no Read (answered: 'I renamed it.')"
    assert judge(case, case.text, [read], False, "") == "no Write"
    assert judge(case, case.text, [read], True, "API Error: too long").startswith("no Write (CLI: API Error")
    refused = {**write, "error": "File has not been read yet"}
    assert judge(case, case.text, [read, refused], False, "").startswith("Write refused: File has not been read")
    assert judge(case, case.text, [read, write], False, "") == "file unchanged"
    lines = case.expected.splitlines(keepends=True)
    i = next(n for n, line in enumerate(lines) if case.new in line)
    wrong = "".join(lines[:i] + [lines[i].replace(case.new, case.old, 1)] + lines[i + 1:])
    assert judge(case, wrong, [read, write], False, "").startswith(f"wrong content: line {i + 1}: expected")
    assert judge(case, case.expected, [read, write], None, "") == "CLI error: no JSON result"


def test_held_out_cases_are_training_data_renames():
    from training import data

    cases = evaluation.held_out_cases()
    assert len(cases) == 10 and len({c.rel for c in cases}) == 10
    assert cases == evaluation.held_out_cases()  # the same every run
    for c in cases:
        assert 30 <= len(c.text.splitlines()) <= 150
        assert c.expected == data.rename(c.text, c.old, c.new) != c.text
        assert c.new.isidentifier() and c.prompt == f"Rename {c.old} to {c.new} in {c.name}"


# -- issue 16 item 3, with the real CLI: a turn ends at the CLI's max_tokens, and a loop ends early --

def scripted_session(case, tmp_path, model_dir, reply: str, max_output_tokens: int | None = None):
    from agent_bridge.app import create_app
    from scripted_model import script_engine

    with serve_engine(str(model_dir)) as engine:
        script_engine(engine).set(reply)
        with RunningServer(create_app(engine)) as srv:
            return evaluation.run_session(case, srv.url, tmp_path / "session", timeout=300,
                                          max_output_tokens=max_output_tokens)


@real_cli
def test_claude_code_max_tokens_ends_each_turn(case, cache_home, tmp_path, agent_sized_model):
    """CLAUDE_CODE_MAX_OUTPUT_TOKENS=48: the CLI's `max_tokens` cuts every reply at 48 tokens
    (a reply of the file's own text, which never loops)."""
    session = scripted_session(case, tmp_path, agent_sized_model, case.text, max_output_tokens=48)
    assert session.requests and not session.passed
    for r in session.requests:
        assert (r["generated"], r["finish"]) == (48, "length"), session.requests
    assert case.text == (tmp_path / "session" / "project" / case.name).read_text()


@real_cli
def test_loop_guard_ends_a_looping_reply_under_claude_code(case, cache_home, tmp_path, agent_sized_model):
    """A model stuck in a loop, asked for Claude Code's 32,000 tokens: each reply ends once 256
    tokens repeat one n-gram (as max_tokens, with the guard's note), so the session ends long
    before the context is full."""
    from engine.base.loop_guard import DEFAULT_WINDOW

    session = scripted_session(case, tmp_path, agent_sized_model, "Renaming now. " + "x = 1\n" * 4000)
    assert session.requests and not session.passed
    for r in session.requests:
        assert r["finish"] == "length" and "loop guard" in r["note"], session.requests
        assert r["generated"] < DEFAULT_WINDOW + 64, session.requests


@real_cli
def test_evaluation_script_end_to_end(case, cache_home, tmp_path, agent_sized_model, capsys):
    """scripts/agent_rename_eval.py's own main against a running server (the scripted model):
    its table, its JSON and its capture of what the CLI sent."""
    from agent_bridge.app import create_app
    from scripted_model import script_engine

    with serve_engine(str(agent_sized_model)) as engine:
        script_engine(engine).set("I cannot do that.")
        with RunningServer(create_app(engine)) as srv:
            rc = evaluation.main(["--url", srv.url, "--only", case.rel, "--capture", str(tmp_path / "cap"),
                                  "--json", str(tmp_path / "out.json"), "--sessions-dir", str(tmp_path / "s")])
    assert rc == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["sessions_dir"] == str(tmp_path / "s")
    (session,) = out["sessions"]
    assert (out["passed"], session["file"], session["why"]) == (0, case.rel, "no Read (answered: 'I cannot do that.')")
    assert [r["finish"] for r in session["requests"]] == ["stop"]
    assert f"| {case.rel} | {case.old} -> {case.new} | no | no Read (answered: " in capsys.readouterr().out
    sent = (tmp_path / "cap" / f"{Path(case.rel).stem}.jsonl").read_text().splitlines()
    assert len(sent) == 1 and case.prompt in json.dumps(json.loads(sent[0])["body"]["messages"])
    assert f"{tmp_path / 's' / 'project'}" in json.dumps(json.loads(sent[0])["body"])  # the CLI ran there


def test_draft_counts_by_drafter_sum_to_the_totals(tiny_model_dir):
    """Every drafted round is counted under the drafter that proposed it, accepted or not."""
    from engine import Engine, GenerationRequest

    with Engine(str(tiny_model_dir), mode="lookup", prefix_cache=False) as e:
        prompt = e.encode("def f(x):\n    return x + 1\n" * 12)
        stats = list(e.generate(GenerationRequest(prompt, max_tokens=80)))[-1].stats
    assert stats.drafted_tokens > stats.accepted_tokens  # some drafts were rejected, and still counted
    assert stats.drafted_by_source == {"lookup": stats.drafted_tokens}
    assert stats.accepted_by_source == {"lookup": stats.accepted_tokens}
    assert stats.to_dict()["drafted_by_source"] == {"lookup": stats.drafted_tokens}  # the `mlx_dspark` field


def test_stats_sum_adds_the_counts_by_drafter():
    from engine.base.events import Stats

    a, b = Stats(), Stats()
    a.add_round(8, 5, "lookup")
    b.add_round(4, 1, "head")
    b.add_round(6, 6, "lookup")
    total = Stats.sum([a, b.to_dict()])  # the MCP tools' totals sum Stats and their dicts
    assert (total.drafted_by_source, total.accepted_by_source) == ({"lookup": 14, "head": 4}, {"lookup": 11, "head": 1})
    assert (total.drafted_tokens, total.accepted_tokens) == (18, 12)


@real_cli
def test_max_turns_ends_a_session_that_repeats_a_refused_call(case, cache_home, tmp_path, agent_sized_model):
    """A model that writes without reading is refused by the CLI and tries again every turn:
    `--max-turns` ends that session, and the verdict quotes the CLI's refusal."""
    from agent_bridge.app import create_app
    from scripted_model import script_engine

    path = str(tmp_path / "session" / "project" / case.name)
    write = {"name": "Write", "arguments": {"file_path": path, "content": case.expected}}
    with serve_engine(str(agent_sized_model)) as engine:
        script_engine(engine).set(f"<tool_call>\n{json.dumps(write)}\n</tool_call>")
        with RunningServer(create_app(engine)) as srv:
            session = evaluation.run_session(case, srv.url, tmp_path / "session", timeout=300, max_turns=3)
    assert session.is_error is True and session.why.startswith("no Read"), session
    assert session.tool_calls == ["Write!"] * 3 and len(session.requests) == 3, session
    assert session.tool_errors and "read" in session.tool_errors[0].lower(), session.tool_errors
