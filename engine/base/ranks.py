"""The processes one model is split over (MLX distributed), and the one way they agree.

Under `mlx.launch` (or any launcher that sets MLX's distributed environment) every rank runs
the same engine on its part of the model (engine/model/split.py). Rank 0, the leader, alone
hears the outside world: requests, cancellations, calls, the clock. What it decides or
measures reaches the others through `share`, so every rank's engine takes the same steps and
runs the same forwards, and the activations cross between ranks inside those forwards, by
MLX's own collectives. One process is a group of one: `share` returns its argument and costs
nothing.

Only the engine thread's steps are taken by every rank, so only there do `share` and `gather`
cross ranks (`in_step`): elsewhere (a request thread, a read the leader runs alone) they are a
group of one, and a measurement read there is this rank's own.
"""

from __future__ import annotations

import contextlib
import pickle
import struct
import sys
import threading
import zlib
from functools import lru_cache
from typing import Any

import mlx.core as mx

# A shared object up to this size crosses in one collective (a scheduler tick's usual news
# fits); a bigger one takes a second.
INLINE_BYTES = 1024
_HEADER = struct.Struct("<II")  # the pickle's length, a CRC of where `share` was called
_thread = threading.local()  # .in_step: this thread takes the steps every rank takes


@contextlib.contextmanager
def in_step(on: bool = True):
    """Within: this thread's `share` and `gather` cross ranks (the engine thread's steps);
    `in_step(False)`: not (what the leader runs alone)."""
    was = getattr(_thread, "in_step", False)
    _thread.in_step = on
    try:
        yield
    finally:
        _thread.in_step = was


class OutOfStepError(RuntimeError):
    """The ranks reached different collectives: a step taken on one rank and not another (a bug
    in what decides the steps, not a fault of the link)."""


# How MLX's backends say a peer went away mid-collective (the ring's words; MPI aborts the
# process instead): a lost rank, wherever the leader noticed it, in `share` or in a forward.
_LINK_LOST = ("connection to a peer was lost",)


def link_lost(error: BaseException) -> bool:
    """Did this collective fail because another rank is gone (not because of this rank's step)?"""
    return any(words in str(error) for words in _LINK_LOST)


def _call_site(depth: int = 3) -> str:
    """Where `share` was called from (a few frames, names and lines): the same on every rank
    that takes the same steps."""
    frame, parts = sys._getframe(2), []
    while frame is not None and len(parts) < depth:
        parts.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return "<".join(parts)


def _crc(site: str) -> int:
    return zlib.crc32(site.encode())


class Ranks:
    """This process's place in the group of processes that hold one model."""

    def __init__(self, group: Any = None):
        self.group = group if group is not None and group.size() > 1 else None
        self.rank = self.group.rank() if self.group is not None else 0
        self.size = self.group.size() if self.group is not None else 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def split(self) -> bool:
        return self.size > 1

    @property
    def crossing(self) -> bool:
        """Do this thread's collectives reach the other ranks now (a split model, in step)?"""
        return self.split and getattr(_thread, "in_step", False)

    def share(self, obj: Any) -> Any:
        """The leader's `obj`, on every rank (the others' argument is ignored; pass None). The
        header carries where the leader called from: a rank that called from elsewhere is out
        of step, and says so before it reads any further."""
        if not self.crossing:
            return obj
        site = _call_site()
        data = pickle.dumps(obj) if self.leader else b""
        head = _HEADER.pack(len(data), _crc(site)) + data[: INLINE_BYTES - _HEADER.size] if self.leader else b""
        first = self._sum_bytes(head, INLINE_BYTES)
        n, leader_site = _HEADER.unpack(first[: _HEADER.size])
        if leader_site != _crc(site):  # the leader was at another share, or in another collective
            raise OutOfStepError(f"ranks out of step: rank {self.rank} shared at {site}, rank 0 elsewhere")
        body = first[_HEADER.size : _HEADER.size + n]
        if len(body) < n:
            body += self._sum_bytes(data[len(body) :], n - len(body))
        return obj if self.leader else pickle.loads(body)

    def gather(self, value: int) -> list[int]:
        """Every rank's `value`, in rank order."""
        if not self.crossing:
            return [int(value)]
        out = mx.distributed.all_gather(mx.array([int(value)], dtype=mx.int32), group=self.group)
        return [int(v) for v in out.tolist()]

    def _sum_bytes(self, data: bytes, size: int) -> bytes:
        """An all-sum of `size` bytes: the leader's data, zeros from everyone else."""
        buf = bytearray(size)
        buf[: len(data)] = data
        summed = mx.distributed.all_sum(mx.array(memoryview(buf), dtype=mx.uint8), group=self.group)
        return bytes(memoryview(summed.astype(mx.uint8)))

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, size={self.size})"


@lru_cache(maxsize=1)
def world() -> Ranks:
    """This process's group: every rank a launcher started, or a group of one."""
    if not mx.distributed.is_available():
        return Ranks()
    return Ranks(mx.distributed.init())


def share(obj: Any) -> Any:
    """The leader's `obj` on every rank of this process's group (engine/base/measurements.py)."""
    return world().share(obj)
