"""The latency-shaped loopback link (engine/bench/shaped_link.py, issue 32): the relay delivers
bytes intact, in order and no sooner than its delay; ranks launched over it meet, sum, and a
failing rank ends the run instead of hanging it. Timings are lower bounds only."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from engine.bench.shaped_link import READ_BYTES, DelayRelay, launch_ranks

ROOT = Path(__file__).resolve().parents[1]

needs_ring = pytest.mark.skipif(not mx.distributed.is_available(), reason="MLX distributed is absent")

ALL_SUM_SCRIPT = """
import mlx.core as mx
group = mx.distributed.init(strict=True, backend="ring")
rank = group.rank()
x = mx.array([1.0, 2.0, 3.0]) * (rank + 1)  # rank 0: [1,2,3], rank 1: [2,4,6]
y = mx.distributed.all_sum(x, group=group)
mx.eval(y)
assert y.tolist() == [3.0, 6.0, 9.0], (rank, y.tolist())
print(f"rank {rank} sum {y.tolist()}", flush=True)
"""

# Rank 1 fails before meeting; rank 0 would then wait in init for a neighbour that never comes.
FAILING_SCRIPT = """
import os
if os.environ["MLX_RANK"] == "1":
    raise SystemExit("rank 1 fails on purpose")
import mlx.core as mx
mx.distributed.init(strict=True, backend="ring")
"""


def rank_env() -> dict:
    """The environment of this test process (LD_PRELOAD included when set), repo importable."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def echo_server() -> socket.socket:
    """A listening socket whose one accepted connection echoes everything back until EOF."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(65536):
                conn.sendall(chunk)

    threading.Thread(target=serve, daemon=True).start()
    return server


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    parts, got = [], 0
    while got < size:
        chunk = sock.recv(size - got)
        assert chunk, f"EOF after {got} of {size} bytes"
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def test_relay_echo_is_intact_ordered_and_delayed():
    delay_s = 0.05
    with echo_server() as server, DelayRelay(server.getsockname()[:2], delay_s) as relay:
        with socket.create_connection(relay.address, timeout=30) as client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Small messages one after another: each comes back whole and in order.
            for i in range(3):
                message = f"message {i}".encode()
                start = time.monotonic()
                client.sendall(message)
                assert recv_exactly(client, len(message)) == message
                # Each byte crosses the relay twice (there and back), delayed each way.
                assert time.monotonic() - start >= delay_s
            # Larger than one relay read: arrives as several chunks, must be rejoined in order.
            payload = os.urandom(3 * READ_BYTES + 1234)
            sender = threading.Thread(target=client.sendall, args=(payload,))
            sender.start()
            assert recv_exactly(client, len(payload)) == payload
            sender.join()


def test_relay_with_no_target_closes_the_client():
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        unused = placeholder.getsockname()[:2]  # closed below: nothing listens there
    with DelayRelay(unused, 0.0, connect_timeout_s=0.3) as relay:
        with socket.create_connection(relay.address, timeout=10) as client:
            assert client.recv(1) == b""  # EOF, as if the target had refused


@needs_ring
@pytest.mark.parametrize("delay_ms", [0.0, 5.0])
def test_two_ranks_all_sum_over_the_link(tmp_path, delay_ms):
    script = tmp_path / "all_sum.py"
    script.write_text(ALL_SUM_SCRIPT)
    with launch_ranks(2, [sys.executable, str(script)], delay_ms=delay_ms, env=rank_env(), cwd=str(tmp_path),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE) as ranks:
        codes = ranks.wait(timeout_s=40)
        outputs = [p.stdout.read().decode() + p.stderr.read().decode() for p in ranks.processes]
    assert codes == [0, 0], outputs
    for rank, output in enumerate(outputs):
        assert f"rank {rank} sum [3.0, 6.0, 9.0]" in output, output


@needs_ring
def test_all_sum_probe_reports_at_least_the_delay():
    delay_ms = 20.0
    probe = [sys.executable, "-m", "engine.bench.shaped_link", "--probe-all-sum", "5"]
    with launch_ranks(2, probe, delay_ms=delay_ms, env=rank_env(), cwd=str(ROOT),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE) as ranks:
        codes = ranks.wait(timeout_s=40)
        outputs = [p.stdout.read().decode() + p.stderr.read().decode() for p in ranks.processes]
    assert codes == [0, 0], outputs
    for output in outputs:
        found = re.search(r"median ([\d.]+) ms, min ([\d.]+) ms", output)
        assert found, output
        # An all_sum of 2 ranks waits for the neighbour's bytes, which cross one relay.
        assert float(found.group(2)) >= delay_ms, output


@needs_ring
def test_failing_rank_fails_the_launch_without_hanging(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILING_SCRIPT)
    command = [sys.executable, "-m", "engine.bench.shaped_link", "-n", "2", "--delay-ms", "5",
               "--", sys.executable, str(script)]
    # The subprocess timeout turns a hang into a failure; the launcher itself has none set.
    result = subprocess.run(command, env=rank_env(), cwd=str(ROOT), capture_output=True, text=True, timeout=40)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "rank 1 fails on purpose" in result.stderr
    assert "rank 1 exited with code 1" in result.stderr
