"""One model over several processes: mlx-lm's own sharding, by pipeline or by tensor.

`pipeline`: each rank holds a run of layers (mlx-lm's `model.model.pipeline(group)`; the last
layers, the norm and the head on rank 0) and passes the hidden state on inside the forward.
`tensor`: each rank holds a slice of every attention and MLP matmul (mlx-lm's
`model.shard(group)`) and the slices are summed inside each layer. Either way every rank
calls the same forward with the same tokens and its own cache, and gets the same logits.
"""

from __future__ import annotations

import zlib
from typing import Any

import mlx.nn as nn

from engine.base.errors import ModelLoadError
from engine.base.ranks import Ranks

SPLITS = ("pipeline", "tensor")


def _inner(model: nn.Module) -> Any:
    """The decoder stack that holds the layers (a VLM's text model keeps it one level down)."""
    text = model.language_model if "language_model" in model else model
    return getattr(text, "model", None)


def splits_for(model: nn.Module) -> tuple[str, ...]:
    """The ways mlx-lm can split this model: "tensor" where it has `shard`, "pipeline" where its
    layers can be pipelined."""
    found = []
    if hasattr(model, "shard"):
        found.append("tensor")
    if hasattr(_inner(model), "pipeline"):
        found.append("pipeline")
    return tuple(found)


def default_split(model: nn.Module) -> str | None:
    """mlx-lm's own pick (sharded_load): tensor where the model has it, else pipeline."""
    found = splits_for(model)
    return found[0] if found else None


def split_model(model: nn.Module, config: dict, split: str | None, ranks: Ranks) -> str | None:
    """Keep this rank's part of a lazily loaded model (before its weights are read); returns the
    split used (None on one process). `split` None: mlx-lm's default."""
    if not ranks.split:
        return None
    kind = split or default_split(model)
    family = type(model).__module__.rsplit(".", 1)[-1]
    if kind not in splits_for(model):
        can = ", ".join(splits_for(model)) or "neither"
        raise ModelLoadError(f"mlx-lm can't split a {family} model by {kind or 'pipeline or tensor'} (it can: {can})")
    if kind == "tensor":
        heads = {k: config.get(k) for k in ("num_attention_heads", "num_key_value_heads")}
        uneven = {k: v for k, v in heads.items() if isinstance(v, int) and v % ranks.size}
        if uneven:
            raise ModelLoadError(f"a tensor split over {ranks.size} ranks needs head counts they divide: {uneven}")
        model.shard(ranks.group)
    else:
        layers = len(_inner(model).layers)
        if layers < ranks.size:
            raise ModelLoadError(f"a {layers}-layer model can't be pipelined over {ranks.size} ranks")
        _inner(model).pipeline(ranks.group)
    return kind


def check_parts_agree(target: Any) -> None:
    """Every rank's part of the cache must be of the same kinds: whether a draft can be taken
    back, and how (a replay is a forward every rank must join), is decided on each rank from
    its own layers. A pipeline that puts recurrent layers on some ranks only can't agree."""
    kinds = sorted({type(c).__name__ for c in target.make_cache()})
    signature = zlib.crc32(",".join(kinds).encode()) & 0x7FFFFFFF  # an int32
    if len(set(target.ranks.gather(signature))) > 1:
        raise ModelLoadError(f"this {target.split} split gives the ranks different layer kinds (rank "
                             f"{target.ranks.rank}: {', '.join(kinds)}): split by tensor, or over fewer ranks")
