"""Round trip: an assistant turn that comes back from the client (its thinking with signature,
text and tool calls, then the tool results) renders to the tokens the model produced, so the
second turn's cached prefix is the whole first turn: its prompt plus its output. For each
syntax, with a tiny tokenizer and a template in the family's shape (tests/family_templates.py)
and the scripted model (tests/scripted_model.py) writing the recorded reply."""

from __future__ import annotations

import json
import shutil

import anthropic
import pytest
from family_templates import TEMPLATES
from reply_recordings import CASES, TOOLS
from scripted_model import MARKER, script_engine
from server_harness import RunningServer

from agent_bridge.app import create_app

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
ASK = [{"role": "user", "content": "Do it."}]


def family_model(tiny_model_dir, tmp_path, syntax: str):
    if syntax == "hermes":
        return tiny_model_dir
    out = tmp_path / syntax
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATES[syntax]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def generation_prompt(engine) -> str:
    """The template's generation prompt (or, with none, the end of the user turn)."""
    tok = engine.tokenizer
    bare = tok.apply_chat_template(ASK, tokenize=False)
    gen = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    return gen[len(bare):] or "[/INST]"


@pytest.mark.parametrize("syntax", ["hermes", "qwen3_coder", "glm47", "kimi_k2", "mistral", "harmony"])
def test_second_turn_hits_the_whole_first_turn(tiny_model_dir, tmp_path, syntax):
    from engine import Engine

    with Engine(str(family_model(tiny_model_dir, tmp_path, syntax))) as engine:
        marker = MARKER if syntax == "hermes" else generation_prompt(engine)
        script = script_engine(engine, marker)
        script.set(CASES[syntax][1])
        app = create_app(engine)
        assert app.state.bridge.syntax.name == syntax  # recognised from the template
        with RunningServer(app) as srv:
            claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
            first = claude.messages.create(model="m", max_tokens=4000, messages=ASK, tools=ANTHROPIC_TOOLS)
            assert first.stop_reason == "tool_use"
            prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
            whole_turn = prompt + first.usage.output_tokens

            def second(content):
                results = [{"type": "tool_result", "tool_use_id": b.id, "content": "done"}
                           for b in content if b.type == "tool_use"]
                history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in content]},
                                 {"role": "user", "content": results}]
                return claude.messages.create(model="m", max_tokens=1, messages=history, tools=ANTHROPIC_TOOLS)

            # the control: the same turn, not recognised (other call ids), renders the template's way
            # and the cache stops inside the first reply (Mistral's template happens to write the
            # recorded calls exactly as the model did)
            other = [b.model_copy(update={"id": b.id + "x"}) if b.type == "tool_use" else b for b in first.content]
            control = second(other)
            if syntax != "mistral":
                assert control.usage.cache_read_input_tokens < whole_turn
            again = second(first.content)
            assert again.usage.cache_read_input_tokens >= whole_turn, (prompt, first.usage, again.usage)
