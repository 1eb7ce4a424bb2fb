"""Vision-language targets (issue 17 item 4): a tiny random Gemma 3 VLM and a tiny random
Qwen3-VL built from mlx-vlm's own classes (tests/tiny_vlm.py, tests/tiny_qwen_vl.py; real
models, random weights, nothing downloaded).

- Lossless: the engine's greedy output for a prompt with an image (plain decoding, and lookup
  drafting) equals mlx-vlm's own generate_step on the same ids and pixels, token for token.
- Prefix cache: the same image and text hit; another image misses from its first token on.
- Qwen3-VL (M-RoPE: 3-D positions for an image's tokens, text after it shifted; deepstack):
  the same, over two turns with the prefix cache hitting past the image, and across a restart.
- Gemma 4 (an image's tokens attend to each other both ways; per-layer inputs): prefill chunks
  never cut an image, and the cache they leave equals mlx-vlm's whole-prompt forward.
- Server: image blocks through the real anthropic and openai clients (base64, data: URL, local
  file) reach the model; a remote URL is a 400 in the API's own shape.
"""

from __future__ import annotations

import base64
import functools
import io

import pytest

pytest.importorskip("mlx_vlm")  # installed by scripts/setup.sh (--no-deps)

from tiny_qwen_vl import build_tiny_qwen3_vl, build_tiny_qwen_vl  # noqa: E402
from tiny_vlm import build_tiny_gemma3_vlm, build_tiny_gemma4_vlm, tiny_image  # noqa: E402

MAX = 24
# Gemma 4's processor builds an audio feature extractor whose default mel filters warn
pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter has all zero values")


def png(color) -> bytes:
    buf = io.BytesIO()
    tiny_image(color).save(buf, "PNG")
    return buf.getvalue()


RED, BLUE = png((200, 30, 30)), png((20, 40, 220))


def ask_color(client, color: str) -> str:
    """The reply of an OpenAI-client chat request holding the red or the blue image."""
    data = base64.b64encode(RED if color == "red" else BLUE).decode()
    reply = client.chat.completions.create(model="m", max_tokens=MAX, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is in the image?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}]}])
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_gemma3_vlm(tmp_path_factory.mktemp("tiny-gemma3-vlm"))


@pytest.fixture(scope="module")
def engine(vlm_dir):
    from engine import Engine

    e = Engine(str(vlm_dir), prefill_chunk=16)  # chunks that cut through the image's tokens
    yield e
    e.close()


def ask(engine, text: str, images: list[bytes], history: list[dict] = ()) -> tuple[list[dict], list[int], object]:
    marker = engine.image_marker
    messages = [*history, {"role": "user", "content": text + "\n" + "\n".join([marker] * len(images))}]
    ids, prompt_images = engine.render_chat_images(messages, images)
    return messages, ids, prompt_images


def run(engine, ids, images, mode="lookup", max_tokens=MAX):
    from engine import GenerationRequest

    return engine.submit(GenerationRequest(prompt_ids=ids, max_tokens=max_tokens, mode=mode, images=images)).result()


def mlx_vlm_reference(vlm_dir, engine, messages, images: list[bytes], max_tokens=MAX) -> tuple[list[int], list[int]]:
    """mlx-vlm on its own: its loader, its processor (prepare_inputs), its generate_step."""
    from mlx_vlm import load
    from mlx_vlm.generate import generate_step
    from mlx_vlm.utils import prepare_inputs
    from PIL import Image

    from engine.base.chat import chat_text

    model, processor = load(str(vlm_dir))
    text = chat_text(engine.tokenizer, messages)
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = prepare_inputs(processor, images=pictures, prompts=text,
                            image_token_index=engine.vision.image_token_id)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    out = []
    for tok, _ in generate_step(inputs["input_ids"], model, inputs["pixel_values"], inputs["attention_mask"],
                                max_tokens=max_tokens, temperature=0.0, **extra):  # Qwen: image_grid_thw
        if int(tok) in engine.target.eos_token_ids:
            break
        out.append(int(tok))
    return inputs["input_ids"][0].tolist(), out


def test_the_engine_reads_images(engine):
    assert engine.reads_images and engine.image_marker == "<start_of_image>"


def test_greedy_output_equals_mlx_vlm_generate(engine, vlm_dir):
    messages, ids, images = ask(engine, "What is in the image?", [RED])
    ref_ids, ref = mlx_vlm_reference(vlm_dir, engine, messages, [RED])
    assert ids == ref_ids and len(images.spans) == 1
    engine.drop_cache(disk=True)
    plain = run(engine, ids, images, mode="baseline")
    engine.drop_cache(disk=True)
    lookup = run(engine, ids, images, mode="lookup")
    assert plain.token_ids == ref and lookup.token_ids == ref and len(ref) >= 8
    assert lookup.stats.drafted_tokens > 0  # lookup drafted (and verified) on the text after the image

    # the image matters: another one changes the reply, and mlx-vlm agrees on it too
    messages, ids, images = ask(engine, "What is in the image?", [BLUE])
    _, ref_blue = mlx_vlm_reference(vlm_dir, engine, messages, [BLUE])
    engine.drop_cache(disk=True)
    assert run(engine, ids, images).token_ids == ref_blue != ref


def test_two_images_in_two_turns_equal_mlx_vlm(engine, vlm_dir):
    history = [{"role": "user", "content": "First picture:\n" + engine.image_marker},
               {"role": "assistant", "content": "A square."}]
    messages = [*history, {"role": "user", "content": "And this one?\n" + engine.image_marker}]
    _, ref = mlx_vlm_reference(vlm_dir, engine, messages, [RED, BLUE])
    ids, images = engine.render_chat_images(messages, [RED, BLUE])
    assert len(images.spans) == 2
    engine.drop_cache(disk=True)
    assert run(engine, ids, images).token_ids == ref


def test_prefix_cache_keys_the_image_by_its_hash(engine):
    engine.drop_cache(disk=True)
    _, ids, images = ask(engine, "Describe the picture.", [RED])
    first = run(engine, ids, images)
    assert first.stats.cached_tokens == 0
    again = run(engine, ids, images)  # same image, same text: the whole prompt is cached
    assert again.stats.cached_tokens == len(ids) - 1 and again.token_ids == first.token_ids

    _, ids_blue, images_blue = ask(engine, "Describe the picture.", [BLUE])
    assert ids_blue == ids  # the same token ids: only the hash tells the images apart
    other = run(engine, ids_blue, images_blue)
    start = images.spans[0][0]
    assert other.stats.cached_tokens <= start  # never past the first image token
    engine.drop_cache(disk=True)
    assert run(engine, ids_blue, images_blue).token_ids == other.token_ids  # and it is BLUE's own reply


def test_prefix_cache_segments_hit_up_to_the_image(tmp_path):
    """All-global layers (a radix tree of per-token segments): another image reuses exactly the
    text before it; the next turn of the same conversation reuses the whole earlier turn."""
    from engine import Engine

    e = Engine(str(build_tiny_gemma3_vlm(tmp_path / "m", sliding_window_pattern=1)), prefill_chunk=16)
    try:
        assert e.prefix_cache.kind == "segments"
        _, ids, images = ask(e, "Describe the picture.", [RED])
        run(e, ids, images, max_tokens=4)
        _, ids_blue, images_blue = ask(e, "Describe the picture.", [BLUE])
        assert run(e, ids_blue, images_blue, max_tokens=4).stats.cached_tokens == images.spans[0][0]
        messages, ids, images = ask(e, "Describe the picture.", [RED])
        done = run(e, ids, images, max_tokens=4)
        follow = [*messages, {"role": "assistant", "content": done.text}]
        ids2, images2 = e.render_chat_images(follow + [{"role": "user", "content": "More detail?"}], [RED])
        assert ids2[: images.end] == ids[: images.end]
        assert run(e, ids2, images2, max_tokens=4).stats.cached_tokens >= images.end
    finally:
        e.close()


def test_the_disk_tier_keeps_image_prefixes_across_restarts(vlm_dir, tmp_path):
    """The hash-derived ids are what the disk tier stores: after a restart the same image hits
    and another one still misses."""
    from engine import Engine

    kv = tmp_path / "kv"
    with Engine(str(vlm_dir), prefix_cache_dir=str(kv)) as e:
        _, ids, images = ask(e, "Describe the picture.", [RED])
        first = run(e, ids, images, max_tokens=6)
    with Engine(str(vlm_dir), prefix_cache_dir=str(kv)) as e:
        again = run(e, ids, images, max_tokens=6)
        assert again.stats.cached_tokens == len(ids) - 1 and again.token_ids == first.token_ids
        _, ids_blue, images_blue = ask(e, "Describe the picture.", [BLUE])
        assert run(e, ids_blue, images_blue, max_tokens=6).stats.cached_tokens <= images.spans[0][0]


def test_bad_images_are_request_errors(engine):
    from engine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="not an image"):
        ask(engine, "Look", [b"not a png"])
    with pytest.raises(InvalidRequestError, match="image markers"):
        engine.render_chat_images([{"role": "user", "content": "no marker"}], [RED])


# -- through the server, with the real clients ------------------------------------------------

@pytest.fixture(scope="module")
def server(engine):
    from agent_bridge.app import create_app
    from server_harness import RunningServer

    with RunningServer(create_app(engine)) as srv:
        yield srv


def reference_reply(engine, text: str, images: list[bytes], max_tokens: int) -> str:
    _, ids, prompt_images = ask(engine, text, images)
    return run(engine, ids, prompt_images, max_tokens=max_tokens).text


def test_anthropic_image_reaches_the_model(engine, server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(RED).decode()}}
    r = client.messages.create(model="m", max_tokens=12, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in the image?"}, block]}])
    assert r.content[0].text == reference_reply(engine, "What is in the image?", [RED], 12)
    assert "omitted_content" not in r.model_extra["mlx_dspark"]
    n = client.messages.count_tokens(model="m", messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in the image?"}, block]}]).input_tokens
    assert n == len(ask(engine, "What is in the image?", [RED])[1])
    again = client.messages.create(model="m", max_tokens=12, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in the image?"}, block]}])
    assert again.usage.cache_read_input_tokens > 0 and again.content[0].text == r.content[0].text

    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    assert err.value.body["type"] == "error" and "not fetched" in err.value.body["error"]["message"]


def test_openai_data_url_and_local_file_reach_the_model(engine, server, tmp_path):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    path = tmp_path / "blue.png"
    path.write_bytes(BLUE)
    expected = reference_reply(engine, "What is in the image?", [BLUE], 10)
    for url in ["data:image/png;base64," + base64.b64encode(BLUE).decode(), path.as_uri(), str(path)]:
        r = client.chat.completions.create(model="m", max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in the image?"}, {"type": "image_url", "image_url": {"url": url}}]}])
        assert r.choices[0].message.content == expected, url
    stream = client.chat.completions.create(model="m", max_tokens=10, stream=True, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in the image?"},
                                     {"type": "image_url", "image_url": {"url": str(path)}}]}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected

    for url, message in [("http://example.com/x.png", "not fetched"), (str(tmp_path / "missing.png"), "no such file"),
                         ("data:image/png;base64,@@@", "base64")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}])
        assert message in err.value.body["message"], url


def test_responses_input_image_reaches_the_model(engine, server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model="m", max_output_tokens=10, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is in the image?"},
        {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(RED).decode()}]}])
    assert r.output_text == reference_reply(engine, "What is in the image?", [RED], 10)
    assert "omitted_content" not in r.model_extra["mlx_dspark"]


def test_a_vlm_without_its_vision_half_answers_with_placeholders(vlm_dir, monkeypatch):
    """A VLM family not supported yet (or mlx-vlm not installed): the checkpoint's text model
    serves, and images become placeholders listed in omitted_content, as for a text model."""
    import anthropic

    import engine.model.vision
    from agent_bridge.app import create_app
    from engine import Engine
    from server_harness import RunningServer

    monkeypatch.setattr(engine.model.vision, "SUPPORTED", ())
    with Engine(str(vlm_dir)) as e, RunningServer(create_app(e)) as srv:
        assert not e.reads_images
        client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
        block = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
        r = client.messages.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is in the image?"}, block]}])
        assert r.model_extra["mlx_dspark"]["omitted_content"] == [{"where": "messages[0].content[1]", "type": "image"}]


def test_concurrent_image_requests_each_get_their_own_reply(engine, server):
    """Renders run in worker threads (the processor has a lock of its own) and the engine keys
    each prompt by its own image: four requests at once, two images, each reply its image's."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    send = functools.partial(ask_color, client)

    expected = {c: send(c) for c in ("red", "blue")}  # one at a time
    colors = ["red", "blue", "blue", "red"]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(send, colors))
    assert expected["red"] != expected["blue"]
    assert replies == [expected[c] for c in colors]


# -- Qwen3-VL: M-RoPE positions (3-D for an image's tokens, shifted after it) and deepstack -----

@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"))


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    from engine import Engine

    e = Engine(str(qwen_dir), prefill_chunk=16, max_batch=4)  # chunks cut through the image's tokens
    yield e
    e.close()


def test_qwen3_vl_greedy_output_equals_mlx_vlm_generate(qwen, qwen_dir):
    assert qwen.reads_images and qwen.image_marker == "<|vision_start|><|image_pad|><|vision_end|>"
    messages, ids, images = ask(qwen, "What is in the image?", [RED])
    ref_ids, ref = mlx_vlm_reference(qwen_dir, qwen, messages, [RED])
    (start, end), = images.spans
    assert ids == ref_ids and start // 16 != (end - 1) // 16  # a chunk boundary inside the image
    assert images.position_shift < 0  # the text after the image sits before its index
    qwen.drop_cache(disk=True)
    plain = run(qwen, ids, images, mode="baseline")
    qwen.drop_cache(disk=True)
    lookup = run(qwen, ids, images, mode="lookup")
    assert plain.token_ids == ref and lookup.token_ids == ref and len(ref) >= 8
    assert lookup.stats.accepted_tokens > 0  # multi-token verify passes on the shifted positions

    messages, ids, images = ask(qwen, "What is in the image?", [BLUE])
    _, ref_blue = mlx_vlm_reference(qwen_dir, qwen, messages, [BLUE])
    qwen.drop_cache(disk=True)
    assert run(qwen, ids, images).token_ids == ref_blue != ref


def test_qwen3_vl_two_turns_hit_the_prefix_cache_and_equal_mlx_vlm(qwen, qwen_dir):
    """Turn 2 reuses turn 1's cache past the image (its positions derived again from the prompt);
    a second image in turn 2 gets its own 3-D positions after the first image's shift."""
    qwen.drop_cache(disk=True)
    messages, ids, images = ask(qwen, "Describe the picture.", [RED])
    first = run(qwen, ids, images)
    assert first.token_ids == mlx_vlm_reference(qwen_dir, qwen, messages, [RED])[1]
    history = [*messages, {"role": "assistant", "content": first.text}]

    turn2 = [*history, {"role": "user", "content": "And its colour?"}]
    ids2, images2 = qwen.render_chat_images(turn2, [RED])
    second = run(qwen, ids2, images2)
    assert second.stats.cached_tokens >= images.end
    assert second.token_ids == mlx_vlm_reference(qwen_dir, qwen, turn2, [RED])[1]
    again = run(qwen, ids2, images2)
    assert again.stats.cached_tokens == len(ids2) - 1 and again.token_ids == second.token_ids

    turn2b = [*history, {"role": "user", "content": "And this one?\n" + qwen.image_marker}]
    ids3, images3 = qwen.render_chat_images(turn2b, [RED, BLUE])
    third = run(qwen, ids3, images3)
    assert len(images3.spans) == 2 and third.stats.cached_tokens >= images.end
    assert third.token_ids == mlx_vlm_reference(qwen_dir, qwen, turn2b, [RED, BLUE])[1]


def test_qwen3_vl_disk_tier_restores_a_prefix_past_the_image(qwen_dir, tmp_path):
    from engine import Engine

    kv = tmp_path / "kv"
    with Engine(str(qwen_dir), prefix_cache_dir=str(kv)) as e:
        messages, ids, images = ask(e, "Describe the picture.", [RED])
        first = run(e, ids, images, max_tokens=8)
    with Engine(str(qwen_dir), prefix_cache_dir=str(kv)) as e:
        turn2 = [*messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": "More?"}]
        ids2, images2 = e.render_chat_images(turn2, [RED])
        restored = run(e, ids2, images2)
        assert restored.stats.cached_tokens >= images.end
        assert restored.token_ids == mlx_vlm_reference(qwen_dir, e, turn2, [RED])[1]


def test_qwen3_vl_image_requests_through_the_clients(qwen):
    """anthropic (base64, sent twice: the second reads the cache) and openai (data: URL), four
    openai requests at once with --max-batch 4 (shifted caches verify alone): each reply its image's."""
    from concurrent.futures import ThreadPoolExecutor

    import anthropic
    import openai

    from agent_bridge.app import create_app
    from server_harness import RunningServer

    with RunningServer(create_app(qwen)) as srv:
        a = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(RED).decode()}}
        msgs = [{"role": "user", "content": [{"type": "text", "text": "What is in the image?"}, block]}]
        r = a.messages.create(model="m", max_tokens=MAX, messages=msgs)
        assert r.content[0].text == reference_reply(qwen, "What is in the image?", [RED], MAX)
        again = a.messages.create(model="m", max_tokens=MAX, messages=msgs)
        assert again.usage.cache_read_input_tokens > 0 and again.content[0].text == r.content[0].text

        o = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)

        send = functools.partial(ask_color, o)

        expected = {c: reference_reply(qwen, "What is in the image?", [RED if c == "red" else BLUE], MAX)
                    for c in ("red", "blue")}
        assert expected["red"] == r.content[0].text != expected["blue"]
        colors = ["red", "blue", "blue", "red"]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(send, colors)) == [expected[c] for c in colors]


def check_next_turn(engine, model_dir, messages, reply, images):
    """The next turn, after the model's `reply` about BLUE: it reuses the cache past the image
    and still equals mlx-vlm."""
    turn2 = [*messages, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "And its colour?"}]
    ids2, images2 = engine.render_chat_images(turn2, [BLUE])
    second = run(engine, ids2, images2)
    assert second.stats.cached_tokens >= images.end
    assert second.token_ids == mlx_vlm_reference(model_dir, engine, turn2, [BLUE])[1]


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen2_vl"])
def test_qwen2_and_2_5_vl_equal_mlx_vlm_over_two_turns(tmp_path, kind):
    """Qwen2-VL and Qwen2.5-VL share the path (M-RoPE in sections, no deepstack): lossless
    against mlx-vlm, the image matters, and the second turn hits the cache past the image."""
    from engine import Engine

    model_dir = build_tiny_qwen_vl(tmp_path / "m", kind)
    with Engine(str(model_dir), prefill_chunk=16) as e:
        replies = {}
        for name, image in (("red", RED), ("blue", BLUE)):
            messages, ids, images = ask(e, "What is in the image?", [image])
            replies[name] = run(e, ids, images)
            assert replies[name].token_ids == mlx_vlm_reference(model_dir, e, messages, [image])[1]
        assert replies["red"].token_ids != replies["blue"].token_ids and replies["red"].stats.accepted_tokens > 0
        check_next_turn(e, model_dir, messages, replies["blue"], images)


@pytest.mark.parametrize("dequantize", ["1", "0"])
def test_a_quantized_qwen3_vl_shares_the_targets_layers(tmp_path, monkeypatch, dequantize):
    """An 8-bit checkpoint, run dequantized (the CPU default for a small model) or quantised:
    mlx-vlm's text model prefills on the target's own layers, and the output equals mlx-vlm's."""
    from engine import Engine

    monkeypatch.setenv("MLX_DSPARK_DEQUANTIZE", dequantize)
    model_dir = build_tiny_qwen3_vl(tmp_path / "m", bits=8)
    with Engine(str(model_dir), prefill_chunk=16) as e:
        ours, theirs = e.target.model.language_model.model, e.vision.model.language_model.model
        assert ours.layers[0].self_attn.q_proj is theirs.layers[0].self_attn.q_proj
        assert ours.embed_tokens is theirs.embed_tokens
        messages, ids, images = ask(e, "What is in the image?", [BLUE])
        assert run(e, ids, images).token_ids == mlx_vlm_reference(model_dir, e, messages, [BLUE])[1]



# -- Gemma 4: an image's tokens attend to each other both ways -----------------------------------

@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    return build_tiny_gemma4_vlm(tmp_path_factory.mktemp("tiny-gemma4-vlm"), seed=1)


@pytest.fixture(scope="module")
def gemma4(gemma4_dir):
    from engine import Engine

    e = Engine(str(gemma4_dir), prefill_chunk=8)  # 8-token chunks would cut the 12-token image
    yield e
    e.close()


def test_gemma4_prefill_chunks_leave_mlx_vlms_cache(gemma4):
    """Chunked from 8 tokens a chunk, after a cached prefix: the keys and values equal those of
    mlx-vlm's own forward over the whole prompt from position 0 (its bidirectional image block)."""
    import mlx.core as mx

    from engine.decoding.verify import prefill
    from engine.model.vision import prefill_chunks

    _, ids, images = ask(gemma4, "What is in the image?", [RED])
    (start, end), = images.spans
    chunks = prefill_chunks(len(ids), 8, features := gemma4.vision.features(ids, images))
    assert any(a <= start and end <= b for a, b in chunks) and start // 8 != (end - 1) // 8
    assert all(b % 8 == 0 and b - a <= 8 for a, b in chunks[:-1] if b <= start or a >= end)  # others end on multiples
    cache = gemma4.target.make_cache()
    for a, b in chunks:
        prefill(gemma4.target, cache, ids[a:b], chunk_size=b - a, embeddings=features[a:b])
    whole = gemma4.target.make_cache()
    gemma4.vision.model.language_model.model(
        None, inputs_embeds=features.embeds[None], cache=whole, per_layer_inputs=features.per_layer[None],
        mm_token_type_ids=mx.array(features.visual.astype("int32"))[None])
    n = len(ids)
    for ours, theirs in zip(cache, whole):
        for x, y in zip(ours.state[:2], theirs.state[:2]):
            assert mx.allclose(x[..., :n, :], y[..., :n, :], atol=1e-5), type(ours).__name__


def test_gemma4_greedy_output_equals_mlx_vlm_generate(gemma4, gemma4_dir):
    assert gemma4.reads_images and gemma4.image_marker == "<|image|>"
    replies = {}
    for name, image in (("red", RED), ("blue", BLUE)):
        messages, ids, images = ask(gemma4, "What is in the image?", [image])
        ref_ids, ref = mlx_vlm_reference(gemma4_dir, gemma4, messages, [image])
        assert ids == ref_ids
        gemma4.drop_cache(disk=True)
        assert run(gemma4, ids, images, mode="baseline").token_ids == ref and len(ref) >= 8
        gemma4.drop_cache(disk=True)
        replies[name] = run(gemma4, ids, images, mode="lookup")
        assert replies[name].token_ids == ref
    assert replies["red"].token_ids != replies["blue"].token_ids

    check_next_turn(gemma4, gemma4_dir, messages, replies["blue"], images)


def test_gemma4_with_kv_shared_layers_equals_mlx_vlm(tmp_path):
    """The last two of four layers read earlier layers' keys and values (Gemma 4 E2B/E4B)."""
    from engine import Engine

    model_dir = build_tiny_gemma4_vlm(tmp_path / "m", seed=1, layers=4, kv_shared_layers=2)
    with Engine(str(model_dir), prefill_chunk=8) as e:
        assert len(e.target.make_cache()) == 2
        messages, ids, images = ask(e, "What is in the image?", [BLUE])
        assert run(e, ids, images).token_ids == mlx_vlm_reference(model_dir, e, messages, [BLUE])[1]


def test_gemma4_sliding_window_shorter_than_an_image(tmp_path):
    """An 8-token window, a 12-token image, a 70-token prompt: the sliding layers' caches rotate,
    and the image's tokens still see each other (as in mlx-vlm), in 8-token chunks or one."""
    from engine import Engine

    model_dir = build_tiny_gemma4_vlm(tmp_path / "m", seed=1, sliding_window=8)
    text = "What is in the image? Answer in detail please, the whole picture."
    for chunk in (8, 64):
        with Engine(str(model_dir), prefill_chunk=chunk) as e:
            messages, ids, images = ask(e, text, [BLUE])
            assert len(ids) > 64 and images.spans[0][1] - images.spans[0][0] > 8
            assert run(e, ids, images).token_ids == mlx_vlm_reference(model_dir, e, messages, [BLUE])[1]


def test_gemma4_image_through_the_openai_client(gemma4):
    import openai

    from agent_bridge.app import create_app
    from server_harness import RunningServer

    with RunningServer(create_app(gemma4)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="m", max_tokens=MAX, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in the image?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(RED).decode()}}]}])
        assert r.choices[0].message.content == reference_reply(gemma4, "What is in the image?", [RED], MAX)


@pytest.mark.parametrize("build", [build_tiny_qwen3_vl, build_tiny_gemma4_vlm])
def test_image_prompts_with_a_quantized_kv_cache(tmp_path, build):
    """--kv-bits 8 (head_dim 64: a whole quantisation group): the image prefill (mlx-vlm's text
    model) writes the quantised cache, and lookup drafting equals plain decoding on it."""
    from engine import Engine

    with Engine(str(build(tmp_path / "m", hidden=128)), prefill_chunk=8, kv_bits=8) as e:
        _, ids, images = ask(e, "What is in the image?", [RED])
        plain = run(e, ids, images, mode="baseline")
        e.drop_cache(disk=True)
        lookup = run(e, ids, images, mode="lookup")
        assert lookup.token_ids == plain.token_ids and lookup.stats.drafted_tokens > 0
        assert "QuantizedKVCache" in {type(c).__name__ for c in e._new_cache()}
