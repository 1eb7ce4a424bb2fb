"""Ollama's own API: POST /api/chat, /api/generate, /api/show; GET /api/tags, /api/ps, /api/version.

The same engine, prefix cache, tool-call parsing and statistics as the other APIs: requests
become a ChatRequest, streams go through stream_driver.drive, written as Ollama's NDJSON
(one JSON object a line; `stream` is on unless the request says `false`). Where Ollama and
this server differ:

- `options` map to our sampling (temperature, top_p, top_k, seed, num_predict, stop); the
  server's defaults are its own (greedy), as on the other APIs. Options it can't apply
  (num_ctx, repeat_penalty, mirostat...) are accepted and listed in `mlx_dspark.notes`.
- `keep_alive` is checked and accepted: models stay loaded for the server's run (`--max-models`
  decides which); an empty chat/generate answers `done_reason` "load" (or "unload" for 0).
- A tool call is sent once it is complete, in one chunk, as Ollama does (arguments an object).
- A reply's `thinking` sent back in the history is left out of the prompt, with a note.
- `prompt_eval_count` counts the prompt tokens computed afresh (Ollama's meaning); the
  cached ones are in `mlx_dspark.cached_tokens`.
- `/api/generate` `context`: the prompt's and the reply's token ids; sent back, they are the
  prefix of the next prompt (and hit the prefix cache). `template` and `suffix` are refused.
- Errors are `{"error": "..."}` with the HTTP status (http_errors.py, by the /api/ path).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine import Done, EngineError, ModelInfo, model_locations
from engine.catalog.model_catalog import describe

from agent_bridge.apis import openai_api
from agent_bridge.apis.sse import SSE_HEADERS, EventStream, Heartbeat
from agent_bridge.apis.stream_driver import PlainText, Wire, collect_text, cut_short, drive, whole_reply
from agent_bridge.chat.chat_request import (MAX_TOKENS_LIMIT, ChatRequest, check_context, get, get_int, get_number,
                                            get_stops, media_text, tool_call)
from agent_bridge.chat.http_errors import ApiError, bad_request, from_engine_error
from agent_bridge.chat.json_body import read_json
from agent_bridge.chat.tool_stream import CallEnd, Reasoning, Reply, Text, ToolCall
from agent_bridge.serving.bridge import Bridge
from agent_bridge.serving.model_registry import same_folder, use_model

# The Ollama API level this server speaks: clients check it (VS Code Copilot wants >= 0.6.4).
OLLAMA_VERSION = "0.12.6"
ROLES = ("system", "user", "assistant", "tool")
APPLIED_OPTIONS = ("temperature", "top_p", "top_k", "seed", "num_predict", "stop")
DURATION_PART = r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)"  # Go's time.ParseDuration units
DURATION = re.compile(f"^(?:{DURATION_PART})+$")
UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
FOREVER = timedelta(days=292 * 365)  # what Ollama says for keep_alive -1


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ndjson(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


class NdjsonStream(EventStream):
    """A generation's stream as NDJSON lines; ends its job like every stream (sse.EventStream)."""

    def __init__(self, content, gen):
        StreamingResponse.__init__(self, content, media_type="application/x-ndjson", headers=SSE_HEADERS)
        self.gen = gen


# -- requests ---------------------------------------------------------------------------

def keep_alive_s(body: dict) -> float | None:
    """`keep_alive`: seconds, or a Go duration ("5m", "1h30m", "-1"); negative means forever."""
    value = get(body, "keep_alive", (float, str), None)
    if value is None or isinstance(value, (int, float)):
        return value
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("-")
    try:
        return sign * float(text)
    except ValueError:
        pass
    if not DURATION.match(text):
        raise bad_request(f"keep_alive: expected seconds or a duration such as '5m', got {value!r}",
                          param="keep_alive")
    return sign * sum(float(n) * UNIT_S[unit] for n, unit in re.findall(DURATION_PART, text))


def _option(read, opts: dict, name: str, *args: Any) -> Any:
    try:
        return read(opts, name, *args)
    except ApiError as e:
        raise bad_request(f"options.{e.message}", param=f"options.{name}") from None


def sampling_options(body: dict, default_max_tokens: int) -> tuple[dict, list[str]]:
    """Ollama `options` -> ChatRequest sampling fields, and notes on the ones not applied."""
    opts = get(body, "options", (dict,), None) or {}
    predict = _option(get_int, opts, "num_predict", None)
    if predict is not None and (predict < -2 or predict == 0):
        raise bad_request("options.num_predict: expected a number of tokens >= 1, or -1 (no limit)",
                          param="options.num_predict")
    fields = dict(
        temperature=_option(get_number, opts, "temperature", 0.0, 0.0, 2.0),
        top_p=_option(get_number, opts, "top_p", 1.0, 1e-9, 1.0),
        top_k=_option(get_int, opts, "top_k", 0, 0),
        seed=_option(get_int, opts, "seed", None),
        stop=_option(get_stops, opts, "stop"),
        # -1 (no limit) and -2 (fill the context): the context window is the limit
        max_tokens=MAX_TOKENS_LIMIT if predict is not None and predict < 0 else predict or default_max_tokens,
    )
    ignored = sorted(k for k, v in opts.items() if k not in APPLIED_OPTIONS and v is not None)
    notes = [f"options not applied by this server: {', '.join(ignored)}"] if ignored else []
    return fields, notes


def response_format(body: dict) -> dict | None:
    """Ollama `format` ("json" or a JSON schema) -> ChatRequest.response_format."""
    fmt = body.get("format")
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "schema": fmt, "name": str(fmt.get("title") or "response")}
    raise bad_request(f"format: expected \"json\" or a JSON schema object, got {fmt!r}", param="format")


def think_kwargs(body: dict) -> dict:
    """`think`: true/false, or an effort ("low", "medium", "high") for models that take one (gpt-oss)."""
    think = get(body, "think", (bool, str), None)
    if think is None:
        return {}
    if isinstance(think, str):
        if think not in ("low", "medium", "high"):
            raise bad_request(f"think: expected true, false, 'low', 'medium' or 'high', got {think!r}", param="think")
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": think}


def image_parts(images: Any, where: str, omitted: list) -> list[str]:
    """A message's `images` (base64 strings) -> image slots for the model (chat_request.media_text)."""
    if images is None:
        return []
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise bad_request(f"{where}.images: expected an array of base64 strings", param="images")
    return [media_text({"type": "image", "source": {"type": "base64", "data": data}}, f"{where}.images[{j}]", omitted)
            for j, data in enumerate(images)]


def convert_messages(messages: list, omitted: list, notes: list) -> list[dict]:
    """Ollama messages -> normalised chat messages. A tool result names its tool (`tool_name`,
    or `tool_call_id`): it answers the last call of that tool. A reply's `thinking` sent back
    is left out (thinking_signature.py says why; Ollama has no signature to check)."""
    out: list[dict] = []
    call_ids: dict[str, str] = {}  # tool name -> id of its latest call
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: expected an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}", param="messages")
        content = get(m, "content", (str,), "", where=f"{where}.")
        content = "\n".join(image_parts(m.get("images"), where, omitted) + ([content] if content else []))
        if role == "tool":
            name = get(m, "tool_name", (str,), "", where=f"{where}.")
            call_id = get(m, "tool_call_id", (str,), "", where=f"{where}.") or call_ids.get(name, name)
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
            continue
        msg: dict = {"role": role, "content": content}
        if role == "assistant":
            calls = get(m, "tool_calls", (list,), None, where=f"{where}.") or []
            msg_calls = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"{where}.tool_calls[{j}].function: expected an object with a name",
                                      param="messages")
                call_id = c.get("id") if isinstance(c.get("id"), str) and c["id"] else f"call_{i}_{j}"
                call_ids[fn["name"]] = call_id
                msg_calls.append(tool_call(call_id, fn["name"], fn.get("arguments", {})))
            if msg_calls:
                msg["tool_calls"] = msg_calls
            if get(m, "thinking", (str,), "", where=f"{where}."):  # unsigned: as on the other APIs
                notes.append(f"{where}.thinking was left out of the prompt (a client's text is never "
                             "shown to the model as its own reasoning)")
        out.append(msg)
    return out


def convert_tools(tools: Any) -> list[dict] | None:
    """Ollama's tools are OpenAI's, their `type` optional."""
    if isinstance(tools, list):
        tools = [{"type": "function", **t} if isinstance(t, dict) else t for t in tools]
    return openai_api.convert_tools(tools)


def common_fields(body: dict, default_max_tokens: int) -> dict:
    """What /api/chat and /api/generate share: model, options, format, think, keep_alive, stream."""
    if get(body, "logprobs", (bool,), False):
        raise bad_request("logprobs: not supported by this server", param="logprobs")
    sampling, notes = sampling_options(body, default_max_tokens)
    keep_alive_s(body)  # checked; models stay loaded for the server's run
    model = get(body, "model", (str,), "") or ""
    return dict(model=model.removesuffix(":latest"), stream=get(body, "stream", (bool,), True),
                template_kwargs=think_kwargs(body), response_format=response_format(body), notes=notes, **sampling)


def parse_chat(body: dict, default_max_tokens: int) -> ChatRequest:
    messages = get(body, "messages", (list,), [])
    omitted: list[dict] = []
    fields = common_fields(body, default_max_tokens)
    converted = convert_messages(messages, omitted, fields["notes"])
    return ChatRequest(messages=converted, tools=convert_tools(body.get("tools")), omitted_content=omitted, **fields)


def parse_generate(body: dict, default_max_tokens: int) -> tuple[ChatRequest, str, list[int], bool]:
    """(request, prompt, context ids to prefix, raw?). Templated: the prompt is a user turn
    (after `system`) in the model's chat template; raw: the prompt's own tokens, no template."""
    for name in ("template", "suffix"):
        if get(body, name, (str,), ""):
            raise bad_request(f"{name}: not supported by this server (the model's own chat template is used)",
                              param=name)
    prompt = get(body, "prompt", (str,), "")
    raw = get(body, "raw", (bool,), False)
    context = get(body, "context", (list,), None) or []
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in context):
        raise bad_request("context: expected an array of token ids", param="context")
    omitted: list[dict] = []
    images = image_parts(body.get("images"), "images", omitted)
    if images and (raw or context):
        raise bad_request("images: not supported with raw or context (send them in a templated prompt)",
                          param="images")
    messages = []
    if not raw:
        system = get(body, "system", (str,), "")
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": "\n".join(images + [prompt])}]
    req = ChatRequest(messages=messages, omitted_content=omitted, **common_fields(body, default_max_tokens))
    return req, prompt, context, raw


# -- responses --------------------------------------------------------------------------

def done_reason(done: Done) -> str:
    return "length" if cut_short(done) else "stop"


def timings(n_prompt: int, done: Done) -> dict:
    """Ollama's final counts and durations (nanoseconds)."""
    s = done.stats
    return {"total_duration": int(s.wall_s * 1e9), "load_duration": 0,
            "prompt_eval_count": max(0, n_prompt - s.cached_tokens), "prompt_eval_duration": int(s.prefill_s * 1e9),
            "eval_count": s.generated_tokens, "eval_duration": int(s.decode_s * 1e9)}


def call_json(c: ToolCall) -> dict:
    return {"id": c.id, "function": {"index": c.index, "name": c.name, "arguments": c.arguments}}


class ChatLines(Wire):
    """/api/chat NDJSON: `message` pieces (content, thinking, a whole tool call), then the final
    object with done_reason and timings. A keep-alive is an empty piece (NDJSON has no comments)."""

    def __init__(self, model: str, n_prompt: int, parser: Any, req: ChatRequest):
        self.model, self.n_prompt, self.parser, self.req = model, n_prompt, parser, req
        self.beat = Heartbeat()  # a call is held back until it ends: keep-alives while it is written

    def part(self, content: str = "", thinking: str = "", calls: list[ToolCall] = ()) -> dict:
        message: dict = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [call_json(c) for c in calls]
        return {"message": message}

    def end(self, done: Done) -> dict:
        return {}

    def obj(self, part: dict, done: Done | None = None, **extra: Any) -> dict:
        out = {"model": self.model, "created_at": now_iso(), **part, "done": done is not None}
        if done is not None:
            out.update(done_reason=done_reason(done), **timings(self.n_prompt, done), **self.end(done),
                       mlx_dspark=self.req.extra(done.stats, self.parser.notes))
        return {**out, **extra}

    def whole(self, reply: Reply, done: Done) -> dict:
        """The non-streaming response: the stream's pieces as one object."""
        return self.obj(self.part(reply.text, reply.reasoning, reply.calls), done)

    def ping(self, info: dict | None) -> list[str]:
        return [ndjson(self.obj(self.part(), **({"mlx_dspark": info} if info else {})))]

    def segment(self, event) -> list[str]:
        if isinstance(event, Text):
            part = self.part(event.text)
        elif isinstance(event, Reasoning):
            part = self.part(thinking=event.text)
        elif isinstance(event, CallEnd):  # Ollama sends a call whole, its arguments an object
            part = self.part(calls=[event.call])
        else:  # a call's start or a piece of its arguments
            return self.ping(None) if self.beat.due(False) else []
        self.beat.due(True)
        return [ndjson(self.obj(part))]

    def closing(self, done: Done, has_calls: bool) -> list[str]:
        return [ndjson(self.obj(self.part(), done))]

    def error(self, e: ApiError) -> list[str]:
        return [ndjson({"error": e.message})]


class GenerateLines(ChatLines):
    """/api/generate NDJSON: `response` pieces (and `thinking`), then `context` at the end."""

    def __init__(self, model: str, prompt_ids: list[int], parser: Any, req: ChatRequest):
        super().__init__(model, len(prompt_ids), parser, req)
        self.prompt_ids = prompt_ids

    def part(self, content: str = "", thinking: str = "", calls: list[ToolCall] = ()) -> dict:
        return {"response": content, **({"thinking": thinking} if thinking else {})}

    def end(self, done: Done) -> dict:
        return {"context": self.prompt_ids + list(done.token_ids)}


def loaded_answer(model: str, req: ChatRequest, kind: str, keep_alive: float | None) -> JSONResponse:
    """An empty chat/generate: Ollama's way to load (or, keep_alive 0, unload) a model."""
    part = {"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""}
    reason = "unload" if keep_alive == 0 else "load"
    notes = req.notes + (["the model stays loaded: this server keeps its models for its run (--max-models)"]
                         if reason == "unload" else [])
    return JSONResponse({"model": model, "created_at": now_iso(), **part, "done": True, "done_reason": reason,
                         **({"mlx_dspark": {"notes": notes}} if notes else {})})


async def chat(request: Request):
    bridge: Bridge = request.app.state.bridge
    body = await read_json(request)
    req = parse_chat(body, bridge.default_max_tokens)
    bridge = await use_model(request, req.model)
    model = req.model or bridge.model_name
    if not req.messages:
        return loaded_answer(model, req, "chat", keep_alive_s(body))
    ids = await bridge.prompt_ids(req)
    gen = await bridge.generate(req, ids, request)
    parser = bridge.parser(req, gen)
    wire = ChatLines(model, len(ids), parser, req)
    if req.stream:
        return NdjsonStream(drive(gen, parser, wire), gen)
    text = await collect_text(gen)
    return JSONResponse(wire.whole(whole_reply(parser, text, gen.done), gen.done))


async def generate(request: Request):
    bridge: Bridge = request.app.state.bridge
    body = await read_json(request)
    req, prompt, context, raw = parse_generate(body, bridge.default_max_tokens)
    bridge = await use_model(request, req.model)
    model = req.model or bridge.model_name
    if not (prompt or context or req.omitted_content):  # nothing to answer (images are in omitted_content)
        return loaded_answer(model, req, "generate", keep_alive_s(body))
    if raw:
        ids = context + await bridge.encode(prompt)
    else:
        ids = context + await bridge.prompt_ids(req, check=False)
    try:
        check_context(ids, bridge.context_window)
    except EngineError as e:
        raise from_engine_error(e) from None
    gen = await bridge.generate(req, ids, request)
    parser = PlainText() if raw else bridge.parser(req, gen)
    wire = GenerateLines(model, ids, parser, req)
    if req.stream:
        return NdjsonStream(drive(gen, parser, wire), gen)
    text = await collect_text(gen)
    return JSONResponse(wire.whole(whole_reply(parser, text, gen.done), gen.done))


# -- models -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _described(path: str, name: str, stamp: float) -> ModelInfo:
    return describe(Path(path), name, "local")


def model_info(path: str, name: str) -> tuple[ModelInfo, float]:
    """The catalog's description of a model folder (cached until its config.json changes)."""
    try:
        stamp = (Path(path) / "config.json").stat().st_mtime
    except OSError:
        stamp = 0.0
    return _described(path, name, stamp), stamp


def parameter_size(n: int | None) -> str:
    if not n:
        return ""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def quantization_level(info: ModelInfo) -> str:
    if info.quantization:
        bits = re.match(r"(\d+)-bit", info.quantization)
        return f"Q{bits.group(1)}" if bits else info.quantization.split()[0].upper()
    dtype = str(info.dtype or "float32")
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype, dtype.upper())


def details(info: ModelInfo) -> dict:
    return {"parent_model": "", "format": "safetensors", "family": info.model_type, "families": [info.model_type],
            "parameter_size": parameter_size(info.parameters), "quantization_level": quantization_level(info)}


def digest(info: ModelInfo) -> str:
    """A stable hash of the model: its config and weights' size (not the weights: they are large)."""
    try:
        config = (Path(info.path) / "config.json").read_bytes()
    except OSError:
        config = info.path.encode()
    return hashlib.sha256(config + str(info.size_bytes).encode()).hexdigest()


def capabilities(info: ModelInfo) -> list[str]:
    caps = ["completion"]
    if info.tool_call_format:
        caps.append("tools")
    if info.images == "yes":
        caps.append("vision")
    if info.reasoning_format:
        caps.append("thinking")
    return caps


def _iso(stamp: float) -> str:
    return datetime.fromtimestamp(stamp, timezone.utc).isoformat().replace("+00:00", "Z")


def tag_entry(name: str, info: ModelInfo, stamp: float) -> dict:
    return {"name": name, "model": name, "modified_at": _iso(stamp), "size": info.size_bytes,
            "digest": digest(info), "details": details(info)}


def _loaded(request: Request) -> list[tuple[str, Bridge]]:
    return list(request.app.state.models.loaded.items())


def _folder(bridge: Bridge) -> str:
    return str(getattr(bridge.engine, "model_path", "") or bridge.engine.info().get("model", ""))


def all_models(request: Request) -> list[tuple[str, str, Bridge | None]]:
    """(name, folder, its bridge if loaded): the loaded models, then the others on this machine."""
    loaded = [(name, _folder(b), b) for name, b in _loaded(request)]
    rest = [(name, str(path), None) for name, path, _ in model_locations(request.app.state.models_dirs)
            if not any(same_folder(str(path), folder) for _, folder, _ in loaded)]
    return loaded + rest


async def tags(request: Request):
    def entries() -> list[dict]:
        return [tag_entry(name, *model_info(folder, name)) for name, folder, _ in all_models(request)]

    return JSONResponse({"models": await run_in_threadpool(entries)})


async def ps(request: Request):
    until = _iso((datetime.now(timezone.utc) + FOREVER).timestamp())

    def entries() -> list[dict]:
        out = []
        for name, bridge in _loaded(request):
            info, stamp = model_info(_folder(bridge), name)
            # MLX keeps weights in unified memory: all of it is the accelerator's
            out.append({**tag_entry(name, info, stamp), "expires_at": until, "size_vram": info.size_bytes,
                        "context_length": bridge.context_window})
        return out

    return JSONResponse({"models": await run_in_threadpool(entries)})


async def show(request: Request):
    body = await read_json(request)
    name = get(body, "model", (str,), "") or get(body, "name", (str,), "")
    if not name:
        raise bad_request("model: field required", param="model")

    def find() -> dict | None:
        for known, folder, bridge in all_models(request):
            if name in (known, known + ":latest"):
                info, stamp = model_info(folder, known)
                return show_body(info, stamp, bridge)
        return None

    found = await run_in_threadpool(find)
    if found is None:
        raise ApiError(404, f"model {name!r} not found (GET /api/tags lists the models here)")
    return JSONResponse(found)


def show_body(info: ModelInfo, stamp: float, bridge: Bridge | None) -> dict:
    context = bridge.context_window if bridge is not None else info.context_length
    template = getattr(bridge.engine.tokenizer, "chat_template", "") if bridge is not None else ""
    family = info.model_type
    return {
        "modelfile": f"# served by mlx-dspark\nFROM {info.path}\n",
        "parameters": "",
        "template": template if isinstance(template, str) else "",
        "details": details(info),
        "model_info": {"general.architecture": family, "general.basename": info.name,
                       "general.parameter_count": info.parameters, f"{family}.context_length": context},
        "capabilities": capabilities(info),
        "modified_at": _iso(stamp),
    }


async def version(request: Request):
    return JSONResponse({"version": OLLAMA_VERSION})


routes = [
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/version", version, methods=["GET"]),
]
