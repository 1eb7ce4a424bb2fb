"""A text-only model answers requests that carry images or documents (issue 13 item 5).

One image pasted into Claude Code stays in the history: a 400 would fail every later turn.
Each image/document block becomes a short placeholder, the same text every time (so the
cached prefix matches), listed in the response's `mlx_dspark.omitted_content`. Checked with
the real anthropic and openai SDKs over a real socket, on a tiny random model: the prompt
the model sees (count_tokens, and greedy output) equals the one with the placeholder typed in.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from agent_bridge.app import create_app
from server_harness import RunningServer

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
PDF = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"},
       "title": "spec.pdf"}
IMAGE_TEXT = "[image omitted: this model reads text only]"
PDF_TEXT = "[document 'spec.pdf' omitted: this model reads text only]"


@pytest.fixture(scope="module")
def server(tiny_engine):
    with RunningServer(create_app(tiny_engine)) as srv:
        yield srv


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _text(s: str) -> dict:
    return {"type": "text", "text": s}


def test_anthropic_image_and_document_become_placeholders(claude):
    with_media = [{"role": "user", "content": [_text("What is in this picture?"), IMAGE, PDF]}]
    typed = [{"role": "user", "content": [_text("What is in this picture?"), _text(IMAGE_TEXT), _text(PDF_TEXT)]}]
    n_media = claude.messages.count_tokens(model="m", messages=with_media).input_tokens
    assert n_media == claude.messages.count_tokens(model="m", messages=typed).input_tokens
    r = claude.messages.create(model="m", max_tokens=6, messages=with_media)
    ref = claude.messages.create(model="m", max_tokens=6, messages=typed)
    assert r.content[0].text == ref.content[0].text and r.usage.input_tokens + r.usage.cache_read_input_tokens == n_media
    assert r.model_extra["mlx_dspark"]["omitted_content"] == [
        {"where": "messages[0].content[1]", "type": "image", "media_type": "image/png"},
        {"where": "messages[0].content[2]", "type": "document", "media_type": "application/pdf", "title": "spec.pdf"}]
    assert "omitted_content" not in ref.model_extra["mlx_dspark"]


def test_anthropic_session_with_an_image_in_history_keeps_working_streaming(claude):
    """The Claude Code case: the image stays in every later request, including inside tool results."""
    history = [
        {"role": "user", "content": [IMAGE, _text("Fix the layout shown.")]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"p": "a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [_text("screenshot:"), IMAGE]}]},
    ]
    events = list(claude.messages.create(model="m", max_tokens=5, messages=history, stream=True))
    delta = [e for e in events if e.type == "message_delta"][0]
    assert delta.delta.stop_reason in ("end_turn", "max_tokens")
    assert [o["where"] for o in delta.model_extra["mlx_dspark"]["omitted_content"]] == [
        "messages[0].content[0]", "messages[2].content[0].content[1]"]


def test_anthropic_text_document_is_read_not_omitted(claude):
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "def f(): pass"},
           "title": "a.py"}
    r = claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": [doc]}])
    ref = claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": "a.py\n\ndef f(): pass"}])
    assert r.input_tokens == ref.input_tokens
    m = claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [doc]}])
    assert "omitted_content" not in m.model_extra["mlx_dspark"]


def test_openai_image_url_becomes_placeholder(oai):
    parts = [{"type": "text", "text": "Describe:"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}]
    r = oai.chat.completions.create(model="m", max_tokens=6, messages=[{"role": "user", "content": parts}])
    ref = oai.chat.completions.create(model="m", max_tokens=6, messages=[{"role": "user", "content": "Describe:\n" + IMAGE_TEXT}])
    assert r.choices[0].message.content == ref.choices[0].message.content
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    assert r.model_extra["mlx_dspark"]["omitted_content"] == [{"where": "messages[0].content[1]", "type": "image"}]
    chunks = list(oai.chat.completions.create(model="m", max_tokens=4, stream=True,
                                              messages=[{"role": "user", "content": parts}]))
    last = chunks[-1].model_extra["mlx_dspark"]
    assert last["omitted_content"] == [{"where": "messages[0].content[1]", "type": "image"}]


def test_responses_input_image_becomes_placeholder(oai):
    r = oai.responses.create(model="m", max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Look:"}, {"type": "input_image", "image_url": "data:image/png;base64," + PNG}]}])
    assert r.status in ("completed", "incomplete")
    assert r.model_extra["mlx_dspark"]["omitted_content"] == [{"where": "input[0].content[1]", "type": "image"}]
