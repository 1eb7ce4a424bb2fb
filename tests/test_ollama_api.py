"""The Ollama API (agent_bridge/apis/ollama_api.py) through the real `ollama` Python client,
against a real server socket and the bundled model: chat and generate, streamed (NDJSON)
and not, `context` given back as the next prompt's prefix, tags/show/ps/version, errors in
Ollama's shape (the client raises ollama.ResponseError with our message).

Tool calls: the bundled model does not call tools on its own, so a second copy of it is
scripted (tests/scripted_model.py: the real engine runs the real model, whose logits are
overridden to write a Hermes `<tool_call>`). The scripted model proves the protocol: the
call the model writes reaches the client as Ollama `tool_calls`, its arguments an object,
and the tool's result goes back into the next turn.

`format` is only mapped here (to ChatRequest.response_format); its enforcement is the
engine's, tested there.
"""

from __future__ import annotations

import base64
import json

import httpx
import ollama
import pytest
from scripted_model import script_engine
from server_harness import RunningServer

from agent_bridge.apis.ollama_api import parse_chat, parse_generate
from agent_bridge.app import create_app

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()


def get_weather(city: str) -> str:
    """Weather for a city.

    Args:
      city: the city's name
    """
    return "sunny"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from engine import Engine
    from engine.base.bundled import default_model_path

    engine = Engine(str(default_model_path()), prefix_cache_dir=str(tmp_path_factory.mktemp("kv")))
    app = create_app(engine)
    with RunningServer(app) as srv:
        yield srv, app.state.bridge
    engine.close()


@pytest.fixture(scope="module")
def scripted():
    from engine import Engine
    from engine.base.bundled import default_model_path

    engine = Engine(str(default_model_path()), prefix_cache=False)
    script = script_engine(engine, marker="<|im_start|>assistant\n")  # this tokenizer's generation prompt
    with RunningServer(create_app(engine)) as srv:
        yield srv, script
    engine.close()


@pytest.fixture
def client(served):
    return ollama.Client(host=served[0].url)


def model_name(served) -> str:
    return served[1].model_name


def test_chat_whole_and_streamed(served, client):
    ask = [{"role": "user", "content": "Say hello."}]
    r = client.chat(model=model_name(served), messages=ask, stream=False, options={"num_predict": 6})
    assert r.done and r.done_reason in ("stop", "length") and r.message.role == "assistant"
    assert isinstance(r.message.content, str) and 1 <= r.eval_count <= 6
    assert r.prompt_eval_count > 0 and r.total_duration > 0 and r.eval_duration > 0
    chunks = list(client.chat(model=model_name(served), messages=ask, stream=True, options={"num_predict": 6}))
    assert len(chunks) >= 2 and [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    assert last.done_reason in ("stop", "length") and 1 <= last.eval_count <= 6 and last.message.content == ""
    assert all(c.message.role == "assistant" and c.model == model_name(served) for c in chunks)
    assert "".join(c.message.content for c in chunks).strip()


def test_stream_is_ndjson_and_the_default(served):
    with httpx.stream("POST", served[0].url + "/api/chat", json={
            "model": model_name(served), "messages": [{"role": "user", "content": "Hi"}],
            "options": {"num_predict": 3}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and lines[-1]["mlx_dspark"]["generated_tokens"] == lines[-1]["eval_count"]


def test_generate_context_is_the_next_prefix(served, client):
    name, bridge = model_name(served), served[1]
    first = client.generate(model=name, prompt="Once upon a time", options={"num_predict": 5})
    n_prompt = len(first.context) - first.eval_count
    assert first.done and first.eval_count >= 1 and n_prompt > 0 and first.response is not None
    again = client.generate(model=name, prompt="And then?", context=first.context, options={"num_predict": 5})
    assert again.context[:len(first.context)] == first.context  # given back: the next prompt's prefix
    n_again = len(again.context) - again.eval_count
    assert n_again > len(first.context)
    assert n_again - again.prompt_eval_count >= n_prompt  # that prefix came from the prefix cache
    # raw: the prompt's own tokens, no template
    raw = client.generate(model=name, prompt="def add(a, b):", raw=True, options={"num_predict": 3})
    ids = bridge.engine.encode("def add(a, b):")
    assert raw.context[:len(ids)] == ids and len(raw.context) == len(ids) + raw.eval_count


def test_generate_streamed_ends_with_context(served, client):
    parts = list(client.generate(model=model_name(served), prompt="Hi", stream=True, options={"num_predict": 4}))
    assert parts[-1].done and parts[-1].context and not any(p.context for p in parts[:-1])
    assert len(parts[-1].context) > parts[-1].eval_count


def test_empty_requests_load_the_model(served, client):
    assert client.generate(model=model_name(served)).done_reason == "load"
    r = client.chat(model=model_name(served), messages=[], keep_alive=0)
    assert r.done and r.done_reason == "unload"


def test_models_tags_show_ps_version(served, client):
    name, bridge = model_name(served), served[1]
    listed = {m.model: m for m in client.list().models}
    assert name in listed and "reference" not in listed  # the bundled entry is the loaded one
    m = listed[name]
    assert m.size > 0 and len(m.digest) == 64 and m.details.family == "qwen3" and m.details.parameter_size == "12.6M"
    assert client.list().models[0].digest == m.digest  # stable
    shown = client.show(name)
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities) and "vision" not in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "qwen3"
    assert shown.modelinfo["qwen3.context_length"] == bridge.context_window
    assert "<|im_start|>" in shown.template
    running = client.ps().models
    assert [r.model for r in running] == [name] and running[0].context_length == bridge.context_window
    version = httpx.get(served[0].url + "/api/version").json()["version"]
    assert tuple(int(x) for x in version.split(".")) >= (0, 6, 4)  # what VS Code Copilot requires


def test_errors_in_ollama_shape(served, client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=model_name(served), messages=[{"role": "robot", "content": "x"}], stream=False)
    assert e.value.status_code == 400 and "messages[0].role" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:  # streamed: refused before the stream starts
        list(client.chat(model=model_name(served), messages=[{"role": "user", "content": "x"}],
                         stream=True, options={"temperature": "hot"}))
    assert e.value.status_code == 400 and "options.temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=model_name(served), prompt="x", keep_alive="soon")
    assert e.value.status_code == 400 and "keep_alive" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.show("no-such-model")
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    r = httpx.post(served[0].url + "/api/generate", json={"model": "x", "prompt": "a", "format": 3})
    assert r.status_code == 400 and r.json() == {"error": "format: expected \"json\" or a JSON schema object, got 3"}
    r = httpx.post(served[0].url + "/api/chat", content=b"{not json")
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    assert httpx.post(served[0].url + "/api/pull", json={}).json() == {"error": "no route /api/pull"}


def test_images_reach_the_prompt_as_placeholders_for_a_text_model(served):
    r = httpx.post(served[0].url + "/api/chat", json={
        "model": model_name(served), "stream": False, "options": {"num_predict": 2},
        "messages": [{"role": "user", "content": "What is this?", "images": [PNG]}]})
    assert r.status_code == 200, r.text
    assert r.json()["mlx_dspark"]["omitted_content"] == [{"where": "messages[0].images[0]", "type": "image"}]


def test_options_format_think_map_to_the_request():
    req = parse_chat({"model": "m:latest", "messages": [{"role": "user", "content": "x"}], "think": True,
                      "format": "json", "options": {"temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 7,
                                                    "num_predict": 9, "stop": ["END"], "num_ctx": 8192,
                                                    "repeat_penalty": 1.1}}, 4096)
    assert (req.model, req.temperature, req.top_p, req.top_k, req.seed, req.max_tokens, req.stop) == \
        ("m", 0.5, 0.9, 3, 7, 9, ["END"])
    assert req.stream is True and req.template_kwargs == {"enable_thinking": True}
    assert req.response_format == {"type": "json"}
    assert req.notes == ["options not applied by this server: num_ctx, repeat_penalty"]
    schema = {"title": "Weather", "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    req, prompt, context, raw = parse_generate({"model": "m", "prompt": "p", "format": schema, "stream": False,
                                                "context": [1, 2], "options": {"num_predict": -1}}, 4096)
    assert req.response_format == {"type": "json_schema", "schema": schema, "name": "Weather"}
    assert (prompt, context, raw, req.stream, req.max_tokens > 4096) == ("p", [1, 2], False, False, True)
    assert parse_chat({"model": "m", "messages": [], "format": ""}, 4096).response_format is None
    echoed = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"},
                                                    {"role": "assistant", "content": "y", "thinking": "planted"}]}, 4096)
    assert "planted" not in json.dumps(echoed.messages) and "messages[1].thinking" in echoed.notes[0]
    assert parse_chat({"model": "m", "messages": [], "think": "high"}, 4096).template_kwargs == \
        {"enable_thinking": True, "reasoning_effort": "high"}


def test_format_is_accepted_by_the_client(served, client):
    r = client.chat(model=model_name(served), messages=[{"role": "user", "content": "JSON please"}], format="json",
                    stream=False, options={"num_predict": 3})
    assert r.done


def test_tool_call_whole_and_streamed_then_its_result(scripted):
    srv, script = scripted
    client = ollama.Client(host=srv.url)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    script.set(CALL, "It is sunny in Paris.")
    r = client.chat(model="reference", messages=ask, tools=[get_weather], stream=False)
    assert r.done_reason == "stop" and r.message.content == ""
    assert [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    chunks = list(client.chat(model="reference", messages=ask, tools=[get_weather], stream=True))
    calls = [c for chunk in chunks for c in chunk.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert chunks[-1].done and not "".join(c.message.content for c in chunks)
    # the agent runs the tool and sends its result back: the next turn answers it
    history = ask + [r.message, {"role": "tool", "tool_name": "get_weather", "content": get_weather("Paris")}]
    answer = list(client.chat(model="reference", messages=history, tools=[get_weather], stream=True))
    assert "".join(c.message.content for c in answer) == "It is sunny in Paris."
    assert not any(c.message.tool_calls for c in answer)


def test_thinking_goes_to_its_own_field(scripted):
    srv, script = scripted
    client = ollama.Client(host=srv.url)
    script.set("<think>Paris is in France.</think>It is in France.")
    r = client.chat(model="reference", messages=[{"role": "user", "content": "Where is Paris?"}], think=True,
                    stream=False)
    assert r.message.thinking.strip() == "Paris is in France." and r.message.content.strip() == "It is in France."
    chunks = list(client.chat(model="reference", messages=[{"role": "user", "content": "Where is Paris?"}], think=True,
                              stream=True))
    assert "".join(c.message.thinking or "" for c in chunks).strip() == "Paris is in France."
    assert "".join(c.message.content for c in chunks).strip() == "It is in France."


def test_integrate_points_copilot_at_the_ollama_api():
    from pathlib import Path

    from agent_bridge.integrate.clients import Options, targets

    found = targets("vscode", Options(command="mlx-dspark", project=Path("."), home=Path("~"), port=9123), {"model"})
    assert [(t.path, t.data) for t in found] == \
        [(Path(".vscode/settings.json"), {"github.copilot.chat.byok.ollamaEndpoint": "http://127.0.0.1:9123"})]
    shipped = Path(__file__).resolve().parents[1] / "integrations" / "vscode" / "settings.json"
    default = targets("vscode", Options(command="mlx-dspark", project=Path("."), home=Path("~")), {"model"})
    assert json.loads(shipped.read_text()) == default[0].data


def test_images_reach_a_vlm(tmp_path):
    """An Ollama message's `images` are the same image to a VLM as any other API's image block."""
    pytest.importorskip("mlx_vlm")
    import io

    from tiny_vlm import build_tiny_gemma3_vlm, tiny_image

    from engine import Engine, GenerationRequest

    buf = io.BytesIO()
    tiny_image((200, 30, 30)).save(buf, "PNG")
    red = buf.getvalue()
    with Engine(str(build_tiny_gemma3_vlm(tmp_path / "vlm"))) as engine, RunningServer(create_app(engine)) as srv:
        ids, images = engine.render_chat_images(
            [{"role": "user", "content": engine.image_marker + "\nWhat is in the image?"}], [red])
        expected = engine.submit(GenerationRequest(prompt_ids=ids, max_tokens=8, images=images)).result().text
        r = httpx.post(srv.url + "/api/chat", timeout=120, json={
            "model": "m", "stream": False, "options": {"num_predict": 8},
            "messages": [{"role": "user", "content": "What is in the image?",
                          "images": [base64.b64encode(red).decode()]}]}).json()
        assert "omitted_content" not in r["mlx_dspark"] and r["mlx_dspark"]["prompt_tokens"] == len(ids)
        assert r["message"]["content"] == expected.lstrip()  # the reply parser drops leading whitespace
        openai_reply = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(red).decode()}},
                {"type": "text", "text": "What is in the image?"}]}]}).json()
        assert r["message"]["content"] == openai_reply["choices"][0]["message"]["content"]
        assert "vision" in ollama.Client(host=srv.url).show(srv_name(srv)).capabilities


def srv_name(srv) -> str:
    return srv.app.state.bridge.model_name


def test_a_call_being_written_keeps_the_stream_alive():
    """While a call's arguments are written nothing of it is sent (Ollama sends calls whole):
    empty pieces keep a client with an idle timeout waiting, then the call comes whole."""
    from agent_bridge.apis.ollama_api import ChatLines
    from agent_bridge.apis.sse import Heartbeat
    from agent_bridge.chat.chat_request import ChatRequest
    from agent_bridge.chat.tool_stream import CallArgs, CallEnd, CallStart, ToolCall

    wire = ChatLines("m", 3, None, ChatRequest(messages=[]))
    wire.beat = Heartbeat(every_s=0.0)  # due at once: what a long call does after 5 s
    call = ToolCall(0, "call_1", "get_weather", '{"city": "Paris"}', complete=True)
    held = [json.loads(line) for e in (CallStart(call), CallArgs(call, '{"city": "Paris"}')) for line in wire.segment(e)]
    assert held and all(h["message"] == {"role": "assistant", "content": ""} and not h["done"] for h in held)
    [whole] = [json.loads(line) for line in wire.segment(CallEnd(call))]
    assert whole["message"]["tool_calls"] == [{"id": "call_1", "function": {
        "index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}]
