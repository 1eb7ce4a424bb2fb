"""The disk tier's background writer: prefix-cache files written as segments are made.

The engine thread hands over a file's arrays (already evaluated: the writer never runs
MLX) and goes on; writer threads take them in order (several where the machine has the
cores: a file's CRC, write and fsync each wait on one thing, and a fast disk takes several
at once). Each file is written to a temp name, fsync'd, renamed to its final name (which
carries the digest of its bytes: `FileDigest`, a CRC-32 per 8 MiB chunk, so a restore checks
the chunks on several threads) and the folder fsync'd, so a file either is whole under its
final name or is not there.
A process killed at any moment loses only what was still queued; a torn temp file is
never read (kv_disk skips it, and any file whose digest does not match).

The engine holds the writers while a request waits for its first token (`DiskWriter.hold`):
they pause between pieces of a file, for at most HOLD_MAX_S, so that a turn's time to first
token mostly does not pay for the previous turn's writes. On MLX CUDA a segment's host bytes live in
unified memory, and reading them faults its pages over from the GPU while the turn's forwards
run there.

The queue is bounded (bytes) and coalesced (one entry per file name: the same segment
queued twice is written once). When full, new files are refused (they stay in RAM and
are offered again on eviction or close). The first write that fails (full disk, read-only
folder, file-size limit) logs one warning and turns writing off; serving goes on.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from engine.base.files import fsync_dir

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BYTES = 1 << 30
HOLD_MAX_S = 2.0  # a hold longer than this lets the writers go on (a long prefill still writes ahead)
HOLD_GAP_S = 0.1  # a hold that comes back sooner after its lift goes on with the lifted one's clock
PIECE_BYTES = 4 << 20  # the writers look at the hold between pieces of this size


def default_writer_threads() -> int:
    """One writer per 4 cores, up to 4: a small machine keeps its cores for the model."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))

_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "uint32": "U32",
           "int64": "I64", "uint64": "U64", "int16": "I16", "uint16": "U16", "int8": "I8", "uint8": "U8",
           "bool": "BOOL", "float64": "F64"}


@dataclass
class FileJob:
    name: str  # the final file name in the writer's folder, less the digest and suffix
    tensors: list[tuple[str, str, tuple[int, ...], memoryview]]  # (name, safetensors dtype, shape, bytes)
    metadata: dict[str, str]
    on_written: Callable[[Path, str, int], None]  # (final path, digest, size), on the writer thread
    nbytes: int = 0


def host_tensor(name: str, a) -> tuple[str, str, tuple[int, ...], memoryview]:
    """An evaluated mx.array as bytes the writer can read without MLX (a view, no copy)."""
    import mlx.core as mx

    dtype = str(a.dtype).replace("mlx.core.", "")
    if dtype == "bfloat16":  # numpy has no bfloat16: the same bits as uint16
        a = a.view(mx.uint16)
        mx.eval(a)
    arr = np.asarray(a)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return name, _DTYPES[dtype], tuple(arr.shape), memoryview(arr).cast("B")


def safetensors_parts(tensors, metadata: dict[str, str]) -> list:
    """The byte runs of a safetensors file (header, then each tensor's data)."""
    header, offset = {"__metadata__": metadata}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as the format recommends
    return [struct.pack("<Q", len(raw)), raw, *(data for *_, data in tensors)]


DIGEST_CHUNK = 8 << 20


class FileDigest:
    """A file's digest: a CRC-32 of each DIGEST_CHUNK of its bytes (at fixed offsets), hashed with
    the size. It guards against torn and corrupt files (not forgers: they could name a file too),
    and its chunks can be checked independently, on as many threads as a restore reads with."""

    def __init__(self):
        self.crcs: list[int] = []
        self.crc = self.filled = self.size = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, DIGEST_CHUNK - self.filled)
            self.crc = zlib.crc32(view[:take], self.crc)
            self.filled += take
            self.size += take
            view = view[take:]
            if self.filled == DIGEST_CHUNK:
                self.crcs.append(self.crc)
                self.crc = self.filled = 0

    def hexdigest(self) -> str:
        return digest_of(self.crcs + ([self.crc] if self.filled else []), self.size)


def digest_of(chunk_crcs: list[int], size: int) -> str:
    """The digest from each chunk's CRC-32 (in file order) and the file's size."""
    raw = struct.pack(f"<Q{len(chunk_crcs)}I", size, *chunk_crcs)
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def write_atomic(folder: Path, name: str, parts: Iterable, suffix: str) -> tuple[Path, str, int]:
    """Write parts to <folder>/<name>_<digest><suffix> durably; returns (path, digest, size)."""
    tmp = folder / f".tmp-{uuid.uuid4().hex}{suffix}"
    h = FileDigest()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
                h.update(part)
            f.flush()
            os.fsync(f.fileno())
        digest = h.hexdigest()
        final = folder / f"{name}_{digest}{suffix}"
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(folder)
    return final, digest, h.size


class DiskWriter:
    def __init__(self, folder: Path, suffix: str, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 threads: int | None = None):
        self.folder, self.suffix = folder, suffix
        self.max_pending_bytes = max_pending_bytes
        self.pending: collections.OrderedDict[str, FileJob] = collections.OrderedDict()
        self.pending_bytes = 0
        self.busy = 0  # jobs being written
        self.failed: str | None = None  # why writing is off
        self.written = self.refused = 0
        self._cv = threading.Condition()
        self._stop = False
        self._held_since: float | None = None  # when the engine's hold began (None: not held)
        self._last_hold = (0.0, float("-inf"))  # (start, lift) of the last hold lifted
        self._flushing = 0  # callers waiting in flush: the writers ignore the hold for them
        for i in range(threads or default_writer_threads()):
            threading.Thread(target=self._run, name=f"mlx-dspark-kv-writer-{i}", daemon=True).start()

    def submit(self, job: FileJob) -> bool:
        """Queue a file; False when it can't be (writing off, queue full)."""
        job.nbytes = sum(t[3].nbytes for t in job.tensors)
        with self._cv:
            if self.failed or self._stop:
                return False
            if job.name in self.pending:
                return True
            if self.pending and self.pending_bytes + job.nbytes > self.max_pending_bytes:
                self.refused += 1
                return False
            self.pending[job.name] = job
            self.pending_bytes += job.nbytes
            self._cv.notify_all()
        return True

    def hold(self, held: bool) -> None:
        """Pause the writers between pieces while `held`, for at most HOLD_MAX_S; a flush or close
        goes ahead regardless. Holds less than HOLD_GAP_S apart count as one: under steady traffic
        (one request admitted as the last one ends) the writers still go on after HOLD_MAX_S."""
        with self._cv:
            now = time.monotonic()
            if not held:
                if self._held_since is not None:
                    self._last_hold = (self._held_since, now)
                    self._held_since = None
                    self._cv.notify_all()
            elif self._held_since is None:
                start, lifted = self._last_hold
                self._held_since = start if now - lifted < HOLD_GAP_S else now

    @property
    def held(self) -> bool:
        return self._held_since is not None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is written (or writing is off); False on timeout."""
        with self._cv:
            self._flushing += 1
            self._cv.notify_all()
            try:
                return self._cv.wait_for(lambda: not (self.pending or self.busy) or self.failed is not None, timeout)
            finally:
                self._flushing -= 1

    def close(self, timeout: float | None = 60.0) -> bool:
        done = self.flush(timeout)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        return done

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self.pending or self._stop)
                if not self.pending:
                    return
                _, job = self.pending.popitem(last=False)
                self.pending_bytes -= job.nbytes
                self.busy += 1
            try:
                parts = self._paced(safetensors_parts(job.tensors, job.metadata))
                path, digest, size = write_atomic(self.folder, job.name, parts, self.suffix)
                job.on_written(path, digest, size)
                ok = True
            except Exception as err:  # a full disk, a read-only folder, a size limit: serving goes on
                ok = False
                self._turn_off(err)
            with self._cv:
                self.busy -= 1
                if ok:
                    self.written += 1
                self._cv.notify_all()

    def _paced(self, parts: list) -> Iterator[memoryview]:
        """A file's bytes in pieces of at most PIECE_BYTES, each given once the hold allows."""
        for part in parts:
            view = memoryview(part).cast("B")
            for at in range(0, max(view.nbytes, 1), PIECE_BYTES):
                self._wait_while_held()
                yield view[at : at + PIECE_BYTES]

    def _wait_while_held(self) -> None:
        with self._cv:
            while self._held_since is not None and not (self._flushing or self._stop):
                left = self._held_since + HOLD_MAX_S - time.monotonic()
                if left <= 0:
                    return
                self._cv.wait(left)

    def _turn_off(self, err: Exception) -> None:
        with self._cv:
            first = self.failed is None
            self.failed = str(err) or type(err).__name__
            dropped = len(self.pending)
            self.pending.clear()
            self.pending_bytes = 0
        if first:
            log.warning("prefix cache: writing to %s failed (%s); the disk tier is off for this run "
                        "(%d queued files dropped), serving goes on from RAM", self.folder, err, dropped)
