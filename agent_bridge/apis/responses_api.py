"""OpenAI Responses API: POST /v1/responses, enough for Codex (`wire_api = "responses"`).

Stateless: the client sends the whole conversation as `input` items (Codex does, with
`store: false`); `previous_response_id` is refused with a clear error.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine import Done

from agent_bridge.apis.openai_api import tool_choice
from agent_bridge.apis.sse import EventStream, sse, sse_comment
from agent_bridge.apis.stream_driver import Wire, collect_text, drive, whole_reply
from agent_bridge.chat.chat_request import ChatRequest, MAX_TOKENS_LIMIT, get, get_int, get_number, json_format, text_of, tool_call
from agent_bridge.chat.http_errors import ApiError, bad_request, openai_body
from agent_bridge.chat.json_body import read_json
from agent_bridge.chat.tool_stream import CallArgs, CallEnd, CallStart, Text, ToolCall
from agent_bridge.serving.bridge import Bridge
from agent_bridge.serving.model_registry import use_model

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
        if t.get("type") not in ("function", "custom"):
            continue  # built-in tools (web search, ...) this server can't run
        if not isinstance(t.get("name"), str):
            raise bad_request(f"tools[{i}].name: expected a string", param="tools")
        if t["type"] == "custom":
            out.append(custom_as_function(t))
            continue
        strict = {"strict": True} if t.get("strict") is True else {}  # its calls kept to the schema (reply_grammar.py)
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                     "parameters": t.get("parameters") or {"type": "object"}, **strict}})
    return out or None


def custom_as_function(tool: dict) -> dict:
    """A custom (freeform) tool, such as Codex's `apply_patch`, shown to the model as a function
    of one string, `input`; its calls go back to the client as `custom_tool_call` items whose
    `input` is that string (and come back in history as the same arguments, see convert_input)."""
    description = tool.get("description") or ""
    fmt = tool.get("format")
    if isinstance(fmt, dict) and isinstance(fmt.get("definition"), str):
        description += f"\n\nThe input follows this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    return {"type": "function", "function": {"name": tool["name"], "description": description, "parameters": {
        "type": "object", "properties": {"input": {"type": "string", "description": "The tool's raw input."}},
        "required": ["input"]}}}


def custom_tool_names(body: dict) -> set[str]:
    tools = body.get("tools")
    return {t["name"] for t in tools or () if isinstance(t, dict) and t.get("type") == "custom"}


def parse_request(body: dict, default_max_tokens: int) -> ChatRequest:
    if body.get("previous_response_id"):
        raise bad_request("previous_response_id: this server keeps no state; send the whole conversation as input",
                          param="previous_response_id")
    instructions = get(body, "instructions", (str,), "") or ""
    omitted: list[dict] = []
    messages = convert_input(get(body, "input", (str, list)), instructions, omitted)
    if not any(m["role"] != "system" for m in messages):
        raise bad_request("input: at least one item is required", param="input")
    parse_tools, forced = tool_choice(body)
    tools = convert_tools(body.get("tools"))
    return ChatRequest(
        messages=messages, model=get(body, "model", (str,), "") or "",
        tools=tools if parse_tools else None, parse_tools=parse_tools, forced_tool=forced,
        max_tokens=get_int(body, "max_output_tokens", None, minimum=1, maximum=MAX_TOKENS_LIMIT) or default_max_tokens,
        temperature=get_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=get_number(body, "top_p", 1.0, 1e-9, 1.0),
        stream=get(body, "stream", (bool,), False),
        omitted_content=omitted,
        response_format=text_format(body),
    )


def text_format(body: dict) -> dict | None:
    """Responses `text.format`: {"type": "text" | "json_object"} or {"type": "json_schema", "name",
    "schema", "strict"} (always enforced)."""
    text = get(body, "text", (dict,), None) or {}
    fmt = get(text, "format", (dict,), None, where="text.")
    if fmt is None:
        return None
    return json_format(fmt.get("type"), fmt.get("schema"), fmt.get("name"), "text.format")


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _item(kind: str, text: str = "", call: ToolCall | None = None, custom: set[str] = frozenset()) -> dict:
    """An output item: kind "call", "reasoning" or "text"; a call of a tool named in `custom`
    is a custom_tool_call carrying its `input` string."""
    if kind == "call" and call.name in custom:
        value = call.arguments.get("input", "")
        return {"id": _id("ctc_"), "type": "custom_tool_call", "status": "completed", "call_id": call.id,
                "name": call.name, "input": value if isinstance(value, str) else json.dumps(value)}
    if kind == "call":
        return {"id": _id("fc_"), "type": "function_call", "status": "completed", "call_id": call.id,
                "name": call.name, "arguments": call.arguments_json}
    if kind == "reasoning":
        return {"id": _id("rs_"), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}
    return {"id": _id("msg_"), "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def finish_response(response: dict, done: Done, n_prompt: int, req: ChatRequest, notes: list[str]) -> dict:
    s = done.stats
    response["status"] = "incomplete" if done.finish_reason == "length" else "completed"
    if done.finish_reason == "length":
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    response["usage"] = {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": s.cached_tokens},
                         "output_tokens": s.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": n_prompt + s.generated_tokens}
    response["mlx_dspark"] = req.extra(done.stats, notes)
    return response


async def responses(request: Request):
    bridge: Bridge = request.app.state.bridge
    body = await read_json(request)
    req = parse_request(body, bridge.default_max_tokens)
    bridge = await use_model(request, req.model)
    ids = await bridge.prompt_ids(req)
    gen = await bridge.generate(req, ids, request)
    parser = bridge.parser(req, gen)
    custom = custom_tool_names(body)
    response = {
        "id": _id("resp_"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": req.model or bridge.model_name, "output": [], "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": True, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "temperature": req.temperature, "top_p": req.top_p,
        "store": False, "text": {"format": {"type": "text"}}, "usage": None, "metadata": {},
    }
    if req.stream:
        return EventStream(drive(gen, parser, ResponsesWire(response, len(ids), parser, req, custom)), gen)
    text = await collect_text(gen)
    reply = whole_reply(parser, text, gen.done)
    response["output"] = [_item(b.kind, b.text, b.call, custom) for b in reply.blocks]
    return JSONResponse(finish_response(response, gen.done, len(ids), req, parser.notes))


class ResponsesWire(Wire):
    """Responses API events. Output items are built whole when they close: the open item is only
    its kind, id, index and text so far (nothing sent is changed afterwards)."""

    def __init__(self, response: dict, n_prompt: int, parser: Any, req: ChatRequest, custom: set[str] = frozenset()):
        self.response, self.n_prompt = response, n_prompt
        self.parser, self.req, self.custom = parser, req, custom
        self.seq = 0
        self.open: dict | None = None  # {"kind": "text"|"reasoning"|"call", "id", "index", "text", "call"}

    def _ev(self, kind: str, **data: Any) -> str:
        self.seq += 1
        return sse(kind, {"type": kind, "sequence_number": self.seq - 1, **data})

    def opening(self) -> list[str]:
        return [self._ev("response.created", response=self.response),
                self._ev("response.in_progress", response=self.response)]

    def ping(self, info: dict | None) -> list[str]:
        return [sse_comment(info)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        o, self.open = self.open, None
        item = _item(o["kind"], o["text"], o["call"], self.custom)
        item["id"], item["status"] = o["id"], "completed"
        self.response["output"].append(item)
        idx = o["index"]
        if o["kind"] == "reasoning":
            return [self._ev("response.output_item.done", output_index=idx, item=item)]
        if item["type"] == "custom_tool_call":
            return [self._ev("response.custom_tool_call_input.done", item_id=o["id"], output_index=idx,
                             input=item["input"]),
                    self._ev("response.output_item.done", output_index=idx, item=item)]
        if o["kind"] == "call":
            return [self._ev("response.function_call_arguments.done", item_id=o["id"], output_index=idx,
                             arguments=item["arguments"]),
                    self._ev("response.output_item.done", output_index=idx, item=item)]
        part = item["content"][0]
        return [self._ev("response.output_text.done", item_id=o["id"], output_index=idx, content_index=0,
                         text=o["text"]),
                self._ev("response.content_part.done", item_id=o["id"], output_index=idx, content_index=0, part=part),
                self._ev("response.output_item.done", output_index=idx, item=item)]

    def _open(self, kind: str, call: ToolCall | None = None) -> list[str]:
        out = self._close()
        idx = len(self.response["output"])
        shown = {**_item(kind, "", call, self.custom), "status": "in_progress"}
        if shown["type"] == "custom_tool_call":
            shown["input"] = ""  # sent whole when the call closes: its JSON-quoted pieces aren't the input's
        if kind == "text":
            shown["content"] = []
        self.open = {"kind": kind, "id": shown["id"], "index": idx, "text": "", "call": call}
        out.append(self._ev("response.output_item.added", output_index=idx, item=shown))
        if kind == "text":
            out.append(self._ev("response.content_part.added", item_id=shown["id"], output_index=idx,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def segment(self, event) -> list[str]:
        out: list[str] = []
        if isinstance(event, CallStart):
            return self._open("call", event.call)
        if isinstance(event, CallArgs):
            o = self.open
            if o["call"].name in self.custom:
                return []
            return [self._ev("response.function_call_arguments.delta", item_id=o["id"], output_index=o["index"],
                             delta=event.text)]
        if isinstance(event, CallEnd):
            return self._close()
        kind = "text" if isinstance(event, Text) else "reasoning"
        if self.open is None or self.open["kind"] != kind:
            out += self._open(kind)
        o = self.open
        o["text"] += event.text
        delta = "response.output_text.delta" if kind == "text" else "response.reasoning_text.delta"
        out.append(self._ev(delta, item_id=o["id"], output_index=o["index"], content_index=0, delta=event.text))
        return out

    def closing(self, done: Done, has_calls: bool) -> list[str]:
        out = self._close()
        finish_response(self.response, done, self.n_prompt, self.req, self.parser.notes)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        return out + [self._ev(kind, response=self.response)]

    def error(self, e: ApiError) -> list[str]:
        self.response["status"] = "failed"
        self.response["error"] = {"code": openai_body(e)["error"]["code"] or "server_error", "message": e.message}
        return [self._ev("response.failed", response=self.response)]


routes = [Route("/v1/responses", responses, methods=["POST"])]
