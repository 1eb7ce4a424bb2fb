"""Strict tools in every call syntax the reply parsers stream (agent_bridge/chat/reply_grammar.py):
hermes, qwen3_coder, glm47, kimi_k2, mistral and harmony.

- The grammar alone (no model), over the tiny test tokenizer: a call as the family's template
  writes it is accepted and parses back to its arguments; one with a wrong type, a missing
  required key, a key the schema doesn't name, a value outside its enum or an unknown tool is
  not; a forced call's grammar starts exactly where the prefix the server writes ends.
- Random walks through the grammar's masks (each step any token it allows: a "model" that tries
  everything) parse back through the syntax's reply parser into calls that validate
  (`jsonschema`) against their tools, with each syntax's markers as text (the tiny tokenizer)
  and as special tokens (the same tokenizer with them added).
- A tiny random model whose chat template is the family's (tests/family_templates.py: the server
  recognises the syntax), served with the serve default (--strict-tools on for every syntax it
  spells): greedy and sampled replies, tool_choice auto, required and named; every call it makes
  validates and a forced call is always made.
"""

from __future__ import annotations

import json
import random
import shutil
import types

import jsonschema
import numpy as np
import openai
import pytest
from family_templates import TEMPLATES
from server_harness import RunningServer
from tiny_models import build_tokenizer

from agent_bridge.chat.chat_request import ChatRequest
from agent_bridge.chat.http_errors import ApiError
from agent_bridge.chat.reply_grammar import CALL_GRAMMARS, reply_constraint, strict_tools
from agent_bridge.chat.tool_stream import CALL_OPENINGS, Syntax, parse_reply

SYNTAXES = ["hermes", "qwen3_coder", "glm47", "kimi_k2", "mistral", "harmony"]
# every syntax's markers, for the tokenizer where they are special tokens
MARKERS = ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
           "<|tool_calls_section_end|>", "[TOOL_CALLS]", "[ARGS]", "<|channel|>", "<|message|>", "<|constrain|>",
           "<|start|>", "<|end|>", "<|call|>", "<|return|>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]

S = {"type": "string", "maxLength": 10}
SCHEMAS = {
    "read_file": {"type": "object", "properties": {"path": S, "offset": {"type": "integer", "minimum": 0},
                                                   "limit": {"type": "integer", "minimum": 1, "maximum": 500}},
                  "required": ["path", "limit"], "additionalProperties": False},
    "write_file": {"type": "object", "properties": {
        "path": {"type": "string", "minLength": 1, "maxLength": 8, "pattern": "^[a-z_]+\\.py$"}, "content": S,
        "mode": {"enum": ["create", "overwrite", "append"]}, "force": {"type": "boolean"}, "ratio": {"type": "number"}},
        "required": ["path", "content", "mode"], "additionalProperties": False},
    "create_issue": {"type": "object", "properties": {
        "title": S, "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "name": S},
                  "required": ["id", "name"], "additionalProperties": False},
        "note": {"type": ["string", "null"], "maxLength": 6}, "level": {"type": ["integer", "null"], "maximum": 3},
        "extra": {"maxLength": 3}},
        "required": ["title", "owner"], "additionalProperties": False},
    "anything": {"type": "object"},
}
TOOLS = [{"type": "function", "function": {"name": n, "description": n.replace("_", " "), "parameters": s}}
         for n, s in SCHEMAS.items()]
GOOD = {  # (tool, arguments) a call may have
    "read_file": {"path": "a.py", "offset": 0, "limit": 9},
    "write_file": {"path": "b.py", "content": "x < y", "mode": "append", "force": True, "ratio": 0.5},
    "create_issue": {"title": "Crash", "tags": ["bug"], "owner": {"id": 3, "name": "Ada"}, "level": 2},
    "anything": {"a": [1, {"b": None}], "c": "text"},
}
BAD = [  # (tool, arguments) no call may have
    ("read_file", {"path": "a.py", "offset": "zero", "limit": 9}),  # a string for an integer
    ("read_file", {"path": "a.py", "offset": 0}),  # a required key missing
    ("read_file", {"path": "a.py", "limit": 501}),  # past the maximum
    ("read_file", {"path": "a.py", "limit": 9, "mode": "x"}),  # a key the schema doesn't name
    ("write_file", {"path": "b.py", "content": "x", "mode": "delete"}),  # outside the enum
    ("write_file", {"path": "b.txt", "content": "x", "mode": "create"}),  # against the pattern
    ("write_file", {"path": "b.py", "content": "far too long a text", "mode": "create"}),  # past maxLength
    ("create_issue", {"title": "t", "owner": {"id": 0, "name": "A"}}),  # nested: below the minimum
    ("delete_file", {"path": "a.py"}),  # not an offered tool
]


def text_of(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def spell(syntax: str, name: str, args: dict) -> str:
    """A call as the family's chat template writes it (glm47 with 4.5's newlines: CALL_OPENINGS' form)."""
    if syntax == "hermes":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
    if syntax == "qwen3_coder":
        params = "".join(f"<parameter={k}>\n{text_of(v)}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if syntax == "glm47":
        params = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{text_of(v)}</arg_value>\n" for k, v in args.items())
        return f"<tool_call>{name}\n{params}</tool_call>"
    if syntax == "kimi_k2":
        return ("<|tool_calls_section_begin|>" + kimi_call(name, args, 0) + "<|tool_calls_section_end|>")
    if syntax == "mistral":
        return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(args)}"
    compact = json.dumps(args, separators=(",", ":"))
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{compact}<|call|>"


def kimi_call(name: str, args: dict, index: int) -> str:
    return (f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{json.dumps(args)}"
            "<|tool_call_end|>")


# -- the tokenizers and grammars --------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return folder / "tokenizer.json"


def grammars_for(tokenizer_json, special: list[str]):
    """The engine's `Grammars` over the tiny tokenizer, `special` added to it as special tokens."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from engine.decoding.grammar import Grammars

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    return Grammars(types.SimpleNamespace(_tokenizer=hf), tok.get_vocab_size(), [tok.token_to_id("<|im_end|>")])


@pytest.fixture(scope="module", params=["text", "special"])
def grammars(request, tokenizer_json):
    """Markers as text (the tiny tokenizer has only hermes' `<tool_call>`, `</tool_call>`, `<think>` and
    `</think>` as special tokens) or as special tokens (every syntax's markers added)."""
    return grammars_for(tokenizer_json, [] if request.param == "text" else MARKERS)


def request_for(syntax: str, forced: str | None, **kw) -> ChatRequest:
    """A request offering TOOLS (none marked strict: the serve default makes them all strict);
    `forced` as the server sets it: the call's opening written into the prompt."""
    req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, forced_tool=forced, **kw)
    if forced is not None:
        start, named = CALL_OPENINGS[syntax]
        req.forced_prefix = start + (named.format(name=forced) if forced else "")
    return req


def constraint_for(grammars, syntax: str, forced: str | None = None, **kw):
    req = request_for(syntax, forced, **kw)
    constraint = reply_constraint(req, Syntax(syntax), grammars.literal, None)
    grammars.check(constraint)
    return req, constraint


def accepts(grammars, constraint, text: str) -> bool:
    from llguidance import LLMatcher

    matcher = LLMatcher(grammars.tokenizer, constraint.grammar, log_level=0)
    tokens = grammars.tokenizer.tokenize_str(text, parse_special=True)
    return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()


# -- the grammar, without a model -----------------------------------------------------------

def test_strict_tools_default_is_on_for_every_syntax():
    """--strict-tools' default (None) is on for the syntaxes CALL_GRAMMARS spells: all six the parsers
    stream; not for an mlx-lm parser the server doesn't stream."""
    assert sorted(CALL_GRAMMARS) == sorted(SYNTAXES) == sorted(CALL_OPENINGS)
    for syntax in SYNTAXES:
        assert strict_tools(request_for(syntax, None), Syntax(syntax), None) == SCHEMAS
        assert strict_tools(request_for(syntax, None), Syntax(syntax), False) is None
    req = request_for("hermes", None)
    req.tools[0] = {**req.tools[0], "function": {**req.tools[0]["function"], "strict": True}}
    assert strict_tools(req, Syntax("mlx_lm", whole=("<x>", "</x>", None)), None) is None
    assert any("not enforced" in n for n in req.notes)


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_grammar_keeps_calls_to_their_schemas(grammars, syntax):
    _, constraint = constraint_for(grammars, syntax)
    for name, args in GOOD.items():
        call = spell(syntax, name, args)
        assert accepts(grammars, constraint, call), call
        reply, _ = parse_reply(call, Syntax(syntax), TOOLS)
        assert [(c.name, c.arguments) for c in reply.calls] == [(name, args)]
    optional_left_out = spell(syntax, "read_file", {"path": "a.py", "limit": 2})
    assert accepts(grammars, constraint, optional_left_out)
    for name, args in BAD:
        call = spell(syntax, name, args)
        assert not accepts(grammars, constraint, call), call
    out_of_order = spell(syntax, "read_file", {"limit": 9, "path": "a.py"})  # (JSON keys keep the schema's order)
    assert not accepts(grammars, constraint, out_of_order)
    if syntax == "harmony":  # reasoning (the analysis channel) and commentary free, then a call or the answer
        before = ("<|channel|>analysis<|message|>Think of a <call>.<|end|><|start|>assistant"
                  "<|channel|>commentary<|message|>Reading.<|end|><|start|>assistant")
        assert accepts(grammars, constraint, before + spell(syntax, "read_file", GOOD["read_file"]))
        assert accepts(grammars, constraint, before + "<|channel|>final<|message|>Done: a.py.<|return|>")
        assert accepts(grammars, constraint, "<|channel|>final<|message|>Done.")
        assert not accepts(grammars, constraint, "Done.")  # not a harmony message
        assert not accepts(grammars, constraint, spell(syntax, "read_file", GOOD["read_file"]).replace(",", ", "))
        assert not accepts(grammars, constraint, "<|channel|>analysis<|message|>a<|call|>b<|end|><|start|>assistant"
                           + spell(syntax, "read_file", GOOD["read_file"]))  # an end marker inside a message
        return
    text = "Sure. Let me look <not a call>.\n"
    two = text + spell(syntax, "read_file", GOOD["read_file"]) + "\n" + spell(syntax, "anything", {}) + "\nDone."
    if syntax == "kimi_k2":  # one section holds several calls
        two = text + ("<|tool_calls_section_begin|>" + kimi_call("read_file", GOOD["read_file"], 0)
                      + kimi_call("anything", {}, 12) + "<|tool_calls_section_end|>Done.")
    assert accepts(grammars, constraint, text) and accepts(grammars, constraint, two)
    reply, _ = parse_reply(two, Syntax(syntax), TOOLS)
    assert [c.name for c in reply.calls] == ["read_file", "anything"]


def test_key_value_values_as_the_parser_reads_them(grammars):
    """qwen3_coder and glm47 values are raw text: a string holds no marker that ends a value for the
    parser (qwen3_coder: one newline around it is the template's; glm47 strips it: no surrounding
    whitespace), numbers and booleans are their JSON text, objects and arrays JSON."""
    qwen = constraint_for(grammars, "qwen3_coder")[1]
    glm = constraint_for(grammars, "glm47")[1]
    for content, ok in [("x\n\ny", True), ("", True), ("\nx", True), ("a</parameter>", False), ("<parameter=k", False),
                        ("</function>", False)]:
        call = spell("qwen3_coder", "write_file", {"path": "b.py", "content": content, "mode": "create"})
        assert accepts(grammars, qwen, call) == ok, call
        if ok:
            assert parse_reply(call, Syntax("qwen3_coder"), TOOLS)[0].calls[0].arguments["content"] == content
    for content, ok in [("a b", True), ("", True), (" a", False), ("a\n", False), ("a</arg_value>", False)]:
        call = spell("glm47", "write_file", {"path": "b.py", "content": content, "mode": "create"})
        assert accepts(grammars, glm, call) == ok, call
    four_point_seven = ("<tool_call>read_file<arg_key>path</arg_key><arg_value>a.py</arg_value>"
                        "<arg_key>limit</arg_key><arg_value>9</arg_value></tool_call>")  # GLM 4.7 writes no newlines
    assert accepts(grammars, glm, four_point_seven)
    for syntax, constraint in (("qwen3_coder", qwen), ("glm47", glm)):
        for value in ("1.5", "1e3", "+1", "01", "nine"):
            call = spell(syntax, "read_file", {"path": "a.py", "limit": 9}).replace(">9<", f">{value}<") \
                .replace("\n9\n", f"\n{value}\n")
            assert not accepts(grammars, constraint, call), call
        for offset, ok in ((2**53, True), (2**53 + 1, False)):  # read back through float(): exact to 2**53
            call = spell(syntax, "read_file", {"path": "a", "offset": offset, "limit": 1})
            assert accepts(grammars, constraint, call) == ok, call
        for force in ("1", "yes", "none"):
            call = spell(syntax, "write_file", {"path": "b.py", "content": "x", "mode": "create", "force": force})
            assert not accepts(grammars, constraint, call), call
        free = spell(syntax, "anything", {"key one": "v", "n": [1, 2]})  # a schema naming no keys: any keys
        assert accepts(grammars, constraint, free)
        untyped = {"title": "t", "owner": {"id": 1, "name": "A"}, "extra": '"ab"'}  # no type: JSON text, as read
        assert accepts(grammars, constraint, spell(syntax, "create_issue", untyped))
        read = parse_reply(spell(syntax, "create_issue", untyped), Syntax(syntax), TOOLS)[0].calls[0].arguments
        assert read["extra"] == "ab"
        assert not accepts(grammars, constraint, spell(syntax, "create_issue", {**untyped, "extra": "ab"}))


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_forced_call_continues_where_the_prefix_ends(grammars, syntax):
    """tool_choice required / named: the server wrote CALL_OPENINGS' text into the prompt; the grammar
    takes the rest of the call from exactly there (then, but in harmony, where the call ends the
    turn, free text and more calls), and never another opening first."""
    start, named = CALL_OPENINGS[syntax]
    call = spell(syntax, "read_file", GOOD["read_file"])
    head = start + named.format(name="read_file")
    assert call.startswith(head)
    after = "" if syntax == "harmony" else " Done."
    _, any_tool = constraint_for(grammars, syntax, "")
    _, one_tool = constraint_for(grammars, syntax, "read_file")
    assert accepts(grammars, any_tool, call[len(start):] + after)
    assert accepts(grammars, one_tool, call[len(head):] + after)
    assert not accepts(grammars, any_tool, call) and not accepts(grammars, one_tool, call)
    assert not accepts(grammars, one_tool, spell(syntax, "write_file", GOOD["write_file"])[len(start):])
    assert not accepts(grammars, any_tool, "Sure.")  # the call comes first


def test_harmony_answer_after_free_reasoning(grammars):
    """harmony with a response_format: the analysis channel stays free, the final message is the JSON."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "schema": schema, "name": "n"}
    for tools in (None, TOOLS):
        req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=tools, response_format=fmt)
        constraint = reply_constraint(req, Syntax("harmony"), grammars.literal, None)
        thought = "<|channel|>analysis<|message|>Count: {n}?<|end|><|start|>assistant"
        assert accepts(grammars, constraint, thought + '<|channel|>final<|message|>{"n": 3}<|return|>')
        assert not accepts(grammars, constraint, thought + '<|channel|>final<|message|>{"n": "3"}')
        assert accepts(grammars, constraint, spell("harmony", "read_file", GOOD["read_file"])) == (tools is not None)


def test_key_value_schemas_they_cannot_keep_to():
    """A schema a key/value syntax can't keep its arguments to: a 400 for a tool the client marked
    strict; under the server's flag alone, a JSON object only, with a note (as for one that doesn't compile)."""
    schema = {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
              "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    for strict in (True, None):
        flag = {} if strict is None else {"strict": strict}
        req = ChatRequest(messages=[{"role": "user", "content": "x"}],
                          tools=[{"type": "function", "function": {"name": "f", "parameters": schema, **flag}}])
        assert strict_tools(req, Syntax("hermes"), None) == {"f": schema}  # JSON: llguidance keeps anyOf
        for syntax in ("qwen3_coder", "glm47"):
            if strict:
                with pytest.raises(ApiError, match="anyOf"):
                    strict_tools(req, Syntax(syntax), None)
            else:
                assert strict_tools(req, Syntax(syntax), None) == {"f": {"type": "object"}}
                assert any("anyOf" in n for n in req.notes)


# -- random walks: whatever the grammar allows parses back into valid calls -----------------

def walk(grammars, constraint, rng: random.Random, opening: list[int], steps: int = 300) -> tuple[list[int], bool]:
    """Tokens the grammar allows, each drawn at random (the call's opening now and then, where the
    grammar allows it: a random walk seldom spells it); ends where the end is allowed, at random.
    Returns (tokens, cut short)."""
    from llguidance import LLMatcher

    matcher = LLMatcher(grammars.tokenizer, constraint.grammar, log_level=0)
    eos = set(grammars.eos_ids)
    out: list[int] = []
    while len(out) < steps and not matcher.is_stopped():
        if rng.random() < 0.1 and matcher.validate_tokens(opening) == len(opening):
            assert matcher.consume_tokens(opening)
            out += opening
            continue
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: grammars.vocab_size]).tolist()
        words = [t for t in allowed if t not in eos]
        if not words or (len(words) < len(allowed) and rng.random() < 0.15):
            return out, False
        token = rng.choice(words)
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    return out, not matcher.is_stopped()


def check_calls(syntax: str, text: str, cut: bool, forced: str | None) -> int:
    """The calls the syntax's parser reads in a reply: each one complete validates (only the last may
    be cut short, by the length), names an offered tool (the named one first, when forced)."""
    reply, _ = parse_reply(text, Syntax(syntax), TOOLS, cut=cut)
    for i, call in enumerate(reply.calls):
        if not call.complete:
            assert cut and i == len(reply.calls) - 1, (text, call.note)
            continue
        jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])
    if forced is not None:
        assert reply.calls and (not forced or reply.calls[0].name == forced), text
    return sum(c.complete for c in reply.calls)


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_random_walks_parse_back_into_valid_calls(grammars, syntax):
    start = CALL_OPENINGS[syntax][0]
    opening = grammars.tokenizer.tokenize_str(start, parse_special=True)
    valid = 0
    for forced in (None, "", "create_issue", "write_file"):
        req, constraint = constraint_for(grammars, syntax, forced)
        for seed in range(12):
            tokens, cut = walk(grammars, constraint, random.Random(seed), opening)
            text = req.forced_prefix + grammars.tokenizer.decode_str(tokens)
            valid += check_calls(syntax, text, cut, forced)
    assert valid >= 24  # most forced walks' calls (a walk may be cut inside its call), and some more


# -- a tiny model under each family's template, through the server ---------------------------

MODEL_TOOLS = [t for t in TOOLS if t["function"]["name"] != "anything"]
PROMPTS = ["Read the file config.py.", "File an issue about the crash."]


@pytest.fixture(scope="module")
def family_servers(tiny_model_dir, tmp_path_factory):
    """One server per syntax, each a tiny random model under that family's chat template, with the
    serve default for strict tools (None: on for every syntax the grammar spells)."""
    from agent_bridge.app import create_app
    from engine import Engine

    started = {}

    def server(syntax: str):
        if syntax not in started:
            folder = tiny_model_dir
            if syntax != "hermes":
                folder = tmp_path_factory.mktemp(syntax)
                shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
                cfg = json.loads((folder / "tokenizer_config.json").read_text())
                cfg["chat_template"] = TEMPLATES[syntax]
                (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
            engine = Engine(str(folder), prefix_cache=False)
            app = create_app(engine, strict_tools=None)
            assert app.state.bridge.syntax.name == syntax  # recognised from the template
            srv = RunningServer(app).__enter__()
            started[syntax] = (srv, engine)
        return started[syntax][0]

    yield server
    for srv, engine in started.values():
        srv.__exit__(None, None, None)
        engine.close()


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_tiny_model_calls_validate_in_its_family_syntax(family_servers, syntax):
    client = openai.OpenAI(base_url=family_servers(syntax).url + "/v1", api_key="unused", max_retries=0)
    choices = ["auto", "required", {"type": "function", "function": {"name": "create_issue"}}]
    made = 0
    for prompt in PROMPTS:
        for choice in choices:
            for seed in (None, 1, 2):  # greedy, then sampled
                sampling = {} if seed is None else {"temperature": 1.0, "seed": seed}
                r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                   tools=MODEL_TOOLS, tool_choice=choice, max_tokens=160, **sampling)
                message, cut = r.choices[0].message, r.choices[0].finish_reason == "length"
                calls = message.tool_calls or []
                for i, call in enumerate(calls):
                    assert call.function.name in SCHEMAS, call
                    args = json.loads(call.function.arguments)
                    notes = r.model_extra["mlx_dspark"].get("notes") or []
                    if cut and i == len(calls) - 1 and any(f"tool call {i} " in n and "cut by max_tokens" in n
                                                           for n in notes):
                        continue  # the last call, cut by max_tokens and closed by the parser
                    jsonschema.validate(args, SCHEMAS[call.function.name])
                if choice != "auto":
                    assert calls, (prompt, choice, seed, message)
                    if isinstance(choice, dict):
                        assert calls[0].function.name == "create_issue"
                made += len(calls)
    assert made >= len(PROMPTS) * 2 * 3
