"""OpenAI API: POST /v1/chat/completions, POST /v1/completions, GET /v1/models."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine import Done, EngineError, PrefillProgress, Tokens

from .chat_request import MAX_TOKENS_LIMIT, ChatRequest, check_context, get, get_int, get_number, get_stops, text_of, tool_call
from .http_errors import ApiError, bad_request, from_engine_error, openai_body
from .job_stream import Bridge, ClientGone, EventStream, Generation, Heartbeat, read_json, sse
from .tool_calls import OutputParser, Segment, parse_text

FINISH = {"length": "length", "stop": "stop", "stop_string": "stop", "cancelled": "stop"}
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def convert_messages(messages: list) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: expected an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}", param="messages")
        content = text_of(m.get("content"), where, allowed=("text", "input_text", "output_text"))
        if role == "developer":
            role = "system"
        if role in ("tool", "function"):
            call_id = m.get("tool_call_id", m.get("name", ""))
            if not isinstance(call_id, str):
                raise bad_request(f"{where}.tool_call_id: expected a string", param="messages")
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
            continue
        msg: dict = {"role": role, "content": content}
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise bad_request(f"{where}.tool_calls: expected an array", param="messages")
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"{where}.tool_calls[{j}].function: expected an object with a name", param="messages")
                msg["tool_calls"].append(tool_call(str(c.get("id", "")), fn["name"], fn.get("arguments", "{}")))
        out.append(msg)
    return out


def convert_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools: expected an array", param="tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        out.append({"type": "function", "function": fn})
    return out or None


def sampling_fields(body: dict, default_max_tokens: int) -> dict:
    max_tokens = get_int(body, "max_completion_tokens", None, minimum=1, maximum=MAX_TOKENS_LIMIT)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, minimum=1, maximum=MAX_TOKENS_LIMIT)
    if get_int(body, "n", 1, minimum=1) != 1:
        raise bad_request("n: only n=1 is supported", param="n")
    if get(body, "logprobs", (bool,), False):
        raise bad_request("logprobs: not supported by this server", param="logprobs")
    seed = get_int(body, "seed", None)
    return dict(
        model=get(body, "model", (str,), "") or "",
        max_tokens=max_tokens or default_max_tokens,
        temperature=get_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=get_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=get_int(body, "top_k", 0, minimum=0),
        seed=seed,
        stop=get_stops(body, "stop"),
        stream=get(body, "stream", (bool,), False),
    )


def parse_chat(body: dict, default_max_tokens: int) -> ChatRequest:
    messages = get(body, "messages", (list,))
    if not messages:
        raise bad_request("messages: at least one message is required", param="messages")
    tools = convert_tools(body.get("tools"))
    choice = get(body, "tool_choice", (str, dict), None)
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise bad_request("tool_choice: expected 'none', 'auto', 'required' or an object", param="tool_choice")
    parse_tools = choice != "none"
    template_kwargs = {}
    if isinstance(body.get("chat_template_kwargs"), dict):  # vLLM/mlx-lm extension, e.g. enable_thinking
        template_kwargs.update(body["chat_template_kwargs"])
    return ChatRequest(messages=convert_messages(messages), tools=tools if parse_tools else None,
                       parse_tools=parse_tools, template_kwargs=template_kwargs,
                       **sampling_fields(body, default_max_tokens), **extension_fields(body))


def extension_fields(body: dict) -> dict:
    """Our own request options, in an `mlx_dspark` object: {"mode", "max_draft", "provenance"}."""
    ext = get(body, "mlx_dspark", (dict,), None) or {}
    max_draft = ext.get("max_draft")
    if max_draft is not None and max_draft != "auto" and (isinstance(max_draft, bool) or not isinstance(max_draft, int)
                                                          or max_draft < 0):
        raise bad_request("mlx_dspark.max_draft: expected a whole number >= 0 or 'auto'", param="mlx_dspark.max_draft")
    mode = ext.get("mode")
    if mode is not None and not isinstance(mode, str):
        raise bad_request("mlx_dspark.mode: expected a string", param="mlx_dspark.mode")
    return dict(mode=mode or None, max_draft=max_draft, provenance=bool(ext.get("provenance")))


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, done: Done) -> dict:
    n = done.stats.generated_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": done.stats.cached_tokens}}


def _include_usage(body: dict) -> bool:
    opts = get(body, "stream_options", (dict,), None)
    return bool(opts and opts.get("include_usage"))


async def chat_completions(request: Request):
    bridge: Bridge = request.app.state.bridge
    body = await read_json(request)
    req = parse_chat(body, bridge.default_max_tokens)
    include_usage = _include_usage(body)
    ids = await bridge.prompt_ids(req)
    gen = await bridge.generate(req, ids, request)
    model = req.model or bridge.model_name
    thinking = bridge.starts_thinking(ids)
    if req.stream:
        parser = OutputParser(bridge.syntax, req.tools, parse_tools=req.parse_tools, thinking=thinking)
        return EventStream(stream_chat(gen, ids, model, parser, include_usage, req.provenance), gen)
    text = await collect(gen)
    segs = parse_text(text, bridge.syntax, req.tools, parse_tools=req.parse_tools, thinking=thinking)
    message: dict = {"role": "assistant", "content": "".join(s.text for s in segs if s.kind == "text") or None}
    reasoning = "".join(s.text for s in segs if s.kind == "thinking")
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = [s.call for s in segs if s.kind == "tool_call"]
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]
    elif message["content"] is None:
        message["content"] = ""
    done = gen.done
    return JSONResponse({
        "id": _id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": "tool_calls" if calls else FINISH.get(done.finish_reason, "stop")}],
        "usage": usage(len(ids), done), "mlx_dspark": done.stats.to_dict(),
    })


async def collect(gen: Generation) -> str:
    text = ""
    async for event in gen.events():
        if isinstance(event, Tokens):
            text += event.text
    return text


async def stream_chat(gen: Generation, ids: list[int], model: str, parser: OutputParser, include_usage: bool,
                      provenance: bool = False):
    base = {"id": _id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    n_calls = 0

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> str:
        return sse(None, {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                               "finish_reason": finish}], **extra})

    def emit(seg: Segment) -> str:
        nonlocal n_calls
        if seg.kind == "text":
            return chunk({"content": seg.text})
        if seg.kind == "thinking":
            return chunk({"reasoning_content": seg.text})
        n_calls += 1
        c = seg.call
        return chunk({"tool_calls": [{"index": n_calls - 1, "id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments_json}}]})

    yield chunk({"role": "assistant", "content": ""})
    beat = Heartbeat()
    try:
        async for event in gen.events():
            if isinstance(event, PrefillProgress):
                yield ": prefill\n\n"  # an SSE comment: keeps proxies and clients from timing out
            elif isinstance(event, Tokens):
                segs = parser.feed(event.text)
                for seg in segs:
                    yield emit(seg)
                if provenance and event.provenance:  # a chunk of its own: SDKs skip empty choices
                    yield sse(None, {**base, "choices": [], "mlx_dspark": {"tokens": event.provenance,
                                                                           "drafted": event.drafted}})
                if beat.due(bool(segs)):
                    yield ": generating\n\n"
    except ApiError as e:
        yield sse(None, openai_body(e))
        return
    except ClientGone:
        return
    for seg in parser.finish():
        yield emit(seg)
    done = gen.done
    finish = "tool_calls" if n_calls else FINISH.get(done.finish_reason, "stop")
    yield chunk({}, finish, mlx_dspark=done.stats.to_dict())
    if include_usage:
        yield sse(None, {**base, "choices": [], "usage": usage(len(ids), done)})
    yield "data: [DONE]\n\n"


def parse_completion(body: dict, default_max_tokens: int) -> tuple[ChatRequest, Any]:
    prompt = get(body, "prompt", (str, list))
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad_request("prompt: expected a string, or one array of token ids (batches are not supported)",
                              param="prompt")
    if get(body, "echo", (bool,), False):
        raise bad_request("echo: not supported by this server", param="echo")
    return ChatRequest(messages=[], **sampling_fields(body, default_max_tokens)), prompt


async def completions(request: Request):
    bridge: Bridge = request.app.state.bridge
    body = await read_json(request)
    req, prompt = parse_completion(body, bridge.default_max_tokens)
    include_usage = _include_usage(body)
    ids = await bridge.encode(prompt) if isinstance(prompt, str) else list(prompt)
    try:
        check_context(ids, bridge.context_window)
    except EngineError as e:
        raise from_engine_error(e) from None
    gen = await bridge.generate(req, ids, request)
    model = req.model or bridge.model_name
    base = {"id": _id("cmpl-"), "object": "text_completion", "created": int(time.time()), "model": model}
    if not req.stream:
        text = await collect(gen)
        done = gen.done
        return JSONResponse({**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                  "finish_reason": FINISH.get(done.finish_reason, "stop")}],
                             "usage": usage(len(ids), done), "mlx_dspark": done.stats.to_dict()})

    async def events():
        def chunk(text: str, finish: str | None = None, **extra: Any) -> str:
            return sse(None, {**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                   "finish_reason": finish}], **extra})
        try:
            async for event in gen.events():
                if isinstance(event, PrefillProgress):
                    yield ": prefill\n\n"
                elif isinstance(event, Tokens) and event.text:
                    yield chunk(event.text)
        except ApiError as e:
            yield sse(None, openai_body(e))
            return
        except ClientGone:
            return
        done = gen.done
        yield chunk("", FINISH.get(done.finish_reason, "stop"), mlx_dspark=done.stats.to_dict())
        if include_usage:
            yield sse(None, {**base, "choices": [], "usage": usage(len(ids), done)})
        yield "data: [DONE]\n\n"

    return EventStream(events(), gen)


def _model_card(bridge: Bridge) -> dict:
    return {"id": bridge.model_name, "object": "model", "created": 0, "owned_by": "mlx-dspark",
            "context_window": bridge.context_window}


async def list_models(request: Request):
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state.bridge)]})


async def get_model(request: Request):
    bridge: Bridge = request.app.state.bridge
    if request.path_params["model"] != bridge.model_name:
        raise ApiError(404, f"model {request.path_params['model']!r} not found; this server serves {bridge.model_name!r}")
    return JSONResponse(_model_card(bridge))


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]
