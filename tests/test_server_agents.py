"""Real agents against the server: Claude Code's recorded session replayed request by
request, the real Claude Code CLI in -p mode, and the real Codex CLI (Responses API).

The model: a tiny random model with a real-sized vocabulary (Claude Code's prompt is then
~15-25k tokens) whose weights are rewritten into a bigram chain, so that its greedy reply
to any chat is exactly REPLY then EOS (server_harness.force_reply). The engine, tokenizer,
chat template and server are the real ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from agent_bridge.app import create_app
from server_harness import RunningServer, build_agent_sized_model, check_anthropic_stream, force_reply

REPLY = "Hi from mlx-dspark."
REPO = Path(__file__).resolve().parents[1]
CLAUDE = REPO / ".node" / "node_modules" / ".bin" / "claude"
CODEX = REPO / ".node" / "node_modules" / ".bin" / "codex"
SKIP_HEADERS = {"content-length", "host", "accept-encoding", "connection"}


@pytest.fixture(scope="module")
def agent_engine(tmp_path_factory):
    from engine import Engine

    model_dir = build_agent_sized_model(tmp_path_factory.mktemp("agent-sized"))
    force_reply(model_dir, "<|im_start|>assistant", REPLY)
    engine = Engine(str(model_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(agent_engine):
    with RunningServer(create_app(agent_engine)) as srv:
        yield srv


def replay(client: httpx.Client, record: dict, body: dict | None = None) -> tuple[list[dict], str]:
    headers = {k: v for k, v in record["headers"].items() if k.lower() not in SKIP_HEADERS}
    r = client.post(record["path"], headers=headers, json=body or record["body"])
    assert r.status_code == 200, r.text[:500]
    assert r.headers["content-type"].startswith("text/event-stream")
    events = check_anthropic_stream(r.text)
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    return events, text


def cached_share(events: list[dict]) -> float:
    usage = events[0]["message"]["usage"]
    return usage["cache_read_input_tokens"] / (usage["input_tokens"] + usage["cache_read_input_tokens"])


def test_replay_rename_session(server, agent_engine, fixtures_dir):
    path = fixtures_dir / "claude-code" / "rename-session.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ids, shares, ttfts = set(), [], []
    with httpx.Client(base_url=server.url, timeout=300) as client:
        for record in records:
            events, text = replay(client, record)
            assert text == REPLY and events[-2]["delta"]["stop_reason"] == "end_turn"
            ids.add(events[0]["message"]["id"])
            final = events[-2]
            assert final["usage"]["cache_read_input_tokens"] == events[0]["message"]["usage"]["cache_read_input_tokens"]
            shares.append(cached_share(events))
            ttfts.append(final["mlx_dspark"]["ttft_s"])
        # the billing line differs between Claude Code runs: it must not change the prompt
        body = json.loads(json.dumps(records[-1]["body"]))
        body["system"][0]["text"] = "x-anthropic-billing-header: cc_version=9.9.999.zzz; cc_entrypoint=sdk-cli;"
        again, _ = replay(client, records[-1], body)
    print(f"\nrename-session ttft_s per turn: {[round(t, 3) for t in ttfts]}; cached share: "
          f"{[round(s, 4) for s in shares]}")
    assert len(ids) == len(records)  # a unique message id per response
    if agent_engine.info().get("prefix_cache") is None:
        pytest.xfail("this engine has no prefix cache")
    assert all(s > 0.9 for s in shares[1:]), shares
    assert cached_share(again) > 0.99


def test_replay_long_session(server, agent_engine, fixtures_dir):
    """Eight agent-sized requests (files read, shell commands, an edit): each accepted, well-formed,
    and each turn starts from the previous one's cached prefix."""
    path = fixtures_dir / "claude-code" / "long-session.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    previous = 0
    with httpx.Client(base_url=server.url, timeout=300) as client:
        for i, record in enumerate(records):
            events, text = replay(client, record)
            assert text == REPLY
            usage = events[0]["message"]["usage"]
            prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
            assert prompt > previous  # append-only turns
            if i and agent_engine.info().get("prefix_cache") is not None:
                assert usage["cache_read_input_tokens"] >= previous - 64, (i, usage, previous)
            previous = prompt


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed (scripts/setup.sh needs npm)")
def test_claude_code_cli(server, tmp_path):
    if not CLAUDE.exists():
        pytest.skip(f"{CLAUDE} is absent: run scripts/setup.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",) and not k.startswith("ANTHROPIC_")}
    env.update(HOME=str(tmp_path), ANTHROPIC_BASE_URL=server.url, ANTHROPIC_API_KEY="dummy",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", CLAUDE_CODE_MAX_OUTPUT_TOKENS="64",
               DISABLE_AUTOUPDATER="1")
    p = subprocess.run([str(CLAUDE), "-p", "say hi", "--output-format", "json"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    result = json.loads(p.stdout)
    assert result["subtype"] == "success" and result["is_error"] is False, result
    assert result["result"] == REPLY
    assert result["usage"]["input_tokens"] + result["usage"]["cache_read_input_tokens"] > 5000  # its whole prompt


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed (scripts/setup.sh needs npm)")
def test_codex_cli(server, tmp_path):
    if not CODEX.exists():
        pytest.skip(f"{CODEX} is absent: run scripts/setup.sh")
    codex_home = tmp_path / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        'model = "local"\nmodel_provider = "mlx"\n\n[model_providers.mlx]\nname = "mlx-dspark"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",) and not k.startswith("OPENAI_")}
    env.update(HOME=str(tmp_path), CODEX_HOME=str(codex_home))
    p = subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", "--json", "say hi"], env=env, cwd=tmp_path,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    events = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    messages = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
                and e["item"].get("type") == "agent_message"]
    assert messages == [REPLY]
    (done,) = [e for e in events if e.get("type") == "turn.completed"]
    assert done["usage"]["input_tokens"] > 1000 and done["usage"]["output_tokens"] >= 1
