"""Images in the prompt of a vision-language target (the `vlm` extra: mlx-vlm).

The text model is the mlx-lm model the engine runs anyway (mlx-lm reads a VLM checkpoint's
language model and drops its vision weights). mlx-vlm's model class adds the vision tower and
projector, sharing the text model's embedding table, and mlx-vlm's processor turns a rendered
prompt and its images into input ids and pixel values. A prompt with images is prefilled from
the merged input embeddings (`Vision.features`); everything after it (decoding, drafting,
rollback) runs on the text model and its cache as for any prompt.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL place tokens by M-RoPE: an image's tokens take 3-D positions
(temporal, height, width) and the text after it continues at `cache offset + shift`, the shift
(mlx-vlm's rope delta, negative: an image spans fewer positions than tokens) fixed by the prompt's
images. Their prompt is prefilled by mlx-vlm's own text model (it takes the 3-D positions and
Qwen3-VL's deepstack features), on the target's weights and cache; after it, the mlx-lm text model
runs as for any prompt, its RoPE offset moved by the shift (`set_position_shift`). For text-only
positions (t = h = w) M-RoPE is plain RoPE, so that is the same model.

Gemma 4's image tokens attend to every token of their own image, later ones too. Its prompt is
prefilled by mlx-vlm's Gemma 4 text model on the target's layers (with its per-layer inputs), each
image whole in one chunk (`prefill_chunks`), the chunk's mask opened within each image
(`see_image_blocks_both_ways`); text after it is causal, so decoding runs on mlx-lm's model.

The prefix cache keys such a prompt by its ids with each image's tokens replaced by ids derived
from the image's hash (`PromptImages.key`): the same image and text hit, another image misses.
The shift is not stored with a cached prefix: the same ids and images give the same positions,
so a request derives it from its own prompt (`PromptImages.position_shift`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from engine.base.errors import InvalidRequestError

log = logging.getLogger(__name__)

# Families whose images reach the model. gemma3's positions are plain 1-D (a token's position
# is the cache's length); the Qwen-VL families' are M-RoPE (3-D for image tokens, shifted after).
MROPE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Gemma 4: an image's tokens attend to each other both ways, so an image is never cut by a
# prefill chunk (`prefill_chunks`) and the chunk's mask lets its image tokens see each other.
BIDIRECTIONAL = ("gemma4",)
SUPPORTED = ("gemma3", *MROPE, *BIDIRECTIONAL)
KEY_SPACE = 2**31 - 1  # hash-derived key ids stay below this (the disk tier stores int32 ids)
MAX_IMAGES = 32


@dataclass
class PromptImages:
    """The images of one prompt: what the vision model reads, and where their tokens are."""

    hashes: list[str]  # sha256 of each image's bytes, in prompt order
    spans: list[tuple[int, int]]  # [start, end) of each image's tokens in the prompt ids
    inputs: dict = field(repr=False)  # the processor's outputs (pixel_values, ...) for the vision model
    position_shift: int = 0  # M-RoPE: a text token's position is its index plus this (0: 1-D positions)

    @property
    def end(self) -> int:
        """Prompt positions from here on are text only."""
        return max(end for _, end in self.spans)

    def key(self, prompt: list[int], vocab_size: int) -> list[int]:
        """The prompt's ids as the prefix cache sees them: each image's tokens replaced by an
        id above the vocabulary derived from that image's hash."""
        out = list(prompt)
        for digest, (start, end) in zip(self._span_hashes(), self.spans):
            image_id = vocab_size + int(digest[:15], 16) % (KEY_SPACE - vocab_size)
            out[start:end] = [image_id] * (end - start)
        return out

    def _span_hashes(self) -> list[str]:
        if len(self.hashes) == len(self.spans):
            return self.hashes
        # a family that splits an image into several runs (crops): every run is keyed by all images
        both = hashlib.sha256("".join(self.hashes).encode()).hexdigest()
        return [both] * len(self.spans)


class Vision:
    """The vision half of a VLM target: its processor, vision tower and projector."""

    def __init__(self, target, model_dir: Path):
        from mlx_vlm.utils import load_model, load_processor, prepare_inputs

        self._prepare_inputs = prepare_inputs
        self.target = target
        model = load_model(model_dir, lazy=True)
        kind = model.config.model_type
        self.mrope, self.bidirectional = kind in MROPE, kind in BIDIRECTIONAL
        if self.mrope or self.bidirectional:
            # mlx-vlm's text model prefills image prompts (3-D positions, deepstack; image tokens
            # seeing each other, per-layer inputs) on the target's own layers: its lazily loaded
            # copies are replaced before they are read.
            share_modules(model.language_model, target.model.language_model)
            if self.bidirectional:
                see_image_blocks_both_ways(model.language_model.model)
        else:
            # The text model is the target's: mlx-vlm's copy is dropped before its weights are read.
            model.language_model = target.model.language_model
        dtype = getattr(mx, target.dtype, None)
        for name, part in model.children().items():  # the vision half in the text model's dtype
            if name != "language_model" and isinstance(dtype, mx.Dtype) and hasattr(part, "set_dtype"):
                part.set_dtype(dtype)
        mx.eval(model.parameters())
        self.model = model
        self.processor = load_processor(model_dir, add_detokenizer=False)
        self._lock = threading.Lock()  # its fast tokenizer fails when two threads use it at once
        config = model.config
        self.image_token_id = int(getattr(config, "image_token_index", None) or config.image_token_id)
        # what the chat template writes for an image: the processor expands it to the image's tokens
        if self.mrope:  # <|vision_start|><|image_pad|><|vision_end|>
            tokens = self.processor.tokenizer.convert_ids_to_tokens([config.vision_start_token_id, self.image_token_id])
            end = getattr(config, "vision_end_token_id", None)  # Qwen2-VL's config doesn't name it
            end = "<|vision_end|>" if end is None else self.processor.tokenizer.convert_ids_to_tokens(end)
            self.image_marker = "".join([*tokens, end])
        elif self.bidirectional:  # the processor writes <|image> soft tokens <image|> in its place
            self.image_marker = self.processor.image_token
        else:
            self.image_marker = self.processor.boi_token

    def prepare(self, text: str, images: list[bytes]) -> tuple[list[int], PromptImages]:
        """A rendered prompt holding one image marker per image -> its ids and its images."""
        if len(images) > MAX_IMAGES:
            raise InvalidRequestError(f"too many images: {len(images)} (at most {MAX_IMAGES} a request)")
        marked = text.count(self.image_marker)
        if marked != len(images):
            raise InvalidRequestError(f"the prompt has {marked} image markers ({self.image_marker!r}) "
                                      f"for {len(images)} images")
        pictures = [open_image(data, i) for i, data in enumerate(images)]
        try:
            with self._lock:
                inputs = self._prepare_inputs(self.processor, images=pictures, prompts=text,
                                              image_token_index=self.image_token_id)
        except Exception as e:  # the processor's own message (sizes, counts)
            raise InvalidRequestError(f"the model's processor rejected the images: {e}") from e
        ids = [int(t) for t in inputs.pop("input_ids")[0].tolist()]
        inputs.pop("attention_mask", None)
        spans = image_spans(ids, self.image_token_id)
        if not spans:
            raise InvalidRequestError("the processor placed no image tokens in the prompt")
        hashes = [hashlib.sha256(data).hexdigest() for data in images]
        shift = 0
        if self.mrope:  # the positions the text after the images continues from
            _, delta = self.model.language_model.get_rope_index(mx.array([ids]), inputs.get("image_grid_thw"))
            shift = int(delta.reshape(-1)[0].item())
        return ids, PromptImages(hashes, spans, inputs, shift)

    def features(self, ids: list[int], images: PromptImages) -> ImageFeatures:
        """The prompt's inputs with the images' features merged in (sliced per prefill chunk)."""
        x = mx.array([ids], dtype=mx.int32)
        out = self.model.get_input_embeddings(x, mask=mx.ones(x.shape, dtype=mx.int32), **images.inputs)
        if self.bidirectional:
            per_layer = getattr(out, "per_layer_inputs", None)
            return ImageFeatures(self, out.inputs_embeds[0], visual=np.array(x[0] == self.image_token_id),
                                 per_layer=None if per_layer is None else per_layer[0])
        if not self.mrope:
            return ImageFeatures(self, out.inputs_embeds[0])
        deepstack = getattr(out, "deepstack_visual_embeds", None)
        visual = np.array(x[0] == self.image_token_id) if deepstack is not None else None
        return ImageFeatures(self, out.inputs_embeds[0], positions=out.position_ids[:, 0, :],
                             visual=visual, deepstack=None if deepstack is None else mx.array(deepstack))

    def forward(self, tokens: mx.array, cache: list, features: ImageFeatures) -> mx.array:
        """Logits (len(tokens), vocab) for a prefill chunk fed its image-merged inputs."""
        lm = self.model.language_model
        if self.bidirectional:
            kinds = mx.array(features.visual.astype(np.int32))[None] if features.visual.any() else None
            per_layer = None if features.per_layer is None else features.per_layer[None]
            h = lm.model(None, inputs_embeds=features.embeds[None], cache=cache, per_layer_inputs=per_layer,
                         mm_token_type_ids=kinds)  # 1 marks an image's tokens
            return lm.logits_from_hidden(h)[0]
        if not self.mrope:
            return self.target.model(tokens[None], cache=cache, input_embeddings=features.embeds[None])[0]
        extra = {}
        if features.deepstack is not None and features.visual.any():
            extra = {"visual_pos_masks": mx.array(features.visual)[None],
                     "deepstack_visual_embeds": features.deepstack}
        h = lm.model(tokens[None], inputs_embeds=features.embeds[None], cache=cache,
                     position_ids=features.positions[:, None, :], **extra)
        return (lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h))[0]


@dataclass
class ImageFeatures:
    """A prompt's image-merged inputs, one row per token; `[a:b]` slices them for a chunk."""

    vision: Vision = field(repr=False)
    embeds: mx.array  # (n, hidden)
    positions: mx.array | None = None  # (3, n) M-RoPE positions; None: the cache's own 1-D ones
    visual: np.ndarray | None = None  # (n,) bool: image positions (deepstack; Gemma 4's blocks)
    deepstack: mx.array | None = None  # (layers, visual positions, hidden)
    per_layer: mx.array | None = None  # (n, layers, per-layer width): Gemma 4's per-layer inputs

    def __getitem__(self, part: slice) -> ImageFeatures:
        start, stop, _ = part.indices(self.embeds.shape[0])
        visual = deepstack = None
        if self.visual is not None:
            visual = self.visual[start:stop]
        if self.deepstack is not None:
            before = int(self.visual[:start].sum())
            deepstack = self.deepstack[:, before : before + int(visual.sum())]
        positions = None if self.positions is None else self.positions[:, start:stop]
        per_layer = None if self.per_layer is None else self.per_layer[start:stop]
        return ImageFeatures(self.vision, self.embeds[start:stop], positions, visual, deepstack, per_layer)

    def whole_images(self) -> list[tuple[int, int]]:
        """[start, stop) of each image that one prefill chunk must hold whole (Gemma 4)."""
        if not self.vision.bidirectional:
            return []
        return image_spans(self.visual.tolist(), True)

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        return self.vision.forward(tokens, cache, self)

    def eval(self) -> None:
        mx.eval([a for a in (self.embeds, self.positions, self.deepstack, self.per_layer) if a is not None])


def prefill_chunks(total: int, size: int, features: ImageFeatures | None = None, depth: int = 0) -> list[tuple[int, int]]:
    """[start, stop) of each prefill chunk of `total` tokens that follow `depth` cached ones:
    `size` each, ending at multiples of `size` in the whole context (the first one shorter where
    the cached prefix isn't one), except that a chunk which would end inside an image that must be
    read whole ends after it instead. Aligned chunks give every prompt the same (chunk, keys)
    attention shapes, which a GPU backend that builds a kernel plan per shape (MLX CUDA's cuDNN)
    builds once, not once per prompt. A prefill that fits in one chunk is one: aligned, a warm
    turn's few tokens would split in two forwards where they cross a multiple, each a new shape
    anyway (on an H100, +80 tokens at depth 20,426 took 54 + 25 rows, 143 + 59 ms; single chunks
    of 111-134 tokens at 15-32k took 77-90 ms)."""
    if total <= size:
        depth = 0  # one chunk, not aligned
    whole = features.whole_images() if features is not None else []
    chunks, start = [], 0
    while start < total:
        stop = min(start + size - (depth + start) % size, total)
        stop = max([stop, *(min(end, total) for first, end in whole if first < stop < end)])
        chunks.append((start, stop))
        start = stop
    return chunks


def see_image_blocks_both_ways(text_model: nn.Module) -> None:
    """Gemma 4's image tokens attend to every token of their own image. mlx-vlm's text model
    builds that mask only for a whole prompt read from position 0 (a square mask); this makes
    it for any chunk, after a cached prefix too: the chunk's own keys are the mask's last columns."""
    make_masks = text_model._make_masks

    def masks(h, cache, mm_token_type_ids=None):
        out = make_masks(h, cache, mm_token_type_ids)
        if mm_token_type_ids is None or h.shape[1] < 2:
            return out
        n = h.shape[1]
        block = text_model._block_sequence_ids_for_mask(mm_token_type_ids)
        same = ((block[..., :, None] != -1) & (block[..., :, None] == block[..., None, :]))[:, None]
        fixed = []
        for m in out:  # arrays: mlx-vlm makes them so for a chunk with image tokens
            m = mx.broadcast_to(m, (*same.shape[:-1], m.shape[-1]))
            fixed.append(mx.concatenate([m[..., :-n], m[..., -n:] | same], axis=-1))
        return fixed

    text_model._make_masks = masks


class _ShiftedPositions:
    """One layer's cache as the text model's attention sees it: its RoPE offset (`offset`) moved
    by the prompt's position shift; storage, masks and everything else are the cache's own."""

    def __init__(self, cache, shift: int):
        self._cache, self._shift = cache, shift

    @property
    def offset(self):
        return self._cache.offset + self._shift

    def __getattr__(self, name):
        return getattr(self._cache, name)


def set_position_shift(cache: list, shift: int) -> None:
    """Positions from here on are the cache's length plus `shift` (an M-RoPE prompt with images)."""
    for c in cache:
        c.position_shift = shift


def position_view(cache: list) -> list:
    """The cache as a forward must see it: shifted where `set_position_shift` says so."""
    shift = getattr(cache[0], "position_shift", 0) if cache else 0
    return [_ShiftedPositions(c, shift) for c in cache] if shift else cache


def share_modules(into: nn.Module, source: nn.Module) -> None:
    """Put `source`'s layers (linears, norms, embeddings: quantised, dequantized or not) in
    place of `into`'s at the same paths, so both models run on one copy of the weights."""
    leaves = lambda m: dict(tree_flatten(m.leaf_modules(), is_leaf=nn.Module.is_module))  # noqa: E731
    mine, theirs = leaves(into), leaves(source)
    into.update_modules(tree_unflatten([(path, theirs[path]) for path in mine if path in theirs]))
    unshared = [path for path, m in leaves(into).items() if path not in theirs and m.parameters()]
    if any(not path.endswith(("rotary_emb", "rope")) for path in unshared):
        log.warning("images: %s keep weights of their own", ", ".join(unshared))


def image_spans(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of image tokens."""
    spans, start = [], None
    for i, t in enumerate([*ids, -1]):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            spans.append((start, i))
            start = None
    return spans


def open_image(data: bytes, index: int = 0):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise InvalidRequestError(f"image {index}: not an image this server can read ({e})") from None
    return img.convert("RGB") if img.mode != "RGB" else img


def image_support(config: dict) -> str | None:
    """None for a text model; "yes" when a VLM's images reach it; else why they become placeholders."""
    if "vision_config" not in config:
        return None
    kind = config.get("model_type")
    if kind not in SUPPORTED:
        return f"placeholders: {kind} is not supported yet (supported: {', '.join(SUPPORTED)})"
    if importlib.util.find_spec("mlx_vlm") is None:
        return "placeholders: mlx-vlm is not installed (pip install 'mlx-dspark[vlm]')"
    return "yes"


def load_vision(target) -> Vision | None:
    """The target's vision half, or None: a text model, an unsupported family, or no mlx-vlm
    (then images reach the model as placeholders)."""
    support = image_support(target.config)
    if support is None:
        return None
    if support != "yes":
        log.warning("images: %s", support)
        return None
    return Vision(target, model_dir(target.path))


def model_dir(path: str) -> Path:
    local = Path(path)
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, local_files_only=True))
