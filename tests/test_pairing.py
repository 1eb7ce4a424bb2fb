"""`--drafter` with a head trained for another model is refused before any request, and before
the model's weights load, with every mismatch named (hidden size, vocabulary, layer taps)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from engine import Engine
from engine.drafting.heads import DrafterLoadError
from engine.drafting.heads.export import dflash_config, dspark_config, random_head_checkpoint


@pytest.fixture(scope="module")
def llama_cfg(tiny_llama_dir):
    return json.loads((tiny_llama_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def foreign_head(tmp_path_factory, llama_cfg):
    """A head for a wider, deeper model with another vocabulary."""
    other = dict(llama_cfg, hidden_size=96, num_hidden_layers=6, vocab_size=llama_cfg["vocab_size"] + 50)
    return random_head_checkpoint(tmp_path_factory.mktemp("foreign") / "head",
                                  dflash_config(other, mask_token_id=0, target_layer_ids=[1, 5]))


def test_engine_refuses_before_loading_the_model(tiny_llama_dir, foreign_head, monkeypatch):
    import engine.engine as engine_module

    def never(*a, **k):
        raise AssertionError("the model was loaded before the drafter was checked")

    monkeypatch.setattr(engine_module, "load_target", never)
    with pytest.raises(DrafterLoadError) as e:
        Engine(str(tiny_llama_dir), drafter=str(foreign_head))
    msg = str(e.value)
    assert "does not fit this model" in msg
    assert "hidden size: the head's is 96, the model's 64" in msg
    assert f"vocabulary: the head's is {json.loads((foreign_head / 'config.json').read_text())['vocab_size']}" in msg
    assert "layer taps: the head was trained on a 6-layer model, this one has 2" in msg


def test_taps_past_the_last_layer_are_named(tmp_path, tiny_llama_dir, llama_cfg):
    cfg = dflash_config(llama_cfg, mask_token_id=0, target_layer_ids=[0, 3])
    cfg["num_target_layers"] = None  # an exporter that doesn't record it: the taps still tell
    head = random_head_checkpoint(tmp_path / "taps", cfg)
    with pytest.raises(DrafterLoadError, match=r"layer taps: the head reads layers \[0, 3\], this model has 2 \(0-1\)"):
        Engine(str(tiny_llama_dir), drafter=str(head))


def test_a_fitting_head_is_accepted(tmp_path, tiny_llama_dir, llama_cfg):
    head = random_head_checkpoint(tmp_path / "ok", dspark_config(llama_cfg, mask_token_id=0, target_layer_ids=[0, 1]))
    engine = Engine(str(tiny_llama_dir), drafter=str(head), prefix_cache=False)
    try:
        assert set(engine.target.heads) == {"dspark"}
    finally:
        engine.close()


def test_serve_exits_with_the_mismatch_and_never_listens(tiny_llama_dir, foreign_head):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "agent_bridge", "serve", "--model", str(tiny_llama_dir), "--drafter",
                        str(foreign_head), "--port", str(port), "--prefix-cache-dir", "off"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "error: drafter" in r.stderr and "hidden size" in r.stderr and "layer taps" in r.stderr
    assert "Traceback" not in r.stderr and "serving" not in r.stdout
