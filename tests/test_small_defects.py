"""Issue 13 items 9 and 10: the smaller defects, one test each (written before the fix)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ld_preload_not_leaked_to_children(tmp_path):
    # item 9: the OpenBLAS re-exec must not hand LD_PRELOAD to the programs we start
    from engine.base.platform import find_openblas

    if sys.platform != "linux" or find_openblas() is None:
        pytest.skip("no OpenBLAS to preload here")
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, subprocess, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from engine.base.platform import ensure_fast_blas, loaded_blas\n"
        "ensure_fast_blas()\n"
        "import mlx.core\n"
        "child = subprocess.run(['sh', '-c', 'echo \"$LD_PRELOAD\"'], capture_output=True, text=True).stdout.strip()\n"
        "print(json.dumps({'blas': loaded_blas(), 'own': os.environ.get('LD_PRELOAD'), 'child': child}))\n")
    for preload in (None, "/nonexistent-user-lib.so"):
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLX_DSPARK_NO_REEXEC")}
        if preload:
            env["LD_PRELOAD"] = preload  # the user's own preload survives, ours is gone
        out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        info = json.loads(out.stdout.strip().splitlines()[-1])
        assert info["blas"].startswith("OpenBLAS")  # the re-exec still happened
        assert info["own"] == preload and info["child"] == (preload or "")


def test_top_k_at_or_above_vocab_is_no_limit(tiny_engine):
    # item 10: a 500 in baseline mode before
    from engine import GenerationRequest, SamplingParams

    vocab = tiny_engine.target.vocab_size
    outs = []
    for top_k in (0, vocab, vocab + 10):
        for mode in ("baseline", "lookup"):
            req = GenerationRequest(prompt_ids=[1, 2, 3, 4], max_tokens=6, mode=mode,
                                    sampling=SamplingParams(temperature=1.0, top_k=top_k, seed=7))
            outs.append((mode, tiny_engine.submit(req).result().token_ids))
    by_mode = {}
    for mode, ids in outs:
        by_mode.setdefault(mode, set()).add(tuple(ids))
    assert all(len(v) == 1 for v in by_mode.values())  # top_k >= vocab samples exactly like no top_k


def test_prefill_chunk_zero_is_refused_up_front(tiny_model_dir, capsys):
    # item 10: it failed every request before
    from agent_bridge.cli import main
    from engine import Engine

    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(str(tiny_model_dir), prefill_chunk=0)
    assert main(["generate", "--model", str(tiny_model_dir), "--prefill-chunk", "0", "--prompt", "hi"]) == 2
    assert "--prefill-chunk" in capsys.readouterr().err


def test_submit_racing_close_never_hangs(tiny_model_dir):
    # item 10: a submit that passed the "closed?" check but queued its work after close's
    # sentinel waited forever. The window is widened here by slowing the queue's put.
    import threading
    import time

    from engine import Done, Engine, EngineError, GenerationRequest

    engine = Engine(str(tiny_model_dir), prefix_cache=False)
    real_put = engine._work.put

    def slow_put(item, *args, **kwargs):
        if item is not None:
            time.sleep(0.5)
        real_put(item, *args, **kwargs)

    engine._work.put = slow_put
    jobs, refused = [], []

    def submitter():
        try:
            jobs.append(engine.submit(GenerationRequest(prompt_ids=[1, 2], max_tokens=1)))
        except EngineError:
            refused.append(True)

    t = threading.Thread(target=submitter)
    t.start()
    time.sleep(0.1)
    engine.close()
    t.join()
    for job in jobs:  # an accepted job ends (done or failed) instead of hanging
        try:
            while not isinstance(job.next_event(timeout=10), Done):
                pass
        except EngineError:
            pass
    assert len(jobs) + len(refused) == 1


def test_serve_on_non_loopback_needs_key_or_insecure(capsys):
    # item 10: `serve --host 0.0.0.0` served read-write file tools to the network
    from agent_bridge.cli import main

    assert main(["serve", "--host", "0.0.0.0", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "--insecure" in err
    # with either flag, the check passes and the command goes on (here: to a missing model)
    for flags in (["--api-key", "k"], ["--insecure"]):
        assert main(["serve", "--host", "0.0.0.0", "--model", "/nonexistent", *flags]) == 2
        assert "--insecure" not in capsys.readouterr().err


def test_stop_sequences_must_be_a_list():
    # item 10: Anthropic's stop_sequences is an array; OpenAI's stop may be a string
    from agent_bridge.apis.anthropic_api import parse_request as parse_anthropic
    from agent_bridge.chat.http_errors import ApiError

    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": "END"}
    with pytest.raises(ApiError) as e:
        parse_anthropic(body, 4096)
    assert e.value.status == 400 and "stop_sequences" in e.value.message
    body["stop_sequences"] = ["END"]
    assert parse_anthropic(body, 4096).stop == ["END"]


def test_atomic_write_syncs_the_folder(tmp_path, monkeypatch):
    # item 10: without a directory fsync the rename can be lost at a power cut
    import stat

    from agent_bridge.mcp.workspace import write_atomic

    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_atomic(tmp_path / "f.txt", "x\n")
    assert synced == [False, True]  # the file, then its folder


def test_stats_are_summed_one_way():
    # item 10: events.Stats, mcp_server.merge_stats and mcp_backends.Totals each summed stats
    import agent_bridge.mcp.backends as backends
    import agent_bridge.mcp.server as mcp_server
    from engine import Stats

    a = {"mode": "lookup", "prompt_tokens": 10, "generated_tokens": 30, "rounds": 10, "drafted_tokens": 40,
         "accepted_tokens": 20, "decode_s": 1.0, "wall_s": 1.5}
    b = {"mode": "lookup", "prompt_tokens": 5, "generated_tokens": 10, "rounds": 5, "drafted_tokens": 10,
         "accepted_tokens": 5, "decode_s": 1.0, "wall_s": 1.2}
    total = Stats.sum([a, b])
    assert (total.generated_tokens, total.rounds, total.drafted_tokens) == (40, 15, 50)
    assert total.decode_tok_s == 20.0 and total.acceptance_rate == 0.5
    assert not hasattr(mcp_server, "merge_stats") and not hasattr(backends, "Totals")


def test_dead_code_is_gone():
    import inspect

    from engine import Engine
    from engine.caches.kv_disk import DiskTier
    from engine.caches.radix_tree import RadixTree

    assert not hasattr(RadixTree, "prefix_key") and not hasattr(DiskTier, "has")
    assert "owner" not in inspect.signature(Engine._enqueue).parameters
