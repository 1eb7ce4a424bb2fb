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

from engine import Done

from agent_bridge.chat.chat_request import (MAX_TOKENS_LIMIT, MEDIA_BLOCKS, ChatRequest, get, get_int, get_number, get_stops, json_format, media_text,
                           text_of, tool_call)
from agent_bridge.apis.sse import EventStream, sse
from agent_bridge.apis.stream_driver import Wire, collect_text, cut_short, drive, whole_reply
from agent_bridge.chat.http_errors import ApiError, anthropic_body, bad_request
from agent_bridge.chat.json_body import read_json
from agent_bridge.chat.thinking_signature import ThinkingSigner
from agent_bridge.chat.tool_stream import CallArgs, CallEnd, CallStart, Reasoning, Reply, Text
from agent_bridge.serving.bridge import Bridge
from agent_bridge.serving.job_stream import Generation
from agent_bridge.serving.model_registry import use_model

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


def convert_messages(messages: list, signer: ThinkingSigner | None = None, notes: list[str] | None = None,
                     omitted: list | None = None) -> tuple[list[dict], str]:
    """Anthropic messages -> normalised chat messages, plus a final assistant prefix if any.

    Thinking blocks this server signed go back to the template as the message's reasoning;
    others are left out (thinking_signature.py says why), each with a line in `notes`.
    Images and documents become placeholders, listed in `omitted`."""
    out: list[dict] = []
    prefix = ""
    notes = [] if notes is None else notes
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
        reasoning: list[str] = []
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
            elif role == "assistant" and kind == "thinking":
                thought = b.get("thinking")
                if isinstance(thought, str) and signer is not None and signer.verify(thought, b.get("signature")):
                    reasoning.append(thought)
                else:
                    notes.append(f"{bw}: a thinking block this server did not sign was left out of the prompt")
            elif role == "assistant" and kind == "redacted_thinking":
                notes.append(f"{bw}: redacted_thinking was left out of the prompt (this server never redacts)")
            else:
                text_of([b], where)  # raises the precise error for an unknown type
        if role == "assistant":
            if i == len(messages) - 1 and not calls:
                prefix = "\n".join(texts)
                continue
            msg: dict = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:  # the key chat templates read (Qwen3, GLM, Kimi, DeepSeek; gpt-oss: `thinking`)
                msg["reasoning_content"] = msg["thinking"] = "".join(reasoning)
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
        strict = {"strict": True} if t.get("strict") is True else {}  # its calls kept to the schema (reply_grammar.py)
        out.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""), "parameters": t["input_schema"], **strict}})
    return out or None


def parse_request(body: dict, default_max_tokens: int, count_only: bool = False,
                  signer: ThinkingSigner | None = None) -> ChatRequest:
    model = get(body, "model", (str,), "" if count_only else None) or ""
    messages = get(body, "messages", (list,))
    if not messages:
        raise bad_request("messages: at least one message is required", param="messages")
    notes: list[str] = []
    omitted: list[dict] = []
    converted, prefix = convert_messages(messages, signer, notes, omitted)
    system = system_text(body.get("system"))
    if system:
        converted.insert(0, {"role": "system", "content": system})
    if count_only:
        max_tokens = 1
    else:
        max_tokens = get_int(body, "max_tokens", minimum=1, maximum=MAX_TOKENS_LIMIT)
    tools = convert_tools(body.get("tools"))
    choice = get(body, "tool_choice", (dict,), None)
    parse_tools, forced = True, None
    if choice is not None:
        if choice.get("type") not in ("auto", "any", "tool", "none"):
            raise bad_request("tool_choice.type: expected 'auto', 'any', 'tool' or 'none'", param="tool_choice")
        if choice["type"] == "none":
            tools, parse_tools = None, False
        elif choice["type"] == "any":
            forced = ""
        elif choice["type"] == "tool":
            if not isinstance(choice.get("name"), str):
                raise bad_request("tool_choice.name: expected a string", param="tool_choice")
            forced = choice["name"]
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
        stop=get_stops(body, "stop_sequences", list_only=True),
        stream=get(body, "stream", (bool,), False),
        template_kwargs=template_kwargs,
        parse_tools=parse_tools,
        assistant_prefix=prefix,
        forced_tool=None if count_only else forced,
        notes=notes,
        omitted_content=omitted,
        response_format=output_format(body),
    )


def output_format(body: dict) -> dict | None:
    """Structured outputs: `output_format` (or the newer `output_config.format`), {"type": "json_schema", "schema"}."""
    config = get(body, "output_config", (dict,), None) or {}
    fmt = get(body, "output_format", (dict,), None) or get(config, "format", (dict,), None, where="output_config.")
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema":
        raise bad_request(f"output_format.type: expected 'json_schema', got {fmt.get('type')!r}", param="output_format")
    return json_format("json_schema", fmt.get("schema"), None, "output_format")


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    # Anthropic counts cached prompt tokens apart: input_tokens is the part computed afresh.
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def _stop(done: Done, has_calls: bool) -> tuple[str, str | None]:
    if cut_short(done):  # also when a call was being written: the client must know it is cut
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    reason = STOP_REASONS.get(done.finish_reason, "end_turn")
    return reason, done.stop_string if reason == "stop_sequence" else None


def _content(reply: Reply, signer: ThinkingSigner) -> list[dict]:
    out = []
    for b in reply.blocks:
        if b.kind == "text":
            out.append({"type": "text", "text": b.text})
        elif b.kind == "reasoning":
            out.append({"type": "thinking", "thinking": b.text, "signature": signer.sign(b.text)})
        else:
            out.append({"type": "tool_use", "id": b.call.id, "name": b.call.name, "input": b.call.arguments})
    return out


async def messages(request: Request):
    bridge: Bridge = request.app.state.bridge
    req = parse_request(await read_json(request), bridge.default_max_tokens, signer=bridge.signer)
    bridge = await use_model(request, req.model)
    ids = await bridge.prompt_ids(req)
    gen = await bridge.generate(req, ids, request)
    model = req.model or bridge.model_name
    parser = bridge.parser(req, gen, id_prefix="toolu_")
    if req.stream:
        return EventStream(drive(gen, parser, AnthropicWire(gen, len(ids), model, bridge.signer, parser, req)), gen)
    text = await collect_text(gen)
    done = gen.done
    reply = whole_reply(parser, text, done)
    reason, seq = _stop(done, bool(reply.calls))
    return JSONResponse({
        "id": new_message_id(), "type": "message", "role": "assistant", "model": model,
        "content": _content(reply, bridge.signer), "stop_reason": reason, "stop_sequence": seq,
        "usage": _usage(len(ids), done.stats.cached_tokens, done.stats.generated_tokens),
        "mlx_dspark": req.extra(done.stats, parser.notes),
    })


class AnthropicWire(Wire):
    """Messages API events: message_start, content blocks (thinking with its closing signature_delta,
    text, tool_use with input_json_delta pieces as the model writes them), message_delta/stop."""

    def __init__(self, gen: Generation, n_prompt: int, model: str, signer: ThinkingSigner, parser: Any,
                 req: ChatRequest):
        self.gen, self.n_prompt, self.model = gen, n_prompt, model
        self.signer, self.parser, self.req = signer, parser, req
        self.index = -1
        self.open_kind: str | None = None
        self.thinking = ""  # the open thinking block's text, signed when it closes

    def opening(self) -> list[str]:
        message = {"id": new_message_id(), "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   # cached: what the engine reused if it has started, else what the prefix cache held
                   # when the request was accepted (bridge.cached_now); message_delta's is what it reused
                   "usage": _usage(self.n_prompt, self.gen.cached_tokens, 0)}
        return [sse("message_start", {"type": "message_start", "message": message})]

    def ping(self, info: dict | None) -> list[str]:
        # keeps the client patient while queued, prefilling or writing a tool call
        return [sse("ping", {"type": "ping", "mlx_dspark": info} if info else {"type": "ping"})]

    def _close(self) -> list[str]:
        if self.open_kind is None:
            return []
        out = []
        if self.open_kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": self.signer.sign(self.thinking)}))
            self.thinking = ""
        self.open_kind = None
        return out + [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, kind: str, block: dict) -> list[str]:
        out = self._close()
        self.index += 1
        self.open_kind = kind
        return out + [sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def segment(self, event) -> list[str]:
        out: list[str] = []
        if isinstance(event, Text):
            if self.open_kind != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": event.text}))
        elif isinstance(event, Reasoning):
            if self.open_kind != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += event.text
            out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
        elif isinstance(event, CallStart):
            c = event.call
            out += self._start("tool_use", {"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
        elif isinstance(event, CallArgs):
            out.append(self._delta({"type": "input_json_delta", "partial_json": event.text}))
        elif isinstance(event, CallEnd):
            out += self._close()
        return out

    def closing(self, done: Done, has_calls: bool) -> list[str]:
        out = self._close()
        if self.index < 0:  # an empty answer still has one (empty) text block, as the API does
            out += self._start("text", {"type": "text", "text": ""})
            out += self._close()
        reason, seq = _stop(done, has_calls)
        out.append(sse("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": _usage(self.n_prompt, done.stats.cached_tokens, done.stats.generated_tokens),
            "mlx_dspark": self.req.extra(done.stats, self.parser.notes)}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out

    def error(self, e: ApiError) -> list[str]:
        return [sse("error", anthropic_body(e))]


async def count_tokens(request: Request):
    bridge: Bridge = request.app.state.bridge
    req = parse_request(await read_json(request), bridge.default_max_tokens, count_only=True, signer=bridge.signer)
    bridge = await use_model(request, req.model)
    ids = await bridge.prompt_ids(req, check=False)
    return JSONResponse({"input_tokens": len(ids)})


routes = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
