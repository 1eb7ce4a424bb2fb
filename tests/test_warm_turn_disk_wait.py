"""A warm turn does not wait for the disk tier to write files its prompt doesn't need.

Claude Code's next turn often differs from the cached context at the reply (a replayed or edited
assistant turn): the prefix cache then matches inside the edge that holds prompt + reply, and
looks on the disk tier for a file that continues further. The reply's own file, just queued, is
in RAM already and continues no further than RAM does: waiting for the writer to finish it (tens
or hundreds of MB after a long reply) cost the rename-session replay up to a second a turn.
Here the writer is held shut, as a slow disk would hold it: the turn must start all the same.
"""

from __future__ import annotations

import queue
import threading

import pytest

from engine import Engine, GenerationRequest, PrefillProgress
from engine.caches import kv_disk_writer

START_WAIT_S = 15.0  # far longer than the tiny model's lookup; the writer's flush waited 30 s


@pytest.fixture
def gated_writer(monkeypatch):
    """The disk writer writes nothing until the returned event is set."""
    gate = threading.Event()
    real = kv_disk_writer.write_atomic

    def held(*args, **kwargs):
        gate.wait(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_disk_writer, "write_atomic", held)
    yield gate
    gate.set()


def test_turn_after_a_diverging_reply_starts_while_its_file_is_written(tiny_model_dir, tmp_path, gated_writer):
    with Engine(str(tiny_model_dir), mode="baseline", prefix_cache_dir=str(tmp_path / "kv")) as engine:
        prompt = engine.encode("def area(width, height):\n    return width * height\n" * 8)
        reply = engine.submit(GenerationRequest(prompt_ids=prompt, max_tokens=24)).result().token_ids
        assert reply, "the turn must have generated something to diverge from"
        other = next(t for t in engine.encode("# the client's own version of the reply") if t != reply[0])
        job = engine.submit(GenerationRequest(prompt_ids=prompt + [other] + prompt[:16], max_tokens=2))
        try:
            first = job.next_event(timeout=START_WAIT_S)
        except queue.Empty:
            pytest.fail(f"the turn waited over {START_WAIT_S} s for the disk writer")
        finally:
            gated_writer.set()
        assert isinstance(first, PrefillProgress) and first.done == len(prompt)
        done = job.result()
        assert done.stats.cached_tokens == len(prompt)
        assert engine.flush_disk(60)  # what was held back is written after all
        assert engine.cache_stats()["disk_writes"] >= 1
