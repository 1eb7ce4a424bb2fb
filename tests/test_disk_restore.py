"""The disk tier's restores (issue 31): a file is read only where reading is faster than computing
(measured rates, a real file reader slowed down for the slow disk), outputs identical either way;
a restore cut in the middle falls back to computing; SIGTERM and `kill -9` leave, and restarts
read, the same segments. Tiny random model; outputs compared with a cache-less engine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine import Engine
from engine.caches import kv_disk
from greedy_ties import assert_same_greedy_away_from_ties
from test_kv_disk_durable import _complete, _free_port, _serve, files, out, session
from test_prefix_cache import rand_tokens
from tiny_models import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("disk_child.py")
SLOW_BYTES_PER_S = 1_000_000


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), prefix_cache=False)
    yield engine
    engine.close()


def throttled(bytes_per_s: float):
    """The tier's own reader, slowed down to `bytes_per_s` (a slow disk)."""
    def read(fd, view, offset):
        got = kv_disk.read_into(fd, view, offset)
        time.sleep(got / bytes_per_s)
        return got
    return read


def warm_engine(model: Path, cache_dir: Path, reader=None) -> Engine:
    e = Engine(str(model), prefix_cache_dir=cache_dir, prefill_chunk=64)
    if reader is not None:
        e.prefix_cache.disk.reader = reader
    return e


def header(path: Path) -> dict:
    """A safetensors file's header: each tensor's dtype, shape and offsets."""
    with open(path, "rb") as f:
        return json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))


def rates(cache_dir: Path) -> dict:
    return json.loads(next(cache_dir.rglob(kv_disk.RATES_FILE)).read_text())


def test_restore_or_compute_by_the_measured_rates(tiny_model_dir, plain, tmp_path, cache_home):
    prompt = rand_tokens(2200, 3)  # a file over 1 MiB: big enough to time the disk by
    expected = out(plain, prompt)[0]
    first = tmp_path / "first"
    e = warm_engine(tiny_model_dir, first)
    assert out(e, prompt) == (expected, 0)
    e.close()
    assert rates(first)["prefill_tokens_per_s"] > 0  # measured by that cold prefill
    assert rates(first)["restore_bytes_per_s"] is None  # nothing read yet
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    shutil.copytree(first, fast)
    shutil.copytree(first, slow)

    # a fast disk: restored, and the rate it read at kept for the next start
    e = warm_engine(tiny_model_dir, fast)
    assert out(e, prompt) == (expected, len(prompt) - 1)
    e.close()
    e = warm_engine(tiny_model_dir, fast)
    assert out(e, prompt) == (expected, len(prompt) - 1)
    assert e.cache_stats()["disk_declined_tokens"] == 0
    e.close()

    # a slow disk: the first start reads (no rate known yet) and measures it ...
    e = warm_engine(tiny_model_dir, slow, throttled(SLOW_BYTES_PER_S))
    assert out(e, prompt) == (expected, len(prompt) - 1)
    e.close()
    measured = rates(slow)
    assert measured["restore_bytes_per_s"] < 2 * SLOW_BYTES_PER_S
    # ... and every later one computes instead: reading would cost more than the prefill
    assert rates(fast)["restore_bytes_per_s"] > measured["restore_bytes_per_s"]
    e = warm_engine(tiny_model_dir, slow, throttled(SLOW_BYTES_PER_S))
    assert out(e, prompt) == (expected, 0)
    stats = e.cache_stats()
    assert stats["disk_loads"] == 0 and stats["disk_declined_tokens"] == len(prompt) - 1
    assert stats["disk_restore_gb_per_s"] is not None and stats["prefill_tokens_per_s"] is not None
    e.close()


def test_a_slow_rate_is_probed_again(tiny_model_dir, plain, tmp_path, cache_home):
    prompt = rand_tokens(2200, 6)
    expected = out(plain, prompt)[0]
    e = warm_engine(tiny_model_dir, tmp_path)
    out(e, prompt)
    e.close()
    e = warm_engine(tiny_model_dir, tmp_path, throttled(SLOW_BYTES_PER_S))  # a loaded disk, timed
    assert out(e, prompt) == (expected, len(prompt) - 1)
    e.close()
    slow = rates(tmp_path)["restore_bytes_per_s"]

    # the disk is fast again: the kept rate still says "compute", and the disk is timed again ...
    e = warm_engine(tiny_model_dir, tmp_path)
    assert out(e, prompt) == (expected, 0)
    assert e.cache_stats()["disk_reprobes"] == 1
    e.prefix_cache.disk.wait_probe(60)
    e.close()
    assert rates(tmp_path)["restore_bytes_per_s"] > 10 * slow
    # ... so the next start reads it
    e = warm_engine(tiny_model_dir, tmp_path)
    assert out(e, prompt) == (expected, len(prompt) - 1)
    e.close()


def test_quantised_kv_goes_to_disk_in_its_own_form(tmp_path_factory, tmp_path):
    wide = build_tiny_model(tmp_path_factory.mktemp("tiny-wide"), arch="qwen3", seed=3, hidden=128)  # head_dim 32
    prompt = rand_tokens(300, 7)
    q8, full = tmp_path / "q8", tmp_path / "full"
    with Engine(str(wide), prefix_cache=False, kv_bits=8) as plain8:
        want = out(plain8, prompt + [11])[0]
        for bits, folder in ((8, q8), (None, full)):
            with Engine(str(wide), kv_bits=bits, prefix_cache_dir=folder) as e:
                out(e, prompt)
        # the packed data (uint32) and the scales and biases, as the cache holds them: not dequantised
        for path in files(q8):
            dtypes = {k: v["dtype"] for k, v in header(path).items() if k.startswith("l")}
            assert dtypes and all(dtypes[k] == "U32" for k in dtypes if k.endswith((".0", ".3")))
        on_disk = {f: sum(p.stat().st_size for p in files(f)) for f in (q8, full)}
        assert 0 < on_disk[q8] < on_disk[full] / 3  # 8 bits and a scale and bias per 32 against float32
        with Engine(str(wide), kv_bits=8, prefix_cache_dir=q8) as again:
            got, cached = out(again, prompt + [11])
            assert cached == len(prompt)  # restored in its own form ...
            assert_same_greedy_away_from_ties(plain8, prompt + [11], want, got)  # ... as recomputing with it
    for other in (4, None):  # another KV format: another identity, never read
        with Engine(str(wide), kv_bits=other, prefix_cache_dir=q8) as e:
            assert e.cache_stats()["disk_files"] == 0


def test_restore_cut_in_the_middle_falls_back_to_computing(tiny_model_dir, plain, tmp_path, cache_home, caplog):
    prompt = rand_tokens(700, 4)
    expected = out(plain, prompt)[0]
    e = warm_engine(tiny_model_dir, tmp_path)
    out(e, prompt)
    e.close()
    written = files(tmp_path)

    def cut_after_first_read(fd, view, offset):  # the files lose their tails while being read
        got = kv_disk.read_into(fd, view, offset)
        for path in written:
            if path.exists():
                os.truncate(path, min(path.stat().st_size, 4096))
        return got

    e = warm_engine(tiny_model_dir, tmp_path, cut_after_first_read)
    assert out(e, prompt) == (expected, 0)
    assert e.cache_stats()["disk_skipped"] >= 1 and e.cache_stats()["disk_loads"] == 0
    e.close()
    assert any("skipping" in r.getMessage() for r in caplog.records)


KILLED_CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from engine.caches import kv_disk
real = kv_disk.read_into
def slow(fd, view, offset):
    print("reading", flush=True)
    time.sleep(0.5)
    return real(fd, view[:4096], offset)
kv_disk.read_into = slow
sys.argv = ["disk_child.py", {cfg!r}]
import runpy
runpy.run_path({child!r}, run_name="__main__")
"""


def test_kill_9_mid_restore_then_restart_reads_it(tiny_model_dir, plain, tmp_path):
    prompt = rand_tokens(700, 5)
    expected = out(plain, prompt)[0]
    cfg = {"model": str(tiny_model_dir), "cache_dir": str(tmp_path), "prompts": [prompt]}
    subprocess.run([sys.executable, str(CHILD), json.dumps(cfg)], check=True, capture_output=True, timeout=300)
    before = {p.name for p in files(tmp_path)}
    code = KILLED_CHILD.format(tests=str(ROOT / "tests"), cfg=json.dumps(cfg), child=str(CHILD))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "reading"  # the restore has begun, a 4 KiB read at a time
    proc.kill()  # kill -9 in the middle of it
    proc.wait(timeout=30)
    assert {p.name for p in files(tmp_path)} == before  # reading left the files as they were
    done = subprocess.run([sys.executable, str(CHILD), json.dumps(cfg)], check=True, capture_output=True,
                          text=True, timeout=300)
    rec = json.loads(done.stdout.splitlines()[0])
    assert rec["tokens"] == expected and rec["cached"] == len(prompt) - 1


KILLED_MID_PREFILL = """
import os, sys
sys.path.insert(0, {tests!r})
import engine.engine
from engine.caches.prefix_cache import SegmentPrefixCache
engine.engine.WRITE_AHEAD_TOKENS = 128
real = SegmentPrefixCache.write_ahead
def then_die(self, tokens, cache):
    real(self, tokens, cache)
    if len(tokens) >= 256:  # the second hand-over, in the middle of the prompt's prefill
        self.flush()
        print(len(tokens), flush=True)
        os._exit(9)  # as kill -9: nothing closes, nothing more is written
SegmentPrefixCache.write_ahead = then_die
sys.argv = ["disk_child.py", {cfg!r}]
import runpy
runpy.run_path({child!r}, run_name="__main__")
"""


def test_a_long_prefill_writes_ahead_and_a_crash_in_it_keeps_that(tiny_model_dir, plain, tmp_path):
    """The disk tier gets a long prompt's first parts while the rest is computed: a process killed
    in the middle of the prefill restarts from what was handed over, output as computed cold."""
    prompt = rand_tokens(700, 6)
    expected = out(plain, prompt)[0]
    cfg = {"model": str(tiny_model_dir), "cache_dir": str(tmp_path), "prompts": [prompt]}
    code = KILLED_MID_PREFILL.format(tests=str(ROOT / "tests"), cfg=json.dumps(cfg), child=str(CHILD))
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert killed.returncode == 9 and killed.stdout.strip() == "256", killed.stderr[-2000:]
    done = subprocess.run([sys.executable, str(CHILD), json.dumps(cfg)], check=True, capture_output=True,
                          text=True, timeout=300)
    rec = json.loads(done.stdout.splitlines()[0])
    assert rec["tokens"] == expected and rec["cached"] == 256


def _session_then(model: Path, cache_dir: Path, prompts: list[list[int]], sig: int) -> None:
    port = _free_port()
    proc = _serve(model, cache_dir, port)
    try:
        for p in prompts:
            _complete(port, p)
        deadline = time.time() + 30  # the background writer done: nothing left that only a clean stop writes
        seen = None
        while time.time() < deadline:
            now = sorted(p.name for p in cache_dir.rglob("*.safetensors"))
            if now == seen and not any(n.startswith(".tmp-") for n in now):
                break
            seen = now
            time.sleep(0.5)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_and_kill_9_restarts_read_the_same_segments(tiny_model_dir, plain, tmp_path):
    # each turn leaves the last one's generated tokens behind: edges split, as in an agent's session
    prompts = session(3, first=400, step=150, seed=21)
    folders = {sig: tmp_path / sig.name for sig in (signal.SIGKILL, signal.SIGTERM)}
    for sig, folder in folders.items():
        _session_then(tiny_model_dir, folder, prompts, sig)
    names = {sig: sorted(p.name for p in files(folder)) for sig, folder in folders.items()}
    assert names[signal.SIGKILL] == names[signal.SIGTERM]  # a clean stop re-writes nothing
    final = prompts[-1] + [5, 6, 7]
    expected = plain.decode(out(plain, final)[0])
    for folder in folders.values():
        port = _free_port()
        proc = _serve(tiny_model_dir, folder, port)
        try:
            text, cached = _complete(port, final)
            assert text == expected and cached == len(prompts[-1])
            stats = httpx.get(f"http://127.0.0.1:{port}/v1/cache", timeout=30).json()["stats"]
            assert stats["prefill_tokens_per_s"] > 0  # kept from the first run's prefills
            assert "disk_restore_gb_per_s" in stats  # files this small don't time the disk: None
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


def test_on_cuda_the_tier_keeps_host_buffers_out_of_mlx_buffer_cache(tmp_path, monkeypatch):
    """MLX CUDA moves a buffer the host reads (the tier's np.asarray) into unified memory for good;
    its buffer cache would hand it out again as a device array. With a tier on CUDA, freed buffers
    go back to the driver (cache limit 0); elsewhere (unified memory, CPU) the cache is left alone."""
    import mlx.core as mx

    before = mx.set_cache_limit(1 << 30)
    mx.set_cache_limit(before)
    try:
        kv_disk.DiskTier(tmp_path / "here", "id", 1 << 30).close()
        assert mx.set_cache_limit(before) == before
        monkeypatch.setattr(kv_disk, "on_cuda", lambda: True)
        kv_disk.DiskTier(tmp_path / "cuda", "id", 1 << 30).close()
        assert mx.set_cache_limit(before) == 0
    finally:
        mx.set_cache_limit(before)
