"""`mlx-dspark benchmark` on a tiny random model: the report's shape and its honesty
(identical output against plain mlx-lm), never its timings."""

from __future__ import annotations

import json

import pytest

from agent_bridge.cli import main
from engine import SamplingParams
from engine.bench.benchmark import build_content, plain_mlx_lm


def _agent_session(path, turns: int = 3):
    """A recorded session of the shape Claude Code sends: system blocks with a billing
    line, a system message inside `messages`, tool use and results, growing turn by turn."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "Rename foo to bar in a.py"}]},
                {"role": "system", "content": "Be brief."}]
    lines = []
    for i in range(turns):
        body = {
            "model": "claude", "max_tokens": 64, "stream": True,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0." + str(i)},
                       {"type": "text", "text": "You are a coding agent."}],
            "tools": [{"name": "Read", "description": "Read a file",
                       "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
            "messages": list(messages),
        }
        lines.append(json.dumps({"path": "/v1/messages", "headers": {}, "body": body}))
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "Read",
                                               "input": {"path": "a.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                          "content": "def foo():\n    return 1\n" * 3}]},
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_benchmark_json_shape(tiny_model_dir, tmp_path, cache_home, capsys):
    session = _agent_session(tmp_path / "session.jsonl")
    rc = main(["benchmark", "--model", str(tiny_model_dir), "--contents", "chat,code,refactor,agent",
               "--modes", "lookup,baseline", "--trials", "2", "--max-tokens", "12", "--no-tune",
               "--agent-session", str(session), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert {"machine", "model", "settings", "cost_curve", "contents", "seconds"} <= set(report)
    assert {"os", "mlx", "backend", "blas", "device_name"} <= set(report["machine"])
    assert report["settings"]["trials"] == 2 and report["settings"]["max_draft"] == "auto"
    assert report["cost_curve"]["measured"] is False  # --no-tune and nothing cached: the default

    for name in ("chat", "code"):
        r = report["contents"][name]
        assert r["kind"] == "decode" and r["prompt_tokens"] > 0
        assert len(r["mlx_lm"]["samples"]) == 2
        assert set(r["modes"]) == {"lookup", "baseline"}
        for mode, m in r["modes"].items():
            assert {"tok_s", "decode_tok_s", "ttft_s", "tokens_per_forward", "speedup", "decode_speedup",
                    "identical", "generated_tokens", "samples"} <= set(m)
            assert len(m["samples"]) == 2
            assert m["identical"] is True  # lossless: the same tokens as plain mlx-lm
            assert m["generated_tokens"] == r["mlx_lm"]["generated_tokens"]
        assert r["modes"]["baseline"]["tokens_per_forward"] == 1.0
        # 12 tokens are too few to count as a loop (engine/loop_guard.repeated_share)
        assert r["repeated_share"] == 0.0 and r["degenerate"] is False

    # The tiny tokenizer makes the real refactor file longer than the tiny context window.
    assert report["contents"]["refactor"]["kind"] == "skipped"

    agent = report["contents"]["agent"]
    assert agent["kind"] == "agent" and len(agent["turns"]) == 3
    lengths = [t["prompt_tokens"] for t in agent["turns"]]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    assert agent["turns"][0]["fraction_of_cold"] == pytest.approx(1.0)
    assert all(t["ttft_s"] > 0 for t in agent["turns"])


def test_benchmark_table(tiny_model_dir, cache_home, capsys):
    rc = main(["benchmark", "--model", str(tiny_model_dir), "--contents", "math", "--trials", "1",
               "--max-tokens", "6", "--max-draft", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "mlx-lm tok/s" in out and "identical" in out
    row = [line for line in out.splitlines() if line.startswith("math")]
    assert len(row) == 1 and row[0].split()[-2:] == ["yes", "0%"]  # identical; share of output in loops


@pytest.mark.parametrize("argv, message", [
    (["--contents", "chat,poetry"], "--contents: unknown poetry"),
    (["--modes", "telepathy"], "--modes: unknown telepathy"),
    (["--max-draft", "lots"], "--max-draft must be a whole number or 'auto'"),
    (["--trials", "0"], "--trials must be >= 1"),
])
def test_benchmark_bad_arguments(tiny_model_dir, argv, message, capsys):
    rc = main(["benchmark", "--model", str(tiny_model_dir), *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_peer_is_plain_mlx_lm(tiny_engine):
    """The peer stops at EOS and at max_tokens like the engine does."""
    ids = tiny_engine.encode("for i in range(10):\n")
    s = tiny_engine.call(lambda t: plain_mlx_lm(t, ids, 9, SamplingParams()))
    assert 0 < len(s.tokens) <= 9 and s.ttft_s > 0 and s.tokens_per_forward == 1.0


def test_refactor_and_edit_contents_use_the_prompt_templates(tiny_engine):
    import prompts

    for name, template in (("refactor", "rename_symbol"), ("edit", "edit_file")):
        c = build_content(tiny_engine, name)
        text = tiny_engine.decode(c.prompts[0])
        first_line = prompts.load(template).split("{", 1)[0]
        assert first_line in text and "```python" in text
        lines = text.count("\n")
        assert lines > 100 and c.max_tokens > len(c.prompts[0]) // 2
