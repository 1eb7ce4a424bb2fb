"""Load a drafter checkpoint in its published layout, strictly, and check it fits the target.

Every tensor the architecture needs must be present with its exact shape, and nothing
unknown may be left over: a mismatch is an error naming the tensor. Then the pairing:
the target's family must support hidden-state taps, the tapped layers must exist, and
hidden size and vocabulary must match.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from engine.drafting.heads import dflash, dspark
from engine.drafting.heads.backbone import HeadConfig
from engine.drafting.heads.registry import DrafterLoadError, kind_of, published_mismatches, resolve_path
from engine.model.config import read_config, text_config

# Non-persistent or derivable tensors some exporters leave in (ignored, as sglang does).
IGNORED_PREFIXES = ("rotary_emb.",)
# DSpark checkpoints may carry frozen copies of the target's embedding and head, and a vocab map.
OPTIONAL_DSPARK = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")


def parse_config(config: dict, kind: str) -> HeadConfig:
    """HeadConfig from config.json: DFlash keeps its fields in `dflash_config`, DSpark at the top."""
    nested = config.get("dflash_config") or {}

    def get(name, default=None):
        return nested.get(name, config.get(name, default))

    def need(name):
        value = get(name)
        if value is None:
            raise DrafterLoadError(f"drafter config.json lacks {name!r}")
        return value

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    n_layers = int(need("num_hidden_layers"))
    layer_types = tuple(config.get("layer_types") or ["full_attention"] * n_layers)
    if len(layer_types) != n_layers:
        raise DrafterLoadError("drafter config: layer_types length differs from num_hidden_layers")
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if rope and rope.get("rope_type", rope.get("type")) == "default":
        rope = None
    conf_on = bool(get("enable_confidence_head", False))
    cfg = HeadConfig(
        architecture=(config.get("architectures") or ["?"])[0],
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(get("num_key_value_heads", heads)),
        head_dim=int(get("head_dim") or hidden // heads),
        intermediate_size=int(need("intermediate_size")),
        vocab_size=int(need("vocab_size")),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=float(get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=int(get("max_position_embeddings", 32768)),
        block_size=int(get("block_size", 16 if kind == "dflash" else 7)),
        mask_token_id=int(need("mask_token_id")),
        target_layer_ids=tuple(int(i) for i in need("target_layer_ids")),
        num_target_layers=get("num_target_layers"),
        rope_scaling=rope,
        attention_bias=bool(get("attention_bias", False)),
        layer_types=layer_types,
        sliding_window=get("sliding_window"),
        is_causal=config.get("is_causal"),
        input_embedding_scale=float(get("input_embedding_scale", 1.0)),
        output_multiplier=float(get("output_multiplier", 1.0)),
        final_logit_softcapping=get("final_logit_softcapping"),
        markov_rank=int(get("markov_rank", 0)),
        markov_head_type=str(get("markov_head_type", "vanilla")).lower(),
        enable_confidence_head=conf_on,
        confidence_head_with_markov=bool(get("confidence_head_with_markov", False)) if conf_on else False,
        confidence_threshold=float(get("confidence_threshold", 0.2 if conf_on else 0.0)),
        draft_vocab_size=get("draft_vocab_size"),
        conv_kernel_size=int(get("conv_kernel_size", 0)),
        conv_group_size=int(get("conv_group_size", 0)),
        selector_rank=int(get("selector_rank", 0)),
        selector_top_k=int(get("selector_top_k", 0)),
    )
    if cfg.architecture == "DFlash2DraftModel":
        if min(cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) <= 0:
            raise DrafterLoadError("DFlash 2 config needs conv_kernel_size, conv_group_size, selector_rank "
                                   "and selector_top_k in dflash_config")
        if hidden % cfg.conv_group_size:
            raise DrafterLoadError(f"DFlash 2: conv_group_size {cfg.conv_group_size} does not divide hidden_size {hidden}")
    if "sliding_attention" in layer_types and cfg.sliding_window is None:
        raise DrafterLoadError("drafter config: sliding_attention layers need sliding_window")
    if kind == "dspark":
        if cfg.markov_rank <= 0:
            raise DrafterLoadError("DSpark config needs markov_rank > 0 (the Markov head is the draft's core)")
        if cfg.markov_head_type not in dspark.MARKOV_TYPES:
            raise DrafterLoadError(f"unsupported DSpark markov_head_type {cfg.markov_head_type!r}")
    if cfg.block_size < 2 and kind == "dflash":
        raise DrafterLoadError("DFlash block_size must be at least 2")
    return cfg


def build_head(cfg: HeadConfig, kind: str, target_hidden: int | None = None, own: set[str] = frozenset()):
    if kind == "dspark":
        cls = dspark.DSparkHead
    else:
        cls = dflash.DFlash2Head if cfg.architecture == "DFlash2DraftModel" else dflash.DFlashHead
    return cls(cfg, target_hidden, own_modules=set(own))


def check_weights(head: nn.Module, weights: dict[str, mx.array]) -> None:
    """Strict: every expected tensor present with its shape, no unknown tensor."""
    expected = dict(tree_flatten(head.parameters()))
    for name, param in expected.items():
        if name not in weights:
            raise DrafterLoadError(f"drafter checkpoint is missing tensor {name!r} (shape {tuple(param.shape)})")
        if tuple(weights[name].shape) != tuple(param.shape):
            raise DrafterLoadError(
                f"drafter tensor {name!r} has shape {tuple(weights[name].shape)}, expected {tuple(param.shape)}"
            )
    extra = sorted(n for n in weights if n not in expected and n != "t2d" and not n.startswith(IGNORED_PREFIXES))
    if extra:
        raise DrafterLoadError(f"drafter checkpoint has unexpected tensor {extra[0]!r}" + (
            f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def check_pairing(head, target) -> None:
    """The head must fit this target: taps, hidden size, vocabulary."""
    cfg = head.cfg
    try:
        target.check_tappable(cfg.target_layer_ids)
    except ValueError as e:
        raise DrafterLoadError(f"drafter does not fit this model: {e}") from None
    if cfg.num_target_layers is not None and int(cfg.num_target_layers) != target.num_layers:
        raise DrafterLoadError(
            f"drafter was trained for a {cfg.num_target_layers}-layer target; this model has {target.num_layers} layers"
        )
    want = head.fc.weight.shape[-1]
    have = len(cfg.target_layer_ids) * target.hidden_size
    if want != have:
        raise DrafterLoadError(
            f"drafter fc expects {want} input features; this model's tapped layers give {have} "
            f"({len(cfg.target_layer_ids)} x hidden {target.hidden_size})"
        )
    shares = head.kind == "dflash" or "lm_head" not in head or "embed_tokens" not in head
    if shares and cfg.hidden_size != target.hidden_size:
        raise DrafterLoadError(
            f"drafter hidden size {cfg.hidden_size} differs from the model's {target.hidden_size} "
            "(it reuses the model's embedding and LM head)"
        )
    if cfg.vocab_size != target.vocab_size:
        raise DrafterLoadError(f"drafter vocabulary {cfg.vocab_size} differs from the model's {target.vocab_size}")
    if not 0 <= cfg.mask_token_id < target.model.model.embed_tokens.weight.shape[0]:
        raise DrafterLoadError(f"drafter mask_token_id {cfg.mask_token_id} is outside the model's embedding table")


def pairing_problems(head_config: dict, target_config: dict) -> list[str]:
    """Why a drafter head (its config.json) can't serve this target (its config.json): hidden
    size, vocabulary and tapped layers, each named. Empty: they fit as far as configs tell."""
    head = {**head_config, **(head_config.get("dflash_config") or {})}
    target = text_config(target_config)
    problems = []
    t_hidden, h_hidden = target.get("hidden_size"), head.get("hidden_size")
    # A DSpark head may carry its own embedding and LM head at another width: its weights decide.
    own_width = any("DSpark" in str(a) for a in head.get("architectures") or [])
    if t_hidden and h_hidden and int(t_hidden) != int(h_hidden) and not own_width:
        problems.append(f"hidden size: the head's is {h_hidden}, the model's {t_hidden}")
    t_vocab, h_vocab = target.get("vocab_size"), head.get("vocab_size")
    if t_vocab and h_vocab and int(t_vocab) != int(h_vocab):
        problems.append(f"vocabulary: the head's is {h_vocab} tokens, the model's {t_vocab}")
    n_layers = target.get("num_hidden_layers")
    taps = [int(i) for i in head.get("target_layer_ids") or []]
    trained_for = head.get("num_target_layers")
    if n_layers and trained_for and int(trained_for) != int(n_layers):
        problems.append(f"layer taps: the head was trained on a {trained_for}-layer model, this one has {n_layers}")
    elif n_layers and taps and max(taps) >= int(n_layers):
        problems.append(f"layer taps: the head reads layers {taps}, this model has {n_layers} (0-{int(n_layers) - 1})")
    return problems


def check_configs(head_config: dict, target_config: dict, source: str = "drafter") -> None:
    """Refuse a head trained for another model from the two config.json files alone (before
    any weights load), naming every mismatch: hidden size, vocabulary, tapped layers."""
    problems = pairing_problems(head_config, target_config)
    if problems:
        raise DrafterLoadError(f"{source} does not fit this model: " + "; ".join(problems))


def precheck(drafter: str | Path, model: str | Path) -> None:
    """The config-level pairing check for a drafter and a model on disk; skipped for what
    isn't local yet (the full check runs when both are loaded)."""
    try:
        head_dir = resolve_path(drafter, allow_download=False)
    except DrafterLoadError:
        return
    target_config = read_config(Path(str(model)).expanduser())
    head_config = read_config(head_dir)
    if target_config is not None and head_config is not None:
        check_configs(head_config, target_config, f"drafter {drafter}")


def load_head(path_or_id: str | Path, target=None, bits: int | None = None, allow_download: bool = True):
    """Load, check strictly, pair with `target` (when given), cast to its dtype, optionally quantise."""
    path = resolve_path(path_or_id, allow_download)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DrafterLoadError(f"could not read {path / 'config.json'}: {e}") from None
    kind = kind_of(config)
    if target is not None:
        check_configs(config, target.config, f"drafter {path_or_id}")
    cfg = parse_config(config, kind)
    for line in published_mismatches(str(path_or_id), config):  # loads anyway: the pairing check decides
        logging.getLogger("engine").warning("drafter config differs from the registry: %s", line)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterLoadError(f"no .safetensors files in {path}")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    for name in ("predecessor_codebook", "successor_codebook"):  # DFlash 2 names them bare
        if f"candidate_selector.{name}" in weights:
            weights[f"candidate_selector.{name}.weight"] = weights.pop(f"candidate_selector.{name}")
    own = {n.split(".")[0] for n in weights if n in OPTIONAL_DSPARK and kind == "dspark"}
    if "d2t" in weights:
        cfg.draft_vocab_size = int(weights["d2t"].shape[0])
    # The fc input width says which target hidden size the head was trained on; the pairing
    # check below compares it with this target's (a clearer error than a shape mismatch).
    fc = weights.get("fc.weight")
    n_taps = len(cfg.target_layer_ids)
    target_hidden = fc.shape[-1] // n_taps if fc is not None and fc.shape[-1] % n_taps == 0 else None
    head = build_head(cfg, kind, target_hidden, own)
    check_weights(head, weights)
    head.load_weights([(n, w) for n, w in weights.items() if n in dict(tree_flatten(head.parameters()))])
    if target is not None:
        check_pairing(head, target)
        dtype = getattr(mx, target.dtype, None)
        if isinstance(dtype, mx.Dtype):
            _cast_floats(head, dtype)
    if bits:
        quantize_head(head, bits)
    mx.eval(head.parameters())
    head.eval()
    head.source = str(path_or_id)
    return head


def _cast_floats(head: nn.Module, dtype: mx.Dtype) -> None:
    head.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, head.parameters()))


def quantize_head(head: nn.Module, bits: int, group_size: int = 64) -> None:
    """Quantise the backbone's linear layers (where the bulk of the bytes is); the small
    Markov/confidence heads stay in float (small, and read one row per draft step)."""
    if bits not in (2, 3, 4, 6, 8):
        raise DrafterLoadError(f"drafter quantisation supports 2, 3, 4, 6 or 8 bits, not {bits}")

    def pick(path: str, module: nn.Module) -> bool:
        return (
            isinstance(module, nn.Linear)
            and (path.startswith("layers.") or path == "fc")
            and module.weight.shape[-1] % group_size == 0
        )

    nn.quantize(head, group_size=group_size, bits=bits, class_predicate=pick)
