"""KV segments: slices of an mlx-lm cache along the token axis, and caches rebuilt from them.

A segment is one list per layer of arrays whose axis 2 is the token axis:
[keys, values] for KVCache, the six quantised parts (data, scales, biases of keys
then of values) for QuantizedKVCache: each kind's own answer (engine/caches/kinds.py).
Segments of consecutive token ranges concatenate into the cache of the whole range.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from engine.caches.kinds import kind_of, leaves

SEQ_AXIS = 2
KV_BITS = (4, 8)


def kv_group_size(config: dict) -> int:
    """The quantisation group for KV: it must divide the head dimension."""
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or (config.get("hidden_size", 64) // heads)
    for g in (64, 32):
        if head_dim % g == 0:
            return g
    raise ValueError(f"--kv-bits needs a head dimension divisible by 32 (this model's is {head_dim})")


def fresh_cache(target, kv_bits: int | None = None) -> list:
    """An empty cache for the target; plain KV layers quantised from the start when kv_bits is set
    (quantising per token, as QuantizedKVCache does, gives the same values however tokens are chunked)."""
    cache = target.make_cache()
    if kv_bits:
        group = kv_group_size(target.config)
        cache = [QuantizedKVCache(group_size=group, bits=kv_bits) if kind_of(c).plain_kv else c for c in cache]
    return cache


def cache_offset(cache: list) -> int | None:
    """Tokens the cache holds, from the first layer that counts them."""
    for c in leaves(cache):
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            return offset
    return None


def segment_layers(cache: list) -> list:
    """The layers that keep per-token segments (plain and quantised attention), CacheList parts included."""
    return [c for c in leaves(cache) if kind_of(c).segments]


def state_layers(cache: list) -> list:
    """The layers reused only whole (recurrent state, sliding windows)."""
    return [c for c in leaves(cache) if not kind_of(c).segments]


def slice_segment(cache: list, start: int, end: int) -> list[list[mx.array]]:
    """Copies (not views: a view would pin the whole cache buffer) of tokens [start, end)."""
    seg = [[mx.contiguous(a[..., start:end, :]) for a in kind_of(c).segment_arrays(c)] for c in cache]
    mx.eval(seg)
    return seg


def cut_segment(seg: list[list[mx.array]], start: int, end: int) -> list[list[mx.array]]:
    out = [[mx.contiguous(a[..., start:end, :]) for a in layer] for layer in seg]
    mx.eval(out)
    return out


def segment_tokens(seg: list[list[mx.array]]) -> int:
    return seg[0][0].shape[SEQ_AXIS] if seg and seg[0] else 0


def segment_nbytes(seg: list[list[mx.array]]) -> int:
    return sum(a.nbytes for layer in seg for a in layer)


def build_cache(cache: list, parts: list[list[list[mx.array]]]) -> list:
    """Fill the empty `cache` with the concatenation of `parts` (consecutive segments).

    Always new array objects: mlx-lm's caches write into their arrays in place, which
    must never reach the segments the prefix tree keeps."""
    n = sum(segment_tokens(p) for p in parts)
    for i, c in enumerate(cache):
        arrays = [mx.concatenate([p[i][j] for p in parts], axis=SEQ_AXIS) for j in range(len(parts[0][i]))]
        kind_of(c).fill(c, arrays, n)
    mx.eval([kind_of(c).segment_arrays(c) for c in cache])
    return cache


def segment_signature(seg: list[list[mx.array]]) -> list[list[tuple]]:
    """Dtype and shape (token axis left out) of each array: what every segment of a model shares."""
    return [[(a.dtype, a.shape[:SEQ_AXIS], a.shape[SEQ_AXIS + 1 :]) for a in layer] for layer in seg]


def check_segment(seg: list[list[mx.array]], signature: list[list[tuple]] | None, n_tokens: int) -> None:
    """Raise ValueError unless `seg` holds n_tokens per array and matches `signature` (when known)."""
    for layer in seg:
        for a in layer:
            if a.ndim != 4 or a.shape[SEQ_AXIS] != n_tokens:
                raise ValueError(f"array of shape {a.shape} for a segment of {n_tokens} tokens")
    if signature is not None and segment_signature(seg) != signature:
        raise ValueError("array layout, dtype or shape differs from this model's")
