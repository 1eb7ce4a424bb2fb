"""OpenAI API: POST /v1/chat/completions, POST /v1/completions, GET /v1/models."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine import Done, EngineError, Tokens, find_models

from agent_bridge.apis.sse import EventStream, sse, sse_comment
from agent_bridge.apis.stream_driver import PlainText, Wire, collect_text, cut_short, drive, whole_reply
from agent_bridge.chat.chat_request import (ChatRequest, MAX_TOKENS_LIMIT, check_context, get, get_int, get_number, get_stops,
                                            json_format, text_of, tool_call)
from agent_bridge.chat.http_errors import ApiError, bad_request, from_engine_error, openai_body
from agent_bridge.chat.json_body import read_json
from agent_bridge.chat.tool_stream import CallArgs, CallStart, Reasoning, Text
from agent_bridge.serving.bridge import Bridge
from agent_bridge.serving.model_registry import current_bridge, same_folder, use_model

FINISH = {"length": "length", "stop": "stop", "stop_string": "stop", "cancelled": "stop"}
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def convert_messages(messages: list, omitted: list | None = None) -> list[dict]:
    """OpenAI messages -> normalised chat messages; image/file/audio parts become placeholders
    listed in `omitted`."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: expected an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}", param="messages")
        content = text_of(m.get("content"), where, allowed=("text", "input_text", "output_text"), omitted=omitted)
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
    parse_tools, forced = tool_choice(body)
    template_kwargs = {}
    if isinstance(body.get("chat_template_kwargs"), dict):  # vLLM/mlx-lm extension, e.g. enable_thinking
        template_kwargs.update(body["chat_template_kwargs"])
    omitted: list[dict] = []
    return ChatRequest(messages=convert_messages(messages, omitted), tools=tools if parse_tools else None,
                       parse_tools=parse_tools, template_kwargs=template_kwargs, forced_tool=forced,
                       omitted_content=omitted, response_format=chat_response_format(body),
                       **sampling_fields(body, default_max_tokens), **extension_fields(body))


def chat_response_format(body: dict) -> dict | None:
    """Chat `response_format`: {"type": "text" | "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}} (always enforced, strict or not)."""
    fmt = get(body, "response_format", (dict,), None)
    if fmt is None:
        return None
    spec = fmt.get("json_schema") if fmt.get("type") == "json_schema" else {}
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema: expected an object", param="response_format")
    return json_format(fmt.get("type"), spec.get("schema"), spec.get("name"), "response_format")


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


def tool_choice(body: dict) -> tuple[bool, str | None]:
    """OpenAI `tool_choice` (chat and Responses forms) -> (read calls?, forced tool: None, "" any, or a name)."""
    choice = get(body, "tool_choice", (str, dict), None)
    if choice is None or choice == "auto":
        return True, None
    if choice == "none":
        return False, None
    if choice == "required":
        return True, ""
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice  # chat / Responses
        if isinstance(fn.get("name"), str):
            return True, fn["name"]
    if isinstance(choice, dict) and choice.get("type") in ("auto", "none", "required"):
        return tool_choice({"tool_choice": choice["type"]})
    raise bad_request("tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}", param="tool_choice")


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
    bridge = await use_model(request, req.model)
    include_usage = _include_usage(body)
    ids = await bridge.prompt_ids(req)
    gen = await bridge.generate(req, ids, request)
    model = req.model or bridge.model_name
    parser = bridge.parser(req, gen)
    if req.stream:
        return EventStream(drive(gen, parser, ChatWire(len(ids), model, include_usage, parser, req)), gen)
    text = await collect_text(gen)
    done = gen.done
    reply = whole_reply(parser, text, done)
    message: dict = {"role": "assistant", "content": reply.text or None}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_json}} for c in reply.calls]
    elif message["content"] is None:
        message["content"] = ""
    return JSONResponse({
        "id": _id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": _finish(done, reply.calls)}],
        "usage": usage(len(ids), done), "mlx_dspark": req.extra(done.stats, parser.notes),
    })


def _finish(done: Done, has_calls: Any) -> str:
    if cut_short(done):  # also with a call being written: "length" tells the client it is cut
        return "length"
    return "tool_calls" if has_calls else FINISH.get(done.finish_reason, "stop")


class ChatWire(Wire):
    """Chat completion chunks; keep-alives are SSE comments (the SDKs skip them). A call's
    first chunk has its index, id and name; the next ones add pieces of its arguments."""

    def __init__(self, n_prompt: int, model: str, include_usage: bool, parser: Any, req: ChatRequest):
        self.n_prompt, self.include_usage = n_prompt, include_usage
        self.parser, self.req = parser, req
        self.base = {"id": _id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": model}

    def _chunk(self, delta: dict, finish: str | None = None, **extra: Any) -> str:
        return sse(None, {**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                    "finish_reason": finish}], **extra})

    def opening(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def ping(self, info: dict | None) -> list[str]:
        return [sse_comment(info)]

    def segment(self, event) -> list[str]:
        if isinstance(event, Text):
            return [self._chunk({"content": event.text})]
        if isinstance(event, Reasoning):
            return [self._chunk({"reasoning_content": event.text})]
        if isinstance(event, CallStart):
            c = event.call
            return [self._chunk({"tool_calls": [{"index": c.index, "id": c.id, "type": "function",
                                                 "function": {"name": c.name, "arguments": ""}}]})]
        if isinstance(event, CallArgs):
            return [self._chunk({"tool_calls": [{"index": event.call.index,
                                                 "function": {"arguments": event.text}}]})]
        return []

    def tokens(self, event: Tokens) -> list[str]:
        if not (self.req.provenance and event.provenance):
            return []
        # a chunk of its own: the SDKs skip chunks with no choices
        return [sse(None, {**self.base, "choices": [], "mlx_dspark": {"tokens": event.provenance,
                                                                      "drafted": event.drafted}})]

    def closing(self, done: Done, has_calls: bool) -> list[str]:
        out = [self._chunk({}, _finish(done, has_calls), mlx_dspark=self.req.extra(done.stats, self.parser.notes))]
        if self.include_usage:
            out.append(sse(None, {**self.base, "choices": [], "usage": usage(self.n_prompt, done)}))
        return out + ["data: [DONE]\n\n"]

    def error(self, e: ApiError) -> list[str]:
        return [sse(None, openai_body(e))]


class CompletionWire(ChatWire):
    """Legacy completion chunks: the same stream with `text` instead of a delta."""

    def __init__(self, n_prompt: int, base: dict, include_usage: bool):
        self.n_prompt, self.include_usage, self.base = n_prompt, include_usage, base

    def _chunk(self, text: str, finish: str | None = None, **extra: Any) -> str:
        return sse(None, {**self.base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                    "finish_reason": finish}], **extra})

    def opening(self) -> list[str]:
        return []

    def segment(self, event) -> list[str]:
        return [self._chunk(event.text)]

    def tokens(self, event: Tokens) -> list[str]:
        return []

    def closing(self, done: Done, has_calls: bool) -> list[str]:
        out = [self._chunk("", FINISH.get(done.finish_reason, "stop"), mlx_dspark=done.stats.to_dict())]
        if self.include_usage:
            out.append(sse(None, {**self.base, "choices": [], "usage": usage(self.n_prompt, done)}))
        return out + ["data: [DONE]\n\n"]


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
    bridge = await use_model(request, req.model)
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
        text = await collect_text(gen)
        done = gen.done
        return JSONResponse({**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                  "finish_reason": FINISH.get(done.finish_reason, "stop")}],
                             "usage": usage(len(ids), done), "mlx_dspark": done.stats.to_dict()})
    return EventStream(drive(gen, PlainText(), CompletionWire(len(ids), base, include_usage)), gen)


def _model_card(bridge: Bridge) -> dict:
    return {"id": bridge.model_name, "object": "model", "created": 0, "owned_by": "mlx-dspark",
            "context_window": bridge.context_window}


async def list_models(request: Request):
    """The served model; with `?all=1` also every model on this machine (engine.find_models)."""
    bridge = current_bridge(request)
    registry = request.app.state.models
    cards = [{**_model_card(b), "loaded": True, "current": b is bridge} for b in registry.loaded.values()]
    cards.sort(key=lambda c: not c["current"])
    if request.query_params.get("all", "").lower() in ("1", "true", "yes"):
        serving = {str(getattr(b.engine, "model_path", "")): c for b, c in zip(registry.loaded.values(), cards)}
        for info in await run_in_threadpool(find_models, getattr(request.app.state, "models_dirs", ())):
            loaded = next((c for path, c in serving.items() if same_folder(info.path, path)), None)
            if loaded is not None:
                loaded["mlx_dspark"] = info.to_dict()
                continue
            cards.append({"id": info.name, "object": "model", "created": 0, "owned_by": info.source,
                          "context_window": info.context_length, "loaded": False, "mlx_dspark": info.to_dict()})
    return JSONResponse({"object": "list", "data": cards})


async def get_model(request: Request):
    loaded = request.app.state.models.loaded
    name = request.path_params["model"]
    if name not in loaded:
        raise ApiError(404, f"model {name!r} not found; this server serves {', '.join(map(repr, loaded))}")
    return JSONResponse(_model_card(loaded[name]))


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]
