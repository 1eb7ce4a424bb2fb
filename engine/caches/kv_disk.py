"""The prefix cache's disk tier: KV segments as safetensors files that survive restarts.

A file holds one edge of the prefix tree: its tokens and per-layer KV arrays. Its name
carries the hash of every token before the edge (the parent's key), the hash through
its end, and a digest of the file's bytes:

    <dir>/<identity>/<parent key>_<end key>_<digest>.safetensors

Keys are seeded with the model identity (weights, config, dtype, KV bits, MLX
version), which also names the folder, so another model's files are never read.
A file that is truncated, corrupt or foreign is skipped with a warning and never
trusted: the digest is checked before anything is used. Writes go to a temp file
then os.replace; the size cap deletes the oldest files first (loads refresh mtime).
Writing happens on a background thread (kv_disk_writer.py) as segments are made; the
index is shared with it under a lock.

A restore reads at the disk's speed: each file is read once, straight into the arrays it
becomes (no second read, no parse pass, no copy), in 8 MiB chunks on several threads (the files of
one restore all in flight together), each chunk's CRC checked as it lands. The tier measures
its restore rate (bytes/s) and is told the model's prefill rate (tokens/s); both are kept in
rates.json beside the files, so the first request after a start can choose without measuring:
a file is read only where reading it is faster than computing its tokens (`worth_reading`).
The restore rate is a moving estimate (each restore's own rate blended in), and one that says
"compute" is re-probed (a file's first PROBE_BYTES read on a background thread, at most once per
REPROBE_S and once a start): a disk that was loaded when it was timed is not trusted forever.
"""

from __future__ import annotations

import array
import collections
import json
import logging
import math
import os
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.base.platform import on_cuda
from engine.caches.kv_disk_writer import DIGEST_CHUNK, DiskWriter, FileDigest, FileJob, digest_of, host_tensor

log = logging.getLogger(__name__)

FORMAT = "mlx-dspark-kv/1"
CHECKPOINT = "ckpt"  # the "parent" part of a whole-state checkpoint's file name
SUFFIX = ".safetensors"
KEY_CHARS = 32
STALE_TMP_S = 3600
READ_THREADS = max(2, min(8, os.cpu_count() or 2))
RATES_FILE = "rates.json"
MIN_RATE_SAMPLE_BYTES = 1 << 20  # smaller restores time the per-file overhead, not the disk
RATE_WEIGHT = 0.5  # of a new measurement against the kept rate
REPROBE_S = 300.0  # a declining restore rate is timed again at most this often
PROBE_BYTES = 32 << 20  # what a re-probe reads of one file
# what each safetensors dtype is read into (bfloat16 as its bits: numpy has no bfloat16)
_MX_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.uint16, "I32": mx.int32, "U32": mx.uint32,
              "I64": mx.int64, "U64": mx.uint64, "I16": mx.int16, "U16": mx.uint16, "I8": mx.int8,
              "U8": mx.uint8, "BOOL": mx.bool_}


def free_buffers_to_the_driver() -> None:
    """On MLX CUDA, freed buffers go back to the driver's pool, not to MLX's buffer cache.

    The tier reads arrays on the host and fills them there (np.asarray), and MLX CUDA moves such
    a buffer into unified memory for good; its buffer cache would then hand it out again as a
    device array, whose pages the GPU faults back in (one H100, long-session at the 8B shape:
    warm turns up to 2x slower, decode 35-55% slower). The driver's own pool (cudaMallocAsync)
    serves device arrays without that."""
    if on_cuda():
        mx.set_cache_limit(0)


@dataclass
class DiskEntry:
    path: Path
    parent: str
    end: str
    digest: str
    size: int
    tokens: array.array | None = None  # read lazily from the file (4 bytes a token)


def _digest(data: bytes) -> str:
    h = FileDigest()
    h.update(data)
    return h.hexdigest()


def read_into(fd: int, view: memoryview, offset: int) -> int:
    """Read from fd at offset into view (one call; may return fewer bytes): the disk tier's reader."""
    return os.preadv(fd, [view], offset)


def _read_exactly(reader, fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        got = reader(fd, view, offset)
        if got <= 0:
            raise ValueError("file shorter than its header says (truncated)")
        view, offset = view[got:], offset + got


@dataclass
class PendingRead:
    """One file being read: its header, the arrays its bytes land in, and each chunk's CRC to come."""
    entry: DiskEntry
    fd: int
    header: dict
    arrays: dict  # tensor name -> the MLX array its bytes are read into (bfloat16 as uint16), or a numpy one
    chunks: list  # futures of each DIGEST_CHUNK's CRC-32, in file order
    size: int


def _regions(header: dict, head: bytes, size: int) -> tuple[dict, list]:
    """Each tensor's MLX array (allocated, to be read into), and the file's byte runs in order as
    (offset, view): the header's bytes, then each array's memory, where its bytes land."""
    start = len(head)  # the 8-byte length and the header
    arrays, runs = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dtype = _MX_DTYPES[info["dtype"]]
        if not 0 <= a <= b <= size - start or b - a != math.prod(info["shape"]) * dtype.size:
            raise ValueError(f"{name}: shape and offsets disagree")  # checked before anything is allocated
        arrays[name] = mx.zeros(info["shape"], dtype)
        runs.append((start + a, name))
    mx.eval(list(arrays.values()))
    views = []
    for offset, name in sorted(runs):
        host = np.asarray(arrays[name])  # the array's own memory (unified on Apple silicon)
        if not (host.flags.writeable and host.flags.c_contiguous):  # a device without it: read, then copy
            host = arrays[name] = np.empty(host.shape, host.dtype)
        views.append((offset, memoryview(host.reshape(-1)).cast("B")))
    at = start
    for offset, view in views:  # our files are written densely: anything else isn't ours
        if offset != at:
            raise ValueError("tensors don't tile the file")
        at += view.nbytes
    if at != size:
        raise ValueError("file longer or shorter than its tensors")
    return arrays, [(0, memoryview(head))] + views


def _chunk_pieces(runs: list, size: int) -> list[list]:
    """The runs cut at DIGEST_CHUNK boundaries: for each chunk, its (offset, view, in memory) pieces."""
    chunks: list[list] = [[] for _ in range((size + DIGEST_CHUNK - 1) // DIGEST_CHUNK)]
    for i, (offset, view) in enumerate(runs):
        pos = 0
        while pos < view.nbytes:
            c = (offset + pos) // DIGEST_CHUNK
            take = min(view.nbytes - pos, (c + 1) * DIGEST_CHUNK - offset - pos)
            chunks[c].append((offset + pos, view[pos : pos + take], i == 0))
            pos += take
    return chunks


def read_tokens(path: Path) -> array.array:
    """The `tokens` tensor of a safetensors file, read without loading the KV arrays."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8 or n > 64 << 20:
            raise ValueError("header longer than the file")
        header = json.loads(f.read(n))
        info = header["tokens"]
        a, b = info["data_offsets"]
        if info["dtype"] != "I32" or not 0 <= a <= b or 8 + n + b > size:
            raise ValueError("bad tokens entry")
        f.seek(8 + n + a)
        raw = f.read(b - a)
    tokens = array.array("i")
    tokens.frombytes(raw)
    if len(tokens) != info["shape"][0]:
        raise ValueError("tokens shape mismatch")
    return tokens


def read_metadata(path: Path) -> dict:
    """The `__metadata__` of a safetensors file, read without its arrays."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8 or n > 64 << 20:
            raise ValueError("header longer than the file")
        return json.loads(f.read(n)).get("__metadata__", {})


def kept_rates(folder: str | os.PathLike) -> dict:
    """The rates a disk tier's folder (<root>/<identity>) keeps: restore bytes/s and prefill
    tokens/s, each None where not measured yet."""
    out = {"restore_bytes_per_s": None, "prefill_tokens_per_s": None}
    try:
        d = json.loads((Path(folder) / RATES_FILE).read_text())
        for k in out:
            if isinstance(d.get(k), (int, float)) and d[k] > 0:
                out[k] = float(d[k])
    except (OSError, ValueError, AttributeError):
        pass
    return out


def _common_prefix(cached: array.array, tokens: list[int]) -> int:
    """How many leading tokens agree (compared as arrays: no Python work a token)."""
    n = min(len(cached), len(tokens))
    if not n:
        return 0
    differ = np.frombuffer(cached, dtype=np.int32, count=n) != np.asarray(tokens[:n], dtype=np.int32)
    return int(differ.argmax()) if differ.any() else n


class DiskTier:
    def __init__(self, root: str | os.PathLike, identity: str, max_bytes: int):
        self.root = Path(root).expanduser()
        self.identity = identity
        self.dir = self.root / identity
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.index: dict[str, list[DiskEntry]] = {}
        self.by_end: dict[str, DiskEntry] = {}
        self.nbytes = 0
        self.writes = self.loads = self.skipped = self.deleted = 0
        self.lock = threading.RLock()  # the index is shared with the writer thread
        self._capping = threading.Lock()  # writer threads finish files at once: one cap pass at a time
        self.queued_parents: collections.defaultdict = collections.defaultdict(list)  # files queued: their tokens, by parent key
        self.reader = read_into  # (fd, view, offset) -> bytes read; tests slow it down
        self._pool: ThreadPoolExecutor | None = None
        self.restore_bytes_per_s, self.prefill_tokens_per_s = self._read_rates()
        self.restored_bytes, self.restore_seconds = 0, 0.0  # this process's restores
        self.declined_files = self.declined_tokens = 0  # faster computed than read
        self.probes = 0  # re-probes of a restore rate that said "compute"
        self._probe: threading.Thread | None = None
        self._probed_at: float | None = None  # monotonic; None: not in this process yet
        self._scan()
        self.writer = DiskWriter(self.dir, SUFFIX)
        free_buffers_to_the_driver()

    # -- the two rates a restore is chosen by ---------------------------------------------

    def _read_rates(self) -> tuple[float | None, float | None]:
        rates = kept_rates(self.dir)
        return rates["restore_bytes_per_s"], rates["prefill_tokens_per_s"]

    def _save_rates(self) -> None:
        tmp = self.dir / f".tmp-rates-{os.getpid()}.json"
        try:
            tmp.write_text(json.dumps({"restore_bytes_per_s": self.restore_bytes_per_s,
                                       "prefill_tokens_per_s": self.prefill_tokens_per_s}))
            os.replace(tmp, self.dir / RATES_FILE)
        except OSError:  # a read-only folder: the rates live in this process only
            pass

    @staticmethod
    def _blend(kept: float | None, new: float) -> float:
        return new if kept is None else (1 - RATE_WEIGHT) * kept + RATE_WEIGHT * new

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """The engine's measured prefill of `tokens` tokens (what a restore must beat)."""
        if tokens > 0 and seconds > 0:
            with self.lock:  # a probe's thread saves the rates too
                self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, tokens / seconds)
                self._save_rates()

    def _note_restore(self, nbytes: int, seconds: float) -> None:
        self.restored_bytes += nbytes
        self.restore_seconds += seconds
        self._note_read_rate(nbytes, seconds)

    def _note_read_rate(self, nbytes: int, seconds: float) -> None:
        """A restore's (or a probe's) bytes read in seconds, blended into the kept rate."""
        if nbytes >= MIN_RATE_SAMPLE_BYTES and seconds > 0:
            with self.lock:  # a probe's thread and the engine thread
                self.restore_bytes_per_s = self._blend(self.restore_bytes_per_s, nbytes / seconds)
                self._save_rates()

    def worth_reading(self, e: DiskEntry, tokens: int) -> bool:
        """Is reading file `e` faster than computing its `tokens`? Yes while either rate is unknown
        (a restore measures the disk; on most machines reading wins by far). A "no" sends the disk
        to be timed again in the background (`_probe_later`): the next request knows."""
        if self.restore_bytes_per_s is None or self.prefill_tokens_per_s is None:
            return True
        if e.size / self.restore_bytes_per_s <= tokens / self.prefill_tokens_per_s:
            return True
        self.declined_files += 1
        self.declined_tokens += tokens
        self._probe_later(e)
        return False

    def _probe_later(self, e: DiskEntry) -> None:
        now = time.monotonic()
        if self._probe is not None and self._probe.is_alive():
            return
        if self._probed_at is not None and now - self._probed_at < REPROBE_S:
            return
        self._probed_at = now
        self.probes += 1
        self._probe = threading.Thread(target=self._time_read, args=(e.path,), name="mlx-dspark-kv-probe",
                                       daemon=True)
        self._probe.start()

    def _time_read(self, path: Path) -> None:
        """Read the first PROBE_BYTES of a file as a restore reads (the tier's reader, chunks on the
        reading threads, CRCs), and blend the rate in (on the probe's own thread)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return  # gone (the cap, a clear): the next decline probes another
        try:
            size = min(os.fstat(fd).st_size, PROBE_BYTES)
            view = memoryview(bytearray(size))
            t0 = time.perf_counter()
            pool = self._reading_pool()
            chunks = [pool.submit(self._read_chunk, fd, [(at, view[at : at + DIGEST_CHUNK], False)])
                      for at in range(0, size, DIGEST_CHUNK)]
            for c in chunks:
                c.result()
            self._note_read_rate(size, time.perf_counter() - t0)
        except (OSError, ValueError) as err:  # truncated under us: a restore would skip it
            log.debug("prefix cache: re-probe of %s failed (%s)", path, err)
        finally:
            os.close(fd)

    def wait_probe(self, timeout: float | None = None) -> None:
        """Wait for a re-probe under way (tests; close)."""
        if self._probe is not None:
            self._probe.join(timeout)

    def _reading_pool(self) -> ThreadPoolExecutor:
        with self.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="mlx-dspark-kv-reader")
            return self._pool

    # -- index ----------------------------------------------------------------------

    def _scan(self) -> None:
        now = time.time()
        for p in self.dir.iterdir():
            name = p.name
            if name.startswith(".tmp-"):
                try:  # left by a crash mid-write; young ones may belong to a live writer
                    if now - p.stat().st_mtime > STALE_TMP_S:
                        p.unlink()
                except OSError:
                    pass
                continue
            parts = name[: -len(SUFFIX)].split("_") if name.endswith(SUFFIX) else []
            if len(parts) != 3:
                continue
            try:
                size = p.stat().st_size
            except OSError:
                continue
            self._add(DiskEntry(p, parts[0], parts[1], parts[2], size))

    def _add(self, e: DiskEntry) -> None:
        with self.lock:
            self._add_locked(e)

    def _add_locked(self, e: DiskEntry) -> None:
        self.index.setdefault(e.parent, []).append(e)
        self.by_end[e.end] = e
        self.nbytes += e.size

    def _drop(self, e: DiskEntry, unlink: bool) -> None:
        with self.lock:
            self._drop_locked(e)
        if unlink:
            try:
                e.path.unlink()
            except OSError:
                pass

    def _drop_locked(self, e: DiskEntry) -> None:
        entries = self.index.get(e.parent, [])
        if e in entries:
            entries.remove(e)
            if not entries:
                del self.index[e.parent]
            self.nbytes -= e.size
        if self.by_end.get(e.end) is e:
            del self.by_end[e.end]

    def skip(self, e: DiskEntry, why: str) -> None:
        """Never trust this file again (unreadable, corrupt, or not this model's layout): a warning,
        and it is deleted."""
        log.warning("prefix cache: skipping %s: %s", e.path, why)
        self.skipped += 1
        self._drop(e, unlink=True)  # in our own identity's folder: useless to anyone

    def delete_all(self) -> None:
        """Delete every file of this identity (the prefix cache's clear)."""
        with self.lock:
            entries = list(self.by_end.values())
        for e in entries:
            self._drop(e, unlink=True)

    @property
    def files(self) -> int:
        return len(self.by_end)

    # -- reading --------------------------------------------------------------------

    def best(self, parent_key: str, tokens: list[int], exclude: set, beyond: int = 0) -> tuple[DiskEntry, int] | None:
        """The file continuing `parent_key` that matches most of `tokens`, and how many it matches.
        A file still being written is waited for only if it matches more than `beyond` tokens (what
        the caller holds already): a turn that left the reply just queued (in RAM too) goes on."""
        parent = parent_key[:KEY_CHARS]
        with self.lock:
            queued = list(self.queued_parents.get(parent, ()))
        if any(_common_prefix(q, tokens) > beyond for q in queued):
            self.writer.flush(timeout=30)
        best = None
        with self.lock:
            entries = list(self.index.get(parent, ()))
        for e in entries:
            if e.path in exclude:
                continue
            if e.tokens is None:
                try:
                    e.tokens = read_tokens(e.path)
                except Exception as err:  # truncated or not ours: never trusted
                    self.skip(e, f"unreadable header ({err})")
                    continue
            k = _common_prefix(e.tokens, tokens)
            if k and (best is None or k > best[1]):
                best = (e, k)
        return best

    def load(self, e: DiskEntry) -> tuple[list[int], list[list[mx.array]]] | None:
        """(tokens, segment) from a file, or None (with a warning) if it can't be trusted."""
        return self.load_many([e])[0]

    def load_many(self, entries: list[DiskEntry]) -> list[tuple[list[int], list[list[mx.array]]] | None]:
        """Each file's (tokens, segment), or None (with a warning) for one that can't be trusted;
        all of them read at once, on the tier's reading threads."""
        t0 = time.perf_counter()
        pending = [self._start_read(e) for e in entries]
        out = [self._finish_read(p) if p is not None else None for p in pending]
        nbytes = sum(p.size for p, got in zip(pending, out) if got is not None)
        self._note_restore(nbytes, time.perf_counter() - t0)
        return out

    def _start_read(self, e: DiskEntry) -> PendingRead | None:
        """Open a file, parse its header, and queue its chunks' reads (straight into its arrays)."""
        try:
            fd = os.open(e.path, os.O_RDONLY)
        except OSError as err:
            self.skip(e, str(err))
            return None
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                raise ValueError("file shorter than a header")
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            if n > size - 8 or n > 64 << 20:
                raise ValueError("header longer than the file")
            head = os.pread(fd, 8, 0) + os.pread(fd, n, 8)
            header = json.loads(head[8:])
            arrays, runs = _regions(header, head, size)
        except Exception as err:  # noqa: BLE001 -- truncated, corrupt or not ours: never trusted
            os.close(fd)
            self.skip(e, f"unreadable header ({err})")
            return None
        pool = self._reading_pool()
        chunks = [pool.submit(self._read_chunk, fd, pieces) for pieces in _chunk_pieces(runs, size)]
        return PendingRead(e, fd, header, arrays, chunks, size)

    def _read_chunk(self, fd: int, pieces: list) -> int:
        """Read one chunk's pieces into their arrays; its CRC-32 (on a reading thread)."""
        crc = 0
        for offset, view, in_memory in pieces:
            if not in_memory:
                _read_exactly(self.reader, fd, view, offset)
            crc = zlib.crc32(view, crc)
        return crc

    def _finish_read(self, p: PendingRead) -> tuple[list[int], list[list[mx.array]]] | None:
        e = p.entry
        try:
            crcs = [c.result() for c in p.chunks]
            if digest_of(crcs, p.size) != e.digest:
                raise ValueError("content digest mismatch (truncated or corrupt)")
            meta = p.header.get("__metadata__", {})
            if meta.get("format") != FORMAT or meta.get("identity") != self.identity:
                raise ValueError(f"written by another model or version ({meta.get('identity')})")
            if meta.get("parent", "")[:KEY_CHARS] != e.parent or meta.get("end", "")[:KEY_CHARS] != e.end:
                raise ValueError("keys don't match the file name")
            arrays = {name: a if isinstance(a, mx.array) else mx.array(a) for name, a in p.arrays.items()}
            tokens = np.asarray(arrays.pop("tokens")).tolist()
            n_layers, per_layer = int(meta["layers"]), int(meta["arrays"])
            if len(arrays) != n_layers * per_layer:
                raise ValueError("unexpected arrays")
            bf16 = {name for name, info in p.header.items() if isinstance(info, dict) and info.get("dtype") == "BF16"}
            segment = [[arrays[f"l{i}.{j}"].view(mx.bfloat16) if f"l{i}.{j}" in bf16 else arrays[f"l{i}.{j}"]
                        for j in range(per_layer)] for i in range(n_layers)]
            mx.eval(segment)
        except Exception as err:  # noqa: BLE001 -- a torn or foreign file is skipped, never trusted
            self.skip(e, str(err))
            return None
        finally:
            for c in p.chunks:  # every read done before the descriptor goes
                c.exception()
            os.close(p.fd)
        e.tokens = array.array("i", tokens)
        self.loads += 1
        try:
            os.utime(e.path)  # recently used: last to go under the cap
        except OSError:
            pass
        return tokens, segment

    # -- writing --------------------------------------------------------------------

    def write(self, parent_key: str, end_key: str, tokens: list[int], segment: list[list[mx.array]]) -> bool:
        """Queue a segment's file for the background writer; False if it can't be queued."""
        parent, end = parent_key[:KEY_CHARS], end_key[:KEY_CHARS]
        if end in self.by_end:
            return True
        tok = mx.array(tokens, dtype=mx.int32)
        mx.eval(tok)
        tensors = [host_tensor("tokens", tok)]
        for i, layer in enumerate(segment):
            for j, a in enumerate(layer):
                tensors.append(host_tensor(f"l{i}.{j}", a))
        meta = {"format": FORMAT, "identity": self.identity, "parent": parent, "end": end,
                "layers": str(len(segment)), "arrays": str(len(segment[0]) if segment else 0)}
        token_array = array.array("i", tokens)

        def written(path: Path, digest: str, size: int) -> None:  # on the writer thread
            with self.lock:
                self.queued_parents[parent].remove(token_array)
                self._add_locked(DiskEntry(path, parent, end, digest, size, token_array))
                self.writes += 1
            self.enforce_cap()

        with self.lock:
            self.queued_parents[parent].append(token_array)
        if not self.writer.submit(FileJob(f"{parent}_{end}", tensors, meta, written)):
            with self.lock:
                self.queued_parents[parent].remove(token_array)
            return False
        return True

    # -- whole-state checkpoints (sliding-window and recurrent models) -------------------
    # mlx-lm's prompt-cache file layout (mlx_lm.models.cache.load_prompt_cache reads it), named
    # ckpt_<hash of its tokens>_<digest>.safetensors; its tokens are in the metadata.

    def write_checkpoint(self, key: str, tokens: list[int], cache: list) -> bool:
        from mlx.utils import tree_flatten

        key = key[:KEY_CHARS]
        if key in self.by_end:
            return True
        scalars: list = [""]  # as save_prompt_cache: non-array state as arrays, noted here
        items = []
        for name, data in tree_flatten([c.state for c in cache]):
            if not isinstance(data, mx.array):
                kind = "none" if data is None else "string" if isinstance(data, str) else "scalar"
                if kind == "string":
                    data = mx.array([ord(ch) for ch in data])
                else:
                    data = mx.array([]) if data is None else mx.array(data)
                scalars.append((name, kind))
            items.append((name, data))
        mx.eval([a for _, a in items])
        tensors = [host_tensor(name, a) for name, a in items]
        own = {"format": FORMAT, "identity": self.identity, "tokens": json.dumps(list(tokens))}
        meta = dict(tree_flatten([own, [type(c).__name__ for c in cache], scalars]))
        token_array = array.array("i", tokens)

        def written(path: Path, digest: str, size: int) -> None:  # on the writer thread
            with self.lock:
                self._add_locked(DiskEntry(path, CHECKPOINT, key, digest, size, token_array))
                self.writes += 1
            self.enforce_cap()

        return self.writer.submit(FileJob(f"{CHECKPOINT}_{key}", tensors, meta, written))

    def best_checkpoint(self, wanted: list[int], longer_than: int) -> DiskEntry | None:
        """The longest checkpoint file whose tokens start `wanted`, if longer than `longer_than`."""
        best = None
        with self.lock:
            entries = list(self.index.get(CHECKPOINT, ()))
        for e in entries:
            if e.tokens is None:
                try:
                    e.tokens = array.array("i", json.loads(read_metadata(e.path)["0.tokens"]))
                except Exception as err:
                    self.skip(e, f"unreadable header ({err})")
                    continue
            n = len(e.tokens)
            if longer_than < n <= len(wanted) and (best is None or n > len(best.tokens)):
                if e.tokens.tolist() == wanted[:n]:
                    best = e
        return best

    def load_checkpoint(self, e: DiskEntry, n_layers: int) -> list | None:
        from mlx_lm.models.cache import load_prompt_cache

        try:
            if _digest(e.path.read_bytes()) != e.digest:
                raise ValueError("content digest mismatch (truncated or corrupt)")
            cache, meta = load_prompt_cache(str(e.path), return_metadata=True)
            if meta.get("format") != FORMAT or meta.get("identity") != self.identity:
                raise ValueError(f"written by another model or version ({meta.get('identity')})")
            if json.loads(meta["tokens"]) != e.tokens.tolist() or len(cache) != n_layers:
                raise ValueError("tokens or layers don't match")
            mx.eval([c.state for c in cache])
        except Exception as err:
            self.skip(e, str(err))
            return None
        self.loads += 1
        return cache

    @property
    def writable(self) -> bool:
        return self.writer.failed is None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued files to be written."""
        return self.writer.flush(timeout)

    def close(self, timeout: float | None = 60.0) -> bool:
        self.wait_probe(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        return self.writer.close(timeout)

    def enforce_cap(self) -> None:
        """Delete the oldest files under the cache folder (every identity's) until under the cap."""
        with self._capping:
            self._enforce_cap()

    def _enforce_cap(self) -> None:
        files = []
        for p in self.root.rglob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, p, st.st_size))
        total = sum(f[2] for f in files)
        if total <= self.max_bytes:
            return
        with self.lock:
            ours = {e.path: e for e in self.by_end.values()}
        for _, p, size in sorted(files, key=lambda f: (f[0], str(f[1]))):
            if total <= self.max_bytes:
                break
            if p in ours:
                self._drop(ours[p], unlink=True)
            else:
                try:
                    p.unlink()
                except OSError:
                    continue
            total -= size
            self.deleted += 1
