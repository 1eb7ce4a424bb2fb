"""OpenAI Responses API: POST /v1/responses, enough for Codex (`wire_api = "responses"`).

Stateless: the client sends the whole conversation as `input` items (Codex does, with
`store: false`); `previous_response_id` is refused with a clear error.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine import PrefillProgress, Tokens

from .chat_request import MAX_TOKENS_LIMIT, ChatRequest, get, get_int, get_number, text_of, tool_call
from .http_errors import ApiError, bad_request, openai_body
from .job_stream import Bridge, ClientGone, EventStream, Heartbeat, read_json, sse
from .model_registry import use_model
from .tool_calls import OutputParser, Segment

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def convert_input(items: Any, instructions: str, omitted: list | None = None) -> list[dict]:
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("input: expected a string or an array of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: expected an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role: expected user, assistant, system or developer, got {role!r}",
                                  param="input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": text_of(item.get("content"), where, allowed=TEXT_PARTS, omitted=omitted)})
        elif kind in ("function_call", "custom_tool_call"):
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise bad_request(f"{where}: {kind} needs a string name and call_id", param="input")
            args = item.get("arguments", "{}") if kind == "function_call" else {"input": item.get("input", "")}
            call = tool_call(call_id, name, args)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)  # one assistant turn, several calls
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output", "")
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id: expected a string", param="input")
            text = output if isinstance(output, str) else text_of(output, where, allowed=TEXT_PARTS, omitted=omitted)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise bad_request(f"{where}.type: unsupported input item type {kind!r}", param="input")
    return out


def convert_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools: expected an array", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad_request(f"tools[{i}]: expected an object", param="tools")
        if t.get("type") != "function":
            continue  # built-in tools (web search, ...) this server can't run
        if not isinstance(t.get("name"), str):
            raise bad_request(f"tools[{i}].name: expected a string", param="tools")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                     "parameters": t.get("parameters") or {"type": "object"}}})
    return out or None


def parse_request(body: dict, default_max_tokens: int) -> ChatRequest:
    if body.get("previous_response_id"):
        raise bad_request("previous_response_id: this server keeps no state; send the whole conversation as input",
                          param="previous_response_id")
    instructions = get(body, "instructions", (str,), "") or ""
    omitted: list[dict] = []
    messages = convert_input(get(body, "input", (str, list)), instructions, omitted)
    if not any(m["role"] != "system" for m in messages):
        raise bad_request("input: at least one item is required", param="input")
    choice = get(body, "tool_choice", (str, dict), None)
    parse_tools = choice != "none"
    tools = convert_tools(body.get("tools"))
    return ChatRequest(
        messages=messages, model=get(body, "model", (str,), "") or "",
        tools=tools if parse_tools else None, parse_tools=parse_tools,
        max_tokens=get_int(body, "max_output_tokens", None, minimum=1, maximum=MAX_TOKENS_LIMIT) or default_max_tokens,
        temperature=get_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=get_number(body, "top_p", 1.0, 1e-9, 1.0),
        stream=get(body, "stream", (bool,), False),
        omitted_content=omitted,
    )


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _item(seg: Segment) -> dict:
    if seg.kind == "tool_call":
        c = seg.call
        return {"id": _id("fc_"), "type": "function_call", "status": "completed", "call_id": c.id,
                "name": c.name, "arguments": c.arguments_json}
    if seg.kind == "thinking":
        return {"id": _id("rs_"), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": seg.text}]}
    return {"id": _id("msg_"), "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": seg.text, "annotations": []}]}


async def responses(request: Request):
    bridge: Bridge = request.app.state.bridge
    body = await read_json(request)
    req = parse_request(body, bridge.default_max_tokens)
    bridge = await use_model(request, req.model)
    ids = await bridge.prompt_ids(req)
    gen = await bridge.generate(req, ids, request)
    parser = OutputParser(bridge.syntax, req.tools, parse_tools=req.parse_tools,
                          thinking=bridge.starts_thinking(ids), id_prefix="call_")
    response = {
        "id": _id("resp_"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": req.model or bridge.model_name, "output": [], "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": True, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "temperature": req.temperature, "top_p": req.top_p,
        "store": False, "text": {"format": {"type": "text"}}, "usage": None, "metadata": {},
    }

    def finish() -> None:
        done = gen.done
        s = done.stats
        response["status"] = "incomplete" if done.finish_reason == "length" else "completed"
        if done.finish_reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["usage"] = {"input_tokens": len(ids), "input_tokens_details": {"cached_tokens": s.cached_tokens},
                             "output_tokens": s.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": len(ids) + s.generated_tokens}
        response["mlx_dspark"] = req.extra(s)

    if not req.stream:
        text = ""
        async for event in gen.events():
            if isinstance(event, Tokens):
                text += event.text
        segs = parser.feed(text) + parser.finish()
        merged: list[Segment] = []
        for seg in segs:
            if merged and seg.kind != "tool_call" and merged[-1].kind == seg.kind:
                merged[-1].text += seg.text
            else:
                merged.append(seg)
        response["output"] = [_item(s) for s in merged]
        finish()
        return JSONResponse(response)
    return EventStream(stream(gen, parser, response, finish), gen)


async def stream(gen, parser: OutputParser, response: dict, finish):
    seq = 0
    current: dict | None = None  # the open message or reasoning item

    def ev(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        return sse(kind, {"type": kind, "sequence_number": seq - 1, **data})

    def close() -> list[str]:
        nonlocal current
        if current is None:
            return []
        item, current = current, None
        idx = item.pop("_index")
        item["status"] = "completed"
        response["output"].append(item)
        if item["type"] == "reasoning":
            return [ev("response.output_item.done", output_index=idx, item=item)]
        part = item["content"][0]
        return [ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                   text=part["text"]),
                ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part),
                ev("response.output_item.done", output_index=idx, item=item)]

    def emit(seg: Segment) -> list[str]:
        nonlocal current
        out: list[str] = []
        idx = len(response["output"])
        if seg.kind == "tool_call":
            out += close()
            idx = len(response["output"])
            item = _item(seg)
            args = item["arguments"]
            out.append(ev("response.output_item.added", output_index=idx,
                          item={**item, "status": "in_progress", "arguments": ""}))
            out.append(ev("response.function_call_arguments.delta", item_id=item["id"], output_index=idx, delta=args))
            out.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx, arguments=args))
            out.append(ev("response.output_item.done", output_index=idx, item=item))
            response["output"].append(item)
            return out
        kind = "message" if seg.kind == "text" else "reasoning"
        if current is None or current["type"] != kind:
            out += close()
            idx = len(response["output"])
            current = _item(Segment(seg.kind, ""))
            current["status"] = "in_progress"
            shown = {k: v for k, v in current.items()}
            if kind == "message":
                shown["content"] = []
            out.append(ev("response.output_item.added", output_index=idx, item=shown))
            if kind == "message":
                out.append(ev("response.content_part.added", item_id=current["id"], output_index=idx, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": []}))
            current["_index"] = idx
        idx = current["_index"]
        current["content"][0]["text"] += seg.text
        if kind == "message":
            out.append(ev("response.output_text.delta", item_id=current["id"], output_index=idx, content_index=0,
                          delta=seg.text))
        else:
            out.append(ev("response.reasoning_text.delta", item_id=current["id"], output_index=idx, content_index=0,
                          delta=seg.text))
        return out

    yield ev("response.created", response=response)
    yield ev("response.in_progress", response=response)
    beat = Heartbeat()
    try:
        async for event in gen.events():
            if isinstance(event, PrefillProgress):
                yield ": prefill\n\n"
            elif isinstance(event, Tokens):
                segs = parser.feed(event.text)
                for seg in segs:
                    for line in emit(seg):
                        yield line
                if beat.due(bool(segs)):
                    yield ": generating\n\n"
    except ApiError as e:
        response["status"] = "failed"
        response["error"] = {"code": openai_body(e)["error"]["code"] or "server_error", "message": e.message}
        yield ev("response.failed", response=response)
        return
    except ClientGone:
        return
    for seg in parser.finish():
        for line in emit(seg):
            yield line
    for line in close():
        yield line
    finish()
    yield ev("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)


routes = [Route("/v1/responses", responses, methods=["POST"])]
