"""The one internal chat request every protocol translates into, and field checks.

Messages are normalised for the model's chat template (the OpenAI/Hugging Face shape):
`{"role": "system"|"user"|"assistant"|"tool", "content": str}`, assistant messages may
carry `tool_calls` (`{"id", "type": "function", "function": {"name", "arguments": dict}}`),
tool messages carry `tool_call_id`. Tools are in OpenAI function form.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from engine import Constraint, GenerationRequest, InvalidRequestError, PromptTooLongError, SamplingParams

from agent_bridge.chat.http_errors import ApiError, bad_request
from agent_bridge.chat.media import image_bytes
from agent_bridge.chat.tool_stream import forced_call_prefix

MAX_TOKENS_LIMIT = 2**31 - 1  # above this a max_tokens is an error, below it is clamped to the context
MAX_STOPS = 16
_MISSING = object()


@dataclass
class ChatRequest:
    messages: list[dict]
    model: str = ""
    tools: list[dict] | None = None
    max_tokens: int = 4096
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    template_kwargs: dict = field(default_factory=dict)
    parse_tools: bool = True  # False when tool_choice is "none"
    assistant_prefix: str = ""  # a final partial assistant message the model continues
    forced_tool: str | None = None  # tool_choice: None free, "" any tool, else that tool's name
    notes: list[str] = field(default_factory=list)  # said back in the response's `mlx_dspark.notes`
    omitted_content: list[dict] = field(default_factory=list)  # images/documents a text model can't read
    images: list[bytes] | None = None  # the images shown to a VLM, in prompt order (set by resolve_media)
    prompt_images: Any = None  # their engine form (engine.PromptImages), set while rendering
    # set while rendering:
    starts_thinking: bool = False  # the template opened a reasoning block in the generation prompt
    may_think: bool = False  # the template lets the model open one (its grammar allows it: reply_grammar.py)
    forced_prefix: str = ""  # the forced call's opening, appended to the prompt
    mode: str | None = None  # decoding mode and draft cap for this request (None: the server's)
    max_draft: int | str | None = None
    provenance: bool = False  # stream how each token was produced (the web app's colouring)
    # The reply's required shape, one form for every API (OpenAI response_format, Responses
    # text.format, Anthropic output_format, Ollama format): None free, {"type": "json"} any JSON
    # value, {"type": "json_schema", "schema": {...}, "name": str} JSON valid under that schema.
    response_format: dict | None = None

    def __post_init__(self) -> None:
        if not self.tools:  # a model's tool-call syntax is only read when the client offered tools
            self.parse_tools = False
        for i, tool in enumerate(self.tools or []):
            check_tool_schema(tool["function"], f"tools[{i}]")
        if self.forced_tool is not None:
            names = [t["function"]["name"] for t in self.tools or []]
            if not names:
                raise bad_request("tool_choice: a call is required but no tools were given", param="tool_choice")
            if self.forced_tool and self.forced_tool not in names:
                raise bad_request(f"tool_choice: {self.forced_tool!r} is not among the tools given", param="tool_choice")

    def generation_request(self, prompt_ids: list[int], constraint: Constraint | None) -> GenerationRequest:
        """The engine's request; `constraint` is the reply's grammar (reply_grammar.py: the
        response_format, strict tool calls, free reasoning), None for a free reply."""
        return GenerationRequest(
            constraint=constraint,
            prompt_ids=prompt_ids,
            max_tokens=self.max_tokens,
            sampling=SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed),
            stop=list(self.stop),
            mode=self.mode,
            max_draft=self.max_draft,
            images=self.prompt_images,
        )

    def extra(self, stats: Any, parser_notes: list[str] = ()) -> dict:
        """The response's `mlx_dspark` field: engine statistics, notes on the request and the reply
        (`notes`), and what the model was not shown (`omitted_content`)."""
        out = stats.to_dict()
        notes = [*self.notes, *parser_notes]
        if notes:
            out["notes"] = notes
        omitted = [{k: v for k, v in note.items() if k != "_block"} for note in self.omitted_content]
        if omitted:
            out["omitted_content"] = omitted
        return out


def constraint_for(response_format: dict | None) -> Constraint | None:
    """The engine's constraint for a `response_format` (None: free); a schema the grammar engine
    can't compile is a 400."""
    if response_format is None:
        return None
    if response_format["type"] == "json":
        return Constraint.any_json()
    try:
        return Constraint.json_schema(response_format["schema"])
    except InvalidRequestError as e:
        name = response_format.get("name")
        raise bad_request(f"response_format{f' {name!r}' if name else ''}: {e}", param="response_format",
                          code="invalid_json_schema") from None


def json_format(kind: Any, schema: Any, name: Any, where: str) -> dict | None:
    """One API's structured-output request as `ChatRequest.response_format`: `kind` "text" (free),
    "json_object"/"json" (any JSON) or "json_schema" (then `schema` is the JSON Schema), checked
    and compiled here, so a bad one is a 400 naming `where` before anything runs."""
    if kind in (None, "text"):
        return None
    if kind in ("json_object", "json"):
        return {"type": "json"}
    if kind != "json_schema":
        raise bad_request(f"{where}.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}", param=where)
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{where}: a json_schema format needs its schema, a JSON object", param=where)
    if name is not None and not isinstance(name, str):
        raise bad_request(f"{where}.name: expected a string", param=where)
    fmt = {"type": "json_schema", "schema": schema, "name": name or ""}
    try:
        Constraint.json_schema(schema)
    except InvalidRequestError as e:
        raise bad_request(f"{where}: {e}", param=where, code="invalid_json_schema") from None
    return fmt


def render(engine: Any, req: ChatRequest) -> list[int]:
    """Messages -> prompt ids through the model's chat template.

    Some templates refuse a system message after the first one (Claude Code sends one
    inside `messages`): then those are folded into the leading system message."""
    resolve_media(req, engine)

    def chat(messages: list[dict]) -> list[int]:
        if not req.images:
            return engine.render_chat(messages, req.tools, **req.template_kwargs)
        ids, req.prompt_images = engine.render_chat_images(messages, req.images, req.tools, **req.template_kwargs)
        return ids

    try:
        ids = chat(req.messages)
    except InvalidRequestError:
        merged = fold_system_messages(req.messages)
        if merged == req.messages:
            raise
        ids = chat(merged)
    if req.assistant_prefix:
        ids = ids + engine.encode(req.assistant_prefix)
    return ids


def force_call(engine: Any, syntax: Any, req: ChatRequest, ids: list[int]) -> list[int]:
    """tool_choice any/tool/required: the reply starts with the model's call opening."""
    try:
        req.forced_prefix = forced_call_prefix(syntax, req.forced_tool or "", req.starts_thinking)
    except ValueError as e:
        raise bad_request(f"tool_choice: {e}", param="tool_choice") from None
    return ids + engine.encode(req.forced_prefix)


def fold_system_messages(messages: list[dict]) -> list[dict]:
    systems = [m["content"] for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(systems)}] if systems else []) + rest


def tool_call(call_id: str, name: str, arguments: Any) -> dict:
    """A normalised assistant tool call; arguments become a dict (templates `tojson` them)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise bad_request(f"tool call {name!r}: arguments are not valid JSON") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"tool call {name!r}: arguments must be a JSON object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# -- field checks: each raises a 400 naming the field ----------------------------------

def check_tool_schema(fn: dict, where: str) -> None:
    """A tool's description and parameters (a JSON Schema object), whichever API it came from."""
    if not isinstance(fn.get("description", ""), (str, type(None))):
        raise bad_request(f"{where}.description: expected a string", param="tools")
    schema = fn.get("parameters")
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise bad_request(f"{where}: the parameters schema must be a JSON object, got {type(schema).__name__}",
                          param="tools")
    kind = schema.get("type", "object")
    if not (isinstance(kind, str) or (isinstance(kind, list) and all(isinstance(k, str) for k in kind))):
        raise bad_request(f"{where}: the schema's type must be a string", param="tools")
    if not isinstance(schema.get("properties", {}), dict) or not isinstance(schema.get("required", []), list):
        raise bad_request(f"{where}: the schema's properties must be an object and required an array", param="tools")
    if fn.get("strict") is True:  # its calls will keep to it (reply_grammar.py): it must compile
        try:
            Constraint.json_schema(schema)
        except InvalidRequestError as e:
            raise bad_request(f"{where} {fn.get('name')!r}: {e}", param="tools", code="invalid_json_schema") from None


def _type_name(kinds: tuple) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
             list: "an array", dict: "an object", type(None): "null"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def get(body: dict, name: str, kinds: tuple, default: Any = _MISSING, where: str = "") -> Any:
    label = f"{where}{name}"
    if name not in body or (body[name] is None and type(None) not in kinds and default is not _MISSING):
        if default is _MISSING:
            raise bad_request(f"{label}: field required", param=label)
        return default
    value = body[name]
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise bad_request(f"{label}: expected {_type_name(kinds)}, got {type(value).__name__}", param=label)
    return value


def get_int(body: dict, name: str, default: Any = _MISSING, minimum: int | None = None,
            maximum: int | None = None) -> Any:
    value = get(body, name, (int,), default)
    if value is None or value is default:
        return value
    if minimum is not None and value < minimum:
        raise bad_request(f"{name}: must be >= {minimum}, got {value}", param=name)
    if maximum is not None and value > maximum:
        raise bad_request(f"{name}: must be <= {maximum}, got {value}", param=name)
    return value


def get_number(body: dict, name: str, default: Any, minimum: float, maximum: float) -> float:
    value = get(body, name, (float,), default)
    if value is None:
        return default
    value = float(value)
    if not minimum <= value <= maximum:
        raise bad_request(f"{name}: must be between {minimum} and {maximum}, got {value}", param=name)
    return value


def get_stops(body: dict, name: str, list_only: bool = False) -> list[str]:
    """Stop strings: OpenAI's `stop` is a string or a list; Anthropic's `stop_sequences` a list."""
    value = get(body, name, (list,) if list_only else (str, list), None)
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if len(stops) > MAX_STOPS or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"{name}: expected a string or up to {MAX_STOPS} strings", param=name)
    return [s for s in stops if s]


# Blocks a text-only model can't read. One pasted image must not break an agent's session
# (it stays in the history, so a 400 would fail every later turn): it becomes a short
# placeholder, the same text every time so the cached prefix still matches.
MEDIA_BLOCKS = ("image", "image_url", "input_image", "document", "input_file", "file", "input_audio")
IMAGE_BLOCKS = ("image", "image_url", "input_image")


def placeholder(block: dict) -> tuple[str, dict]:
    """(text the model sees, what the response lists) for one media block."""
    kind = block.get("type")
    label = {"image_url": "image", "input_image": "image", "input_file": "file", "input_audio": "audio"}.get(kind, kind)
    note = {"type": label}
    source = block.get("source")
    if isinstance(source, dict) and isinstance(source.get("media_type"), str):
        note["media_type"] = source["media_type"]
    file = block.get("file") if isinstance(block.get("file"), dict) else {}
    title = block.get("title") or block.get("filename") or file.get("filename")
    name = ""
    if isinstance(title, str) and title:
        note["title"] = title[:200]
        name = f" {title[:200]!r}"
    return f"[{label}{name} omitted: this model reads text only]", note


def document_text(block: dict) -> str | None:
    """An Anthropic document whose source is plain text is text the model can read."""
    source = block.get("source")
    if block.get("type") == "document" and isinstance(source, dict) and source.get("type") == "text" \
            and isinstance(source.get("data"), str):
        title = block.get("title")
        return (f"{title}\n\n" if isinstance(title, str) and title else "") + source["data"]
    return None


def media_text(block: dict, where: str, omitted: list | None) -> str:
    text = document_text(block)
    if text is None:
        text, note = placeholder(block)
        if omitted is not None:
            if block.get("type") in IMAGE_BLOCKS:  # a VLM may read it: decided once the model is known
                text = IMAGE_SLOT.format(len(omitted))
                note["_block"] = block
            omitted.append({"where": where, **note})
    return text


# An image's place in a message's text until the model is known (resolve_media): private-use
# characters around the index of its entry in `omitted_content`.
IMAGE_SLOT = "\ue000{}\ue001"
_SLOTS = re.compile("\ue000(\\d+)\ue001")


def resolve_media(req: ChatRequest, engine: Any) -> list[bytes]:
    """Fill the image slots: a model that reads images gets its own image marker there (the
    image's bytes go to `req.images`, in order, and it leaves `omitted_content`); a text model
    gets the placeholder. Idempotent."""
    if req.images is not None:
        return req.images
    marker = getattr(engine, "image_marker", None)
    images: list[bytes] = []
    shown: set[int] = set()

    def fill(m: re.Match, show: bool = True) -> str:
        n = int(m.group(1))
        if n >= len(req.omitted_content) or "_block" not in req.omitted_content[n]:
            return m.group(0)  # not one of ours
        note = req.omitted_content[n]
        if marker is None or not show:
            return placeholder(note["_block"])[0]
        images.append(image_bytes(note["_block"], note["where"]))
        shown.add(n)
        return marker

    for message in req.messages:
        if isinstance(message.get("content"), str) and "\ue000" in message["content"]:
            message["content"] = _SLOTS.sub(fill, message["content"])
    # an image in a reply being continued is never shown (it is text the model writes after)
    req.assistant_prefix = _SLOTS.sub(lambda m: fill(m, show=False), req.assistant_prefix)
    req.omitted_content = [note for i, note in enumerate(req.omitted_content) if i not in shown]
    req.images = images
    return images


def text_of(content: Any, where: str, allowed: tuple = ("text",), omitted: list | None = None) -> str:
    """A message content (string or list of text parts) as one string. Media blocks become a
    placeholder, recorded (with where they were) in `omitted` when given."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or an array of content blocks")
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise bad_request(f"{where}.content[{i}]: expected an object")
        kind = block.get("type")
        if kind in allowed:
            text = block.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}.content[{i}].text: expected a string")
            parts.append(text)
        elif kind in MEDIA_BLOCKS:
            parts.append(media_text(block, f"{where}.content[{i}]", omitted))
        else:
            raise bad_request(f"{where}.content[{i}]: unsupported content block type {kind!r}")
    return "\n".join(parts)


def check_context(prompt_ids: list[int], context_window: int) -> None:
    if len(prompt_ids) >= context_window:
        raise PromptTooLongError(len(prompt_ids), context_window)


__all__ = ["ApiError", "ChatRequest", "IMAGE_BLOCKS", "MEDIA_BLOCKS", "MAX_TOKENS_LIMIT", "check_context", "constraint_for",
           "fold_system_messages", "get", "json_format",
           "get_int", "get_number", "get_stops", "media_text", "placeholder", "render", "resolve_media", "text_of",
           "tool_call"]
