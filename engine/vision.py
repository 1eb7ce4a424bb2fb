"""Images in the prompt of a vision-language target (the `vlm` extra: mlx-vlm).

The text model is the mlx-lm model the engine runs anyway (mlx-lm reads a VLM checkpoint's
language model and drops its vision weights). mlx-vlm's model class adds the vision tower and
projector, sharing the text model's embedding table, and mlx-vlm's processor turns a rendered
prompt and its images into input ids and pixel values. A prompt with images is prefilled from
the merged input embeddings (`Vision.embeddings`); everything after it (decoding, drafting,
rollback) runs on the text model and its cache as for any prompt.

The prefix cache keys such a prompt by its ids with each image's tokens replaced by ids derived
from the image's hash (`PromptImages.key`): the same image and text hit, another image misses.
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

from .errors import InvalidRequestError

log = logging.getLogger(__name__)

# Families whose text positions are plain 1-D (a token's position is the cache's length):
# prefilling their image embeddings leaves a cache the text model continues as it is.
# Qwen2/3-VL use M-RoPE, whose positions after an image are offset from the cache's length
# (mlx-vlm keeps that offset in the model): not supported yet, their images become placeholders.
SUPPORTED = ("gemma3",)
KEY_SPACE = 2**31 - 1  # hash-derived key ids stay below this (the disk tier stores int32 ids)
MAX_IMAGES = 32


@dataclass
class PromptImages:
    """The images of one prompt: what the vision model reads, and where their tokens are."""

    hashes: list[str]  # sha256 of each image's bytes, in prompt order
    spans: list[tuple[int, int]]  # [start, end) of each image's tokens in the prompt ids
    inputs: dict = field(repr=False)  # the processor's outputs (pixel_values, ...) for the vision model

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
        model = load_model(model_dir, lazy=True)
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
        self.image_token_id = int(model.config.image_token_index)
        # what the chat template writes for an image: the processor expands it to the image's tokens
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
        return ids, PromptImages(hashes, spans, inputs)

    def embeddings(self, ids: list[int], images: PromptImages) -> mx.array:
        """Input embeddings (len(ids), hidden) with the images' features merged in."""
        x = mx.array([ids], dtype=mx.int32)
        out = self.model.get_input_embeddings(x, mask=mx.ones(x.shape, dtype=mx.int32), **images.inputs)
        meta = [k for k in ("position_ids", "rope_deltas") if getattr(out, k, None) is not None]
        if meta:  # cannot happen for SUPPORTED families; a guard against a silently wrong cache
            raise InvalidRequestError(f"this model's image positions ({', '.join(meta)}) are not supported")
        return out.inputs_embeds[0]


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
