"""The hybrid reference model's training path (training/qwen3_5_torch.py, train_hybrid.sh) on CPU.

The PyTorch decoder must be the model mlx-lm runs: same logits on the exported weights
(float32, tiny random config), through mlx-lm's own ``qwen3_5`` class, with and without its
cache; its chunked gated delta rule must equal the token-by-token recurrence, gradients too.
Skips without torch (the ``train`` extra; scripts/setup.sh installs it where a CPU wheel is at hand).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

from qwen3_5_torch import (  # noqa: E402
    Qwen35Config,
    Qwen35ForCausalLM,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

TOKENIZER = ROOT / "engine" / "reference_model"


def tiny_config(**kw) -> Qwen35Config:
    d = dict(vocab_size=8192, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_key_head_dim=32,
             linear_num_value_heads=4, linear_value_head_dim=16)
    d.update(kw)
    return Qwen35Config(**d)


def random_model(cfg: Qwen35Config, chunk=16, seed=0) -> Qwen35ForCausalLM:
    """Random weights away from the initial values (norm offsets, biases), so a wrong layout shows."""
    torch.manual_seed(seed)
    m = Qwen35ForCausalLM(cfg, chunk=chunk)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight") or n.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.3)
            elif "proj" in n or "embed" in n:
                p.mul_(5)
    return m.eval()


@pytest.mark.parametrize("tri", ["solve", "doubling"])
@pytest.mark.parametrize("T,chunk", [(100, 32), (64, 64), (7, 16)])
def test_chunked_rule_equals_recurrence_with_gradients(T, chunk, tri, monkeypatch):
    import qwen3_5_torch

    monkeypatch.setattr(qwen3_5_torch, "TRI_INVERSE", tri)
    g = torch.Generator().manual_seed(T)
    B, H, Dk, Dv = 2, 3, 16, 8

    def leaf(*shape, scale=1.0, offset=0.0):
        return (torch.rand(*shape, generator=g, dtype=torch.float64) * scale + offset).requires_grad_()

    q, k, v = leaf(B, H, T, Dk, scale=2, offset=-1), leaf(B, H, T, Dk, scale=2, offset=-1), leaf(B, H, T, Dv)
    logdecay, beta = leaf(B, H, T, scale=-0.7), leaf(B, H, T)
    state = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    grads = []
    for fn, kw in ((chunk_gated_delta_rule, {"chunk": chunk}), (recurrent_gated_delta_rule, {})):
        kn = torch.nn.functional.normalize(k, dim=-1)
        o, s = fn(q, kn, v, logdecay, beta, state=state, **kw)
        (o.pow(2).mean() + o.sum() + s.sum()).backward()
        grads.append([o.detach(), s.detach()] + [t.grad.clone() for t in (q, k, v, logdecay, beta)])
        for t in (q, k, v, logdecay, beta):
            t.grad = None
    for a, b in zip(*grads):
        assert torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-4 * float(b.abs().max())), (a - b).abs().max()


def test_chunk_scan_backward_is_the_gradient():
    """The hand-written backward of the loop over chunks, against finite differences."""
    from qwen3_5_torch import ChunkScan

    g = torch.Generator().manual_seed(3)
    BH, N, C, Dk, Dv = 2, 3, 4, 3, 2

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()

    args = (t(N, BH, C, Dv), t(N, BH, C, Dk, scale=0.5), torch.rand(N, BH, 1, 1, generator=g, dtype=torch.float64)
            .requires_grad_(), t(N, BH, Dk, C, scale=0.5), t(BH, Dk, Dv))  # chunk-major
    assert torch.autograd.gradcheck(ChunkScan.apply, args)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny random model exported in float32 with the bundled tokenizer, and its torch twin."""
    from export import export_model

    d = tmp_path_factory.mktemp("hybrid_fp32")
    model = random_model(tiny_config())
    export_model(model, d, dtype=torch.float32)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, d / f)
    return d, model


def test_export_is_mlx_lm_qwen3_5_with_equal_logits(exported):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    d, model = exported
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5"
    assert cfg["layer_types"] == ["linear_attention", "linear_attention", "full_attention"]
    ids = torch.randint(0, 8192, (2, 75), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).numpy()
    mm, _ = load_model(d)
    kinds = [type(c).__name__ for c in mm.make_cache()]
    assert kinds == ["ArraysCache", "ArraysCache", "KVCache"]
    scale = float(np.abs(want).max())
    got = np.array(mm(mx.array(ids.numpy())))
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, scale)
    # through mlx-lm's caches: a prompt, then one token, then the rest
    cache = make_prompt_cache(mm)
    parts = [np.array(mm(mx.array(ids.numpy()[:, a:b]), cache=cache)) for a, b in ((0, 40), (40, 41), (41, 75))]
    assert np.abs(np.concatenate(parts, 1) - want).max() <= 1e-4 * max(1.0, scale)


def test_mlx_lm_generate_and_8bit_copy(exported, tmp_path):
    """mlx-lm generates from the export; the 8-bit copy (training/quantize_mlx.py) loads, is small,
    and keeps the tokenizer and chat template."""
    from mlx_lm import generate, load

    import quantize_mlx

    d, _ = exported
    model, tok = load(str(d))
    ids = tok.encode("def main():")
    assert len(generate(model, tok, ids, max_tokens=8, verbose=False)) > 0
    files = quantize_mlx.quantize(d, tmp_path / "q8")
    names = {p.name for p in files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "README.md" not in names
    cfg = json.loads((tmp_path / "q8" / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 8
    q8, tok8 = load(str(tmp_path / "q8"))
    assert tok8.chat_template
    assert len(generate(q8, tok8, ids, max_tokens=8, verbose=False)) > 0


@pytest.mark.slow
def test_train_hybrid_script_smoke(tmp_path):
    """train_hybrid.sh end to end on CPU at tiny size: both stages, stats, the 8-bit copy."""
    pytest.importorskip("tokenizers")
    env = dict(os.environ, PY=sys.executable, BUDGET="8", OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"),
               SEQ="512", BATCH="2", WORKERS="2", LOG_EVERY="1",
               EXTRA="--tiny --max-files 200 --min-lines 10 --max-lines 30 --sanity 0")
    r = subprocess.run(["bash", str(ROOT / "training" / "train_hybrid.sh")], env=env, capture_output=True, text=True,
                       timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "out"
    model_dir = out / "model_mlx8"
    stats = json.loads((model_dir / "train_stats.json").read_text())
    assert stats["stage1"]["steps"] > 0 and stats["stage2"]["steps"] > 0
    assert "tok/s" in (out / "train.log").read_text()
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(p.stat().st_size < 16e6 for p in files)
