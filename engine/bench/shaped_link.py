"""A latency-shaped loopback link between MLX ring-backend ranks (issue 32).

`tc netem` needs the sch_netem kernel module, which this machine lacks, so the added latency
lives in userspace: a TCP relay per ordered pair of ranks that delivers every chunk it reads
`delay_s` after reading it, in order, in both directions, without a bandwidth cap.

How MLX's ring backend meets (read from mlx/distributed/ring/ring.cpp and checked by the tests):
the environment names the rank (MLX_RANK) and a JSON hostfile (MLX_HOSTFILE), a list with one
list of "ip:port" addresses per rank. Rank r binds and accepts on every address of entry r
(its left neighbour connects there) and connects to every address of entry (r + 1) % n, its
right neighbour; it never reads other entries. So each rank gets its own hostfile: its own
entry is its real listening address, every other entry a relay forwarding to that rank, and
every byte between two ranks crosses exactly one relay.

Run a command as ranks over the link:

    python -m engine.bench.shaped_link -n 2 --delay-ms 5 -- .venv/bin/python script.py

and time one all_sum that way (the probe runs as each rank):

    python -m engine.bench.shaped_link -n 2 --delay-ms 5 -- \\
        .venv/bin/python -m engine.bench.shaped_link --probe-all-sum 50
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field

HOST = "127.0.0.1"
READ_BYTES = 256 * 1024  # one recv; a larger message arrives as several chunks
SEND_BYTES = 4 * 1024 * 1024  # due chunks are joined into one send up to this size
MAX_QUEUED_BYTES = 64 * 1024 * 1024  # past this the reader stops reading: TCP backpressure
CONNECT_TIMEOUT_S = 60.0  # the relay retries its target this long (a rank binds late)
STOP_GRACE_S = 3.0  # terminate, then kill after this


# ---- the relay ----------------------------------------------------------------------------


class _DelayedQueue:
    """Chunks in read order with the time each is due; the delay is constant, so the head
    is always the first due."""

    def __init__(self) -> None:
        self.items: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.ended = False  # the reader hit EOF or an error, or the writer failed
        self.cond = threading.Condition()

    def put(self, due: float, data: bytes) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.queued < MAX_QUEUED_BYTES or self.ended)
            if self.ended:  # the writer failed: nothing will be delivered any more
                return
            self.items.append((due, data))
            self.queued += len(data)
            self.cond.notify_all()

    def end(self) -> None:
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def take_due(self) -> bytes | None:
        """Block until the head is due, then pop every due chunk (joined up to SEND_BYTES);
        None once the reader ended and the queue is empty."""
        with self.cond:
            self.cond.wait_for(lambda: self.items or self.ended)
            if not self.items:
                return None
            due = self.items[0][0]
        # The head can only be popped by this thread, and chunks behind it are due later,
        # so sleeping outside the lock is safe.
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        with self.cond:
            now, parts, size = time.monotonic(), [], 0
            while self.items and self.items[0][0] <= now and size < SEND_BYTES:
                data = self.items.popleft()[1]
                parts.append(data)
                size += len(data)
            self.queued -= size
            self.cond.notify_all()
        return b"".join(parts)


def _read_into(src: socket.socket, queue: _DelayedQueue, delay_s: float) -> None:
    """Read `src` until EOF or error, stamping each chunk due `delay_s` after its read."""
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    try:
        while True:
            n = src.recv_into(buffer)
            if n == 0:
                break
            queue.put(time.monotonic() + delay_s, bytes(view[:n]))
    except OSError:
        pass
    finally:
        queue.end()


def _write_from(queue: _DelayedQueue, dst: socket.socket, on_error) -> None:
    """Deliver due chunks to `dst`; at the reader's EOF pass the half-close on."""
    try:
        while (data := queue.take_due()) is not None:
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        queue.end()
        on_error()


class _Connection:
    """One accepted client and its target: two delayed directions, four threads."""

    def __init__(self, client: socket.socket, upstream: socket.socket, delay_s: float) -> None:
        self.sockets = (client, upstream)
        self.threads = []
        for src, dst in ((client, upstream), (upstream, client)):
            queue = _DelayedQueue()
            self.threads.append(threading.Thread(target=_read_into, args=(src, queue, delay_s), daemon=True))
            self.threads.append(threading.Thread(target=_write_from, args=(queue, dst, self.abort), daemon=True))
        for thread in self.threads:
            thread.start()
        self.closer = threading.Thread(target=self._close_when_done, daemon=True)
        self.closer.start()

    def abort(self) -> None:
        """A write failed (or the relay closes): end both directions now."""
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _close_when_done(self) -> None:
        for thread in self.threads:
            thread.join()
        for sock in self.sockets:
            sock.close()

    def join(self, timeout_s: float) -> None:
        self.closer.join(timeout_s)


def _connect_with_retries(target: tuple[str, int], timeout_s: float, stop: threading.Event) -> socket.socket | None:
    """Connect to `target`, retrying while it is not listening yet (ranks bind late)."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        try:
            sock = socket.create_connection(target, timeout=timeout_s)
        except OSError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    return None


class DelayRelay:
    """Listens on 127.0.0.1:`port` (0: any free port, see `.address`) and forwards each
    connection it accepts to `target`, both directions, every chunk delivered `delay_s`
    after it was read. The listening socket is bound here and held, so its port is safe."""

    def __init__(self, target: tuple[str, int], delay_s: float, port: int = 0,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.target, self.delay_s, self.connect_timeout_s = target, delay_s, connect_timeout_s
        self.stop = threading.Event()
        self.connections: list[_Connection] = []
        self.lock = threading.Lock()
        self.listener = socket.create_server((HOST, port))
        self.listener.settimeout(0.1)  # the accept loop checks `stop` this often
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.acceptor = threading.Thread(target=self._accept_loop, daemon=True)
        self.acceptor.start()

    def _accept_loop(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Connected in its own thread: a target that binds late must not hold up accepts.
            threading.Thread(target=self._open, args=(client,), daemon=True).start()

    def _open(self, client: socket.socket) -> None:
        upstream = _connect_with_retries(self.target, self.connect_timeout_s, self.stop)
        if upstream is None:
            client.close()  # the peer sees EOF, as if the target had refused
            return
        with self.lock:
            if self.stop.is_set():
                client.close()
                upstream.close()
                return
            self.connections.append(_Connection(client, upstream, self.delay_s))

    def close(self) -> None:
        """Stop accepting and end every connection (pending chunks are dropped)."""
        self.stop.set()
        self.acceptor.join()
        self.listener.close()
        with self.lock:
            connections = list(self.connections)
        for connection in connections:
            connection.abort()
        for connection in connections:
            connection.join(STOP_GRACE_S)

    def __enter__(self) -> DelayRelay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- ranks --------------------------------------------------------------------------------


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_listen_ports(count: int) -> list[int]:
    """Ports a rank can bind after us. Chosen below the ephemeral range: a relay retrying a
    connect to a port in that range, with nothing listening yet, can be handed that very
    port as its source and connect to itself (TCP simultaneous open), stealing the rank's
    port; and no outgoing connection takes them meanwhile. Each is checked bindable."""
    low = 20000
    high = min(_ephemeral_range()[0], 65536)
    if high - low < 1000:
        low, high = 10000, 20000
    picked: list[int] = []
    while len(picked) < count:
        port = random.randrange(low, high)
        if port in picked:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((HOST, port))
            except OSError:
                continue
        picked.append(port)
    return picked


def hostfiles(listen: list[tuple[str, int]], relays: dict[tuple[int, int], DelayRelay]) -> list[list[list[str]]]:
    """Per rank, the ring hostfile it reads: its own entry its real address, entry j the relay
    (rank -> j) when there is one, else j's real address."""
    n = len(listen)

    def entry(rank: int, j: int) -> list[str]:
        host, port = relays[(rank, j)].address if (rank, j) in relays else listen[j]
        return [f"{host}:{port}"]

    return [[entry(rank, j) for j in range(n)] for rank in range(n)]


@dataclass
class Ranks:
    """The rank processes and the relays between them; `wait()` then `close()` (or `with`)."""

    processes: list[subprocess.Popen]
    relays: list[DelayRelay] = field(default_factory=list)
    workdir: tempfile.TemporaryDirectory | None = None

    def wait(self, timeout_s: float | None = None) -> list[int]:
        """Exit codes of all ranks. As `mlx.launch` does, the first rank to fail stops the
        others (a ring rank whose peer is gone can block in accept forever). Past
        `timeout_s` every rank is stopped and TimeoutError raised."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in self.processes]
            if all(code is not None for code in codes):
                return codes
            if any(code not in (None, 0) for code in codes):
                self.stop()
                return [p.returncode for p in self.processes]
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"ranks still running after {timeout_s} s: exit codes {codes}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Terminate the ranks still running, kill those that outlive the grace."""
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.processes:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close(self) -> None:
        self.stop()
        for relay in self.relays:
            relay.close()
        if self.workdir is not None:
            self.workdir.cleanup()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def launch_ranks(n: int, argv: list[str], delay_ms: float = 0.0, env: dict | None = None,
                 stdout=None, stderr=None, cwd: str | None = None, verbose: bool = False) -> Ranks:
    """Start `n` processes of `argv` as MLX ring-backend ranks on localhost, with the
    environment `mlx.launch --backend ring` gives them (MLX_RANK, MLX_HOSTFILE, and
    MLX_RING_VERBOSE=1 when verbose) plus `env`, and OPENBLAS_NUM_THREADS at cores / n where
    neither sets it. With `delay_ms` > 0 every byte between two
    ranks crosses a relay adding that latency in each direction. `stdout`/`stderr` go to
    Popen (None: inherited)."""
    if n < 2:
        raise ValueError(f"a link needs at least 2 ranks, got {n}")
    listen = [(HOST, port) for port in free_listen_ports(n)]
    relays: dict[tuple[int, int], DelayRelay] = {}
    if delay_ms > 0:
        for rank in range(n):
            for j in range(n):
                if j != rank:
                    relays[(rank, j)] = DelayRelay(listen[j], delay_ms / 1000.0)
    workdir = tempfile.TemporaryDirectory(prefix="shaped_link_")
    ranks = Ranks([], list(relays.values()), workdir)
    try:
        for rank, hostfile in enumerate(hostfiles(listen, relays)):
            path = os.path.join(workdir.name, f"hostfile_{rank}.json")
            with open(path, "w") as f:
                json.dump(hostfile, f)
            # each rank its share of this machine's cores, as separate machines would each have
            # their own (two BLAS pools of all cores each on the same cores slow both ranks)
            cores = {"OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
            rank_env = {**cores, **os.environ, **(env or {}), "MLX_RANK": str(rank), "MLX_HOSTFILE": path}
            if verbose:
                rank_env["MLX_RING_VERBOSE"] = "1"
            ranks.processes.append(subprocess.Popen(
                argv, env=rank_env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr))
    except BaseException:
        ranks.close()
        raise
    return ranks


# ---- measurements -------------------------------------------------------------------------


def probe_all_sum(rounds: int, elements: int = 16) -> list[float]:
    """Run as a rank: time `rounds` all_sums of `elements` float32 ones (after one warm-up),
    check each sum, print the median and minimum; returns the seconds of each."""
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend="ring")
    x = mx.ones((elements,), dtype=mx.float32)
    mx.eval(mx.distributed.all_sum(x, group=group))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        y = mx.distributed.all_sum(x, group=group)
        mx.eval(y)
        times.append(time.perf_counter() - start)
        if not mx.all(y == group.size()).item():
            raise SystemExit(f"rank {group.rank()}: wrong all_sum {y}")
    print(f"rank {group.rank()}/{group.size()}: all_sum of {elements} float32, {rounds} rounds: "
          f"median {statistics.median(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms", flush=True)
    return times


def relay_throughput(message_bytes: int, messages: int, delay_s: float = 0.0) -> dict[str, float]:
    """Stream `messages` of `message_bytes` one way through a relay into a sink and back an
    8-byte ack at the end; MB/s and messages/s, to check the relay is not the bottleneck."""
    done = threading.Event()
    total = message_bytes * messages

    def sink(server: socket.socket) -> None:
        conn, _ = server.accept()
        with conn:
            got = 0
            while got < total:
                chunk = conn.recv(READ_BYTES)
                if not chunk:
                    break
                got += len(chunk)
            conn.sendall(got.to_bytes(8, "big"))
        done.set()

    with socket.create_server((HOST, 0)) as server, DelayRelay(server.getsockname()[:2], delay_s) as relay:
        threading.Thread(target=sink, args=(server,), daemon=True).start()
        payload = os.urandom(message_bytes)
        with socket.create_connection(relay.address) as client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start = time.perf_counter()
            for _ in range(messages):
                client.sendall(payload)
            ack = int.from_bytes(client.recv(8), "big")
            elapsed = time.perf_counter() - start
        done.wait(5)
    if ack != total:
        raise RuntimeError(f"relay delivered {ack} of {total} bytes")
    return {"MB/s": total / elapsed / 1e6, "messages/s": messages / elapsed, "seconds": elapsed}


# ---- command line -------------------------------------------------------------------------


def _forward_lines(stream, rank: int, out, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.buffer.write(f"[{rank}] ".encode() + line)
            out.flush()
    stream.close()


def run_prefixed(n: int, argv: list[str], delay_ms: float, timeout_s: float | None, verbose: bool) -> int:
    """Run `argv` as `n` ranks, each output line prefixed with its rank; 0 when all passed."""
    lock = threading.Lock()
    with launch_ranks(n, argv, delay_ms, stdout=subprocess.PIPE, stderr=subprocess.PIPE, verbose=verbose) as ranks:
        # The launcher ends when its ranks have, its relays up while they shut down (a rank's
        # shutdown crosses the link): SIGTERM, sent to the launcher alone, goes on to every rank;
        # a terminal's Ctrl-C already reaches them all, so SIGINT is only waited out.
        signal.signal(signal.SIGTERM, lambda signum, frame: [p.send_signal(signum) for p in ranks.processes
                                                             if p.poll() is None])
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        readers = [threading.Thread(target=_forward_lines, args=(stream, rank, out, lock))
                   for rank, p in enumerate(ranks.processes)
                   for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]
        for reader in readers:
            reader.start()
        try:
            codes = ranks.wait(timeout_s)
        except TimeoutError as e:
            print(f"[shaped_link] {e}", file=sys.stderr)
            codes = [p.returncode for p in ranks.processes] + [1]
        for reader in readers:
            reader.join()
    for rank, code in enumerate(codes[:n]):
        if code != 0:
            print(f"[shaped_link] rank {rank} exited with code {code}", file=sys.stderr)
    return 0 if all(code == 0 for code in codes) else 1


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.bench.shaped_link",
        description="Run a command as MLX ring-backend ranks on localhost with latency added between them.")
    parser.add_argument("-n", type=int, default=2, help="number of ranks")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="latency added to each direction between ranks")
    parser.add_argument("--timeout-s", type=float, default=None, help="stop every rank after this")
    parser.add_argument("--verbose", action="store_true", help="set MLX_RING_VERBOSE=1 in the ranks")
    parser.add_argument("--probe-all-sum", type=int, metavar="ROUNDS",
                        help="run as a rank: time ROUNDS small all_sums (use it as the command)")
    parser.add_argument("--relay-throughput", action="store_true",
                        help="measure one relay's throughput for messages of 4 KB to 4 MB and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each rank runs")
    opts = parser.parse_args(args)
    if opts.probe_all_sum is not None:
        probe_all_sum(opts.probe_all_sum)
        return 0
    if opts.relay_throughput:
        for size, count in ((4 * 1024, 20000), (64 * 1024, 4000), (1024 * 1024, 400), (4 * 1024 * 1024, 100)):
            result = relay_throughput(size, count)
            print(f"{size:>8} B x {count:>5}: {result['MB/s']:8.1f} MB/s {result['messages/s']:9.0f} msg/s")
        return 0
    command = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
    if not command:
        parser.error("no command given (put it after --)")
    return run_prefixed(opts.n, command, opts.delay_ms, opts.timeout_s, opts.verbose)


if __name__ == "__main__":
    sys.exit(main())
