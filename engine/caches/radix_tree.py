"""A radix tree over token ids whose edges carry payloads (KV segments in the prefix cache).

Each node's edge holds `tokens` and a payload covering exactly those tokens; branches
share the nodes of their common prefix. The tree knows payloads only through two
functions: `cut(payload, start, end)` and `size(payload)` (bytes), so it can be tested
with plain lists. Every node also knows the hash of all tokens from the root to its
end (seeded with the model identity): the disk tier's keys.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any, Callable, Iterator


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (list comparisons run in C: an agent's edges are long)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def token_bytes(tokens: list[int]) -> bytes:
    return array("q", tokens).tobytes()


class Node:
    __slots__ = ("tokens", "payload", "children", "parent", "last_used", "hasher", "on_disk", "nbytes")

    def __init__(self, tokens: list[int], payload: Any, parent: "Node | None", hasher, nbytes: int = 0):
        self.tokens = tokens
        self.payload = payload
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.last_used = 0
        self.hasher = hasher  # sha256 state after every token from the root to this node's end
        self.on_disk = False  # a disk file holds exactly this edge, keyed by the parent's hash
        self.nbytes = nbytes

    @property
    def key(self) -> str:
        return self.hasher.hexdigest()

    def is_leaf(self) -> bool:
        return not self.children


class RadixTree:
    def __init__(self, cut: Callable[[Any, int, int], Any], size: Callable[[Any], int], seed: bytes = b""):
        self.cut, self.size = cut, size
        h = hashlib.sha256()
        h.update(seed)
        self.root = Node([], None, None, h)
        self.clock = 0
        self.nbytes = 0
        self.n_tokens = 0
        self.n_nodes = 0

    def _hasher_after(self, parent: Node, tokens: list[int]):
        h = parent.hasher.copy()
        h.update(token_bytes(tokens))
        return h

    def match(self, tokens: list[int], start: Node | None = None) -> list[tuple[Node, int]]:
        """The longest cached prefix of tokens: [(node, tokens used of its edge)], root excluded;
        only the last node can be used partially (the prompt diverges inside its edge)."""
        node, pos, path = start or self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            edge = child.tokens
            k = common_prefix(edge, tokens[pos : pos + len(edge)])
            path.append((child, k))
            if k < len(edge):
                break
            node, pos = child, pos + k
        return path

    def split(self, node: Node, k: int) -> Node:
        """Cut node's edge after k tokens; returns the new upper node (node keeps the rest)."""
        parent = node.parent
        upper = Node(node.tokens[:k], self.cut(node.payload, 0, k), parent, self._hasher_after(parent, node.tokens[:k]))
        lower_payload = self.cut(node.payload, k, len(node.tokens))
        self.nbytes -= node.nbytes
        upper.nbytes = self.size(upper.payload)
        node.payload, node.tokens, node.parent = lower_payload, node.tokens[k:], upper
        node.nbytes = self.size(lower_payload)
        # The old file (if any) stays valid under the old key and holds the upper part (a partial
        # match reads it); the lower part's key changed.
        upper.on_disk, node.on_disk = node.on_disk, False
        self.nbytes += upper.nbytes + node.nbytes
        upper.last_used = node.last_used
        upper.children[node.tokens[0]] = node
        parent.children[upper.tokens[0]] = upper
        self.n_nodes += 1
        return upper

    def insert(self, tokens: list[int], payload_for: Callable[[int, int], Any], start: Node | None = None) -> list[Node]:
        """Make tokens a path from `start` (root by default); payload_for(a, b) gives the payload of
        tokens[a:b] for the part not cached yet. Returns the path's nodes."""
        node, pos, nodes = start or self.root, 0, []
        while pos < len(tokens):
            path = self.match(tokens[pos:], node)
            if not path:
                break
            child, k = path[0]
            if k < len(child.tokens):
                if pos + k == len(tokens):  # ends inside a cached edge: nothing new
                    nodes.append(child)
                    pos += k
                    break
                child = self.split(child, k)
            nodes.append(child)
            node, pos = child, pos + k
        if pos < len(tokens):
            leaf = self.add_child(node, tokens[pos:], payload_for(pos, len(tokens)))
            nodes.append(leaf)
        self.touch(nodes)
        return nodes

    def add_child(self, parent: Node, tokens: list[int], payload: Any) -> Node:
        leaf = Node(list(tokens), payload, parent, self._hasher_after(parent, tokens), self.size(payload))
        parent.children[tokens[0]] = leaf
        self.nbytes += leaf.nbytes
        self.n_tokens += len(tokens)
        self.n_nodes += 1
        return leaf

    def remove_leaf(self, node: Node) -> None:
        assert node.is_leaf() and node is not self.root
        del node.parent.children[node.tokens[0]]
        self.nbytes -= node.nbytes
        self.n_tokens -= len(node.tokens)
        self.n_nodes -= 1
        node.payload = None

    def touch(self, nodes) -> None:
        self.clock += 1
        for n in nodes:
            n.last_used = self.clock

    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def lru_leaf(self, pinned: set = frozenset()) -> Node | None:
        """The least recently used leaf not in `pinned` (what the running request uses)."""
        best = None
        for n in self.nodes():
            if n.is_leaf() and n not in pinned and (best is None or n.last_used < best.last_used):
                best = n
        return best
