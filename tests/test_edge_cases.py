"""EOS, stop strings and max_tokens inside accepted drafts; empty and oversized prompts."""

from __future__ import annotations

import pytest

from engine import Engine, GenerationRequest, InvalidRequestError, PromptTooLongError
from engine.base.stops import TextAssembler

PROMPT_TEXT = "Re-emit this:\nfor i in range(10):\n    print(i, i * i)\n"


def run(engine, prompt, **kw):
    return list(engine.generate(GenerationRequest(prompt, **kw)))[-1]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with Engine(str(tiny_model_dir)) as e:
        yield e


@pytest.fixture(scope="module")
def reference(engine):
    prompt = engine.render_chat([{"role": "user", "content": PROMPT_TEXT}])
    done = run(engine, prompt, max_tokens=40, mode="baseline")
    assert len(done.token_ids) == 40
    return prompt, done


def test_eos_inside_accepted_draft(engine, reference):
    prompt, ref = reference
    ids = ref.token_ids
    k = next(i for i in range(8, 30) if ids[i] not in ids[:i])  # first occurrence of a token
    eos_before = set(engine.tokenizer.eos_token_ids)
    engine.tokenizer.add_eos_token(str(ids[k]))
    try:
        base = run(engine, prompt, max_tokens=40, mode="baseline")
        spec = run(engine, prompt, max_tokens=40, mode="lookup", corpus=[prompt + ids], max_draft=32)
    finally:
        engine.tokenizer.eos_token_ids = eos_before
    assert base.token_ids == ids[:k] and base.finish_reason == "stop"
    assert spec.token_ids == ids[:k] and spec.finish_reason == "stop"
    assert spec.text == base.text
    assert spec.stats.rounds < k, "the EOS should have come inside a long accepted draft"


def test_max_tokens_mid_draft(engine, reference):
    prompt, ref = reference
    spec = run(engine, prompt, max_tokens=7, mode="lookup", corpus=[prompt + ref.token_ids], max_draft=32)
    assert spec.token_ids == ref.token_ids[:7]
    assert spec.finish_reason == "length"
    assert spec.stats.rounds == 1  # one round accepted 32 drafted tokens; 7 were kept


def test_stop_string_spanning_rounds(engine, reference):
    prompt, ref = reference
    tok = engine.tokenizer
    pieces = [tok.decode([t]) for t in ref.token_ids]
    # a stop string made of the end of token j and the start of token j+1
    j = next(i for i in range(3, 30) if len(pieces[i]) >= 1 and len(pieces[i + 1]) >= 1
             and "".join(pieces[: i + 2]).count(pieces[i][-1] + pieces[i + 1][0]) == 1)
    stop = pieces[j][-1] + pieces[j + 1][0]
    full = ref.text
    expected = full[: full.index(stop)]
    for mode, cap, corpus in [("baseline", None, []), ("lookup", 1, []), ("lookup", 32, [prompt + ref.token_ids])]:
        done = run(engine, prompt, max_tokens=40, mode=mode, max_draft=cap, corpus=corpus, stop=[stop])
        assert done.finish_reason == "stop_string", mode
        assert done.text == expected, mode
        assert done.stop_string == stop


def test_streamed_text_never_passes_a_stop_string(engine, reference):
    prompt, ref = reference
    stop = ref.text[10:14]
    events = list(engine.generate(GenerationRequest(prompt, max_tokens=40, mode="lookup", stop=[stop])))
    streamed = "".join(e.text for e in events if hasattr(e, "text") and not hasattr(e, "finish_reason"))
    assert stop not in streamed
    assert streamed == events[-1].text


def test_text_assembler_holds_back_partial_stops(engine):
    tok = engine.tokenizer
    ids = tok.encode("hello world, stop here please", add_special_tokens=False)
    asm = TextAssembler(tok, ["stop here"])
    out = ""
    for t in ids:
        delta, stopped = asm.add(t)
        out += delta
        assert "stop" not in out
        if stopped:
            break
    assert stopped and out == "hello world, "


def test_empty_prompt_is_a_clear_error(engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        run(engine, [], max_tokens=5)


def test_prompt_longer_than_context(engine):
    too_long = [5] * (engine.context_window + 1)
    with pytest.raises(PromptTooLongError, match="prompt is too long"):
        run(engine, too_long, max_tokens=5)


def test_max_tokens_clipped_to_context(engine):
    prompt = [5, 6, 7] * ((engine.context_window - 10) // 3)
    done = run(engine, prompt, max_tokens=100, mode="lookup")
    assert len(prompt) + len(done.token_ids) <= engine.context_window


def test_bad_token_ids_and_params(engine):
    with pytest.raises(InvalidRequestError):
        run(engine, [10**9], max_tokens=5)
    from engine import SamplingParams

    with pytest.raises(InvalidRequestError):
        run(engine, [5, 6], max_tokens=5, sampling=SamplingParams(temperature=-1))
    with pytest.raises(InvalidRequestError):
        run(engine, [5, 6], max_tokens=5, mode="nonsense")


def test_zero_max_tokens(engine, reference):
    prompt, _ = reference
    done = run(engine, prompt, max_tokens=0)
    assert done.token_ids == [] and done.finish_reason == "length"


def test_cancel_between_rounds(engine, reference):
    prompt, _ = reference
    job = engine.submit(GenerationRequest(prompt, max_tokens=2000, mode="baseline"))
    seen = 0
    for event in job:
        if hasattr(event, "token_ids") and not hasattr(event, "finish_reason"):
            seen += 1
            if seen == 3:
                job.cancel()
    assert event.finish_reason == "cancelled"
    assert len(event.token_ids) < 2000
    # the engine serves the next request normally
    assert run(engine, prompt, max_tokens=3).finish_reason in ("length", "stop")
