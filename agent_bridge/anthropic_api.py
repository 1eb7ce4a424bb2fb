"""Anthropic Messages API: POST /v1/messages (also ?beta=true) and /v1/messages/count_tokens.

What Claude Code sends (DESIGN.md, "What real clients do"): `system` as blocks whose first
is an `x-anthropic-billing-header` line that changes between runs, stripped here so the
prompt (and its cached prefix) stays the same; a `role: "system"` message inside
`messages`; `thinking`, `context_management`, `output_config`, `metadata` and
`anthropic-beta` headers, accepted and ignored where they don't apply.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine import Done, PrefillProgress, Tokens

from .chat_request import (MAX_TOKENS_LIMIT, MEDIA_BLOCKS, ChatRequest, get, get_int, get_number, get_stops, media_text,
                           text_of, tool_call)
from .http_errors import ApiError, anthropic_body, bad_request
from .job_stream import Bridge, ClientGone, EventStream, Generation, Heartbeat, read_json, sse
from .model_registry import use_model
from .tool_calls import OutputParser, Segment, parse_text

BILLING_PREFIX = "x-anthropic-billing-header:"
STOP_REASONS = {"length": "max_tokens", "stop_string": "stop_sequence", "stop": "end_turn", "cancelled": "end_turn"}


def system_text(system: Any) -> str:
    """`system` (string or text blocks) without the billing line, which varies between runs."""
    if system is None:
        return ""
    if isinstance(system, str):
        blocks = [system]
    elif isinstance(system, list):
        blocks = []
        for i, b in enumerate(system):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise bad_request(f"system[{i}]: expected a text block", param="system")
            blocks.append(b["text"])
    else:
        raise bad_request("system: expected a string or an array of text blocks", param="system")
    kept = []
    for text in blocks:
        lines = [ln for ln in text.split("\n") if not ln.startswith(BILLING_PREFIX)]
        text = "\n".join(lines)
        if text.strip():
            kept.append(text)
    return "\n".join(kept)


def _tool_result_text(block: dict, where: str, omitted: list | None) -> str:
    text = text_of(block.get("content", ""), where, omitted=omitted)  # images a tool returned: placeholders
    if block.get("is_error"):
        text = f"Error: {text}"
    return text


def convert_messages(messages: list, omitted: list | None = None) -> tuple[list[dict], str]:
    """Anthropic messages -> normalised chat messages, plus a final assistant prefix if any.
    Images and documents become placeholders, listed in `omitted`."""
    out: list[dict] = []
    prefix = ""
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: expected an object")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{where}.role: expected 'user', 'assistant' or 'system', got {role!r}")
        if not isinstance(content, (str, list)):
            raise bad_request(f"{where}.content: expected a string or an array of content blocks")
        if role == "system" or isinstance(content, str):
            if role == "assistant" and i == len(messages) - 1:
                prefix = text_of(content, where, omitted=omitted)
                continue
            out.append({"role": role, "content": text_of(content, where, omitted=omitted)})
            continue
        texts: list[str] = []
        calls: list[dict] = []
        for j, b in enumerate(content):
            bw = f"{where}.content[{j}]"
            if not isinstance(b, dict):
                raise bad_request(f"{bw}: expected an object")
            kind = b.get("type")
            if kind == "text":
                texts.append(text_of([b], where))
            elif kind in MEDIA_BLOCKS:
                texts.append(media_text(b, bw, omitted))
            elif role == "user" and kind == "tool_result":
                if not isinstance(b.get("tool_use_id"), str):
                    raise bad_request(f"{bw}.tool_use_id: expected a string")
                if texts:  # keep the order the user wrote
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": _tool_result_text(b, bw, omitted)})
            elif role == "assistant" and kind == "tool_use":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("id"), str):
                    raise bad_request(f"{bw}: tool_use needs a string id and name")
                calls.append(tool_call(b["id"], b["name"], b.get("input", {})))
            elif role == "assistant" and kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning is not shown to the model again
            else:
                text_of([b], where)  # raises the precise error for an unknown type
        if role == "assistant":
            if i == len(messages) - 1 and not calls:
                prefix = "\n".join(texts)
                continue
            msg: dict = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out, prefix


def convert_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools: expected an array", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad_request(f"tools[{i}]: expected an object with a string name", param="tools")
        if "input_schema" not in t:
            continue  # server tools (web search...) this server can't run
        if not isinstance(t["input_schema"], dict):
            raise bad_request(f"tools[{i}].input_schema: expected an object", param="tools")
        out.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""), "parameters": t["input_schema"]}})
    return out or None


def parse_request(body: dict, default_max_tokens: int, count_only: bool = False) -> ChatRequest:
    model = get(body, "model", (str,), "" if count_only else None) or ""
    messages = get(body, "messages", (list,))
    if not messages:
        raise bad_request("messages: at least one message is required", param="messages")
    omitted: list[dict] = []
    converted, prefix = convert_messages(messages, omitted)
    system = system_text(body.get("system"))
    if system:
        converted.insert(0, {"role": "system", "content": system})
    if count_only:
        max_tokens = 1
    else:
        max_tokens = get_int(body, "max_tokens", minimum=1, maximum=MAX_TOKENS_LIMIT)
    tools = convert_tools(body.get("tools"))
    choice = get(body, "tool_choice", (dict,), None)
    parse_tools = True
    if choice is not None:
        if choice.get("type") not in ("auto", "any", "tool", "none"):
            raise bad_request("tool_choice.type: expected 'auto', 'any', 'tool' or 'none'", param="tool_choice")
        if choice["type"] == "none":
            tools, parse_tools = None, False
    template_kwargs = {}
    thinking = get(body, "thinking", (dict,), None)
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad_request("thinking.type: expected 'enabled', 'disabled' or 'adaptive'", param="thinking")
        template_kwargs["enable_thinking"] = kind != "disabled"
    return ChatRequest(
        messages=converted,
        model=model,
        tools=tools,
        max_tokens=max_tokens,
        temperature=get_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=get_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=get_int(body, "top_k", 0, minimum=0),
        stop=get_stops(body, "stop_sequences"),
        stream=get(body, "stream", (bool,), False),
        template_kwargs=template_kwargs,
        parse_tools=parse_tools,
        assistant_prefix=prefix,
        omitted_content=omitted,
    )


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    # Anthropic counts cached prompt tokens apart: input_tokens is the part computed afresh.
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def _stop(done: Done, has_calls: bool) -> tuple[str, str | None]:
    if has_calls:
        return "tool_use", None
    reason = STOP_REASONS.get(done.finish_reason, "end_turn")
    return reason, done.stop_string if reason == "stop_sequence" else None


def _block(seg: Segment) -> dict:
    if seg.kind == "text":
        return {"type": "text", "text": seg.text}
    if seg.kind == "thinking":
        return {"type": "thinking", "thinking": seg.text, "signature": ""}
    return {"type": "tool_use", "id": seg.call.id, "name": seg.call.name, "input": seg.call.arguments}


def _parser(bridge: Bridge, req: ChatRequest, ids: list[int]) -> OutputParser:
    return OutputParser(bridge.syntax, req.tools, parse_tools=req.parse_tools,
                        thinking=bridge.starts_thinking(ids) and not req.assistant_prefix, id_prefix="toolu_")


async def messages(request: Request):
    bridge: Bridge = request.app.state.bridge
    req = parse_request(await read_json(request), bridge.default_max_tokens)
    bridge = await use_model(request, req.model)
    ids = await bridge.prompt_ids(req)
    gen = await bridge.generate(req, ids, request)
    model = req.model or bridge.model_name
    if req.stream:
        return EventStream(stream(gen, req, ids, model, _parser(bridge, req, ids)), gen)
    text = ""
    async for event in gen.events():
        if isinstance(event, Tokens):
            text += event.text
    done = gen.done
    p = _parser(bridge, req, ids)
    segs = parse_text(text, p.s, req.tools, parse_tools=req.parse_tools, thinking=p.state == "thinking",
                      id_prefix="toolu_")
    reason, seq = _stop(done, any(s.kind == "tool_call" for s in segs))
    return JSONResponse({
        "id": new_message_id(), "type": "message", "role": "assistant", "model": model,
        "content": [_block(s) for s in segs], "stop_reason": reason, "stop_sequence": seq,
        "usage": _usage(len(ids), done.stats.cached_tokens, done.stats.generated_tokens),
        "mlx_dspark": req.extra(done.stats),
    })


async def stream(gen: Generation, req: ChatRequest, ids: list[int], model: str, parser: OutputParser):
    index = -1
    open_kind: str | None = None

    def close() -> list[str]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": index})]

    def emit(seg: Segment) -> list[str]:
        nonlocal index, open_kind
        out: list[str] = []
        if seg.kind == "tool_call":
            out += close()
            index += 1
            start = {"type": "tool_use", "id": seg.call.id, "name": seg.call.name, "input": {}}
            out.append(sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}))
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": seg.call.arguments_json}}))
            out.append(sse("content_block_stop", {"type": "content_block_stop", "index": index}))
            return out
        if open_kind != seg.kind:
            out += close()
            index += 1
            open_kind = seg.kind
            start = {"type": "text", "text": ""} if seg.kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
            out.append(sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}))
        delta = ({"type": "text_delta", "text": seg.text} if seg.kind == "text"
                 else {"type": "thinking_delta", "thinking": seg.text})
        out.append(sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
        return out

    message = {"id": new_message_id(), "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": _usage(len(ids), gen.cached_tokens, 0)}
    yield sse("message_start", {"type": "message_start", "message": message})
    beat = Heartbeat()
    try:
        async for event in gen.events():
            if isinstance(event, PrefillProgress):
                yield sse("ping", {"type": "ping"})  # keeps the client patient during a long prefill
            elif isinstance(event, Tokens):
                segs = parser.feed(event.text)
                for seg in segs:
                    for line in emit(seg):
                        yield line
                if beat.due(bool(segs)):
                    yield sse("ping", {"type": "ping"})
    except ApiError as e:
        yield sse("error", anthropic_body(e))
        return
    except ClientGone:
        return
    for seg in parser.finish():
        for line in emit(seg):
            yield line
    for line in close():
        yield line
    done = gen.done
    reason, seq = _stop(done, bool(parser.calls))
    if index < 0:  # an empty answer still has one (empty) text block, as the API does
        yield sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        yield sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    yield sse("message_delta", {
        "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
        "usage": _usage(len(ids), done.stats.cached_tokens, done.stats.generated_tokens),
        "mlx_dspark": req.extra(done.stats)})
    yield sse("message_stop", {"type": "message_stop"})


async def count_tokens(request: Request):
    bridge: Bridge = request.app.state.bridge
    req = parse_request(await read_json(request), bridge.default_max_tokens, count_only=True)
    bridge = await use_model(request, req.model)
    ids = await bridge.prompt_ids(req, check=False)
    return JSONResponse({"input_tokens": len(ids)})


routes = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
