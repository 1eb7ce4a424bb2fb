"""Structured outputs on the bundled model: 50 generated schemas, with and without constraints.

Reports the schema-valid rate both ways, tokens per forward and decode tok/s for constrained
decoding with forced-token drafts (lookup mode) against constrained decoding without drafts
(baseline), and the grammar mask's cost per token on the bundled 8k vocabulary and on a
synthetic ~150k one (the bundled tokenizer.json with random byte-level tokens added).

    .venv/bin/python scripts/bench_structured.py [--schemas 50] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import jsonschema
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from engine import REFERENCE_MODEL_DIR, Constraint, Engine, GenerationRequest
from engine.decoding.grammar import GrammarState

WORDS = ["name", "path", "id", "count", "email", "city", "status", "tags", "size", "owner", "title", "kind",
         "score", "enabled", "items", "parent", "mode", "user", "level", "color"]


def leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "integer", "boolean", "enum", "array"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 12, 20])}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "create", "delete", "read", "high", "low"], 3)}
    return {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}


def schema(rng: random.Random, depth: int = 0) -> dict:
    keys = rng.sample(WORDS, rng.randint(2, 4))
    props = {k: schema(rng, depth + 1) if depth < 1 and rng.random() < 0.25 else leaf(rng) for k in keys}
    return {"type": "object", "properties": props, "required": keys, "additionalProperties": False}


def schemas(n: int) -> list[dict]:
    rng = random.Random(34)
    return [schema(rng) for _ in range(n)]


def valid(text: str, s: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), s)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run(engine: Engine, ids: list[int], max_tokens: int, mode: str, constraint=None):
    return list(engine.generate(GenerationRequest(ids, max_tokens=max_tokens, mode=mode, constraint=constraint)))[-1]


def mask_cost(tokenizer: LLTokenizer, vocab: int, grammar: str, tokens: list[int], draft: int = 0) -> float:
    """Seconds per mask along `tokens` (a reply the grammar accepts): one mask a token as plain
    decoding makes them, or (`draft` > 0) as a verify pass does, the masks of `draft` tokens
    and the position after them in one call (`GrammarState.bitmasks_along`)."""
    state = GrammarState(LLMatcher(tokenizer, grammar, log_level=0), vocab, [0])
    masks, t0 = 0, time.perf_counter()
    if draft:
        for start in range(0, len(tokens), draft):
            masks += len(state.bitmasks_along(tokens[start : start + draft]))
            state.advance(tokens[start : start + draft])
    else:
        for tok in tokens:
            state.allowed()
            state.advance([tok])
            masks += 1
    return (time.perf_counter() - t0) / max(1, masks)


def wide_tokenizer(size: int = 150_000) -> tuple[LLTokenizer, dict]:
    """The bundled tokenizer with random byte-level tokens added to its BPE vocabulary, up to `size`."""
    spec = json.loads((REFERENCE_MODEL_DIR / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "\"", "_", ":", ",", "{", "}"]
    rng = random.Random(0)
    while len(vocab) < size:
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 10)))
        vocab.setdefault(word, len(vocab))
    return LLTokenizer(json.dumps(spec)), spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    engine = Engine(None, max_batch=1, prefix_cache=False)
    rows = {"free": [], "baseline": [], "lookup": []}
    replies = []
    for s in schemas(args.schemas):
        ask = f"Reply with only a JSON object valid under this JSON schema:\n{json.dumps(s)}"
        ids = engine.render_chat([{"role": "user", "content": ask}])
        c = Constraint.json_schema(s)
        for key, mode, constraint in (("free", "lookup", None), ("baseline", "baseline", c), ("lookup", "lookup", c)):
            done = run(engine, ids, args.max_tokens, mode, constraint)
            rows[key].append((valid(done.text, s), done))
        replies.append((c.grammar, rows["lookup"][-1][1].token_ids))
    print(f"{args.schemas} schemas, max_tokens {args.max_tokens}, bundled model")
    for key, label in (("free", "unconstrained (lookup)"), ("baseline", "constrained, no drafts"),
                       ("lookup", "constrained, forced + lookup drafts")):
        ok = sum(v for v, _ in rows[key])
        tokens = sum(len(d.token_ids) for _, d in rows[key])
        rounds = sum(d.stats.rounds for _, d in rows[key])
        decode = sum(d.stats.decode_s for _, d in rows[key])
        forced = sum(d.stats.accepted_by_source.get("grammar", 0) for _, d in rows[key])
        print(f"  {label:38s} valid {ok}/{len(rows[key])} ({100 * ok / len(rows[key]):.0f}%)  "
              f"tokens/forward {tokens / max(1, rounds):.2f}  decode {tokens / max(decode, 1e-9):.0f} tok/s"
              f"  forced-only rounds' tokens {forced}")
    same = sum(a[1].token_ids == b[1].token_ids for a, b in zip(rows["baseline"], rows["lookup"]))
    print(f"  constrained greedy with drafts == without: {same}/{len(replies)}")
    # a verify pass masks every position it checks: the drafted tokens and the one after them
    lookup = [d for _, d in rows["lookup"]]
    per_token = sum(d.stats.drafted_tokens + d.stats.rounds for d in lookup) / max(1, sum(len(d.token_ids) for d in lookup))
    draft = max(1, round(sum(d.stats.drafted_tokens for d in lookup) / max(1, sum(d.stats.rounds for d in lookup))))
    grammars = engine.grammars
    wide, spec = wide_tokenizer()
    for tokenizer, vocab, what in ((grammars.tokenizer, grammars.vocab_size, "bundled"),
                                   (wide, len(spec["model"]["vocab"]), "synthetic")):
        plain = np.mean([mask_cost(tokenizer, vocab, g, t) for g, t in replies])
        batched = np.mean([mask_cost(tokenizer, vocab, g, t, draft) for g, t in replies])
        print(f"  mask cost, vocab {vocab} ({what}): plain decoding {plain * 1e3:.3f} ms a token; verify passes "
              f"(drafts of {draft}, masks in one call) {batched * 1e3:.3f} ms a mask x {per_token:.2f} masks a token "
              f"= {batched * per_token * 1e3:.3f} ms a token")
    engine.close()


if __name__ == "__main__":
    main()
