"""What a sequence keeps: per-layer caches and how each takes back a draft, recurrent-state capture, KV segments, the batched store, the prefix cache and its disk tier."""
