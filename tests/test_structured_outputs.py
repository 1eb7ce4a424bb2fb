"""Structured outputs: the reply kept to a JSON schema by a grammar, inside the verify loop.

On the bundled model: constrained decoding with drafts (lookup, a head, forced tokens) equals
constrained decoding without drafts token for token (greedy); every constrained reply parses and
validates; constrained sampling keeps the constrained distribution (chi-square); the real
`openai` and `anthropic` clients get schema-valid replies over a socket, and a 400 for a schema
the grammar engine can't compile. (The unconstrained valid rate: scripts/bench_structured.py.)
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.models.cache import make_prompt_cache

from agent_bridge.app import create_app
from engine import Constraint, Engine, GenerationRequest, InvalidRequestError, SamplingParams
from engine.base.sampling import accept_greedy, target_probs
from engine.decoding.grammar import masked, pack_bits
from engine.decoding.verify import accept_greedy_masked
from engine.drafting.lookup import LookupDrafter
from server_harness import RunningServer
from stats_util import chi_square_fits

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": NAME, "maxItems": 3}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "maximum": 999}, "email": NAME}, "required": ["id", "email"],
        "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"path": {"type": "string", "maxLength": 20}, "content": NAME,
                                      "mode": {"enum": ["create", "overwrite"]}},
     "required": ["path", "content", "mode"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1, "maxItems": 4},
]
PROMPTS = ["Reply in JSON.", "Describe a user as JSON: name Ada, age 36.",
           "Write the file config.py with content x = 1, as JSON."]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def engine():
    eng = Engine(None, max_batch=1, prefix_cache=False)
    yield eng
    eng.close()


def constrained(engine, prompt, schema, mode, sampling=SamplingParams(), max_tokens=MAX_TOKENS):
    ids = engine.render_chat([{"role": "user", "content": prompt}])
    req = GenerationRequest(ids, max_tokens=max_tokens, mode=mode, sampling=sampling,
                            constraint=Constraint.json_schema(schema))
    return list(engine.generate(req))[-1]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_greedy_with_drafts_equals_without(engine, schema):
    forced = 0
    for prompt in PROMPTS:
        plain = constrained(engine, prompt, schema, "baseline")
        jsonschema.validate(json.loads(plain.text), schema)  # constrained plain decoding is valid
        for mode in ("lookup", "dspark"):
            drafted = constrained(engine, prompt, schema, mode)
            assert drafted.token_ids == plain.token_ids, (mode, prompt, drafted.text, plain.text)
            assert drafted.finish_reason == plain.finish_reason == "stop"
            assert drafted.stats.rounds < len(plain.token_ids)  # the drafts held
            forced += drafted.stats.accepted_by_source.get("grammar", 0)
    assert forced > 0  # forced tokens were drafted (for free) and accepted


def test_lookup_continues_past_forced_tokens(engine):
    """After the grammar's forced tokens the draft goes on with lookup's match at the new end (a
    reply copying JSON from its prompt), as far as the grammar allows; greedy output unchanged."""
    schema = SCHEMAS[4]
    shown = json.dumps({"path": "src/app/config.py", "content": "x = 1", "mode": "create"})
    prompt = f"Return this JSON exactly: {shown}"
    ids = engine.render_chat([{"role": "user", "content": prompt}])
    state = engine.grammars.start(Constraint.json_schema(schema))
    lookup = LookupDrafter()
    lookup.start(ids)
    forced = state.shape_draft([], None, 32, deterministic=True)
    continued = state.shape_draft([], None, 32, deterministic=True, continue_after=lookup.continue_after)
    assert forced.tokens and continued.tokens[: len(forced.tokens)] == forced.tokens
    assert len(continued.tokens) > len(forced.tokens) and continued.forced == len(forced.tokens)
    assert state.valid_prefix(continued.tokens) == len(continued.tokens)  # the matcher left at the start
    assert shown.startswith(engine.decode(continued.tokens))
    plain = constrained(engine, prompt, schema, "baseline")
    drafted = constrained(engine, prompt, schema, "lookup")
    assert drafted.token_ids == plain.token_ids, (drafted.text, plain.text)


def test_greedy_pick_under_masks_equals_the_masked_argmax():
    """A verify pass's greedy pick from the raw argmax and mask bits (a row masked only where its
    argmax is not allowed) equals the argmax of the masked logits: a drafted token that is the
    raw argmax but outside the mask is rejected."""
    logits = mx.array([[0, 5, 1, 0, 0, 0, 0, 0], [3, 0, 0, 9, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0]], dtype=mx.float32)
    allowed = np.zeros((3, 8), dtype=bool)
    allowed[0, [1, 2]] = allowed[1, [0, 2]] = allowed[2, :] = True
    bits = np.stack([pack_bits(row, 1) for row in allowed])
    for draft in ([1, 3], [1, 0], [2, 0], [3, 0], []):
        assert accept_greedy_masked(logits, draft, bits, 8) == accept_greedy(masked(logits, allowed), draft)
    assert accept_greedy_masked(logits, [1, 3], bits, 8) == (1, 0)
    assert accept_greedy_masked(logits, [1, 0], bits, 8) == (2, 2)


def test_every_constrained_reply_validates(engine):
    for i, schema in enumerate(SCHEMAS):
        for prompt in PROMPTS[:2]:
            done = constrained(engine, prompt, schema, "lookup", SamplingParams(temperature=1.0, seed=i))
            assert done.finish_reason == "stop", done.text
            jsonschema.validate(json.loads(done.text), schema)


def test_any_json_and_a_schema_the_engine_cannot_compile(engine):
    ids = engine.render_chat([{"role": "user", "content": "Some JSON please."}])
    done = list(engine.generate(GenerationRequest(ids, max_tokens=48, constraint=Constraint.any_json(),
                                                  mode="lookup")))[-1]
    if done.finish_reason == "stop":
        json.loads(done.text)
    for bad in ({"type": "foo"}, {"$ref": "#/nowhere"}, {"type": "string", "pattern": "(?<=a)b"}):
        with pytest.raises(InvalidRequestError, match="can't be compiled"):
            Constraint.json_schema(bad)


def _exact_constrained_pairs(engine, prompt, constraint, params):
    """P(t1, t2) under the constraint: each position's logits masked, then mlx-lm's filters."""

    def run(target):
        state = engine.grammars.start(constraint)
        p1 = target_probs(masked(target.forward(prompt, make_prompt_cache(target.model)), state.allowed()[None]),
                          params)[-1]
        joint = np.zeros((len(p1), len(p1)))
        for t1 in np.nonzero(p1)[0]:
            state.advance([int(t1)])
            logits = target.forward(prompt + [int(t1)], make_prompt_cache(target.model))
            joint[t1] = p1[t1] * target_probs(masked(logits, state.allowed()[None]), params)[-1]
            state.rollback(1)
        return joint

    return engine.call(run)


def test_constrained_sampling_keeps_the_constrained_distribution(engine):
    schema = {"type": "integer"}
    constraint = Constraint.json_schema(schema)
    prompt = engine.render_chat([{"role": "user", "content": "Pick a number."}])
    params = SamplingParams(temperature=1.0, top_k=4)
    joint = _exact_constrained_pairs(engine, prompt, constraint, params)
    support = np.argwhere(joint > 0)
    t1, t2 = np.unravel_index(np.argmax(joint), joint.shape)
    corpus = [prompt + [int(t1), int(t2), int(t1)]]  # lookup drafts the likeliest pair: accepts and rejects
    counts, drafted, seeds = np.zeros_like(joint), 0, 1200
    for seed in range(seeds):
        req = GenerationRequest(prompt, max_tokens=2, mode="lookup", max_draft=4, corpus=corpus, constraint=constraint,
                                sampling=SamplingParams(temperature=1.0, top_k=4, seed=seed))
        done = list(engine.generate(req))[-1]
        drafted += done.stats.drafted_tokens
        if len(done.token_ids) == 2:
            counts[done.token_ids[0], done.token_ids[1]] += 1
    assert drafted > seeds // 2, "drafts were not exercised"
    eos = list(engine.target.eos_token_ids)
    joint[eos, :] = joint[:, eos] = 0  # a reply ended by EOS (the integer complete) is not a pair
    support = np.argwhere(joint > 0)
    ok, stat, crit = chi_square_fits(counts[support[:, 0], support[:, 1]], joint[support[:, 0], support[:, 1]])
    assert ok and counts.sum() == counts[support[:, 0], support[:, 1]].sum(), f"chi2 {stat:.1f} > {crit:.1f}"


@pytest.fixture(scope="module")
def server(engine):
    with RunningServer(create_app(engine)) as srv:
        yield srv


def test_openai_response_format_over_a_socket(server):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    schema = SCHEMAS[0]
    messages = [{"role": "user", "content": "Describe a user as JSON."}]
    r = oai.chat.completions.create(model="local", messages=messages, max_tokens=MAX_TOKENS, response_format={
        "type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"
    stream = oai.chat.completions.create(model="local", messages=messages, max_tokens=MAX_TOKENS, stream=True,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "user", "schema": schema}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    r = oai.chat.completions.create(model="local", messages=messages, max_tokens=MAX_TOKENS,
                                    response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        json.loads(r.choices[0].message.content)
    out = oai.responses.create(model="local", input="Describe a user as JSON.", max_output_tokens=MAX_TOKENS,
                               text={"format": {"type": "json_schema", "name": "user", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(out.output_text), schema)
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="local", messages=messages, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "foo"}}})
    assert err.value.status_code == 400 and "can't be compiled" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="local", input="x", max_output_tokens=8,
                             text={"format": {"type": "json_schema", "name": "bad", "schema": {"$ref": "#/x"}}})


def test_anthropic_output_format_over_a_socket(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    schema = SCHEMAS[1]
    m = claude.messages.create(model="local", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "JSON?"}],
                               extra_body={"output_format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="local", max_tokens=8, messages=[{"role": "user", "content": "JSON?"}],
                               extra_body={"output_format": {"type": "json_schema", "schema": {"type": "foo"}}})
    assert err.value.status_code == 400 and err.value.body["error"]["type"] == "invalid_request_error"


def test_batched_verify_keeps_the_constraint(engine):
    """Constrained sequences verified in one batched forward (--max-batch 2) equal constrained
    plain decoding alone."""
    batched = Engine(None, max_batch=2, prefix_cache=False)
    try:
        ids = engine.render_chat([{"role": "user", "content": PROMPTS[1]}])
        jobs = [(s, batched.submit(GenerationRequest(ids, max_tokens=MAX_TOKENS, mode="lookup",
                                                     constraint=Constraint.json_schema(s)))) for s in SCHEMAS[:4]]
        for s, job in jobs:
            assert job.result().token_ids == constrained(engine, PROMPTS[1], s, "baseline").token_ids
        assert batched.batched_rounds > 0
    finally:
        batched.close()


def test_a_retry_with_another_shape_is_another_request():
    """A client's retry takes over its earlier job only when it asks for the same reply: the
    same prompt held to another schema (or to none) has another key."""
    from agent_bridge.serving.bridge import request_key

    ids = [1, 2, 3]
    free = GenerationRequest(ids, max_tokens=8)
    as_int = GenerationRequest(ids, max_tokens=8, constraint=Constraint.json_schema({"type": "integer"}))
    as_str = GenerationRequest(ids, max_tokens=8, constraint=Constraint.json_schema({"type": "string"}))
    keys = {request_key(None, r) for r in (free, as_int, as_str)}
    assert len(keys) == 3
    assert request_key(None, as_int) == request_key(None, GenerationRequest(
        ids, max_tokens=8, constraint=Constraint.json_schema({"type": "integer"})))
    assert request_key(None, GenerationRequest([1, 2, 4], max_tokens=8)) != request_key(None, free)  # another prompt
