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
    held, plain = tmp_path / "held", tmp_path / "plain"
    held.mkdir(), plain.mkdir()
    writer, written = DiskWriter(held, ".safetensors", threads=2), []
    jobs = [job("a", written), job("bb", written)]
    writer.hold(True)
    assert writer.held
    assert all(writer.submit(j) for j in jobs)
    temps = lambda: [p for p in held.iterdir() if p.name.startswith(".tmp-")]  # noqa: E731
    assert wait_for(lambda: len(temps()) == 2, 30)  # each writer has opened its file...
    time.sleep(0.2)
    assert all(p.stat().st_size == 0 for p in temps()) and not written and not finals(held)  # ...and waits
    writer.hold(False)
    assert not writer.held
    assert wait_for(lambda: len(written) == 2, 30)
    for j in jobs:  # the same files, names (their digests) included, as written without pieces or a hold
        kv_disk_writer.write_atomic(plain, j.name, kv_disk_writer.safetensors_parts(j.tensors, j.metadata), ".safetensors")
    assert [(p.name, p.read_bytes()) for p in finals(held)] == [(p.name, p.read_bytes()) for p in finals(plain)]
    writer.close()


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
    assert wait_for(lambda: bool(written), 30)
    assert time.monotonic() - start >= 0.3
    assert writer.held
    writer.close()


def test_steady_traffic_does_not_starve_the_writers(tmp_path, monkeypatch):
    """One request admitted as the last one ends: holds back to back, each shorter than the
    limit. Held less than HOLD_GAP_S apart, they count as one, and the writers go on."""
    monkeypatch.setattr(kv_disk_writer, "HOLD_MAX_S", 0.3)
    writer, written = DiskWriter(tmp_path, ".safetensors", threads=1), []
    writer.hold(True)
    writer.submit(job("a", written))
    deadline = time.monotonic() + 20
    while not written and time.monotonic() < deadline:
        time.sleep(0.2)  # a request's prefill, shorter than HOLD_MAX_S
        writer.hold(False)  # its first token; the next request at once
        writer.hold(True)
    assert written
    writer.close()


def test_the_engine_holds_the_writers_until_the_first_token(tiny_model_dir, tmp_path, long_hold, monkeypatch):
    """Held during the prefill and its first round, for a cold and a warm turn; lifted as the
    first token goes out, so the turn's files are written while it decodes or after it."""
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
            at_first_token = [(seen[:], writer_of(engine).held) for event in job if isinstance(event, Tokens)][:1]
            assert at_first_token, "no tokens"
            during_prefill, held_after = at_first_token[0]
            assert during_prefill and all(during_prefill), "the writers ran beside a prefill"
            assert not held_after, "the hold outlasted the first token"
            seen.clear()
        assert engine.flush_disk(30)
        assert engine.cache_stats()["disk_writes"] >= 1
