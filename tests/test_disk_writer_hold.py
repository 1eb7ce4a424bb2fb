"""The disk tier's writers yield to a request's time to first token.

While a request waits for its first token the engine holds the writers (`DiskWriter.hold`):
they pause between pieces of a file, so the turn does not run beside the previous turn's writes
(on MLX CUDA those read unified memory, whose page faults slow the GPU's forwards). A hold lasts
at most HOLD_MAX_S, a flush or close goes through it, and what was held is written after, byte
for byte as without a hold.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine import Engine, GenerationRequest, Tokens
from engine.caches import kv_disk_writer
from engine.caches.kv_disk_writer import DiskWriter, FileJob
from test_prefix_cache import rand_tokens


def job(name: str, written: list, nbytes: int = 3 * kv_disk_writer.PIECE_BYTES + 5) -> FileJob:
    data = np.random.default_rng(len(name)).integers(0, 255, nbytes, dtype=np.uint8)
    return FileJob(name, [("x", "U8", (nbytes,), memoryview(data))], {"k": "v"},
                   lambda path, digest, size: written.append(path))


def finals(folder) -> list:
    return sorted(p for p in folder.iterdir() if not p.name.startswith(".tmp-"))


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def long_hold(monkeypatch):
    monkeypatch.setattr(kv_disk_writer, "HOLD_MAX_S", 120.0)


def test_a_held_writer_writes_nothing_until_the_hold_lifts(tmp_path, long_hold):
    held, free = tmp_path / "held", tmp_path / "free"
    held.mkdir(), free.mkdir()
    writer, reference = DiskWriter(held, ".safetensors", threads=2), DiskWriter(free, ".safetensors", threads=1)
    written: list = []
    writer.hold(True)
    assert writer.held
    assert writer.submit(job("a", written)) and writer.submit(job("bb", written))
    time.sleep(0.5)
    assert not written and not finals(held)  # each writer waits at its file's first piece
    writer.hold(False)
    assert not writer.held
    assert wait_for(lambda: len(written) == 2, 30)
    assert reference.submit(job("a", [])) and reference.submit(job("bb", [])) and reference.flush(30)
    assert [p.read_bytes() for p in finals(held)] == [p.read_bytes() for p in finals(free)]
    writer.close(), reference.close()


def test_a_flush_goes_through_a_hold(tmp_path, long_hold):
    writer, written = DiskWriter(tmp_path, ".safetensors", threads=1), []
    writer.hold(True)
    writer.submit(job("a", written))
    assert writer.flush(30) and written  # what a SIGTERM handler needs: everything on disk now
    assert writer.held  # the engine's hold stands for what comes next
    writer.close()


def test_a_hold_lasts_at_most_hold_max_s(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_disk_writer, "HOLD_MAX_S", 0.3)
    writer, written = DiskWriter(tmp_path, ".safetensors", threads=1), []
    writer.hold(True)
    start = time.monotonic()
    writer.submit(job("a", written))
    assert wait_for(lambda: bool(written), 30)  # steady traffic never starves the writers
    assert time.monotonic() - start >= 0.3
    assert writer.held
    writer.close()


def test_the_engine_holds_the_writers_until_the_first_token(tiny_model_dir, tmp_path, long_hold, monkeypatch):
    """Held during the prefill and its first round, for a cold and a warm turn; lifted once the
    first token is out, so the turn's files are written while it decodes or after it."""
    import engine.engine as engine_mod

    seen: list[bool] = []
    real_prefill = engine_mod.prefill

    def prefill(*args, **kwargs):
        seen.append(writer_of(engine).held)
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "prefill", prefill)
    writer_of = lambda e: e.prefix_cache.disk.writer  # noqa: E731
    with Engine(str(tiny_model_dir), mode="baseline", prefix_cache_dir=str(tmp_path)) as engine:
        first = rand_tokens(300, 3)
        for prompt in (first, first + rand_tokens(40, 4)):
            job = engine.submit(GenerationRequest(prompt_ids=prompt, max_tokens=12))
            firsts = [seen[:] for event in job if isinstance(event, Tokens)][:1]
            assert firsts and firsts[0] and all(firsts[0]), "the writers ran beside a prefill"
            seen.clear()
            assert wait_for(lambda: not writer_of(engine).held, 10)
        assert engine.flush_disk(30)
        assert engine.cache_stats()["disk_writes"] >= 1
